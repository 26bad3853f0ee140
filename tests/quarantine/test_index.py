"""The lookups of a dataset's samples by file (:class:`SampleIndex`): they
are those of a walk over every data info, through mmengine's wrappers, with
repeated files and paths inside longer ones; mmengine's datasets are
searched (serialized infos, or infos kept as objects), never walked, so the
first trigger of a run on a million infos costs what it costs on 16; a
dataset whose ``get_data_info`` makes its paths up is walked once, in a
forked child or in process alike; one per dataset, shared by the
quarantine, the diagnosis and the composed guard.

mmengine datasets of data infos only (:mod:`mmnan_testing.infos`), in
process; the first trigger on a real Runner; the composed guard on mmdet's
Mosaic over 8 synthetic images.
"""
import gc
import os
import signal
import statistics
import time
import uuid

import pytest
from mmengine.dataset import (ClassBalancedDataset, ConcatDataset,
                              RepeatDataset)
from mmengine.runner import Runner
from mmengine.structures import BaseDataElement

from mmnanhook._child import REAP_WITHIN
from mmnanhook.diagnosis import annotations, annotation_of
from mmnanhook.quarantine import (FILE_NAME, Quarantine, prepare_index,
                                  read_quarantine, sample_index)
from mmnanhook.quarantine import _index
from mmnanhook.quarantine._index import BACKGROUND_FROM
from mmnan_testing.infos import (InfoDataset, InfoInputs, InfoModel,
                                 IterTimes, ManyInfosDataset, SlowInChild,
                                 TailSampler, fixed_path, objects365_path)
from mmnan_testing.preempt import alive

# Files repeated, a sample that names none, and a path that holds another.
PATHS = ['a.jpg', 'b.jpg', 'a.jpg', None, 'c.jpg', 'b.jpg', 'a.jpg',
         'x/a.jpg']
LOOKED_UP = ['a.jpg', 'b.jpg', 'c.jpg', 'd.jpg', 'x/a.jpg', 'missing.jpg',
             '.jpg']


class MadeUpPaths(InfoDataset):
    """Its ``get_data_info`` makes ``img_path`` up from the stored one (a
    root joined on read): no search finds it in the infos, it is walked."""

    def get_data_info(self, idx):
        info = super(MadeUpPaths, self).get_data_info(idx)
        if info.get('img_path') is not None:
            info['img_path'] = 'root/' + info['img_path']
        return info


class TwoClasses(object):
    """Samples' classes for ``ClassBalancedDataset``: 'a.jpg' the rare one
    (repeated)."""

    def get_cat_ids(self, idx):
        path = self.get_data_info(idx).get('img_path') or ''
        return [0] if path.endswith('/a.jpg') or path == 'a.jpg' else [1]


def _dataset(kind, way='serialized'):
    """``kind``: ``'plain'``, or in a Repeat, Concat or ClassBalanced
    wrapper; ``way``: its infos ``'serialized'``, kept as ``'objects'``, or
    ``'made_up'`` (walked)."""
    cls = MadeUpPaths if way == 'made_up' else InfoDataset
    if kind == 'balanced':
        cls = type('Balanced' + cls.__name__, (TwoClasses, cls), {})
    serialize = way != 'objects'
    inner = cls(PATHS, serialize_data=serialize)
    if kind == 'repeat':
        return RepeatDataset(inner, times=3)
    if kind == 'concat':
        return ConcatDataset([inner, cls(['d.jpg', 'a.jpg'],
                                         serialize_data=serialize)])
    if kind == 'balanced':
        return ClassBalancedDataset(inner, oversample_thr=0.9)
    return inner


def _walk(dataset, path):
    # What the lookups did before the index: read every data info.
    return [i for i in range(len(dataset))
            if str(dataset.get_data_info(i).get('img_path')) == path]


def _batch(*paths):
    return dict(data_samples=[BaseDataElement(metainfo=dict(img_path=p))
                              for p in paths])


@pytest.mark.parametrize('way', [
    'serialized', 'serialized-forked', 'objects', 'made_up',
    'made_up-in_process', 'made_up-forked'])
