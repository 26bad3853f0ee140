"""What the DDP vote before every backward costs (CPU, gloo, one host).

Under DDP every backward first waits for the ranks' vote on whether a forward
raised (``mmnanhook.distributed.Ranks.before_backward``): one all-reduce of one
float per rank over gloo, on the host (under NCCL too: a gloo group of its
own, never a device sync). The first collective a train step calls from
Python (mmdet's ``reduce_mean``) is voted before too (``ForwardGuard``), the
others only recorded once a step was, a batch norm's that shares statistics
too (issue 65; before, exempt: only looked at). This script starts ``--ranks``
processes with torch's launcher and times, on each, ``--votes`` calls one
after the other (the median and the 90th percentile, after ``--warmup``): a
vote, a plain ``dist.barrier()`` and ``all_reduce`` of one float for scale,
and that ``all_reduce`` guarded (voted: nothing recorded yet; recorded; a
batch norm's, recorded). The guard's host time alone, without the
collective's: ``benchmarks/guard_host.py``. Compare with a training iteration: one vote per micro-step, one
more before the first collective of the loss.

Usage::

    python benchmarks/ddp_vote.py                 # 2 ranks, 2000 votes
    python benchmarks/ddp_vote.py --ranks 2 --votes 200 --warmup 20
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import json
import os
import statistics
import time


def _measure(votes, warmup):
    import torch
    import torch.distributed as dist

    from mmnanhook.distributed import ForwardGuard, Ranks
    dist.init_process_group('gloo')
    ranks = Ranks.start()
    tensor = torch.ones(1)

    def all_reduce():
        dist.all_reduce(tensor)

    def guarded(norm):
        # The guard of a train step around a collective of this script's
        # (mmdet's reduce_mean), or a batch norm's (a SyncBN's). In the
        # first step nothing is recorded: each is voted before.
        guard = ForwardGuard(ranks, ('__main__', ) if norm else ())
        guard.install()
        guard.begin(lambda: 0)

        def call():
            dist.all_reduce(tensor)

        def step():
            # The next step calls what the first recorded.
            guard.end()
            guard.begin(lambda: 0)

        return call, step, guard.remove

    def timed(call):
        for _ in range(warmup):
            call()
        seconds = []
        for _ in range(votes):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        seconds.sort()
        return dict(median_us=statistics.median(seconds) * 1e6,
                    p90_us=seconds[int(0.9 * len(seconds))] * 1e6)

    voted, step, unvote = guarded(False)
    timings = {}
    for name, call in (('vote', ranks.before_backward),
                       ('barrier', dist.barrier),
                       ('all_reduce', all_reduce),
                       ('all_reduce, guarded (voted)', voted)):
        timings[name] = timed(call)
    step()
    timings['all_reduce, guarded (recorded)'] = timed(voted)
    unvote()
    norm, norm_step, unnorm = guarded(True)
    # The first step records them (each voted before).
    timed(norm)
    norm_step()
    timings["all_reduce, guarded (a norm's, recorded)"] = timed(norm)
    unnorm()
    if dist.get_rank() == 0:
        print(json.dumps(dict(ranks=dist.get_world_size(), votes=votes,
                              **timings)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ranks', type=int, default=2)
    parser.add_argument('--votes', type=int, default=2000)
    parser.add_argument('--warmup', type=int, default=100)
    parser.add_argument('--worker', action='store_true',
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _measure(args.votes, args.warmup)
        return
    import subprocess

    from mmnan_testing.ddp import launch_command
    env = dict(os.environ, OMP_NUM_THREADS='1')
    subprocess.run(launch_command([
        os.path.abspath(__file__), '--worker', '--votes', str(args.votes),
        '--warmup', str(args.warmup)], args.ranks), env=env, check=True)


if __name__ == '__main__':
    main()
