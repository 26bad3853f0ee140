"""mmpose's zoo configs (body 2D keypoints on COCO, top-down): a heatmap
head (ResNet-50), the RLE regression (ResNet-50, a flow model's
log-likelihood loss) and RTMPose-s (SimCC, CSPNeXt, its EMA and
PipelineSwitchHook), each a child of the shipped config
(:mod:`mmnan_testing.zoo`: 96x128 input, ``init_cfg=None``) on a synthetic
COCO-keypoints dataset of four images, one person each
(:func:`mmnanhook.demo.make_coco_keypoints_dataset`), batches of two.

* A clean run is bitwise the run without mmnanhook: weights, EMA, optimizer,
  LR and momentum each iteration, the last checkpoint.
* One image that loads as float pixels, all NaN
  (:mod:`mmnan_testing.nodata`): under the default policy the step stops
  before the update, the image alone named, weights and optimizer those
  before it; its bundle replays in a fresh process (``mmnan replay``) to
  the same report; under ``'drop'`` every iteration completes, that image
  alone left out (the step applied is the step on its batch mate alone) and
  quarantined.

A NaN keypoint in the annotation (the RLE config): its loss raises on it
(mmpose's flow model, torch's ``MultivariateNormal`` argument check), a data
incident of that sample: named under the default policy, left out and
quarantined under ``'drop'``.

RTMPose trains two epochs, so that its PipelineSwitchHook switches (before
the second); the others one.
"""
import json
import os
import os.path as osp

import pytest
import torch
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

from mmnanhook import NonFiniteError
from mmnan_testing import cli, zoo
from mmnan_testing.nodata import nodata_pipeline, register_nodata_transforms

NAMES = ['td_hm_res50', 'td_reg_res50_rle', 'rtmpose_s']
LENGTH = {'rtmpose_s': 2}
IMAGES = 4
# The image that loads as NaN.
TILE = 1
# make test's share (the codebases leg): the heatmap config's NaN-image
# catch; the rest is the full tier's (make test-zoo).
EVERYDAY = 'td_hm_res50'


def _param(name, everyday=False):
    return pytest.param(name, marks=zoo.codebase_marks('mmpose', everyday))


def _train(cfg, probe, build=Runner.from_cfg):
    """Build ``cfg`` and train it on one thread (both runs of a comparison
    alike); the runner and what training raised, or ``None``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = build(cfg)
        return runner, zoo.train_catching(runner, probe)
    finally:
        torch.set_num_threads(before)


def _nodata(cfg, bad):
    """Load ``bad`` (a base name) as all NaN in every train pipeline of
    ``cfg``, the one a PipelineSwitchHook switches to included."""
    register_nodata_transforms()
    dataset = cfg.train_dataloader.dataset
    dataset.pipeline = nodata_pipeline(dataset.pipeline, bad)
    pipelines = [dataset.pipeline]
    for hook in cfg.get('custom_hooks') or []:
        if hook.get('switch_pipeline'):
            hook['switch_pipeline'] = nodata_pipeline(
                hook['switch_pipeline'], bad)
            pipelines.append(hook['switch_pipeline'])
    for steps in pipelines:
        assert sum(s['type'].endswith('LoadNodataImage')
                   for s in steps) == 1, steps
        for step in steps:
            # The loader yields every image as float32 pixels, and
            # albumentations' median blur refuses a float32 image with a
            # kernel above 5 (RTMPose's draws up to 7).
            for albu in step.get('transforms') or []:
                if isinstance(albu, dict) and albu.get('type') == 'MedianBlur':
                    albu['blur_limit'] = 5


def _dataset_index(runner, path):
    """The indices of the train dataset's samples that load ``path``."""
    dataset = runner.train_dataloader.dataset
    return [i for i in range(len(dataset))
            if dataset.get_data_info(i)['img_path'] == path]


def _tile_run(root, name, policy):
    """Train ``name`` with image :data:`TILE` loading as all NaN under
    ``policy`` (``None``: the hook's default).

    Returns:
        dict: ``runner``, ``probe`` (a ``zoo.DropProbe``), ``error``, the
        ``bad`` image's path and ``data``.
    """
    data = zoo.make_zoo_dataset(name, str(root / 'data'), num_images=IMAGES)
    bad = osp.join(data['img_dir'], data['images'][TILE])
    cfg = zoo.child_config(name, data, str(root / 'work'),
                           length=LENGTH.get(name, 1), hook='line',
                           hook_options={} if policy is None else dict(
                               policy=policy))
    cfg.log_level = 'WARNING'
    _nodata(cfg, osp.basename(bad))
    probe = zoo.DropProbe(bad)
    runner, error = _train(cfg, probe)
    return dict(runner=runner, probe=probe, error=error, bad=bad,
                data=data)


