"""The zoo tier: configs as shipped inside the installed packages.

Each test trains a child of the shipped file (see :mod:`mmnan_testing.zoo`: data
root, 320 px, ``init_cfg=None``, a short schedule) on a synthetic dataset,
with the zoo's own schedulers, pipelines, samplers, loops, EMA and default
hooks, and compares with the same run without mmnanhook.

Faults are real paths through the zoo's own code: a COCO json that declares
an image twice as wide as its file (``Resize`` clips a box to zero width,
the box coder takes ``log(0)``), a collinear DOTA polygon, or an LR blow-up
without warmup.
"""
import functools
import glob
import math
import os
import os.path as osp
import re

import pytest
import torch
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

from mmnanhook import NanDetectHook, NonFiniteError
from mmnanhook._format import format_value
from mmnanhook.bundle import load_bundle
from mmnanhook.cli._replay import build_model, config_from_text
from mmnanhook.diagnosis import declared_sizes, diagnose
from mmnanhook.quarantine import read_quarantine
from mmnanhook.report import format_report
from mmnanhook.memory import restore_rng
from mmnan_testing import cli, legs, zoo

# name -> ('data', {image index: defect}) or ('lr', the LR of the blow-up).
FAULTS = {
    'retinanet_r50': ('data', {1: 'size_mismatch'}),
    'faster_rcnn_r50': ('data', {1: 'size_mismatch'}),
    'mask_rcnn_r50': ('data', {1: 'size_mismatch'}),
    'fcos_r50': ('lr', 1e30),
    'rtmdet_tiny': ('lr', 1e30),
    'segformer_b0_ade': ('lr', 1e30),
    # DINO's matcher raises on the NaN costs the blown-up weights give.
    'dino_r50': ('lr', 1e4),
    'resnet18_in1k': ('lr', 1e30),
    'deit_tiny_in1k': ('lr', 1e30),
    'rotated_retinanet': ('data', {1: 'collinear'}),
    'oriented_rcnn': ('data', {1: 'collinear'}),
}
# Epochs, or iterations of an iteration-based loop: RTMDet switches its
# pipeline (PipelineSwitchHook) after the first epoch.
LENGTH = {'rtmdet_tiny': 2, 'segformer_b0_ade': 2}
# Options of the skip runs: no replay, no bundle, except where the fault
# makes the forward raise: only a replay tells that NaN made it raise.
SKIP = dict(policy='skip', replay=False, max_dumps=0)
SKIP_OPTIONS = {'dino_r50': dict(SKIP, replay=True)}
IMAGES = 4
# The short side the smoke set's configs train at: what make test proves on
# them is mmnanhook's part (the fault caught, the fixes verified, the drop),
# not the model's; 224 px costs about half of 320's.
SIDE = {'retinanet_r50': 224, 'rotated_retinanet': 224}
# Two threads: the zoo's models are compute-bound, unlike the tiny ones;
# one where make test runs both legs at once, a core each.
THREADS = 2


# The zoo smoke set of make test: the config of each mechanism there, and
# the leg whose make test runs it (each leg's share fits its core); every
# other (config, leg) runs in make test-zoo (marker zoo_full).
EVERYDAY = {'retinanet_r50': 'modern', 'rotated_retinanet': 'dota'}


def _names(everyday=()):
    """The configs of :data:`FAULTS` as parameters, those of ``everyday`` in
    make test (on their leg of :data:`EVERYDAY`), the others in the full
    tier."""
    return [pytest.param(name, marks=[
        pytest.mark.zoo, getattr(pytest.mark, zoo.ZOO[name].package),
        pytest.mark.everyday_leg(EVERYDAY[name]) if name in everyday
        else pytest.mark.zoo_full]) for name in FAULTS]


SMOKE = ('retinanet_r50', 'rotated_retinanet')


def _zoo_threads():
    # make test runs both legs at once, one core each, and writes 2 into
    # MMNANHOOK_TEST_THREADS_FILE when one of them is done.
    path = os.environ.get('MMNANHOOK_TEST_THREADS_FILE')
    if path and osp.isfile(path):
        with open(path) as f:
            return int(f.read().strip() or THREADS)
    return int(os.environ.get('MMNANHOOK_TEST_THREADS', THREADS))


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(_zoo_threads())
    yield
    torch.set_num_threads(before)


