"""The failure gallery: tier 2 end to end on the real tiny detectors.

Each test plants one fault in a real mmdet / mmrotate detector (its data, a
small module of this file registered in mmdet's ``MODELS``, a weight, the
learning rate, the RNG), trains it on a real Runner with ``NanDetectHook``,
and checks what the bundle and the diagnosis say against what was planted.
Expected source lines are found in this file by a marker comment.
"""
import glob
import json
import math
import os
import os.path as osp

import pytest
import torch
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.runner import Runner

from mmnanhook import NonFiniteError, compat
from mmnanhook.bundle import load_bundle, to_strict_json
from mmnanhook.memory import restore_rng
from mmnan_testing import faults, testbed
from mmnan_testing import cpu_amp  # noqa: F401 - registers its wrappers
from mmnan_testing.ddp import BAD_ITER, BAD_RANK, run_ranks

MANIFEST_KEYS = ('format_version', 'iter', 'epoch', 'rank', 'world_size',
                 'trigger', 'losses', 'nonfinite_losses', 'grad_norm',
                 'nonfinite_grads', 'versions', 'files')
VERSION_KEYS = ('python', 'torch', 'mmengine', 'mmcv', 'mmdet', 'mmrotate',
                'mmnanhook')

class _AtIter(Hook):
    """Calls ``action(runner)`` before the train iterations in ``iters``."""

    priority = 'VERY_HIGH'

    def __init__(self, action, iters):
        self.action = action
        self.iters = iters

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter in self.iters:
            self.action(runner, runner.iter)


# -- running and reading -----------------------------------------------------


def _runner(tmp_path, name, defects=None, hook=None, max_iters=2,
            num_images=4, tail=None, hooks=(), **overrides):
    """A Runner of a tiny config with NanDetectHook dumping into
    ``tmp_path/dumps``; ``tail`` plants a :data:`TAILS` module in the neck."""
    data = testbed.make_dataset(name, str(tmp_path / 'data'),
                                num_images=num_images, defects=defects or {})
    cfg = testbed.tiny_config(name, data, str(tmp_path / 'work'),
                              max_iters=max_iters, log_level='WARNING',
                              **overrides)
    if tail is not None:
        cfg.model.neck = dict(type='GalleryNeck', fpn=cfg.model.neck,
                              tail=tail)
    hook = dict(hook or {}, type='NanDetectHook')
    hook.setdefault('dump_dir', str(tmp_path / 'dumps'))
    cfg.custom_imports = dict(imports=['mmnanhook'],
                              allow_failed_imports=False)
    cfg.custom_hooks = [hook]
    runner = Runner.from_cfg(cfg)
    for extra in hooks:
        runner.register_hook(extra)
    return runner, data


def _raises(runner, error=NonFiniteError):
    with pytest.raises(error) as info:
        runner.train()
    return info.value


def _bundles(dump_dir):
    """Bundle directories in ``dump_dir``; no partial ones may be left."""
    entries = sorted(os.listdir(str(dump_dir))) if osp.isdir(
        str(dump_dir)) else []
    assert not [e for e in entries if e.startswith('.')], entries
    return [osp.join(str(dump_dir), e) for e in entries]


def _strict_json(path):

    def reject(token):
        raise AssertionError('{} is not strict JSON: {}'.format(path, token))

    with open(path) as f:
        return json.load(f, parse_constant=reject)


def _bundle_of(error, dump_dir):
    """The error's bundle, verified; it must be the only one."""
    assert error.bundle is not None, str(error)
    assert _bundles(dump_dir) == [error.bundle]
    bundle = load_bundle(error.bundle)
    report = _strict_json(osp.join(error.bundle, 'report.json'))
    # What the error carries is what was written.
    assert report == to_strict_json(error.report)
    assert str(error).rstrip().endswith(error.bundle)
    assert error.report['summary'] in str(error)
    return bundle, report


def _model(runner):
    return runner.model.module if is_model_wrapper(
        runner.model) else runner.model