@pytest.mark.parametrize('kind', ['plain', 'repeat', 'concat', 'balanced'])
def test_lookups_are_those_of_a_walk(tmp_path, kind, way):
    # Searched, searched until a child's walk is done, or walked (at the
    # first lookup, before it, or in a child).
    dataset = _dataset(kind, way.split('-')[0])
    index = sample_index(dataset)
    if '-' in way:
        index.start(background=way.endswith('forked'))
    quarantine = Quarantine(str(tmp_path / 'q.json'), dataset)
    looked_up = LOOKED_UP + ['root/' + p for p in LOOKED_UP]
    assert any(_walk(dataset, path) for path in looked_up)
    for path in looked_up:
        walked = _walk(dataset, path)
        assert index.indices(path) == walked
        assert quarantine.indices_of(path) == walked
        first, info = index.first(path)
        assert first == (walked[0] if walked else None)
        assert info == (dataset.get_data_info(first) if walked else None)
    made_up = way.startswith('made_up')
    assert index.searched is not made_up
    assert index.builds == (1 if made_up or '-' in way else 0)


@pytest.mark.parametrize('search', ['memmem', 'portable'])
def test_a_search_is_not_fooled_by_the_bytes_around_a_path(monkeypatch,
                                                           search):
    # A path inside longer ones, and bytes that are no path.
    if search == 'portable':
        # Where libc has no memmem; chunks so small that hits straddle two.
        monkeypatch.setattr(_index, '_MEMMEM', None)
        monkeypatch.setattr(_index, '_CHUNK', 7)
    else:
        assert _index._MEMMEM is not None
    paths = ['p/1.jpg', 'p/1.jpg.bak', 'q/p/1.jpg', 'p/2.jpg', 'p/1.jpg']
    dataset = InfoDataset(paths)
    for path in paths + ['p/1', 'jpg', '1.jpg', 'bbox_label', 'instances']:
        assert sample_index(dataset).indices(path) == _walk(dataset, path)
    assert sample_index(dataset).indices('p/1.jpg') == [0, 4]


@pytest.mark.parametrize('kind', ['plain', 'repeat', 'concat'])
def test_annotations_are_those_of_a_walk(kind):
    dataset = _dataset(kind)
    paths = ('b.jpg', 'missing.jpg', None, 'a.jpg')
    infos = {}
    found = annotations(dataset, _batch(*paths), infos)
    walked = [_walk(dataset, p) if p else [] for p in paths]
    expected = [dataset.get_data_info(w[0]) if w else None for w in walked]
    assert found == [annotation_of(dataset, e) if e else None
                     for e in expected]
    assert infos == {i: e for i, e in enumerate(expected) if e}


def test_a_lookup_reads_the_data_infos_of_its_indices_only(tmp_path):
    inner = InfoDataset([objects365_path(i) for i in range(2000)])
    dataset = RepeatDataset(inner, times=2)
    assert sample_index(dataset).searched
    # Its first and last samples, to see their paths stored as they are.
    assert inner.calls == 2
    bad, other = objects365_path(1998), objects365_path(1990)
    expected = annotation_of(inner, inner.get_data_info(1998))
    inner.calls = 0
    assert annotations(dataset, _batch(other, bad))[1] == expected
    # Each file's two indices, then the first's info.
    assert inner.calls == 2 * 3
    inner.calls = 0
    quarantine = Quarantine(str(tmp_path / 'q.json'), dataset)
    assert quarantine.add(bad, 'zero width').indices == [1998, 3998]
    assert inner.calls == 0  # the trigger's files are kept
    assert sample_index(dataset).builds == 0


def test_a_large_dataset_is_walked_in_a_child_from_before_train():
    large = [objects365_path(i) for i in range(BACKGROUND_FROM)]
    small, searched, made_up = (MadeUpPaths(PATHS), InfoDataset(large),
                                MadeUpPaths(large))
    for each in (small, searched, made_up):
        prepare_index(each)
    assert sample_index(small).builds == 0  # at its first lookup
    for each in (searched, made_up):
        assert sample_index(each).builds == 1 and each.calls == 0
    assert sample_index(searched).indices(objects365_path(5)) == [5]
    assert sample_index(made_up).indices('root/' + objects365_path(5)) == [5]
    # Searched (or its index, when the child was done): its first and last
    # infos read, to see their paths stored as they are, then the one found;
    # made up: its first (its path is not), then the found one, from the
    # child's index.
    assert searched.calls == 3 and made_up.calls == 2


class _SlowChild(SlowInChild, InfoDataset):
    """A walk of it takes 25 s."""