def _run(name, data, work_dir, hook=None, hook_options=None, extra=None):
    cfg = zoo.child_config(name, data, str(work_dir),
                           length=LENGTH.get(name, 1), hook=hook,
                           hook_options=hook_options, extra=extra,
                           side=SIDE.get(name, zoo.SMALL_SIDE))
    cfg.log_level = 'WARNING'
    runner = RUNNERS.build(cfg) if hook == 'base' else Runner.from_cfg(cfg)
    probe = zoo.ZooProbe()
    return runner, probe, zoo.train_catching(runner, probe)


@pytest.mark.parametrize('name', _names())
def test_clean_run_is_the_run_without_the_hook(tmp_path, name):
    """Full tier only: two trainings per config, and the same identity is
    shown in make test by the toy and tiny-detector runs under schedulers
    (tests/sentinel/test_schedulers_and_guard.py)."""
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'data'),
                                num_images=IMAGES)
    ref, ref_probe, error = _run(name, data, tmp_path / 'ref')
    assert error is None
    # The `_base_` snippet, merged next to the shipped config.
    runner, probe, error = _run(name, data, tmp_path / 'hook', hook='base')
    assert error is None
    assert not osp.exists(osp.join(runner.work_dir, 'nan_dumps'))
    # Every hook of the zoo config is still there, plus ours.
    assert [h for h in probe.hooks if h != 'NanDetectHook'] == \
        ref_probe.hooks
    assert probe.hooks.count('NanDetectHook') == 1
    norms = runner.message_hub.get_scalar('train/grad_norm').data[0]
    assert len(norms) == len(ref_probe.lr) >= 2
    assert runner.message_hub.get_scalar('train/spikes').current() == 0
    assert probe.lr == ref_probe.lr and probe.momentum == ref_probe.momentum
    assert probe.loss == ref_probe.loss
    zoo.assert_equal(zoo.model_state(runner), zoo.model_state(ref), 'state')
    # CheckpointHook's save_last writes one at the end of every run.
    zoo.assert_same_checkpoints(runner, ref)


def _train_into_error(name, data, work_dir, extra=None):
    """Train the child of ``name`` with the hook's one line until it raises.

    Returns:
        tuple: The ``NonFiniteError``, the ``zoo.BatchFiles`` probe, the
        runner.
    """
    cfg = zoo.child_config(name, data, str(work_dir),
                           length=LENGTH.get(name, 1), hook='line',
                           extra=extra, side=SIDE.get(name, zoo.SMALL_SIDE))
    cfg.log_level = 'WARNING'
    runner, probe = zoo.runner_with_files(cfg)
    with pytest.raises(NonFiniteError) as info:
        runner.train()
    return info.value, probe, runner


def fault_kinds(name):
    kind, fault = FAULTS[name]
    return set(fault.values()) if kind == 'data' else set()


def _fault_config(name, tmp_path):
    kind, fault = FAULTS[name]
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'data'),
                                num_images=IMAGES,
                                defects=fault if kind == 'data' else None)
    extra = None
    if kind == 'lr':
        # No warmup, and an LR no schedule should ever reach.
        extra = ('optim_wrapper = dict(optimizer=dict(lr=%r))\n'
                 'param_scheduler = []' % fault)
    return kind, data, extra


