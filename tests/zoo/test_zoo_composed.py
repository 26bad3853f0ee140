"""Composed samples on the zoo's mosaic detectors, ``policy='drop'``, 2
persistent worker processes: a nodata tile (float pixels, all NaN, as a
remote-sensing loader yields it) that reaches training as a Mosaic partner
or from a CachedMosaic/CachedMixUp cache is traced to its file, dropped with
its composed sample, quarantined alone, and never drawn, loaded or served
from a cache again; no second trigger.

The shipped pipelines, changed where a test on this data needs it:

* the loading step is :class:`~mmnan_testing.nodata.LoadNodataImage`
  (``LoadImageFromFile`` with ``to_float32=True``, the tile NaN);
* ``YOLOXHSVRandomAug`` is left out: it casts to int16 and back, which turns
  NaN pixels into finite ones and hides the tile;
* YOLOX only: ``Mosaic.get_indexes`` draws ``randint(0, len(dataset))``,
  bounds included: on 8 images index 8 is drawn within a few samples and
  ``CocoDataset`` raises ``IndexError``. A ``RepeatDataset(times=1)`` around
  the COCO dataset maps that index to 0 (the tile is not image 0);
* ``YOLOXModeSwitchHook(num_last_epochs=0)``: Mosaic in the first two
  epochs, the last without (its switch restarts the persistent workers),
  as the shipped schedule ends.
"""
import glob
import json
import os
import os.path as osp

import pytest

from mmnan_testing import zoo
from mmnan_testing.nodata import (nodata_pipeline, read_log,
                                      register_nodata_transforms)

pytestmark = [pytest.mark.zoo, pytest.mark.mmdet]

EPOCHS = 3
IMAGES = 8


def _run(tmp_path, name, bad):
    from mmengine.runner import Runner
    register_nodata_transforms()
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'data'),
                                num_images=IMAGES)
    work = str(tmp_path / 'work')
    cfg = zoo.child_config(name, data, work, length=EPOCHS, hook='line',
                           hook_options=dict(policy='drop'), workers=True)
    cfg.train_dataloader.update(num_workers=2, persistent_workers=True)
    log = str(tmp_path / 'tile.log')
    tile = data['images'][bad]
    dataset = cfg.train_dataloader.dataset
    if name == 'yolox_tiny':
        dataset.pipeline = nodata_pipeline(dataset.pipeline, tile, log)
        dataset.dataset.pipeline = nodata_pipeline(dataset.dataset.pipeline,
                                                   tile, log)
        dataset.dataset = dict(type='RepeatDataset', times=1,
                               dataset=dataset.dataset)
        for hook in cfg.custom_hooks:
            if hook['type'] == 'YOLOXModeSwitchHook':
                hook['num_last_epochs'] = 0
    else:
        dataset.pipeline = nodata_pipeline(dataset.pipeline, tile, log)
    runner = Runner.from_cfg(cfg)
    runner.train()
    return runner, data, tile, log, work


def _reports(work):
    found = []
    for path in sorted(glob.glob(osp.join(work, 'nan_dumps', '*',
                                          'report.json'))):
        with open(path) as f:
            report = json.load(f)
        with open(osp.join(osp.dirname(path), 'manifest.json')) as f:
            report['iter'] = json.load(f)['iter']
        found.append(report)
    return found


def _quarantined(work):
    with open(osp.join(work, 'nan_quarantine.json')) as f:
        return json.load(f)['samples']


def _after(lines, work, kind):
    """The worker-process lines of ``kind`` written after the quarantine
    (the list's mtime: its flags are set before it is written)."""
    since = os.stat(osp.join(work, 'nan_quarantine.json')).st_mtime
    return [line for line in lines if line[0] != os.getpid()
            and line[2][0] == kind and line[1] > since]


def _check_drop(runner, tile, work):
    """One trigger, the partner blamed and quarantined alone."""
    assert runner.epoch == EPOCHS
    reports = _reports(work)
    assert len(reports) == 1, [r.get('summary') for r in reports]
    report = reports[0]
    assert report['kind'] == 'data', report.get('summary')
    assert [osp.basename(s['img_path']) for s in report['samples']] == [tile]
    assert [osp.basename(s['file']) for s in _quarantined(work)] == [tile]
    assert runner.message_hub.get_scalar(
        'train/samples_dropped').current() == 1
    return report


# BAD: the tile's index; on these seeds its first composed sample holds it
# as a partner, which the test checks (the main image is another file).
YOLOX_BAD = 5