@pytest.fixture(scope='module')
def raised(tmp_path_factory):
    """The default policy's run of each config, trained once (for the
    catch and the replay)."""
    return zoo.once_per_name(
        tmp_path_factory, lambda root, name: _tile_run(root, name, None))


@pytest.mark.parametrize('name', [_param(n) for n in NAMES])
def test_clean_run_is_the_run_without_the_hook(tmp_path, name):
    """Full tier: two trainings per config; make test shows the identity on
    the toy and tiny-detector runs under schedulers."""
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'data'),
                                num_images=IMAGES)
    runs = {}
    for key, hook in (('ref', None), ('hook', 'base')):
        cfg = zoo.child_config(name, data, str(tmp_path / key),
                               length=LENGTH.get(name, 1), hook=hook)
        cfg.log_level = 'WARNING'
        probe = zoo.ZooProbe()
        # The `_base_` snippet makes the run a NanDetectRunner.
        runner, error = _train(cfg, probe, RUNNERS.build if hook
                               else Runner.from_cfg)
        assert error is None, error
        runs[key] = (runner, probe)
    (ref, ref_probe), (runner, probe) = runs['ref'], runs['hook']
    assert not osp.exists(osp.join(runner.work_dir, 'nan_dumps'))
    # Every hook of the zoo config is still there, plus ours.
    assert [h for h in probe.hooks if h != 'NanDetectHook'] == \
        ref_probe.hooks
    assert probe.hooks.count('NanDetectHook') == 1
    iters = IMAGES // 2 * LENGTH.get(name, 1)
    assert len(ref_probe.lr) == iters
    norms = runner.message_hub.get_scalar('train/grad_norm').data[0]
    assert len(norms) == iters
    assert probe.lr == ref_probe.lr and probe.momentum == ref_probe.momentum
    assert probe.loss == ref_probe.loss
    assert all(ref_probe.finite) and None not in ref_probe.loss
    zoo.assert_equal(zoo.model_state(runner), zoo.model_state(ref), 'state')
    ours = zoo.assert_same_checkpoints(runner, ref)
    if name == 'rtmpose_s':
        # Its EMA (averaged weights and buffers) and its pipeline switch
        # ran, in both runs alike.
        assert 'ema_state_dict' in ours
        emas = [[h for h in r.hooks if type(h).__name__ == 'EMAHook']
                for r in (runner, ref)]
        assert [len(e) for e in emas] == [1, 1]
        zoo.assert_equal(emas[0][0].ema_model.state_dict(),
                         emas[1][0].ema_model.state_dict(), 'ema')
        switched = [[h._has_switched for h in r.hooks
                     if type(h).__name__ == 'PipelineSwitchHook']
                    for r in (runner, ref)]
        assert switched == [[True], [True]]


@pytest.mark.parametrize('name', [_param(n, n == EVERYDAY) for n in NAMES])
def test_the_nan_image_is_caught_before_the_update_and_named(raised, name):
    """In make test (codebases leg): the heatmap config's; the others in
    the full tier."""
    run = raised(name)
    error, probe, runner, bad = run['error'], run['probe'], run['runner'], \
        run['bad']
    assert isinstance(error, NonFiniteError), error
    (at, ) = [i for i, files in enumerate(probe.files) if bad in files]
    # Weights and optimizer state (Adam's / AdamW's moments) bitwise those
    # before that iteration.
    zoo.assert_stopped_before(runner, probe, at, error)
    report = error.report
    assert report['kind'] == 'data'
    # The image alone, by its dataset index; its batch mate is not blamed.
    (sample, ) = report['samples']
    assert sample['img_path'] == bad
    assert [sample['dataset_index']] == _dataset_index(runner, bad)
    assert any('NaN' in p for p in sample['problems'])
    assert error.bundle and osp.isdir(error.bundle)


@pytest.mark.parametrize('name', [_param(n) for n in NAMES])
def test_the_bundle_replays_to_the_same_report(raised, name):
    """Full tier: a fresh process per config (the model rebuilt from the
    bundle's config, mmpose's registries)."""
    error = raised(name)['error']
    assert isinstance(error, NonFiniteError), error
    code, replayed = cli.replay_json(error.bundle)
    assert code == 0
    original = cli.run_report(error.bundle)
    assert replayed['kind'] == original['kind'] == 'data'
    assert [s['img_path'] for s in replayed['samples']] == \
        [raised(name)['bad']]
    cli.assert_same_report(replayed, original)