@pytest.mark.parametrize('name', _names(SMOKE))
def test_real_fault_is_caught_before_it_reaches_the_weights(tmp_path, name):
    """In make test: RetinaNet R50 (modern leg: its schedulers, its verified
    fixes, the fresh-process replay) and the rotated RetinaNet (DOTA leg);
    the other configs and legs in the full tier (one to four minutes each
    on two cores)."""
    kind, data, extra = _fault_config(name, tmp_path)
    if kind == 'lr':
        _, ref_probe, _ = _run(name, data, tmp_path / 'ref', extra=extra)
        expected = ref_probe.first_bad_iter
    error, probe, runner = _train_into_error(name, data, tmp_path / 'raise',
                                             extra)
    if kind == 'data':
        bad = [osp.join(data['img_dir'], d) for d in data['defect_images']]
        expected = [i for i, files in enumerate(probe.files)
                    if set(files) & set(bad)][0]
    assert expected is not None
    assert error.iter == expected == probe.before[0]
    assert error.trigger in ('loss', 'grad', 'exception')
    # Weights and optimizer state are bitwise those before that iteration.
    zoo.assert_equal(zoo.weights(runner), probe.before[1], 'weights')
    zoo.assert_equal(runner.optim_wrapper.state_dict(), probe.before[2],
                     'optimizer')
    assert error.bundle and osp.isdir(error.bundle)
    if kind == 'data':
        # Exactly the bad image of the batch, for its data problem; its
        # innocent batch mate is not blamed.
        samples = error.report['samples']
        assert [s['img_path'] for s in samples] == [
            f for f in probe.files[expected] if f in bad]
        assert all(s['problems'] for s in samples)
    if 'size_mismatch' in (fault_kinds(name)):
        # The root cause, not only the clipped box it left.
        assert ('the annotation declares the image 640x320 (width x height) '
                'but the file is 320x320') in error.report['summary']
        assert 'has zero width' in error.report['summary']
    if kind == 'data':
        _assert_fixes_proven(name, error)


# The fixes each planted data fault's replays must prove: the batch without
# the sample, the hinted box filter in the zoo's own pipeline, and (for an
# annotation declaring the wrong size) the file's real size declared.
PROVEN = {'size_mismatch': ('drop_samples', 'filter', 'declared_size'),
          'collinear': ('drop_samples', 'filter')}


def _assert_fixes_proven(name, error):
    fixes = dict((f['kind'], f) for f in error.report['fixes'])
    for kind in set(k for fault in fault_kinds(name) for k in PROVEN[fault]):
        assert fixes[kind]['status'] == 'verified', fixes[kind]
        assert math.isfinite(fixes[kind]['loss'])
    assert fixes['filter']['fix'].startswith('add `dict(type={!r}'.format(
        'mmdet.FilterAnnotations' if zoo.ZOO[name].package == 'mmrotate'
        else 'FilterAnnotations'))
    # The verified fix is in the error's message, in one line.
    assert 'verified fix: ' in str(error)
    if name == 'retinanet_r50':
        _assert_replayed_alike_and_refuted(error)


@pytest.mark.zoo
@pytest.mark.zoo_full
@pytest.mark.mmdet
def test_voc_zero_width_box_on_the_zoo_voc_config(tmp_path):
    """Full tier: a second dataset format of the fixes; make test verifies
    them on COCO (RetinaNet R50) and DOTA."""
    # mmdet's VOC RetinaNet as shipped (RepeatDataset of a ConcatDataset,
    # bbox_min_size=32): image 1's XML declares twice its width, so a box
    # beyond the real border passes the size filter and Resize clips it to
    # zero width.
    name = 'retinanet_r50_voc'
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'data'),
                                num_images=IMAGES,
                                defects={1: 'size_mismatch'})
    bad = osp.join(data['img_dir'], data['defect_images'][0])
    error, probe, _ = _train_into_error(name, data, tmp_path / 'raise')
    assert error.iter == [i for i, files in enumerate(probe.files)
                          if bad in files][0]
    assert [s['img_path'] for s in error.report['samples']] == [bad]
    assert 'has zero width' in error.report['summary']
    fixes = dict((f['kind'], f) for f in error.report['fixes'])
    assert fixes['drop_samples']['status'] == 'verified'
    assert fixes['filter']['status'] == 'verified'
    # VOCDataset keeps a box beyond the border it declares: declaring the
    # real size leaves it to be clipped again. Refuted, and so not advice.
    assert fixes['declared_size']['status'] == 'refuted'
    assert not any('fix the sizes' in hint for hint in error.report['hints'])
    assert 'refuted: in the annotation of' in format_report(error.report)


