"""What one host sync costs on a GPU: the budget tier 1 spends once per
iteration (the step check reads one flag back to the host).

Timed on the host with ``time.perf_counter``, ``--calls`` times each after
``--warmup`` untimed ones, the median reported:

* ``sync_idle_us``: ``torch.cuda.synchronize()`` with nothing queued;
* ``read_idle_us``: what tier 1's step check reads back, rebuilt: ten
  scalars (a norm, a loss scale, eight loss terms) stacked and concatenated
  and read with ``.tolist()`` (kernels, a device-to-host copy, a sync),
  nothing else queued: its cost once the iteration's work is done;
* ``launch_us``: the same kernels without the read back (what the read adds
  is ``read_idle_us - launch_us``);
* ``read_after_work_us``: the read right after a queued matmul of
  ``--size`` squared, minus that matmul followed by a plain
  ``synchronize`` (both wait for it; the difference is the read's own cost).

Usage (on a device machine)::

    python benchmarks/cuda_sync.py --json sync.json
"""
import argparse
import json
import statistics
import sys
import time


def _median_us(fn, calls, warmup, sync):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        sync()
    return 1e6 * statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--calls', type=int, default=2000)
    parser.add_argument('--warmup', type=int, default=200)
    parser.add_argument('--size', type=int, default=4096)
    parser.add_argument('--json', help='write the figures here')
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print('no CUDA device')
        return 2
    sync = torch.cuda.synchronize
    scalars = [torch.rand((), device='cuda') for _ in range(10)]
    a = torch.randn(args.size, args.size, device='cuda', dtype=torch.half)

    def launch():
        return torch.cat([torch.stack(scalars)])

    def read():
        return launch().tolist()

    def work_then_read():
        a.mm(a)
        return read()

    def work_then_sync():
        a.mm(a)
        launch()
        sync()

    figures = dict(
        gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
        cuda=torch.version.cuda, calls=args.calls, warmup=args.warmup,
        sync_idle_us=_median_us(sync, args.calls, args.warmup, sync),
        read_idle_us=_median_us(read, args.calls, args.warmup, sync),
        launch_us=_median_us(launch, args.calls, args.warmup, sync))
    after = _median_us(work_then_read, args.calls // 4, args.warmup, sync)
    plain = _median_us(work_then_sync, args.calls // 4, args.warmup, sync)
    figures.update(matmul_then_sync_us=plain,
                   read_after_work_us=after - plain)
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == '__main__':
    sys.exit(main())
