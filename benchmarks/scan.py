"""Throughput of the dataset pass (``mmnan scan`` / ``mmnan doctor``) with
1 and more worker processes: the zoo RetinaNet R50's train pipeline on a
synthetic COCO set at 320 px (see ``mmnan_testing.zoo``), runs alternating
between the worker counts, median images/s of the repeats.

    python benchmarks/scan.py --images 400 --workers 1 2 --repeats 3
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import statistics
import tempfile
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--images', type=int, default=400)
    parser.add_argument('--workers', type=int, nargs='+', default=[1, 2])
    parser.add_argument('--repeats', type=int, default=3)
    args = parser.parse_args()

    from mmnan_testing import zoo
    from mmnanhook.doctor import scan_config
    root = tempfile.mkdtemp(prefix='mmnan_scan_bench_')
    data = zoo.make_zoo_dataset('retinanet_r50', root + '/data',
                                num_images=args.images, defects={3: 'outside'})
    cfg = zoo.child_config('retinanet_r50', data, root + '/run')
    path = root + '/config.py'
    cfg.dump(path)
    rates = dict((w, []) for w in args.workers)
    for _ in range(args.repeats):
        for workers in args.workers:
            start = time.time()
            total, bad, _ = scan_config(path, progress=False, workers=workers)
            rates[workers].append(total / (time.time() - start))
    base = statistics.median(rates[args.workers[0]])
    for workers in args.workers:
        rate = statistics.median(rates[workers])
        print('workers %d: %.1f images/s (median of %d; %s), %.2fx of %d' % (
            workers, rate, args.repeats,
            ', '.join('%.1f' % r for r in rates[workers]), rate / base,
            args.workers[0]))


if __name__ == '__main__':
    main()