def _assert_replayed_alike_and_refuted(error):
    # A fresh process replays the bundle (its copy of the bad image, the
    # zoo pipeline rebuilt from its config) to the same fixes and outcomes.
    code, replayed = cli.replay_json(error.bundle)
    assert code == 0
    assert [(f['kind'], f['fix'], f['status']) for f in replayed['fixes']] \
        == [(f['kind'], f['fix'], f['status'])
            for f in error.report['fixes']]
    # A fix that cannot help is refuted: with a NaN planted in a weight,
    # the batch without the bad sample is still non-finite.
    bundle = load_bundle(error.bundle)
    cfg = config_from_text(bundle.text('config.py'))
    model = build_model(cfg)
    model.load_state_dict(bundle.load('model'))
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float('nan')
    report = diagnose(
        model, bundle.load('data_batch'),
        restore_rng=functools.partial(restore_rng, bundle.load('rng')),
        declared=declared_sizes(bundle.manifest['annotations']))
    assert report.kind == 'params'
    (drop, ) = [f for f in report.fixes if f.kind == 'drop_samples']
    assert drop.status == 'refuted' and drop.samples == [
        s.index for s in report.samples] and drop.samples
    assert 'policy' not in drop.fix  # 'drop' would not drop there


@pytest.mark.parametrize('name', _names(SMOKE))
def test_skip_finishes_the_epoch(tmp_path, name):
    """In make test as the fault test above; the other configs and legs in
    the full tier."""
    kind, data, extra = _fault_config(name, tmp_path)
    runner, probe, error = _run(
        name, data, tmp_path / 'skip', hook='line', extra=extra,
        hook_options=SKIP_OPTIONS.get(name, SKIP))
    assert error is None
    if zoo.ZOO[name].by_epoch:
        assert runner.epoch == LENGTH.get(name, 1)
    assert runner.iter == len(probe.lr) >= 2
    skipped = runner.message_hub.get_scalar('train/nan_skipped').current()
    assert skipped >= 1
    assert all(torch.isfinite(v).all() for v in zoo.weights(runner).values()
               if v.is_floating_point())


def test_hook_class_is_the_registered_one():
    assert RUNNERS.get('mmnanhook.NanDetectRunner').__name__ == \
        'NanDetectRunner'
    assert NanDetectHook.priority == 'ABOVE_NORMAL'


@pytest.mark.zoo
@pytest.mark.mmdet
def test_snippet_merges_with_a_config_that_has_custom_imports(tmp_path):
    import mmdet
    from mmengine.config import Config
    shipped = osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs',
                       'convnext',
                       'mask-rcnn_convnext-t-p4-w7_fpn_amp-ms-crop-3x_coco.py')
    base = Config.fromfile(shipped, import_custom_modules=False)
    child = tmp_path / 'child.py'
    child.write_text('_base_ = %r\n' % ([
        shipped, osp.join(zoo.config_dir(), '_base_', 'nan_detect.py')], ))
    cfg = Config.fromfile(str(child), import_custom_modules=False)
    assert cfg.runner_type == 'mmnanhook.NanDetectRunner'
    assert cfg.custom_imports == base.custom_imports
    assert cfg.default_hooks == base.default_hooks
    assert cfg.get('custom_hooks') == base.get('custom_hooks')


