"""What the DDP vote before every backward costs (CPU, gloo, one host).

Under DDP every backward first waits for the ranks' vote on whether a forward
raised (``mmnanhook.sentinel.Ranks.before_backward``): one all-reduce of one
float per rank over gloo, on the host (under NCCL too: a gloo group of its
own, never a device sync). This script starts ``--ranks`` processes with
torch's launcher and times, on each, ``--votes`` votes one after the other
(the median and the 90th percentile, after ``--warmup``), and the same number
of plain ``dist.barrier()`` calls for scale. Compare the median with a
training iteration: the per-step cost is one vote per micro-step.

Usage::

    python benchmarks/ddp_vote.py                 # 2 ranks, 2000 votes
    python benchmarks/ddp_vote.py --ranks 2 --votes 200 --warmup 20
"""
import argparse
import json
import os
import statistics
import sys
import time


def _measure(votes, warmup):
    import torch.distributed as dist

    from mmnanhook.sentinel import Ranks
    dist.init_process_group('gloo')
    ranks = Ranks.start()
    timings = {}
    for name, call in (('vote', ranks.before_backward),
                       ('barrier', dist.barrier)):
        for _ in range(warmup):
            call()
        seconds = []
        for _ in range(votes):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        seconds.sort()
        timings[name] = dict(median_us=statistics.median(seconds) * 1e6,
                             p90_us=seconds[int(0.9 * len(seconds))] * 1e6)
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

    from mmnanhook.testing.ddp import free_port, launcher
    env = dict(os.environ, OMP_NUM_THREADS='1')
    subprocess.run([sys.executable] + launcher() + [
        '--nproc_per_node', str(args.ranks), '--master_addr', '127.0.0.1',
        '--master_port', str(free_port()), os.path.abspath(__file__),
        '--worker', '--votes', str(args.votes), '--warmup',
        str(args.warmup)], env=env, check=True)


if __name__ == '__main__':
    main()