@pytest.mark.parametrize('name', [_param(n) for n in NAMES])
def test_drop_completes_every_iteration_with_the_image_alone_quarantined(
        tmp_path, name):
    """Full tier: one training per config; make test's drop on a zoo
    config is mmdet's RetinaNet R50."""
    run = _tile_run(tmp_path, name, 'drop')
    runner, probe, bad = run['runner'], run['probe'], run['bad']
    assert run['error'] is None, run['error']
    length = LENGTH.get(name, 1)
    assert runner.epoch == length
    # Every iteration ran with a full batch; the image was loaded in one
    # iteration only, never again.
    assert runner.iter == len(probe.files) == len(probe.loss) == \
        IMAGES // 2 * length
    assert all(len(files) == 2 for files in probe.files)
    assert [i for i, files in enumerate(probe.files) if bad in files] == \
        [probe.at['iter']]
    assert all(probe.finite) and None not in probe.loss
    sample = zoo.dropped_alone(runner, bad, IMAGES)
    assert sample.indices == _dataset_index(runner, bad)
    assert 'NaN' in sample.reason
    assert len(os.listdir(osp.join(runner.work_dir, 'nan_dumps'))) == 1
    # The update applied is the step on its batch mate alone, from the same
    # state (last: it loads that state into the model).
    _assert_dropped_by_hand(runner, probe, bad)


def _assert_dropped_by_hand(runner, probe, bad):
    """The update the drop applied is the step on the batch mate alone, by
    hand on one thread as the run trained."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        zoo.assert_equal(zoo.step_by_hand(runner, probe, bad),
                         probe.at['after'], 'state')
    finally:
        torch.set_num_threads(before)


def _keypoint_run(root, policy):
    """One epoch of the RLE config whose annotation of image :data:`TILE`
    holds a NaN keypoint (its left wrist's x), under ``policy``."""
    name = 'td_reg_res50_rle'
    data = zoo.make_zoo_dataset(name, str(root / 'data'), num_images=IMAGES)
    with open(data['ann_file']) as f:
        coco = json.load(f)
    (person, ) = [a for a in coco['annotations'] if a['image_id'] == TILE + 1]
    wrist = 9
    assert person['keypoints'][3 * wrist + 2] > 0  # a labelled keypoint
    person['keypoints'][3 * wrist] = float('nan')
    # (json writes NaN, and reads it back, as mmpose's xtcocotools does.)
    with open(data['ann_file'], 'w') as f:
        json.dump(coco, f)
    bad = osp.join(data['img_dir'], data['images'][TILE])
    cfg = zoo.child_config(name, data, str(root / 'work'), length=1,
                           hook='line',
                           hook_options={} if policy is None else dict(
                               policy=policy))
    cfg.log_level = 'WARNING'
    probe = zoo.DropProbe(bad)
    runner, error = _train(cfg, probe)
    return dict(runner=runner, probe=probe, error=error, bad=bad)


@pytest.mark.zoo
@pytest.mark.zoo_full
@pytest.mark.mmpose
def test_a_nan_keypoint_raising_in_the_rle_loss_is_its_samples(tmp_path):
    """Full tier: one training; make test has the diagnosis on a toy flow
    loss (tests/diagnosis/test_nonfinite_targets.py)."""
    run = _keypoint_run(tmp_path, None)
    error, probe, runner, bad = run['error'], run['probe'], run['runner'], \
        run['bad']
    assert isinstance(error, NonFiniteError), error
    (at, ) = [i for i, files in enumerate(probe.files) if bad in files]
    assert error.iter == at == probe.before[0]
    assert error.trigger == 'exception'
    zoo.assert_equal(zoo.weights(runner), probe.before[1], 'weights')
    zoo.assert_equal(runner.optim_wrapper.state_dict(), probe.before[2],
                     'optimizer')
    report = error.report
    # mmpose's loss raised (not a NaN loss), and the sample is the cause.
    assert report['exception']['type'] == 'ValueError'
    assert report['kind'] == 'data'
    (sample, ) = report['samples']
    assert sample['img_path'] == bad
    assert [sample['dataset_index']] == _dataset_index(runner, bad)
    assert sample['problems'] and all('NaN' in p and 'keypoint' in p
                                      for p in sample['problems'])
    fixes = dict((f['kind'], f) for f in report['fixes'])
    assert fixes['drop_samples']['status'] == 'verified'


@pytest.mark.zoo
@pytest.mark.zoo_full
@pytest.mark.mmpose
def test_drop_leaves_out_the_nan_keypoint_the_rle_loss_raises_on(tmp_path):
    """Full tier: one training."""
    run = _keypoint_run(tmp_path, 'drop')
    runner, probe, bad = run['runner'], run['probe'], run['bad']
    assert run['error'] is None, run['error']
    assert runner.iter == len(probe.files) == len(probe.loss) == IMAGES // 2
    assert all(len(files) == 2 for files in probe.files)
    assert all(probe.finite) and None not in probe.loss
    sample = zoo.dropped_alone(runner, bad, IMAGES)
    assert sample.indices == _dataset_index(runner, bad)
    _assert_dropped_by_hand(runner, probe, bad)