@pytest.mark.zoo
@pytest.mark.zoo_full
@pytest.mark.mmdet
def test_lr_blowup_of_the_zoo_retinanet_is_a_divergence(tmp_path):
    """Full tier: two trainings of the R50; make test has the divergence on
    the tiny detectors (tests/diagnosis/test_gallery.py)."""
    # The story: mmdet's RetinaNet R50 with lr=20 and no warmup.
    name = 'retinanet_r50'
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'data'), num_images=8)
    extra = 'optim_wrapper = dict(optimizer=dict(lr=20.0))\n' \
        'param_scheduler = []'
    _, ref_probe, _ = _run(name, data, tmp_path / 'ref', extra=extra)
    bad = ref_probe.first_bad_iter
    assert bad is not None and bad >= 2
    # Without the hook: where the rise that ends in the failure begins.
    losses = ref_probe.loss[:bad]
    start = len(losses) - 1
    while start > 0 and losses[start - 1] < losses[start]:
        start -= 1
    _, probe, error = _run(name, data, tmp_path / 'hook', hook='line',
                           extra=extra)
    assert isinstance(error, NonFiniteError) and error.iter == bad
    report = error.report
    assert report['kind'] == 'divergence'
    assert report['divergence']['began_at'] == start
    assert report['divergence']['lr'] == pytest.approx(20.0)
    assert any('clip_grad' in hint or 'learning rate' in hint
               for hint in report['hints'])
    # The rise itself, from where it began to the trigger, as the run
    # without the hook logged it, and its line in the report.
    rise = report['divergence']['rise']
    shown = [v for v in rise['values'] if v is not None]
    assert rise['series'] == 'loss'
    assert shown[0][0] == start and shown[-1][0] == bad
    assert [v for _, v in shown[:-1]] == pytest.approx(
        [ref_probe.loss[i] for i, _ in shown[:-1]])
    assert not math.isfinite(shown[-1][1])
    rise_line = 'loss {} at iterations {}-{}, lr 20'.format(
        ' -> '.join('...' if v is None else format_value(v[1])
                    for v in rise['values']), start, bad)
    assert rise_line in report['summary'] and rise_line in str(error)
    assert 'divergence: from iter {} (loss'.format(start) in format_report(
        report)
    # A lower LR cannot be replayed without a snapshot: said, with the
    # option that keeps one.
    (fix, ) = report['fixes']
    assert fix['kind'] == 'lower_lr' and fix['status'] == 'untested'
    assert fix['fix'] == 'optim_wrapper.optimizer.lr=2'
    assert "policy='rewind'" in fix['detail']


def _assert_dropped_by_hand(runner, probe, bad):
    """The update the run applied is that step by hand on the other sample
    alone, from the same state (weights, BN buffers, optimizer state and
    LR), through the run's own optim wrapper (its clip_grad included),
    which training left without mmnanhook's bindings."""
    zoo.assert_equal(zoo.step_by_hand(runner, probe, bad),
                     probe.at['after'], 'state')


@pytest.fixture(scope='module')
def drop_run(tmp_path_factory):
    """mmdet's RetinaNet R50 as shipped, with its schedule and its
    dataloader (2 persistent worker processes, shuffling, aspect-ratio
    batches), 2 epochs under ``policy='drop'``; image 1's annotation
    declares twice its real width. Trained once for the tests below."""
    name = 'retinanet_r50'
    root = tmp_path_factory.mktemp('drop')
    data = zoo.make_zoo_dataset(name, str(root / 'data'), num_images=IMAGES,
                                defects={1: 'size_mismatch'})
    bad = osp.join(data['img_dir'], data['defect_images'][0])
    cfg = zoo.child_config(name, data, str(root / 'drop'), length=2,
                           hook='line', hook_options=dict(policy='drop'),
                           workers=True, side=SIDE[name])
    assert cfg.train_dataloader.num_workers == 2
    assert cfg.train_dataloader.persistent_workers
    runner = Runner.from_cfg(cfg)
    probe = zoo.DropProbe(bad)
    runner.register_hook(probe)
    before = torch.get_num_threads()
    threads = _zoo_threads()
    torch.set_num_threads(threads)
    try:
        runner.train()
    finally:
        torch.set_num_threads(before)
    return dict(runner=runner, probe=probe, data=data, bad=bad, root=root,
                threads=threads)


