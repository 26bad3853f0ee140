"""mmyolo's YOLOv5-s zoo config (``yolov5_collate``: no sample's metainfo in
the batch, its boxes one ``(M, 6)`` tensor whose first column is each box's
place in the batch) with one image that loads as NaN, the second sample of
iteration 1 (:mod:`mmnan_testing.yolo`). Issue 63: the report said ``sample
1 (no img_path)``, and under ``'drop'`` the leave-out replay kept the
sample's box rows, so the drop was refuted and the run died in iteration 1
(``IndexError: index 1 is out of bounds for dimension 0 with size 1``).
Each test trains its own epoch (about 8-11 s here); mmyolo is in the DOTA
leg only.
"""
import json
import os.path as osp

import pytest

from mmnan_testing import yolo

pytestmark = [pytest.mark.zoo, pytest.mark.mmyolo]


def _placed(result):
    """The tile's file; it is the second sample of iteration 1."""
    # The first four main images loaded are the epoch's two batches.
    order = result['order'][:yolo.IMAGES]
    assert order.index(result['tile']) == 3, order
    return osp.join(result['work'], '..', 'data', 'images', result['tile'])


@pytest.mark.zoo_full
def test_the_default_policy_names_the_file_from_its_data_info(tmp_path):
    """Full tier: make test's drop (below) quarantines the same sample by
    its index, its file from the same data info."""
    result = yolo.run(str(tmp_path))
    tile = _placed(result)
    error = result['error']
    assert error is not None and error.iter == 1
    summary = error.report['summary']
    assert 'sample 1 (%s)' % osp.normpath(tile) in summary, summary
    (sample, ) = error.report['samples']
    assert (sample['index'], osp.normpath(sample['img_path']),
            sample['dataset_index']) == (1, osp.normpath(tile), yolo.BAD)
    # Leaving it out is replayed on the batch without its box rows.
    drop = [f for f in error.report['fixes'] if f['kind'] == 'drop_samples']
    assert drop and drop[0]['status'] == 'verified', drop
    # The bundle says who each sample was, and pictures the file.
    with open(osp.join(error.bundle, 'manifest.json')) as f:
        index, file = json.load(f)['samples'][1]
    assert (index, osp.normpath(file)) == (yolo.BAD, osp.normpath(tile))
    assert osp.isfile(osp.join(error.bundle, 'sample1_file.png'))


def test_drop_completes_the_epoch_with_that_sample_alone_quarantined(
        tmp_path):
    result = yolo.run(str(tmp_path), 'drop')
    tile = _placed(result)
    runner = result['runner']
    assert result['error'] is None and runner.iter == 2 and \
        result['finite']
    assert runner.message_hub.get_scalar(
        'train/samples_dropped').current() == 1
    with open(osp.join(result['work'], 'nan_quarantine.json')) as f:
        listed = json.load(f)['samples']
    assert [(s['indices'], osp.normpath(s['file']), s['source'])
            for s in listed] == [([yolo.BAD], osp.normpath(tile), 'drop')]
