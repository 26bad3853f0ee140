"""Where tier 1's time goes on a GPU: cProfile over one run of
``cuda_overhead.py``'s SmallResNet (fp16 ``AmpOptimWrapper``) with
``NanDetectHook``, mmnanhook's functions by cumulative time (cProfile adds
its own cost per Python call: compare the rows with each other, not with the
unprofiled iteration time).

Usage (on a device machine)::

    python benchmarks/cuda_profile.py --iters 200
"""
import argparse
import cProfile
import pstats
import sys
import tempfile

from cuda_overhead import _iteration_times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iters', type=int, default=200)
    parser.add_argument('--width', type=int, default=256)
    parser.add_argument('--rows', type=int, default=40)
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print('no CUDA device')
        return 2
    import mmnanhook  # noqa: F401 - registers NanDetectHook
    profile = cProfile.Profile()
    profile.enable()
    times = _iteration_times(dict(type='NanDetectHook'), args.iters,
                             args.width, tempfile.mkdtemp(prefix='mmnan_'))
    profile.disable()
    print('%d iterations, median %.3f ms (profiled)' %
          (len(times), 1e3 * sorted(times)[len(times) // 2]))
    stats = pstats.Stats(profile, stream=sys.stdout)
    stats.sort_stats('cumulative').print_stats('mmnanhook', args.rows)
    stats.sort_stats('tottime').print_stats(args.rows)
    return 0


if __name__ == '__main__':
    sys.exit(main())