@pytest.mark.zoo
@pytest.mark.everyday_leg('modern')
@pytest.mark.mmdet
def test_drop_keeps_the_good_sample_and_never_loads_the_bad_one(drop_run):
    """In make test on the modern leg (the drop and quarantine with 2
    persistent workers); the DOTA leg's run is in the full tier."""
    runner, probe, bad = drop_run['runner'], drop_run['probe'], \
        drop_run['bad']
    # Both epochs, every batch full; the bad image loaded once, never in
    # the second epoch.
    assert runner.epoch == 2 and runner.iter == len(probe.files) == 4
    assert all(len(files) == 2 for files in probe.files)
    assert [i for i, files in enumerate(probe.files) if bad in files] == \
        [probe.at['iter']] and probe.at['iter'] < 2
    # With the run's threads: the other leg may have ended since (and given
    # this one a second core), and other threads sum in another order.
    torch.set_num_threads(drop_run['threads'])
    _assert_dropped_by_hand(runner, probe, bad)
    hub = runner.message_hub
    assert hub.get_scalar('train/samples_dropped').current() == 1
    assert hub.get_scalar('train/nan_skipped').current() == 0
    # What LogProcessor smooths and prints is finite.
    for key, buffer in hub.log_scalars.items():
        if key.startswith('train/loss') or key == 'train/grad_norm':
            assert all(math.isfinite(v) for v in buffer.data[0]), key
    logged = re.findall(r' loss: (\S+)', open(glob.glob(osp.join(
        runner.log_dir, '*.log'))[0]).read())
    # (The zoo's LoggerHook prints every 50 iterations and at each epoch's
    # end: here the end of each epoch.)
    assert len(logged) == 2 and all(math.isfinite(float(v)) for v in logged)
    # The quarantine names the bad image alone; one cause, one bundle.
    (sample, ) = read_quarantine(
        osp.join(runner.work_dir, 'nan_quarantine.json'), IMAGES)
    assert sample.file == bad and sample.indices == [1]
    assert 'declares the image 640x320' in sample.reason
    assert len(os.listdir(osp.join(runner.work_dir, 'nan_dumps'))) == 1


@pytest.mark.zoo
@pytest.mark.zoo_full
@pytest.mark.mmdet
@pytest.mark.skipif(legs.RESUME_BROKEN is not None,
                    reason=str(legs.RESUME_BROKEN))
def test_a_resumed_run_reads_the_quarantine_back(drop_run):
    """Full tier: a third epoch of the drop run (DOTA leg; mmengine 0.10.7
    cannot resume on torch >= 2.6); make test resumes the tiny RetinaNet's
    quarantine (tests/quarantine/)."""
    first, bad = drop_run['runner'], drop_run['bad']
    cfg = zoo.child_config('retinanet_r50', drop_run['data'], first.work_dir,
                           length=3, hook='line',
                           hook_options=dict(policy='drop'), workers=True,
                           side=SIDE['retinanet_r50'])
    cfg.resume = True
    runner, files = zoo.runner_with_files(cfg)
    runner.train()
    # The third epoch only, and the bad image not in it.
    assert runner.epoch == 3 and len(files.files) == 2
    assert not [f for f in files.files if bad in f]
    assert all(len(f) == 2 for f in files.files)
    (sample, ) = read_quarantine(
        osp.join(runner.work_dir, 'nan_quarantine.json'), IMAGES)
    assert sample.file == bad
    assert len(os.listdir(osp.join(runner.work_dir, 'nan_dumps'))) == 1


@pytest.mark.zoo
@pytest.mark.zoo_full
@pytest.mark.mmrotate
def test_drop_on_the_rotated_retinanet_leaves_out_the_collinear_polygon(
        tmp_path):
    """Full tier: make test's drop on a zoo config is the RetinaNet R50's;
    the rotated RetinaNet's raise and skip are in make test (DOTA leg)."""
    # mmrotate's rotated RetinaNet as shipped; image 1 holds a polygon whose
    # corners lie on one line (a rotated box of zero height).
    name = 'rotated_retinanet'
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'data'),
                                num_images=IMAGES, defects={1: 'collinear'})
    bad = osp.join(data['img_dir'], data['defect_images'][0])
    cfg = zoo.child_config(name, data, str(tmp_path / 'drop'), length=1,
                           hook='line', hook_options=dict(policy='drop'),
                           side=SIDE[name])
    runner = Runner.from_cfg(cfg)
    probe = zoo.DropProbe(bad)
    runner.register_hook(probe)
    runner.train()
    assert runner.iter == len(probe.files) == 2 and probe.at is not None
    # The step of the bad batch was applied on the other image alone.
    _assert_dropped_by_hand(runner, probe, bad)
    sample = zoo.dropped_alone(runner, bad, IMAGES)