@pytest.mark.everyday_leg('modern')
def test_a_nodata_mosaic_partner_is_blamed_dropped_and_never_loaded_again(
        tmp_path):
    """In make test on the modern leg (the mosaic case of the smoke set);
    the DOTA leg's run is in the full tier."""
    runner, data, tile, log, work = _run(tmp_path, 'yolox_tiny', YOLOX_BAD)
    report = _check_drop(runner, tile, work)
    lines = read_log(log)
    served = [line for line in lines if line[2][0] == 'serve']
    assert served, 'the tile was never drawn as a partner'
    # Drawn as a partner of another image (the text names the main image).
    assert 'main image' in report['samples'][0]['problems'][0]
    assert tile not in report['samples'][0]['problems'][0].split(
        'main image ')[1].split(')')[0]
    # SimOTA's binary_cross_entropy raised on the NaN scores: a data
    # incident, the exception kept in the report.
    assert (report['exception'] or {}).get('phase') == 'forward'
    assert _after(lines, work, 'load') == []
    assert _after(lines, work, 'serve') == []


# On these seeds both composed samples of the first batch to hold the tile
# do (main image and partner): 'drop' skips that step (every sample fails),
# the next trigger holds it in one sample and drops it.
RTMDET_BAD = 3


@pytest.mark.zoo_full
def test_a_nodata_tile_is_never_served_from_a_cache_after_its_quarantine(
        tmp_path):
    """Full tier: make test's mosaic case is YOLOX's; the cached one costs
    as much again."""
    runner, data, tile, log, work = _run(tmp_path, 'rtmdet_tiny', RTMDET_BAD)
    assert runner.epoch == EPOCHS
    reports = _reports(work)
    assert reports and all(
        set(osp.basename(s['img_path']) for s in r['samples']) == {tile}
        for r in reports), [r.get('summary') for r in reports]
    (entry, ) = _quarantined(work)
    assert osp.basename(entry['file']) == tile
    # No trigger after the one that quarantined it.
    assert max(r['iter'] for r in reports) == entry['iter']
    assert runner.message_hub.get_scalar(
        'train/samples_dropped').current() == 1
    lines = read_log(log)
    assert [line for line in lines if line[2][0] == 'serve'], \
        'the tile was never served from a cache'
    assert _after(lines, work, 'serve') == []


def _healthy(tmp_path, name, hook_options):
    from mmengine.runner import Runner
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'data'),
                                num_images=IMAGES)
    cfg = zoo.child_config(name, data, str(tmp_path / str(hook_options)),
                           hook='line' if hook_options else None,
                           hook_options=hook_options)
    cfg.log_level = 'WARNING'
    runner = Runner.from_cfg(cfg)
    probe = zoo.ZooProbe()
    runner.register_hook(probe)
    runner.train()
    return runner, probe


@pytest.mark.zoo_full
@pytest.mark.parametrize('name', [
    # mmyolo's Mosaic in the dataset's own pipeline: it is handed the
    # dataset, and keeps an empty results_cache all the same.
    pytest.param('yolov5_s', marks=pytest.mark.mmyolo),
    # mmdet's Mosaic under MultiImageMixDataset; CachedMosaic's cache.
    'yolox_tiny', 'rtmdet_tiny'])
def test_a_healthy_run_under_drop_is_the_run_without_the_hook(tmp_path,
                                                              name):
    """Full tier: two trainings of a mosaic detector. Before issue 53 the
    composed guard took any list ``results_cache`` for a cache: on mmyolo's
    YOLOv5 the first iteration died in a RecursionError (the guard read the
    dataset as a cache, which loaded a sample, which drew partners...)."""
    ref, ref_probe = _healthy(tmp_path, name, None)
    runner, probe = _healthy(tmp_path, name, dict(policy='drop'))
    assert probe.loss == ref_probe.loss and len(probe.loss) >= 2
    assert probe.lr == ref_probe.lr
    zoo.assert_equal(zoo.model_state(runner), zoo.model_state(ref))
    ours, theirs = zoo.last_checkpoint(runner), zoo.last_checkpoint(ref)
    # The EMA of YOLOv5 and RTMDet, the weights of all three.
    for key in ('state_dict', 'ema_state_dict'):
        assert (key in ours) == (key in theirs), key
        if key in ours:
            zoo.assert_equal(ours[key], theirs[key], key)
    assert 'ema_state_dict' in ours or name == 'yolox_tiny'
