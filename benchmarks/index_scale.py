"""What looking a sample up by its file costs on a dataset of 1.7 M images,
with the index (:class:`mmnanhook.quarantine.SampleIndex`) and with the
walks it replaced.

The dataset: an mmengine ``BaseDataset`` of ``--size`` data infos shaped
like mmdet's (``img_path`` like Objects365's, two instances each), kept
serialized (``serialize_data=True``, as mmdet's datasets are), no images
(:class:`mmnan_testing.infos.InfoDataset`). The bad sample is near the end;
the batch is 2 samples (one bad).

Measured, in one process, each after the last:

* ``walk``: what a trigger cost before the index: the diagnosis's walk over
  the data infos until the batch's files are found (``annotations``), then
  the quarantine's map of every file to its indices (a dict of the
  dataset's path strings, kept per rank: its RSS too);
* ``fork``: :func:`prepare_index`'s start in ``before_train``: the fork of
  the child that walks the dataset (the training process's cost);
* ``build``: until that child is done (time in the background), and the
  index's memory: its arrays' bytes, the shared memory they take (system
  wide, ``Shmem`` of ``/proc/meminfo``) and the RSS it adds to this
  process (the shared pages it touched included);
* ``train``: a pure-Python busy loop (a stand-in for the training
  process's own work) timed while the child walks and after: how much the
  walk slows this process (the machine's other core runs the child);
* ``lookup``: a trigger's lookups with the index: the batch's
  ``annotations`` and the quarantine's indices of the bad file, on this
  dataset and on one of 8 samples (whose index is walked at the first
  lookup, in process: included);
* ``in_process``: the same walk as the child's, in this process (what a
  lazy build at the first trigger would put on its path).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/index_scale.py
    python benchmarks/index_scale.py --size 100000
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)

import argparse
import gc
import time

from mmengine.structures import BaseDataElement

from mmnanhook.diagnosis import annotations
from mmnanhook.quarantine import (Quarantine, SampleIndex, prepare_index,
                                  sample_index)
from mmnan_testing.infos import InfoDataset, objects365_path


def _kb_field(path, name):
    with open(path) as f:
        for line in f:
            if line.startswith(name):
                return int(line.split()[1]) * 1024
    return 0


def _rss():
    return _kb_field('/proc/self/status', 'VmRSS:')


def _shmem():
    # The index's arrays are shared memory: counted here, once.
    return _kb_field('/proc/meminfo', 'Shmem:')


def _mb(n):
    return '%.1f MB' % (n / 2.0**20)


def _batch(paths):
    return dict(data_samples=[BaseDataElement(metainfo=dict(img_path=p))
                              for p in paths])


def _old_lookups(dataset, batch_paths, bad):
    """The walks of the diagnosis and the quarantine before the index."""
    wanted = set(batch_paths)
    start = time.perf_counter()
    for index in range(len(dataset)):
        wanted.discard(str(dataset.get_data_info(index).get('img_path')))
        if not wanted:
            break
    diagnosis = time.perf_counter() - start
    before = _rss()
    start = time.perf_counter()
    by_file = {}
    for index in range(len(dataset)):
        by_file.setdefault(dataset.get_data_info(index).get('img_path'),
                           []).append(index)
    indices = by_file[bad]
    quarantine = time.perf_counter() - start
    return diagnosis, quarantine, _rss() - before, indices, by_file


def _spin(seconds):
    """Iterations of a pure-Python loop in ``seconds``."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            count += 1
    return count


def _trigger(dataset, batch_paths, bad, work):
    start = time.perf_counter()
    found = annotations(dataset, _batch(batch_paths))
    indices = Quarantine(work, dataset).indices_of(bad)
    return time.perf_counter() - start, found, indices


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=int, default=1700000)
    parser.add_argument('--spin', type=float, default=3.0,
                        help='seconds of each busy-loop measurement')
    args = parser.parse_args()
    n = args.size
    bad = objects365_path(n - 7)
    batch = [objects365_path(n - 1000), bad]

    start = time.perf_counter()
    dataset = InfoDataset([objects365_path(i) for i in range(n)])
    gc.collect()
    print('dataset: %d data infos, %s serialized, made in %.1f s' % (
        n, _mb(dataset.data_bytes.nbytes), time.perf_counter() - start))
    print('baseline busy loop: %d iterations in %.1f s' % (
        _spin(args.spin), args.spin))

    diagnosis, quarantine, dict_rss, old, by_file = _old_lookups(
        dataset, batch, bad)
    del by_file
    gc.collect()
    print('walk: diagnosis %.2f s, quarantine %.2f s (its dict: %s RSS)' % (
        diagnosis, quarantine, _mb(dict_rss)))

    before, shared = _rss(), _shmem()
    start = time.perf_counter()
    prepare_index(dataset)
    forked = time.perf_counter() - start
    busy = _spin(args.spin)
    index = sample_index(dataset)
    index.first(bad)  # waits for the child
    built = time.perf_counter() - start
    print('fork: %.3f s; build: done %.1f s after it, in the child; '
          'busy loop meanwhile: %d iterations in %.1f s' % (
              forked, built, busy, args.spin))
    print('index: %s of arrays, %s of shared memory, %s RSS added to this '
          'process (%d builds)' % (_mb(index.nbytes), _mb(_shmem() - shared),
                                   _mb(_rss() - before), index.builds))
    print('busy loop after: %d iterations in %.1f s' % (
        _spin(args.spin), args.spin))

    took, found, indices = _trigger(dataset, batch, bad, 'unused.json')
    assert indices == old and found[1] is not None
    small = InfoDataset([objects365_path(i) for i in range(8)])
    took_small, found_small, _ = _trigger(
        small, [objects365_path(3), objects365_path(6)], objects365_path(6),
        'unused.json')
    assert found_small[1] is not None
    again, _, _ = _trigger(dataset, batch, bad, 'unused.json')
    print('lookup (batch of 2 + the quarantine): %.2f ms; on 8 samples '
          '(index walked at this first lookup) %.2f ms; again %.2f ms' % (
              took * 1e3, took_small * 1e3, again * 1e3))

    start = time.perf_counter()
    SampleIndex(dataset).start(background=False)
    print('in_process: the same walk here %.1f s' % (
        time.perf_counter() - start))


if __name__ == '__main__':
    main()
