"""The forward guard's host time per collective call (one process, no ranks).

Under DDP every collective a train step calls from Python goes through
``mmnanhook.distributed.ForwardGuard``'s wrapper: a frame walk says whose it
is; the train step's own and, since issue 65, a batch norm's that shares
statistics are recorded (their signature built and compared with the last
step's, a list append). This script times the wrapper alone: the
collective is a no-op stand-in (what a real one costs, gloo's or NCCL's, is
``benchmarks/ddp_vote.py``'s), called from a module the guard takes for a
batch norm, in a step that matches the record (the steady state: no vote).
Rows, each the median of ``--rounds`` rounds of ``--calls`` calls,
interleaved:

* ``bare``: the stand-in itself, unwrapped;
* ``inactive``: wrapped, between train steps;
* ``own``: a caller the guard lets through (mmnanhook's own, as a batch
  norm's was before issue 65: the frame walk alone);
* ``norm, recorded``: a batch norm's, recorded.

The cost a batch norm pays per call since issue 65 is ``norm, recorded``
minus ``own``; a step pays it once per norm layer in training mode (mmcv's
``SyncBatchNorm`` calls 2-3 collectives a layer, torch's one).

Usage::

    python benchmarks/guard_host.py --rounds 21 --calls 2000
"""
import argparse
import json
import statistics
import time
import types


def _caller(name):
    """A function of a module named ``name`` that calls ``all_reduce`` of
    ``torch.distributed`` (the frame the guard looks at)."""
    module = types.ModuleType(name)
    exec('import torch.distributed as dist\n'
         'def statistics(tensor):\n'
         '    dist.all_reduce(tensor)\n', module.__dict__)
    return module.statistics


class _Ranks(object):
    """The votes, as the guard sees them (never taken in a recorded step)."""

    def before_backward(self):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--rounds', type=int, default=21)
    parser.add_argument('--calls', type=int, default=2000)
    parser.add_argument('--channels', type=int, default=256)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import mmnanhook
    from mmnanhook.distributed import ForwardGuard

    def collective(tensor, *rest, **kwargs):
        return None

    dist.all_reduce = collective
    # A SyncBN's sums, sums of squares and count, one channel each.
    tensor = torch.ones(2 * args.channels + 1)
    norm = _caller('stand_in_sync_bn')
    own = _caller(mmnanhook.__name__ + '.stand_in')
    guard = ForwardGuard(_Ranks(), ['stand_in_sync_bn'])
    guard.install()
    wrapped = dist.all_reduce

    def step():
        # One train step of ``calls`` norm collectives: the first records
        # them, every later one matches the record.
        guard.begin(lambda: 0)
        for _ in range(args.calls):
            norm(tensor)
        guard.end()

    step()

    def timed(call, active):
        if active:
            guard.begin(lambda: 0)
        start = time.perf_counter()
        for _ in range(args.calls):
            call(tensor)
        seconds = time.perf_counter() - start
        if active:
            guard.end()
        if call is own:
            # A step of no recorded collective is the record now: the
            # norms' again.
            step()
        return seconds / args.calls * 1e6

    rows = {'bare': (collective, False), 'inactive': (wrapped, False),
            'own': (own, True), 'norm, recorded': (norm, True)}
    times = dict((name, []) for name in rows)
    for _ in range(args.rounds):
        for name, (call, active) in rows.items():
            times[name].append(timed(call, active))
    guard.remove()
    result = dict((name + '_us', round(statistics.median(values), 3))
                  for name, values in times.items())
    result['norm_cost_us'] = round(
        result['norm, recorded_us'] - result['own_us'], 3)
    result.update(torch=torch.__version__, calls=args.calls,
                  rounds=args.rounds)
    print(json.dumps(result))


if __name__ == '__main__':
    main()