def test_a_lookup_does_not_wait_for_the_walk():
    dataset = _SlowChild([objects365_path(i) for i in range(BACKGROUND_FROM)])
    prepare_index(dataset)
    index = sample_index(dataset)
    try:
        start = time.perf_counter()
        assert index.indices(objects365_path(8000)) == [8000]
        assert time.perf_counter() - start < 5
        assert alive(index._builder.pid) and index.nbytes == 0
    finally:
        index.close()


def test_a_walk_dropped_under_way_runs_no_handler_of_the_process(tmp_path):
    # The pytest process with a preemption handler (SIGTERM: checkpoint,
    # exit) when its dataset goes: before issue 52 its finalizer sent the
    # walk's child SIGTERM, which ran that handler there.
    dataset = _SlowChild([objects365_path(i) for i in range(BACKGROUND_FROM)])
    written = str(tmp_path / 'handler')

    def preempted(signum, frame):
        with open('%s.%d' % (written, os.getpid()), 'w'):
            pass
        os._exit(143)

    before = signal.signal(signal.SIGTERM, preempted)
    try:
        prepare_index(dataset)
        pid = sample_index(dataset)._builder.pid
        time.sleep(0.2)  # the child under way
        start = time.perf_counter()
        del dataset
        gc.collect()
        assert time.perf_counter() - start < REAP_WITHIN
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not alive(pid) and os.listdir(str(tmp_path)) == []


class _SlowMadeUp(SlowInChild, MadeUpPaths):
    """Walked, never searched; slowly in a child."""


def _stopped_walk():
    """A :class:`_SlowMadeUp` (its index lives while it does), its index,
    whose walk's child is stopped (SIGSTOP), and the child's pid."""
    dataset = _SlowMadeUp([objects365_path(i) for i in range(BACKGROUND_FROM)])
    index = sample_index(dataset)
    index.start()
    os.kill(index._builder.pid, signal.SIGSTOP)
    return dataset, index, index._builder.pid


def test_a_stopped_walk_is_waited_for_within_its_bound(monkeypatch):
    # A lookup that needs the walk's arrays (a dataset that cannot be
    # searched) while the walk's child is stopped: it gives up on it once
    # its progress stood still for STALLED seconds, kills it, says so, and
    # walks here.
    monkeypatch.setattr(_index, 'STALLED', 1.0)
    said = []
    monkeypatch.setattr(_index, 'log', lambda line, level: said.append(line))
    dataset, index, pid = _stopped_walk()
    start = time.perf_counter()
    assert index.indices('root/' + objects365_path(5)) == [5]
    assert time.perf_counter() - start < _index.STALLED + REAP_WITHIN + 5
    assert not alive(pid) and index.builds == 2
    assert len(said) == 1 and 'made no progress for 1 s' in said[0]


def test_a_stopped_walk_is_closed_within_its_bound():
    dataset, index, pid = _stopped_walk()
    start = time.perf_counter()
    index.close()
    assert time.perf_counter() - start < REAP_WITHIN
    assert not alive(pid)
    # A later lookup that needs the arrays walks in process.
    assert index.indices('root/' + objects365_path(5)) == [5]
    assert index.builds == 2


class _ChildFails(MadeUpPaths):
    """Its data infos cannot be read in another process."""

    def __init__(self, paths):
        self.owner = os.getpid()
        super(_ChildFails, self).__init__(paths)

    def get_data_info(self, idx):
        assert os.getpid() == self.owner, 'a child process'
        return super(_ChildFails, self).get_data_info(idx)


def test_a_walk_that_failed_in_the_child_is_done_here():
    dataset = _ChildFails(PATHS)
    index = sample_index(dataset)
    index.start()
    assert index.indices('root/b.jpg') == [1, 5]
    assert index.builds == 2


def test_one_index_per_dataset_while_it_lives():
    dataset = RepeatDataset(InfoDataset(PATHS), times=2)
    index = sample_index(dataset)
    assert sample_index(dataset) is index
    assert sample_index(dataset.dataset) is not index
    annotations(dataset, _batch('a.jpg'))
    Quarantine('unused.json', dataset).indices_of('b.jpg')
    assert index.searched and index.builds == 0
    del dataset
    gc.collect()
    assert index.dataset is None