# -- 1. degenerate GT box ----------------------------------------------------

DEGENERATE = [
    pytest.param('retinanet_voc', 'zero_size', marks=pytest.mark.mmdet,
                 id='retinanet_voc-zero_size'),
    pytest.param('rotated_retinanet', 'collinear', marks=pytest.mark.mmrotate,
                 id='rotated_retinanet-collinear'),
]


def _position(runner, path):
    """(iteration, index in its batch) of image ``path`` in the loader's
    order (DOTADataset globs its annotation files, unsorted)."""
    loader = runner.train_dataloader
    paths = [osp.normpath(loader.dataset.get_data_info(i)['img_path'])
             for i in range(len(loader.dataset))]
    return divmod(paths.index(path), loader.batch_size)


@pytest.mark.parametrize('name,defect', DEGENERATE)
def test_degenerate_gt_box_names_the_image_and_writes_a_full_bundle(
        tmp_path, name, defect):
    runner, data = _runner(tmp_path, name, {3: defect})
    bad_path = osp.join(data['img_dir'], data['defect_images'][0])
    bad_iter, bad_index = _position(runner, bad_path)
    error = _raises(runner)
    assert (error.trigger, error.iter) == ('loss', bad_iter)
    bundle, report = _bundle_of(error, tmp_path / 'dumps')

    assert report['kind'] == 'data'
    assert [(s['index'], osp.normpath(s['img_path']))
            for s in report['samples']] == [(bad_index, bad_path)]
    assert report['samples'][0]['problems']
    assert bad_path in report['summary']
    assert [s['index'] for s in report['batch_problems']] == [bad_index]
    # The innocent sample is finite on its own and not blamed.
    assert [(r['index'], r['result']) for r in report['sample_replays']] \
        == [(i, 'nonfinite' if i == bad_index else 'finite')
            for i in range(2)]
    assert 'loss_bbox' in report['nonfinite_losses']
    assert any('FilterAnnotations' in hint for hint in report['hints'])

    manifest = _strict_json(osp.join(error.bundle, 'manifest.json'))
    assert set(MANIFEST_KEYS) <= set(manifest)
    assert manifest['format_version'] == 1
    assert (manifest['iter'], manifest['epoch'], manifest['rank'],
            manifest['world_size'], manifest['trigger']) == (bad_iter, 0, 0,
                                                             1, 'loss')
    assert manifest['losses']['loss_bbox'] in ('inf', 'nan')
    assert 'loss_bbox' in manifest['nonfinite_losses']
    assert manifest['grad_norm'] is None or isinstance(
        manifest['grad_norm'], (float, str))
    assert set(manifest['nonfinite_grads']) >= {'names', 'count'}
    assert set(VERSION_KEYS) <= set(manifest['versions'])
    assert manifest['versions']['torch'] == torch.__version__
    names = {entry['name'] for entry in manifest['files']}
    assert {'report.json', 'report.txt', 'history.json', 'history.png',
            'data_batch.pth', 'model.pth', 'optimizer.pth', 'rng.pth'} \
        <= names
    with open(osp.join(error.bundle, 'history.png'), 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    # The raw batch as the hook saw it, with its image paths.
    batch = bundle.load('data_batch')
    assert osp.normpath(
        batch['data_samples'][bad_index].img_path) == bad_path


# -- 2. sqrt at 0, backward only ---------------------------------------------


@pytest.mark.mmdet
def test_sqrt_at_zero_in_a_custom_loss_names_the_sqrt_node(tmp_path):
    faults.register_mmdet_modules()
    runner, _ = _runner(
        tmp_path, 'retinanet', max_iters=1,
        **{'model.bbox_head.loss_bbox': dict(type='SqrtL1Loss')})
    error = _raises(runner)
    assert error.trigger == 'grad'
    _, report = _bundle_of(error, tmp_path / 'dumps')
    # Finite forward: only backward goes wrong, with Inf first (the NaN
    # after it is what anomaly mode would name).
    assert report['losses']['loss_bbox'] not in ('inf', '-inf', 'nan')
    assert report['nonfinite_losses'] == []
    assert report['kind'] == 'backward'
    assert faults.is_op(report['op'], 'SqrtBackward')
    assert report['backward']['inf'] > 0 and report['backward']['nan'] == 0
    assert report['module'] == 'bbox_head.loss_bbox'
    assert report['location'] == faults.line_of('sqrt')
    assert report['batch_problems'] == []
    assert any('clamp' in hint for hint in report['hints'])


# -- 3. division by zero in forward ------------------------------------------


@pytest.mark.mmdet
def test_forward_division_by_zero_names_the_producer_not_its_parent(
        tmp_path):
    faults.register_mmdet_modules()
    runner, _ = _runner(tmp_path, 'retinanet', tail='divide', max_iters=1)
    error = _raises(runner)
    assert error.trigger == 'loss'
    _, report = _bundle_of(error, tmp_path / 'dumps')
    assert report['kind'] == 'forward'
    assert report['module'] == 'neck.tail'
    assert report['forward']['module'] == 'neck.tail'
    assert faults.is_op(report['op'], 'DivBackward')
    assert report['location'] == faults.line_of('divide')
    assert report['params'] == [] and report['batch_problems'] == []


# -- 4. NaN weight -----------------------------------------------------------


@pytest.mark.mmdet
def test_nan_written_into_one_weight_is_a_params_finding(tmp_path):
    # The head's last regression conv: no norm layer after it whose running
    # stats the NaN could reach.
    weight = 'bbox_head.retina_reg.weight'

    def poison(runner, _):
        with torch.no_grad():
            dict(_model(runner).named_parameters())[weight].view(-1)[3] = \
                float('nan')

    runner, _ = _runner(tmp_path, 'retinanet',
                        hooks=[_AtIter(poison, {1})])
    error = _raises(runner)
    assert error.iter == 1
    _, report = _bundle_of(error, tmp_path / 'dumps')
    assert report['kind'] == 'params'
    assert report['params'] == [weight]
    assert report['module'] == weight.rsplit('.', 1)[0]
    assert weight in report['summary']


# -- 5. in-place modification error in backward ------------------------------


@pytest.mark.mmdet
def test_inplace_error_propagates_with_a_bundle_naming_the_line(tmp_path):
    faults.register_mmdet_modules()
    runner, _ = _runner(tmp_path, 'retinanet', tail='inplace', max_iters=1)
    error = _raises(runner, RuntimeError)
    assert type(error) is RuntimeError  # the original type, not wrapped
    assert 'inplace operation' in str(error)
    bundles = _bundles(tmp_path / 'dumps')
    assert len(bundles) == 1
    notes = str(error) + ''.join(getattr(error, '__notes__', []))
    assert bundles[0] in notes
    load_bundle(bundles[0])
    manifest = _strict_json(osp.join(bundles[0], 'manifest.json'))
    assert manifest['trigger'] == 'exception'
    assert manifest['exception'].startswith('RuntimeError')
    report = _strict_json(osp.join(bundles[0], 'report.json'))
    assert report['kind'] == 'exception'
    assert report['exception']['type'] == 'RuntimeError'
    assert report['exception']['phase'] == 'backward'
    assert faults.is_op(report['op'], 'SigmoidBackward')
    assert report['location'] == faults.line_of('sigmoid')
    assert report['module'] == 'neck.tail'


# -- 6. an RNG-dependent fault -----------------------------------------------


@pytest.mark.mmdet
def test_rng_dependent_fault_reproduces_in_the_replay(tmp_path):
    faults.register_mmdet_modules()
    # The user's RNG state at iteration 1 drops the map in the first draw
    # of the forward, not in the draw after it: a replay that did not put
    # the RNG back would come out finite.
    seeds = {0: faults.seed_of(False), 1: faults.seed_of(True, False)}
    runner, _ = _runner(
        tmp_path, 'retinanet', tail='drop', max_iters=2,
        hooks=[_AtIter(lambda _, it: torch.manual_seed(seeds[it]), seeds)])
    error = _raises(runner)
    assert (error.trigger, error.iter) == ('loss', 1)
    bundle, report = _bundle_of(error, tmp_path / 'dumps')
    assert report['kind'] == 'forward'
    assert report['module'] == 'neck.tail'
    assert report['location'] == faults.line_of('drop')
    # The bundle's RNG state is the one before that forward.
    state = torch.get_rng_state()
    try:
        restore_rng(bundle.load('rng'))
        assert float(torch.rand(())) < faults.DROP_P
    finally:
        torch.set_rng_state(state)


# -- 7. exploding learning rate ----------------------------------------------


@pytest.mark.mmdet
def test_exploding_learning_rate_is_caught_and_not_blamed_on_data(tmp_path):
    runner, _ = _runner(tmp_path, 'retinanet', max_iters=6,
                        **{'optim_wrapper.optimizer.lr': 1e4})
    error = _raises(runner)
    assert error.trigger in ('loss', 'grad')
    assert error.iter >= 1  # the first step, from sane weights, is finite
    _, report = _bundle_of(error, tmp_path / 'dumps')
    # The data is clean: no sample may be blamed for it.
    assert report['batch_problems'] == []
    assert all(not s['problems'] for s in report['samples'])
    # One update from sane weights made them explode: a divergence that
    # began at the last step applied, at the LR the warmup gave it.
    assert report['kind'] == 'divergence', report['summary']
    divergence = report['divergence']
    assert divergence['series'] == 'weights'
    assert divergence['began_at'] == error.iter - 1
    assert divergence['factor'] >= 1e3
    assert divergence['lr'] == pytest.approx(
        runner.message_hub.get_scalar('train/lr').data[0][error.iter - 1])
    assert 'training diverged from iter %d' % (error.iter - 1) in \
        report['summary']
    hints = report['hints']
    assert any('lower the learning rate' in h and 'warmup' in h
               for h in hints)
    assert any('clip_grad' in h for h in hints)


# -- 8. one-rank NaN under DDP -----------------------------------------------


@pytest.mark.ddp
def test_one_rank_nan_under_ddp_only_the_culprit_writes_a_bundle(tmp_path):
    # The tier-1 DDP worker: rank 1 alone sees a non-finite loss.
    results, log = run_ranks('nan_loss', tmp_path)
    for rank, result in enumerate(results):
        assert result['raised'], (rank, log[-5000:])
        assert (result['iter'], result['rank'], result['bad_ranks']) == (
            BAD_ITER, rank, [BAD_RANK])
    culprit = results[BAD_RANK]
    assert _bundles(tmp_path / 'dumps') == [culprit['bundle']]
    assert results[1 - BAD_RANK]['bundle'] is None
    manifest = load_bundle(culprit['bundle']).manifest
    assert (manifest['rank'], manifest['world_size'], manifest['iter'],
            manifest['bad_ranks']) == (BAD_RANK, 2, BAD_ITER, [BAD_RANK])
    # The culprit replayed its own batch: the fault reproduced.
    assert culprit['kind'] not in (None, 'not_reproduced')


# -- 9. AMP: float16 range vs a real bug -------------------------------------

needs_cpu_amp = pytest.mark.skipif(
    compat.cpu_grad_scaler() is None,
    reason='AMP on CPU needs a CPU GradScaler (torch >= 2.3); '
    "AmpOptimWrapper itself requires a GPU, which this leg's torch lacks")


@pytest.mark.mmdet
@needs_cpu_amp
def test_amp_real_bug_is_not_called_an_overflow(tmp_path):
    # A zero-size box is non-finite in float32 too: the fp32 replay must
    # not call it a range problem.
    runner, data = _runner(
        tmp_path, 'retinanet_voc', {3: 'zero_size'},
        **{'optim_wrapper.type': 'CpuAmpOptimWrapper',
           'optim_wrapper.loss_scale': 'dynamic'})
    error = _raises(runner)
    _, report = _bundle_of(error, tmp_path / 'dumps')
    assert report['amp_dtype'] == 'bfloat16'
    assert report['overflow'] is None
    assert report['kind'] == 'data'
    assert [s['index'] for s in report['samples']] == [1]
    # float32 does not help a real bug: refuted, and not advice.
    fixes = dict((f['kind'], f['status']) for f in report['fixes'])
    assert fixes['fp32'] == 'refuted' and fixes['filter'] == 'verified'


@pytest.mark.mmdet
@needs_cpu_amp
@pytest.mark.skipif(
    compat.autocast('cpu', torch.float16) is None,
    reason='this torch cannot autocast to float16 on CPU')
def test_amp_fp16_range_overflow_names_the_module(tmp_path):
    faults.register_mmdet_modules()
    runner, _ = _runner(
        tmp_path, 'retinanet', tail='amplify', max_iters=1,
        **{'optim_wrapper.type': 'CpuFp16AmpOptimWrapper',
           'optim_wrapper.loss_scale': 'dynamic'})
    error = _raises(runner)
    assert error.trigger == 'loss'
    _, report = _bundle_of(error, tmp_path / 'dumps')
    assert report['amp_dtype'] == 'float16'
    assert report['kind'] == 'overflow'
    assert report['overflow']['module'] == 'neck.tail'
    assert report['module'] == 'neck.tail'
    assert report['location'] == faults.line_of('amplify')
    assert report['overflow']['max_abs'] > torch.finfo(torch.float16).max
    assert math.isfinite(report['overflow']['max_abs'])
    # The fix, proven: the same iteration in float32 is finite.
    (fix, ) = report['fixes']
    assert (fix['kind'], fix['status']) == ('fp32', 'verified')
    assert "'neck.tail'" in fix['fix'] and math.isfinite(fix['loss'])
    assert 'verified fix: ' + fix['fix'] in str(error)


# -- 10. max_dumps -----------------------------------------------------------


@pytest.mark.mmdet
def test_max_dumps_keeps_the_newest_bundles(tmp_path):
    # One zero-size box in each iteration: three triggers, all skipped.
    runner, _ = _runner(
        tmp_path, 'retinanet_voc', {1: 'zero_size', 3: 'zero_size',
                                    5: 'zero_size'},
        hook=dict(policy='skip', max_dumps=2, replay=False), max_iters=3,
        num_images=6)
    runner.train()
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 3
    bundles = [load_bundle(b) for b in _bundles(tmp_path / 'dumps')]
    # The newest, and the first: the only one holding the model state, which
    # the others name.
    assert sorted(b.manifest['iter'] for b in bundles) == [0, 2]
    first, last = sorted(bundles, key=lambda b: b.manifest['iter'])
    assert first.has('model') and not last.has('model')
    assert last.state_bundle().path == first.path


@pytest.mark.mmdet
def test_a_later_bundle_of_a_kind_names_the_state_and_replays_from_it(
        tmp_path):
    from mmnanhook.cli._replay import replay_bundle
    from mmnanhook.errors import BundleError
    runner, _ = _runner(
        tmp_path, 'retinanet_voc', {1: 'zero_size', 3: 'zero_size'},
        hook=dict(policy='skip'), max_iters=2, num_images=4)
    runner.train()
    first, second = [load_bundle(b) for b in _bundles(tmp_path / 'dumps')]
    assert first.has('model') and first.has('optimizer')
    assert not second.has('model') and not second.has('optimizer')
    assert first.manifest['run'] == runner.timestamp
    assert second.manifest['state_from'] == dict(
        iter=first.manifest['iter'], rank=0, run=runner.timestamp)
    assert second.state_bundle().path == first.path
    assert sorted(n for n in second.files if n.endswith('.pth')) == [
        'data_batch.pth', 'rng.pth']

    replayed = replay_bundle(second.path)[1]
    # The batch is its own: its bad box is found again, on the state of the
    # first bundle, and the report says so.
    assert [s.index for s in replayed.samples] == [
        s['index'] for s in second.report['samples']]
    assert replayed.kind.value == second.report['kind']
    assert second.state_note() in replayed.notes
    assert 'iteration {}'.format(first.manifest['iter']) in \
        second.state_note()

    os.rename(first.path, str(tmp_path / 'moved'))
    with pytest.raises(BundleError) as info:
        replay_bundle(second.path)
    assert '\n' not in str(info.value)
    assert 'holds no model state' in str(info.value)


@pytest.mark.mmdet
def test_dump_state_every_writes_the_state_each_time(tmp_path):
    runner, _ = _runner(
        tmp_path, 'retinanet_voc', {1: 'zero_size', 3: 'zero_size'},
        hook=dict(policy='skip', replay=False, dump_state='every'),
        max_iters=2, num_images=4)
    runner.train()
    bundles = [load_bundle(b) for b in _bundles(tmp_path / 'dumps')]
    assert len(bundles) == 2
    assert all(b.has('model') and b.state_ref is None for b in bundles)


# -- 11. an unwritable dump_dir ----------------------------------------------


@pytest.mark.mmdet
@pytest.mark.parametrize('policy', ['skip', 'raise'])
def test_unwritable_dump_dir_follows_the_policy_and_logs_why(tmp_path,
                                                             policy):
    blocker = tmp_path / 'not_a_dir'
    blocker.write_text(u'a regular file')
    dump_dir = str(blocker / 'dumps')
    runner, _ = _runner(tmp_path, 'retinanet_voc', {1: 'zero_size'},
                        hook=dict(policy=policy, dump_dir=dump_dir))
    if policy == 'skip':
        runner.train()
        assert runner.iter == 2
        assert runner.message_hub.get_scalar(
            'train/nan_skipped').current() == 1
    else:
        error = _raises(runner)
        assert error.bundle is None
        assert error.report['kind'] == 'data'  # the diagnosis still ran
        assert 'bundle:' not in str(error)
    logs = glob.glob(osp.join(runner.log_dir, '*.log'))
    assert len(logs) == 1
    with open(logs[0]) as f:
        log = f.read()
    assert 'the bundle was NOT written to {}: '.format(dump_dir) in log
    assert 'Not a directory' in log



# -- 12. skip undoes what the failing forward wrote into buffers -------------


@pytest.mark.mmdet
@pytest.mark.parametrize('policy', ['skip', 'warn'])
def test_skip_restores_running_statistics_the_failing_forward_wrote(
        tmp_path, policy):
    stats = {}

    def poison_stem_input(runner, it):
        # A NaN reaching the stem BN in train mode poisons its running
        # statistics during the forward, before any optimizer step.
        bn = _model(runner).backbone.bn1
        stats['before'] = bn.running_mean.clone()
        handle = _model(runner).backbone.conv1.register_forward_hook(
            lambda module, args, out: out.fill_(float('nan')))
        stats['handle'] = handle

    def remove_poison(runner, it):
        stats['handle'].remove()

    runner, _ = _runner(
        tmp_path, 'retinanet', hook=dict(policy=policy, replay=False,
                                         max_dumps=0), max_iters=3,
        hooks=[_AtIter(poison_stem_input, {1}), _AtIter(remove_poison, {2})])
    runner.train()
    running_mean = _model(runner).backbone.bn1.running_mean
    if policy == 'skip':
        # Iteration 1 never happened; iteration 2 updated finite statistics.
        assert bool(torch.isfinite(running_mean).all())
        assert not torch.equal(running_mean, stats['before'])
    else:
        # 'warn' steps as MMEngine would: the poison stays (the reason skip
        # restores it).
        assert not bool(torch.isfinite(running_mean).all())
