"""Composed samples on mmdet's real datasets and transforms: the parts each
Mosaic/CachedMosaic sample is made of are in its metainfo, a blocked file is
never drawn or served from a cache again (in a persistent worker process
too), the data and RNG draws are unchanged while nothing is blocked, the
diagnosis traces a NaN input to the partner it came from, and the workers
started anew after a handover hold the sample index walked once.

8 synthetic COCO images of 64 px, in process unless said.
"""
import os.path as osp
import random

import numpy as np
import pytest
import torch

from mmnan_testing import composed

pytestmark = pytest.mark.mmdet

IMAGES = composed.IMAGES


@pytest.fixture(scope='module')
def coco(tmp_path_factory):
    return composed.make_data(str(tmp_path_factory.mktemp('coco')))


def _parts(sample):
    from mmnanhook.quarantine import PARTS
    return [osp.basename(p) for _, p in
            sample['data_samples'].metainfo.get(PARTS) or ()]


def _draw(dataset, order, seed=0):
    random.seed(seed)
    np.random.seed(seed)
    return [dataset[i] for i in order]


@pytest.mark.parametrize('make', [composed.mosaic, composed.cached],
                         ids=['mosaic', 'cached'])
def test_parts_are_recorded_and_nothing_else_changes(coco, make):
    from mmnanhook.quarantine._composed import ComposedGuard
    order = list(range(IMAGES)) * 2
    plain = _draw(make(coco), order)
    dataset = make(coco)
    guard = ComposedGuard(dataset)
    assert guard.bound
    guarded = _draw(dataset, order)
    state = random.getstate()
    _draw(make(coco), order)
    assert random.getstate() == state  # the same draws from `random`
    for a, b in zip(plain, guarded):
        x, y = a['inputs'], b['inputs']
        assert x.shape == y.shape and bool(
            ((x == y) | (torch.isnan(x) & torch.isnan(y))).all())
    assert all(_parts(s) for s in guarded[IMAGES:])
    assert not any(_parts(s) for s in plain)
    guard.remove()
    assert not any(_parts(s) for s in _draw(dataset, order))


@pytest.mark.parametrize('make', [composed.mosaic, composed.cached],
                         ids=['mosaic', 'cached'])
def test_a_blocked_file_is_never_drawn_nor_served_again(coco, make):
    from mmnanhook.quarantine._composed import ComposedGuard
    dataset = make(coco)
    guard = ComposedGuard(dataset)
    before = _draw(dataset, list(range(IMAGES)) * 2)
    assert any('000005.png' in _parts(s) for s in before)
    guard.block(osp.join(coco['img_dir'], '000005.png'))
    # The sampler no longer gives it as the main image; nor may a cache.
    after = _draw(dataset, [i for i in list(range(IMAGES)) * 4 if i != 5],
                  seed=1)
    assert not any('000005.png' in _parts(s) for s in after)
    assert all(bool(torch.isfinite(s['inputs']).all()) for s in after)


def test_a_persistent_worker_sees_a_file_blocked_after_it_started(coco):
    from torch.utils.data import DataLoader
    from mmengine.dataset import pseudo_collate
    from mmnanhook.quarantine._composed import ComposedGuard
    dataset = composed.mosaic(coco)
    guard = ComposedGuard(dataset)
    order = [i for i in list(range(IMAGES)) * 3 if i != 5]
    loader = DataLoader(dataset, batch_size=1, sampler=order, num_workers=1,
                        persistent_workers=True, collate_fn=pseudo_collate)
    first = [_parts(dict(data_samples=b['data_samples'][0]))
             for b in loader]
    assert any('000005.png' in parts for parts in first)
    guard.block(osp.join(coco['img_dir'], '000005.png'))
    second = [_parts(dict(data_samples=b['data_samples'][0]))
              for b in loader]
    assert second and not any('000005.png' in parts for parts in second)
    del loader


def test_the_diagnosis_blames_the_partner_not_the_main_image(coco):
    from mmengine.dataset import pseudo_collate
    from mmnanhook.diagnosis._composed import trace_parts
    from mmnanhook.diagnosis._data import check_batch
    from mmnanhook.quarantine._composed import ComposedGuard
    dataset = composed.mosaic(coco)
    ComposedGuard(dataset)
    samples = [s for s in _draw(dataset, [i for i in range(IMAGES)
                                          if i != 5] * 3)
               if '000005.png' in _parts(s)]
    assert samples
    batch = pseudo_collate(samples[:1])
    (finding, ) = check_batch(batch)
    assert finding.categories and osp.basename(
        finding.img_path) != '000005.png'
    main = finding.img_path
    trace_parts([finding], batch, dataset)
    assert osp.basename(finding.img_path) == '000005.png'
    assert main in finding.problems[0].text


