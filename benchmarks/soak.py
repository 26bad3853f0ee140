"""Soak: ``policy='skip'`` for many iterations through random faults.

A tiny RetinaNet (VOC-style data) trains ``--iters`` iterations; a random
``--bad-fraction`` of the batches are bad, half a zero-width GT box (data
fault), half a NaN gradient born in backward (see
:mod:`mmnan_testing.soak`). Prints whether every bad step was skipped,
whether ``train/nan_skipped`` equals their count, whether the weights
stayed finite, how many bundles stayed on disk, and the slope of the
resident memory over the last ``--tail`` iterations (least squares).

Usage::

    python benchmarks/soak.py                 # 500 iterations
    python benchmarks/soak.py --iters 50 --tail 40
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import datetime
import sys
import tempfile
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iters', type=int, default=500)
    parser.add_argument('--tail', type=int, default=400,
                        help='iterations the memory slope is fitted on')
    parser.add_argument('--bad-fraction', type=float, default=0.1)
    parser.add_argument('--max-dumps', type=int, default=5)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--baseline', action='store_true',
                        help='the same run without mmnanhook and without '
                        'faults: the memory slope MMEngine has by itself')
    parser.add_argument('--work-dir', help='default: a temporary directory')
    args = parser.parse_args(argv)
    if args.iters < 2 or not 0 < args.tail <= args.iters or \
            not 0 < args.bad_fraction < 1:
        parser.error('need --iters >= 2, 0 < --tail <= --iters and '
                     '0 < --bad-fraction < 1')
    from mmnan_testing.soak import run_soak
    start = time.time()
    result = run_soak(args.work_dir or tempfile.mkdtemp(prefix='mmnan_soak_'),
                      iters=args.iters, bad_fraction=args.bad_fraction,
                      seed=args.seed, max_dumps=args.max_dumps,
                      tail=args.tail, hook=not args.baseline)
    planned = result['planned']
    kinds = sorted(set(planned.values()))
    rss = result['rss_mb']
    print('# mmnanhook soak%s, %s: %d iterations, %d bad (%s), policy=skip, '
          'max_dumps=%d' % (' baseline (no hook, no faults)' if args.baseline
                            else '', datetime.date.today().isoformat(),
                            result['iters'], len(planned),
                            ', '.join('%d %s' % (list(planned.values()).count(
                                k), k) for k in kinds), args.max_dumps))
    print('every bad step skipped, train/nan_skipped == bad steps: %s '
          '(%d == %d)' % (result['skipped'] == len(planned),
                          result['skipped'], len(planned)))
    print('weights finite after every iteration: %s' % result['finite'])
    print('bundles on disk: %d (max_dumps %d)' % (result['bundles'],
                                                   args.max_dumps))
    print('RSS: %.0f MB after the first iteration, %.0f MB after the last; '
          'slope over the last %d: %+.1f KB/iteration' %
          (rss[0], rss[-1], args.tail, result['slope_kb_per_iter']))
    trimmed = result['trimmed_mb']
    if trimmed:
        print('RSS after malloc_trim(0) (free heap handed back): %.0f MB '
              'after the first iteration, %.0f MB after the last; slope over '
              'the last %d: %+.1f KB/iteration' %
              (trimmed[0], trimmed[-1], args.tail,
               result['trimmed_slope_kb_per_iter']))
    print('took %.0f s' % (time.time() - start))
    ok = (result['skipped'] == len(planned) and result['finite']
          and result['bundles'] <= args.max_dumps)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
