"""The quarantine on mmdet's iteration-based RetinaNet as shipped
(``retinanet_r50_fpn_90k_coco.py``: ``IterBasedTrainLoop``, an endless
shuffling ``InfiniteSampler``, aspect-ratio batches, 2 persistent worker
processes): the loop builds its dataloader iterator before any hook runs.
"""
import os
import os.path as osp

import pytest
from mmengine.dataset import InfiniteSampler

from mmnanhook.quarantine import read_quarantine
from mmnan_testing import zoo

NAME = 'retinanet_r50_90k'
# The short side it trains at: the quarantine's passes, not the model, are
# what it tests.
SIDE = 192
IMAGES = 8
PASSES = 3
# 2 workers x prefetch_factor 2: index batches handed out ahead.
AHEAD = 4

pytestmark = pytest.mark.skipif(not zoo.available(NAME),
                                reason='mmdet is not installed')


def _bad_index():
    """An image whose second pass lands in a batch sampled before its first
    pass ends: in flight when it is dropped there.

    The order is the shipped sampler's (the run's seed 0); the synthetic
    images are all one aspect-ratio group, so batches are its pairs.
    """
    stream = iter(InfiniteSampler(list(range(IMAGES)), shuffle=True, seed=0))
    first, second = [next(stream) for _ in range(IMAGES)], \
        [next(stream) for _ in range(IMAGES)]
    for index in first:
        if second.index(index) // 2 <= first.index(index) // 2:
            return index
    pytest.fail('no image of seed 0 is in flight in its second pass')


@pytest.mark.zoo
@pytest.mark.mmdet
@pytest.mark.everyday_leg('dota')
def test_drop_on_the_iteration_based_zoo_config_holds_for_all_passes(
        tmp_path):
    """In make test on the DOTA leg (each leg's share fits its core); the
    modern leg's run is in the full tier."""
    bad_index = _bad_index()
    data = zoo.make_zoo_dataset(NAME, str(tmp_path / 'data'),
                                num_images=IMAGES,
                                defects={bad_index: 'size_mismatch'})
    bad = osp.join(data['img_dir'], data['defect_images'][0])
    iters = PASSES * IMAGES // 2
    cfg = zoo.child_config(NAME, data, str(tmp_path / 'drop'), length=iters,
                           hook='line', hook_options=dict(policy='drop'),
                           workers=True, side=SIDE)
    loader = cfg.train_dataloader
    assert cfg.train_cfg.type == 'IterBasedTrainLoop'
    assert loader.sampler.type == 'InfiniteSampler'
    assert loader.batch_sampler.type == 'AspectRatioBatchSampler'
    assert loader.num_workers == 2 and loader.persistent_workers
    runner, files = zoo.runner_with_files(cfg)
    runner.train()
    assert runner.iter == iters == len(files.files)
    assert all(len(batch) == 2 for batch in files.files)
    # The quarantine names the bad image alone, dropped where it came first.
    (sample, ) = read_quarantine(
        osp.join(runner.work_dir, 'nan_quarantine.json'))
    assert sample.file == bad and sample.indices == [bad_index]
    seen = [i for i, batch in enumerate(files.files) if bad in batch]
    drop = sample.iter
    assert seen[0] == drop < IMAGES // 2
    # Later, only in the batch sampled before the drop (its second pass):
    # it lost the image before the forward, without a trigger; no batch
    # sampled after the drop holds it.
    later = seen[1:]
    assert len(later) == 1 and later[0] <= drop + AHEAD, seen
    hub = runner.message_hub
    assert hub.get_scalar('train/quarantine_removed').current() == 1
    assert hub.get_scalar('train/samples_dropped').current() == 1
    assert hub.get_scalar('train/nan_skipped').current() == 0
    # One diagnosis, one bundle in all.
    dumps = osp.join(runner.work_dir, 'nan_dumps')
    assert len([d for d in os.listdir(dumps) if not d.startswith('.')]) == 1