def test_fresh_workers_after_a_handover_look_up_without_a_walk(
        coco, tmp_path):
    # A worker forked before the guard (as IterBasedTrainLoop's), then the
    # quarantine, the guard and the diagnosis look the tile up (mmdet's
    # CocoDataset searched, nothing walked), then the handover: the fresh
    # worker answers a lookup without a walk too and never draws the tile.
    import functools
    from torch.utils.data import DataLoader
    from mmengine.dataset import pseudo_collate
    from mmnanhook.diagnosis import annotations
    from mmnanhook.quarantine import Quarantine, sample_index
    from mmnanhook.quarantine._composed import ComposedGuard
    from mmnanhook.quarantine._workers import Handover
    from mmnan_testing.nodata import log_index, read_log
    log = str(tmp_path / 'loads.log')
    tile = composed.tile_path(coco)
    dataset = composed.mosaic(coco, log)
    loader = DataLoader(
        dataset, batch_size=1, num_workers=1, collate_fn=pseudo_collate,
        sampler=[i for i in range(IMAGES) if i != 5] * 4,
        worker_init_fn=functools.partial(log_index, log, tile))
    old = iter(loader)
    first = next(old)
    guard = ComposedGuard(dataset)
    quarantine = Quarantine(str(tmp_path / 'q.json'), dataset)
    assert quarantine.add(tile, 'nodata').indices == [5]
    guard.block(tile)
    annotations(dataset, first)
    handover = Handover(old, loader, None)
    batches = list(handover)
    assert len(batches) == 4 * (IMAGES - 1) - 1
    assert sample_index(dataset).builds == 0
    lines = read_log(log)
    index = {pid: words[1:] for pid, _, words in lines
             if words[0] == 'index'}
    # Both workers (forked before and after the lookups): nothing walked,
    # no arrays, the lookup answered by a search.
    assert list(index.values()) == [['0', '0', '1', '5']] * 2
    (fresh, ) = [pid for pid, _, words in lines
                 if words[0] == 'index'][1:]
    served = [words for pid, _, words in lines if pid == fresh]
    assert served and not any(w[0] in ('load', 'serve') for w in served)


def _iteration_based(tmp_path, name, tile, hook=True, iters=24):
    """The tiny RetinaNet on Mosaic samples (``MultiImageMixDataset``),
    trained by ``IterBasedTrainLoop`` with a shuffling ``InfiniteSampler``
    and 2 persistent workers (started when the loop is built, before any
    hook); ``tile`` (a base name, or None) is nodata."""
    from mmnan_testing import testbed, zoo
    from mmnan_testing.nodata import (nodata_pipeline,
                                      register_nodata_transforms)
    register_nodata_transforms()
    data = testbed.make_dataset('retinanet', str(tmp_path / 'data'),
                                num_images=IMAGES)
    log = str(tmp_path / ('%s.log' % name))
    cfg = testbed.tiny_config('retinanet', data, str(tmp_path / name),
                              max_iters=iters, log_level='INFO')
    nodata = [tile] if tile else []
    inner = cfg.train_dataloader.dataset
    inner.pipeline = nodata_pipeline(inner.pipeline[:2], nodata[0], log) \
        if tile else inner.pipeline[:2]
    # (mmdet 3.1's PackDetInputs asserts every meta key: a flip step.)
    mix = [dict(type='Mosaic', img_scale=(64, 64), pad_val=114.0),
           dict(type='Resize', scale=(64, 64), keep_ratio=True),
           dict(type='RandomFlip', prob=0.5), dict(type='PackDetInputs')]
    cfg.train_dataloader.dataset = dict(
        type='MultiImageMixDataset', pipeline=nodata_pipeline(
            mix, nodata[0], log) if tile else mix,
        # Mosaic draws randint(0, len) bounds included.
        dataset=dict(type='RepeatDataset', times=1, dataset=inner))
    cfg.train_dataloader.update(
        num_workers=2, persistent_workers=True,
        sampler=dict(type='InfiniteSampler', shuffle=True))
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters)
    runner, files = zoo.runner_with_files(
        cfg, dict(policy='drop') if hook else None)
    runner.train()
    return runner, files.files, log


@pytest.mark.everyday_leg('modern')
def test_workers_started_before_the_hook_are_kept_while_nothing_is_bad(
        tmp_path):
    """In make test on the modern leg; the DOTA leg's run is in the full
    tier."""
    # Nothing is quarantined: the workers the iteration-based loop started
    # before the hook are kept, and every batch and weight is what the run
    # without the hook has.
    from mmnan_testing.zoo import weights
    plain, plain_files, _ = _iteration_based(tmp_path, 'plain', None,
                                             hook=False, iters=8)
    guarded, guarded_files, _ = _iteration_based(tmp_path, 'guarded', None,
                                                 iters=8)
    assert guarded_files == plain_files
    a, b = weights(plain), weights(guarded)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.everyday_leg('dota')
def test_iteration_based_workers_never_draw_a_quarantined_partner(tmp_path):
    """In make test on the DOTA leg; the modern leg's run is in the full
    tier."""
    # The loop's workers started before the hook: at the quarantine they
    # finish the batches in flight and make way for fresh ones, which hold
    # the guard. No worker started after the quarantine draws the tile; no
    # diagnosis blames another file.
    import glob
    import json
    import os
    from mmnan_testing.nodata import read_log
    from mmnan_testing.toy import log_text
    tile = '000005.png'
    runner, files, log = _iteration_based(tmp_path, 'drop', tile)
    (sample, ) = json.load(open(osp.join(
        runner.work_dir, 'nan_quarantine.json')))['samples']
    assert osp.basename(sample['file']) == tile
    assert 'workers started anew' in log_text(runner)
    for path in glob.glob(osp.join(runner.work_dir, 'nan_dumps', '*',
                                   'report.json')):
        blamed = [s['img_path'] for s in json.load(open(path))['samples']]
        assert blamed and all(p is None or osp.basename(p) == tile
                              for p in blamed), blamed
    lines = read_log(log)
    since = os.stat(osp.join(runner.work_dir,
                             'nan_quarantine.json')).st_mtime
    before = set(line[0] for line in lines if line[1] <= since)
    fresh = [line for line in lines if line[0] not in before
             and line[0] != os.getpid()]
    # (Every worker logs its loads: the tile's, and nothing else. Fresh
    # workers must exist, or the check below proves nothing.)
    # The old workers drew it (as a main image or a partner)...
    assert any(line[2][0] == 'load' for line in lines if line[1] <= since)
    # ... the fresh ones never load it, nor serve it as a part.
    assert fresh and not any(line[2][0] in ('serve', 'load')
                             for line in fresh), fresh
