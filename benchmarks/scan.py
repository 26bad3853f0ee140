"""Throughput of the dataset pass (``mmnan scan`` / ``mmnan doctor``).

The full pipeline with 1 and more worker processes: the zoo RetinaNet R50's
train pipeline on a synthetic COCO set at 320 px (see ``mmnan_testing.zoo``),
runs alternating between the worker counts after ``--warmup`` untimed
rounds, median images/s of the repeats and the median of each repeat's ratio
to the first count; the cores kept busy (CPU seconds of the process and its
workers over the wall time).

The fast mode (``mmnan scan --fast``: data infos and image headers, no
decoding, no pipeline) in this one process (one core, one torch thread) on
its own synthetic COCO set of ``--fast-images``: images/s of the whole
``scan_config`` (config loaded, dataset built, every sample checked), of the
pass alone over the built dataset, and the floor of the pass: PIL opening
each file once for its size. The files were just written, so they are read
from the page cache (a cold disk adds its own seek per file).

    python benchmarks/scan.py --images 400 --workers 1 2 --repeats 3 \\
        --fast-images 5000
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import os.path as osp
import resource
import statistics
import tempfile
import time


def _config(root, images, defects):
    from mmnan_testing import zoo
    data = zoo.make_zoo_dataset('retinanet_r50', root + '/data',
                                num_images=images, defects=defects)
    cfg = zoo.child_config('retinanet_r50', data, root + '/run')
    path = root + '/config.py'
    cfg.dump(path)
    return path, data


def _median(rates):
    return '%.1f images/s (median of %d; %s)' % (
        statistics.median(rates), len(rates),
        ', '.join('%.1f' % r for r in rates))


def _cpu_seconds():
    # This process and its reaped children (the pool's workers).
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def full_pipeline(images, workers, repeats, warmup):
    from mmnanhook.doctor import scan_config
    path, _ = _config(tempfile.mkdtemp(prefix='mmnan_scan_bench_'), images,
                      {3: 'outside'})
    # Untimed: the first scans of a process pay its imports and the first
    # reads of the files (the page cache), whichever worker count is first.
    for _ in range(warmup):
        for count in workers:
            scan_config(path, progress=False, workers=count)
    rates = dict((w, []) for w in workers)
    cores = dict((w, []) for w in workers)
    for _ in range(repeats):
        for count in workers:
            start, cpu = time.time(), _cpu_seconds()
            total, bad, _ = scan_config(path, progress=False, workers=count)
            wall = time.time() - start
            rates[count].append(total / wall)
            cores[count].append((_cpu_seconds() - cpu) / wall)
    for count in workers:
        # Each repeat runs every count back to back: the ratio of a pair
        # sees the same state of the machine.
        paired = [r / b for r, b in zip(rates[count], rates[workers[0]])]
        print('full pipeline, %d images, workers %d: %s, %.2fx of %d '
              '(median of the paired ratios; %s); cores busy %.2f' % (
                  images, count, _median(rates[count]),
                  statistics.median(paired), workers[0],
                  ', '.join('%.2f' % r for r in paired),
                  statistics.median(cores[count])))


def fast_mode(images, repeats):
    import torch
    from PIL import Image

    from mmnanhook.doctor import scan_config
    from mmnanhook.doctor._dataset import (build_dataset, check_dataset,
                                           load_config)
    torch.set_num_threads(1)
    path, data = _config(tempfile.mkdtemp(prefix='mmnan_scan_fast_'),
                         images, {3: 'size_mismatch'})
    files = [osp.join(data['img_dir'], name) for name in data['images']]
    whole, alone, floor = [], [], []
    for _ in range(repeats):
        start = time.time()
        total, bad, _ = scan_config(path, progress=False, fast=True)
        whole.append(total / (time.time() - start))
        dataset, context = build_dataset(load_config(path), path)
        start = time.time()
        for _ in check_dataset(dataset, context, fast=True):
            pass
        alone.append(len(dataset) / (time.time() - start))
        start = time.time()
        for name in files:
            with Image.open(name) as image:
                image.size
        floor.append(len(files) / (time.time() - start))
    assert [b.index for b in bad] == [3], [b.index for b in bad]
    print('fast mode, %d images, 1 process: scan_config %s; the pass alone '
          '%s; the floor (PIL opens each file for its size) %s' % (
              images, _median(whole), _median(alone), _median(floor)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--images', type=int, default=400)
    parser.add_argument('--workers', type=int, nargs='+', default=[1, 2])
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--warmup', type=int, default=1,
                        help='untimed rounds of every worker count first')
    parser.add_argument('--fast-images', type=int, default=5000,
                        help='images of the fast mode\'s set (0: skip it)')
    args = parser.parse_args()
    if args.images:
        full_pipeline(args.images, args.workers, args.repeats, args.warmup)
    if args.fast_images:
        fast_mode(args.fast_images, args.repeats)


if __name__ == '__main__':
    main()