@pytest.mark.mmdet
def test_the_quarantine_the_guard_and_the_diagnosis_share_one_index(
        tmp_path):
    # Mosaic under MultiImageMixDataset: the guard's source is the wrapped
    # dataset, whose indices are the wrapper's: one index for both.
    import random
    import numpy as np
    from mmengine.dataset import pseudo_collate
    from mmnanhook.diagnosis._composed import trace_parts
    from mmnanhook.diagnosis._data import check_batch
    from mmnanhook.quarantine._composed import ComposedGuard
    from mmnan_testing import composed
    data = composed.make_data(str(tmp_path / 'coco'))
    dataset = composed.mosaic(data)
    guard = ComposedGuard(dataset)
    index = sample_index(dataset)
    assert index is sample_index(dataset.dataset)
    tile = composed.tile_path(data)
    random.seed(0)
    np.random.seed(0)
    samples = [dataset[i] for i in [0, 1, 2, 3, 4, 6, 7] * 3]
    batch = pseudo_collate([s for s in samples if tile in [
        p for _, p in s['data_samples'].metainfo['mmnan_parts']]][:1])
    findings = check_batch(batch)
    trace_parts(findings, batch, dataset)
    assert findings[0].img_path == tile
    assert annotations(dataset, batch)[0] is not None
    quarantine = Quarantine(str(tmp_path / 'q.json'), dataset)
    assert quarantine.add(tile, 'nodata').indices == [5]
    guard.block(tile)
    # mmdet's CocoDataset keeps its infos serialized: searched, no walk.
    assert index.searched and index.builds == 0


@pytest.mark.parametrize('size', ['small', 'large'])
def test_many_files_are_looked_up_in_the_index(size):
    # A reviewed list of many files: searched up to MANY_FILES, then the
    # walk (begun at before_train for a large dataset, else here) serves.
    count = BACKGROUND_FROM if size == 'large' else 2 * _index.MANY_FILES
    dataset = InfoDataset([objects365_path(i) for i in range(count)])
    prepare_index(dataset)
    index = sample_index(dataset)
    for i in range(_index.MANY_FILES):
        assert index.indices(objects365_path(i)) == [i]
    assert index.nbytes == 0 or size == 'large'
    assert index.indices(objects365_path(count - 1)) == [count - 1]
    assert index.builds == 1 and index.nbytes == 12 * count


# A dataset whose walk takes seconds (1.7 M in the benchmark).
LARGE = 1000000
# The samples trained on: the dataset's last 12, a batch of 2 (6
# iterations); the bad one is the 6th, in iteration 2.
TRAINED, BAD_AT = 12, 5


def _first_trigger(tmp_path, size):
    """A real Runner training :class:`InfoModel` under ``policy='drop'`` on
    the last samples of ``size`` infos, the bad one in iteration 2: (that
    iteration's time less the median of the others, the dataset, the run's
    quarantine list)."""
    bad = size - TRAINED + BAD_AT
    dataset = ManyInfosDataset(size, pipeline=[InfoInputs(bad=[bad])])
    times = IterTimes()
    runner = Runner(
        model=InfoModel(), work_dir=str(tmp_path),
        experiment_name='first_trigger_' + uuid.uuid4().hex,
        train_dataloader=dict(
            dataset=dataset, sampler=TailSampler(dataset, TRAINED),
            batch_size=2, num_workers=0,
            collate_fn=dict(type='pseudo_collate')),
        train_cfg=dict(by_epoch=False, max_iters=TRAINED // 2),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        custom_hooks=[dict(type='NanDetectHook', policy='drop'), times],
        default_hooks=dict(checkpoint=None), log_level='WARNING',
        default_scope='mmengine', randomness=dict(seed=0))
    runner.train()
    clean = [t for i, t in times.times.items() if i != BAD_AT // 2]
    took = times.times[BAD_AT // 2] - statistics.median(clean)
    listed = read_quarantine(os.path.join(str(tmp_path), FILE_NAME), size)
    # The Runner's (its config holds a copy of the dataset given); its walk
    # ends here, not in a later test.
    dataset = runner.train_dataloader.dataset
    sample_index(dataset).close()
    return took, dataset, listed


def test_the_first_trigger_costs_the_same_on_a_million_infos(tmp_path):
    # Before the search, the lookups of a trigger in iteration 2 waited for
    # the walk begun at before_train: seconds on a million infos.
    small, _, _ = _first_trigger(tmp_path / 'small', 16)
    took, dataset, listed = _first_trigger(tmp_path / 'large', LARGE)
    assert took - small < 1.0, (took, small)
    bad = LARGE - TRAINED + BAD_AT
    assert [(s.file, s.indices) for s in listed] == [(fixed_path(bad), [bad])]
    # Searched while the walk begun at before_train went on.
    assert sample_index(dataset).searched
    assert sample_index(dataset).builds == 1
