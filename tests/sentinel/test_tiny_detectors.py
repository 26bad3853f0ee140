"""Tier 1 on the tiny real detectors (mmdet RetinaNet, mmrotate RetinaNet).

A degenerate ground-truth box that the VOC / DOTA loaders keep makes the
regression target ``log(0)``: ``loss_bbox`` is infinite while the gradients
stay finite, so only the loss check can stop the step.
"""
import pytest
from mmengine.runner import Runner

from mmnanhook import NonFiniteError, compat
from mmnan_testing import testbed
from mmnan_testing.toy import Probe, assert_same


def _runner(tmp_path, name, defects, hook=None, max_iters=3, **overrides):
    data = testbed.make_dataset(name, str(tmp_path / 'data'),
                                defects=defects)
    cfg = testbed.tiny_config(name, data, str(tmp_path / 'work'),
                              max_iters=max_iters, log_level='WARNING',
                              **overrides)
    cfg.custom_imports = dict(imports=['mmnanhook'],
                              allow_failed_imports=False)
    cfg.custom_hooks = [hook or dict(type='NanDetectHook')]
    runner = Runner.from_cfg(cfg)
    probe = Probe()
    runner.register_hook(probe)
    return runner, probe


@pytest.mark.mmdet
def test_retinanet_inf_loss_term_is_named_before_the_step(tmp_path):
    # Image 1 is in iteration 0.
    runner, probe = _runner(tmp_path, 'retinanet_voc', {1: 'zero_size'})
    with pytest.raises(NonFiniteError) as info:
        runner.train()
    err = info.value
    assert (err.trigger, err.iter, err.rank) == ('loss', 0, 0)
    assert 'loss_bbox=inf' in str(err) and 'loss_cls=' in str(err)
    assert 'non-finite gradients' not in str(err)
    assert_same(
        {n: p.detach() for n, p in runner.model.named_parameters()},
        probe.before[0][0])
    # The VOC zero-size box: leaving the sample out and the hinted filter in
    # the config's own pipeline are both proven finite.
    assert_fixes_verified(err, 'FilterAnnotations')


def assert_fixes_verified(error, filter_type):
    fixes = dict((f['kind'], f) for f in error.report['fixes'])
    assert fixes['drop_samples']['status'] == 'verified'
    assert fixes['filter']['status'] == 'verified', fixes['filter']
    assert "type='{}'".format(filter_type) in fixes['filter']['fix']
    assert fixes['filter']['hint'] is not None
    assert 'verified fix: ' in str(error)


@pytest.mark.mmdet
def test_retinanet_skip_policy_trains_on(tmp_path):
    runner, probe = _runner(tmp_path, 'retinanet_voc', {3: 'zero_size'},
                            hook=dict(type='NanDetectHook', policy='skip'))
    runner.train()
    assert runner.iter == 3
    assert_same(probe.after[1][0], probe.before[1][0])
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 1


@pytest.mark.mmdet
@pytest.mark.skipif(
    compat.cpu_grad_scaler() is None,
    reason='needs a CPU GradScaler (torch >= 2.3) to run AMP on CPU')
def test_retinanet_after_amp_rewrote_the_wrapper_type(tmp_path):
    from mmnan_testing import cpu_amp  # noqa: F401 - registers it

    # What mmdet's tools/train.py --amp does to the config.
    runner, probe = _runner(
        tmp_path, 'retinanet_voc', {3: 'zero_size'},
        **{'optim_wrapper.type': 'CpuAmpOptimWrapper',
           'optim_wrapper.loss_scale': 'dynamic'})
    with pytest.raises(NonFiniteError) as info:
        runner.train()
    assert (info.value.trigger, info.value.iter) == ('loss', 1)
    assert 'loss_bbox=inf' in str(info.value)
    # A data fault under AMP: float32 does not help, leaving it out does.
    fixes = dict((f['kind'], f['status']) for f in info.value.report['fixes'])
    assert fixes['fp32'] == 'refuted' and fixes['drop_samples'] == 'verified'
    assert probe.wrapper_types == [
        ('CpuAmpOptimWrapper', [('CpuAmpOptimWrapper', True)])] * 2
    assert len(runner.message_hub.get_scalar('train/loss_scale').data[0]) \
        == 2
    assert type(runner.optim_wrapper).__name__ == 'CpuAmpOptimWrapper'


@pytest.mark.mmrotate
def test_rotated_retinanet_degenerate_box(tmp_path):
    runner, probe = _runner(tmp_path, 'rotated_retinanet',
                            {1: 'collinear'})
    with pytest.raises(NonFiniteError) as info:
        runner.train()
    assert (info.value.trigger, info.value.iter) == ('loss', 0)
    assert 'loss_bbox=inf' in str(info.value)
    assert_fixes_verified(info.value, 'mmdet.FilterAnnotations')
    assert_same(
        {n: p.detach() for n, p in runner.model.named_parameters()},
        probe.before[0][0])
