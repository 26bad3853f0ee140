"""The index of a dataset's samples by file (:class:`SampleIndex`): its
lookups are those of a walk over every data info, through mmengine's
wrappers and with repeated files; a lookup reads the data infos of its
candidates only; one index per dataset, built once, in a forked child or in
process alike, and shared by the quarantine, the diagnosis and the composed
guard.

mmengine datasets of data infos only (:mod:`mmnan_testing.infos`), in
process; the composed guard on mmdet's Mosaic over 8 synthetic images.
"""
import os

import pytest
from mmengine.dataset import ConcatDataset, RepeatDataset
from mmengine.structures import BaseDataElement

from mmnanhook.diagnosis import annotations, annotation_of
from mmnanhook.quarantine import Quarantine, prepare_index, sample_index
from mmnanhook.quarantine._index import BACKGROUND_FROM
from mmnan_testing.infos import InfoDataset, objects365_path

# Files repeated, and a sample that names none.
PATHS = ['a.jpg', 'b.jpg', 'a.jpg', None, 'c.jpg', 'b.jpg', 'a.jpg']
LOOKED_UP = ['a.jpg', 'b.jpg', 'c.jpg', 'd.jpg', 'missing.jpg']


def _dataset(kind):
    inner = InfoDataset(PATHS)
    if kind == 'repeat':
        return RepeatDataset(inner, times=3)
    if kind == 'concat':
        return ConcatDataset([inner, InfoDataset(['d.jpg', 'a.jpg'])])
    return inner


def _walk(dataset, path):
    # What the lookups did before the index: read every data info.
    return [i for i in range(len(dataset))
            if str(dataset.get_data_info(i).get('img_path')) == path]


def _batch(*paths):
    return dict(data_samples=[BaseDataElement(metainfo=dict(img_path=p))
                              for p in paths])


@pytest.mark.parametrize('background', [False, True],
                         ids=['in_process', 'forked'])
@pytest.mark.parametrize('kind', ['plain', 'repeat', 'concat'])
def test_lookups_are_those_of_a_walk(tmp_path, kind, background):
    dataset = _dataset(kind)
    index = sample_index(dataset)
    index.start(background=background)
    quarantine = Quarantine(str(tmp_path / 'q.json'), dataset)
    for path in LOOKED_UP:
        walked = _walk(dataset, path)
        assert index.indices(path) == walked
        assert quarantine.indices_of(path) == walked
        first, info = index.first(path)
        assert first == (walked[0] if walked else None)
        assert info == (dataset.get_data_info(first) if walked else None)
    assert index.builds == 1


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


def test_a_lookup_reads_the_data_infos_of_its_candidates_only(tmp_path):
    inner = InfoDataset([objects365_path(i) for i in range(2000)])
    dataset = RepeatDataset(inner, times=2)
    sample_index(dataset).start(background=False)
    assert inner.calls == len(dataset)
    bad, other = objects365_path(1998), objects365_path(1990)
    expected = annotation_of(inner, inner.get_data_info(1998))
    inner.calls = 0
    assert annotations(dataset, _batch(other, bad))[1] == expected
    assert inner.calls == 2  # the first index of each
    inner.calls = 0
    quarantine = Quarantine(str(tmp_path / 'q.json'), dataset)
    assert quarantine.add(bad, 'zero width').indices == [1998, 3998]
    assert inner.calls == 2  # the file's two indices
    assert sample_index(dataset).builds == 1


def test_a_large_dataset_is_walked_in_a_child_from_before_train():
    small = InfoDataset(PATHS)
    large = InfoDataset([objects365_path(i) for i in range(BACKGROUND_FROM)])
    prepare_index(small)
    prepare_index(large)
    assert sample_index(small).builds == 0  # at its first lookup
    assert sample_index(large).builds == 1 and large.calls == 0
    assert sample_index(large).indices(objects365_path(5)) == [5]
    assert large.calls == 1


class _ChildFails(InfoDataset):
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
    assert index.indices('b.jpg') == [1, 5]
    assert index.builds == 2


def test_one_index_per_dataset_while_it_lives():
    import gc
    dataset = RepeatDataset(InfoDataset(PATHS), times=2)
    index = sample_index(dataset)
    assert sample_index(dataset) is index
    assert sample_index(dataset.dataset) is not index
    annotations(dataset, _batch('a.jpg'))
    Quarantine('unused.json', dataset).indices_of('b.jpg')
    assert index.builds == 1
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
    assert index.builds == 1
