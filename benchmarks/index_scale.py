"""What looking a sample up by its file costs on a dataset of 1.7 M images:
a trigger's lookups (:class:`mmnanhook.quarantine.SampleIndex`) in its
first iteration and later, and the walks they replaced.

The dataset: an mmengine ``BaseDataset`` of ``--size`` data infos shaped
like mmdet's (``img_path`` like Objects365's, two instances each), kept
serialized (``serialize_data=True``, as mmdet's datasets are), no images
(:class:`mmnan_testing.infos.InfoDataset`). The bad sample is near the end;
the batch is 2 samples (one bad).

Measured, in one process, each after the last:

* ``walk``: what a trigger cost before any index: the diagnosis's walk over
  the data infos until the batch's files are found (``annotations``), then
  the quarantine's map of every file to its indices (a dict of the
  dataset's path strings, kept per rank: its RSS too);
* ``prepare``: :func:`prepare_index` in ``before_train`` (the training
  process's cost: a fork of the child that walks the dataset where a
  dataset is walked, the search's check of two samples where it is
  searched);
* ``first``: a trigger's lookups right after it (the batch's
  ``annotations`` and the quarantine's indices of the bad file), as in a
  run's first iterations: where the lookups use an index built from
  ``before_train``, they wait for it here;
* ``late``: the same lookups of other files (another trigger, later: once
  the child's walk is done, when there is one), and on a dataset of 8
  samples;
* ``index``: then, its arrays' bytes (0 without a walk), the shared memory
  they take (system wide, ``Shmem`` of ``/proc/meminfo``) and the RSS added
  to this process since ``prepare``;
* ``in_process``: a walk of the whole dataset in this process, for scale
  (what a lazy walk at the first trigger would cost).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/index_scale.py
    python benchmarks/index_scale.py --size 100000
    # beside the commit before, this script on both trees:
    benchmarks/beside.sh REV 2 .venv/bin/python $PWD/benchmarks/index_scale.py
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)

import argparse
import gc
import time

from mmengine.structures import BaseDataElement

from mmnanhook.diagnosis import annotations
from mmnanhook.quarantine import Quarantine, prepare_index, sample_index
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


def _trigger(dataset, batch_paths, bad, work):
    start = time.perf_counter()
    found = annotations(dataset, _batch(batch_paths))
    indices = Quarantine(work, dataset).indices_of(bad)
    return time.perf_counter() - start, found, indices


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=int, default=1700000)
    args = parser.parse_args()
    n = args.size
    bad = objects365_path(n - 7)
    batch = [objects365_path(n - 1000), bad]

    start = time.perf_counter()
    dataset = InfoDataset([objects365_path(i) for i in range(n)])
    gc.collect()
    print('dataset: %d data infos, %s serialized, made in %.1f s' % (
        n, _mb(dataset.data_bytes.nbytes), time.perf_counter() - start))

    diagnosis, quarantine, dict_rss, old, by_file = _old_lookups(
        dataset, batch, bad)
    del by_file
    gc.collect()
    print('walk: diagnosis %.2f s, quarantine %.2f s (its dict: %s RSS)' % (
        diagnosis, quarantine, _mb(dict_rss)))

    before, shared = _rss(), _shmem()
    start = time.perf_counter()
    prepare_index(dataset)
    prepared = time.perf_counter() - start
    took, found, indices = _trigger(dataset, batch, bad, 'unused.json')
    assert indices == old and found[1] is not None
    index = sample_index(dataset)
    print('prepare: %.3f s; first: a trigger\'s lookups right after it '
          '%.3f s (%d walks, searched: %s)' % (
              prepared, took, index.builds,
              getattr(index, 'searched', False)))

    # A later trigger: after any walk begun at prepare is done.
    while index._builder is not None and index._builder.poll() is None:
        time.sleep(0.05)
    print('walk: done %.1f s after prepare (%s)' % (
        time.perf_counter() - start, 'in a child' if index.builds else
        'none'))
    later = [objects365_path(n - 3000), objects365_path(n - 20)]
    again, found, _ = _trigger(dataset, later, later[1], 'unused.json')
    assert found[1] is not None
    print('index: %s of arrays, %s of shared memory, %s RSS added to this '
          'process' % (_mb(index.nbytes), _mb(_shmem() - shared),
                       _mb(_rss() - before)))
    small = InfoDataset([objects365_path(i) for i in range(8)])
    took_small, found_small, _ = _trigger(
        small, [objects365_path(3), objects365_path(6)], objects365_path(6),
        'unused.json')
    assert found_small[1] is not None
    print('late: another trigger\'s lookups %.2f ms; on 8 samples %.2f ms' % (
        again * 1e3, took_small * 1e3))

    start = time.perf_counter()
    _walk_all(dataset)
    print('in_process: a walk of every info here %.1f s' % (
        time.perf_counter() - start))


def _walk_all(dataset):
    for index in range(len(dataset)):
        dataset.get_data_info(index)


if __name__ == '__main__':
    main()
