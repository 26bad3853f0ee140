"""Tier 1 under AMP on CPU: bf16 autocast with a real CPU GradScaler.

``AmpOptimWrapper.__init__`` asserts a GPU, so
:class:`~mmnan_testing.cpu_amp.CpuAmpOptimWrapper` replaces only the
constructor; every other method under test is the real ``AmpOptimWrapper``
one.
"""
import copy

import pytest
import torch

from mmnanhook import compat
from mmnanhook.sentinel import sentinel_of
from mmnan_testing import cpu_amp  # noqa: F401 - registers its wrappers
from mmnan_testing.toy import (Probe, ToyDataset, assert_same,
                                   assert_state_same, make_runner, params,
                                   train_error)

pytestmark = pytest.mark.skipif(
    compat.cpu_grad_scaler() is None,
    reason='needs a CPU GradScaler (torch.amp.GradScaler("cpu"), torch >= '
    '2.3); AmpOptimWrapper itself requires a GPU')

SCALE = 2.0**16
ALL = 16  # samples in the toy dataset


def amp_wrapper(**kwargs):
    cfg = dict(type='CpuAmpOptimWrapper', loss_scale='dynamic',
               optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
    cfg.update(kwargs)
    return cfg


def _step_by_hand(runner, before, *indices):
    """The update step on samples ``indices`` alone from the state
    ``before`` (parameters, optim wrapper state: its loss scaler too), as
    BaseModel.train_step does it, through the run's own AMP wrapper
    (training left it without mmnanhook's bindings)."""
    data = ToyDataset(ALL, {})
    model, wrapper = runner.model, runner.optim_wrapper
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(before[0][name])
    wrapper.load_state_dict(copy.deepcopy(before[1]))
    wrapper.zero_grad()
    batch = {'inputs': [data[i]['inputs'] for i in indices],
             'fault': [''] * len(indices)}
    with wrapper.optim_context(model):
        losses = model._run_forward(model.data_preprocessor(batch, True),
                                    mode='loss')
    loss, _ = model.parse_losses(losses)
    wrapper.update_params(loss)
    return params(runner)


def _scales(runner):
    return list(runner.message_hub.get_scalar('train/loss_scale').data[0])


@pytest.mark.filterwarnings('ignore:Error detected in')
def test_scaled_overflow_crashes_anomaly_mode_without_mmnanhook(tmp_path):
    # The scenario of the next test, without mmnanhook: anomaly mode turns an
    # ordinary GradScaler overflow into a crash.
    state = torch.is_anomaly_enabled()
    torch.autograd.set_detect_anomaly(True)
    try:
        runner = make_runner(tmp_path, faults={2: 'overflow'},
                             optim_wrapper=amp_wrapper())
        with pytest.raises(RuntimeError, match='nan values'):
            runner.train()
    finally:
        torch.autograd.set_detect_anomaly(state)


@pytest.mark.parametrize('anomaly', ['on_trigger', 'always'])
def test_overflow_is_not_a_failure(tmp_path, anomaly):
    probe = Probe()
    runner = make_runner(tmp_path, faults={2: 'overflow'}, probe=probe,
                         hook=dict(type='NanDetectHook', anomaly=anomaly),
                         optim_wrapper=amp_wrapper())
    runner.train()
    assert runner.iter == 4
    assert _scales(runner) == [SCALE, SCALE, SCALE / 2, SCALE / 2]
    # GradScaler skipped the overflowing step.
    assert_same(probe.after[1][0], probe.before[1][0])
    assert not torch.equal(probe.after[2][0]['fc.weight'],
                           probe.before[2][0]['fc.weight'])
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 0


def test_nan_loss_under_amp_is_a_trigger(tmp_path):
    runner = make_runner(tmp_path, faults={2: 'nan_term'},
                         hook=dict(type='NanDetectHook'),
                         optim_wrapper=amp_wrapper())
    err = train_error(runner)
    assert (err.trigger, err.iter) == ('loss', 1)
    assert 'loss_aux=nan' in str(err) and 'loss_scale=65536' in str(err)


def test_loss_scale_below_minimum_is_a_trigger(tmp_path):
    faults = {i: 'overflow_hard' for i in range(ALL)}
    runner = make_runner(tmp_path, faults=faults,
                         hook=dict(type='NanDetectHook',
                                   min_loss_scale=2.0**14),
                         optim_wrapper=amp_wrapper())
    err = train_error(runner)
    # 65536, 32768 and 16384 overflow; 8192 is below the minimum.
    assert (err.trigger, err.iter) == ('amp_scale', 3)
    assert 'min_loss_scale=16384' in str(err)
    assert _scales(runner) == [SCALE, SCALE / 2, SCALE / 4, SCALE / 8]


def test_consecutive_overflow_skips_are_a_trigger(tmp_path):
    faults = {i: 'overflow_hard' for i in range(ALL)}
    runner = make_runner(tmp_path, faults=faults,
                         hook=dict(type='NanDetectHook', min_loss_scale=None,
                                   max_overflow_skips=2),
                         optim_wrapper=amp_wrapper())
    err = train_error(runner)
    assert (err.trigger, err.iter) == ('amp_scale', 2)
    assert '3 consecutive AMP overflow skips' in str(err)


def test_skip_under_amp_leaves_everything_bitwise(tmp_path):
    probe = Probe()
    runner = make_runner(tmp_path, faults={2: 'nan_term'}, probe=probe,
                         hook=dict(type='NanDetectHook', policy='skip'),
                         optim_wrapper=amp_wrapper())
    runner.train()
    assert_same(probe.after[1][0], probe.before[1][0])
    # Optimizer state and the GradScaler's state (scale, growth tracker).
    assert_state_same(probe.after[1][1], probe.before[1][1])
    assert 'loss_scaler' in probe.after[1][1]
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 1


@pytest.mark.parametrize('clip', [
    dict(max_norm=0.05),
    # Never clips, but makes mmengine log the unscaled norm it computes.
    dict(max_norm=1e9)
])
def test_unscaled_norm_and_clipping_match_mmengine(tmp_path, clip):
    ref = make_runner(tmp_path / 'ref',
                      optim_wrapper=amp_wrapper(clip_grad=dict(clip)))
    ref.train()
    ours = amp_wrapper(clip_grad=dict(clip)) if clip['max_norm'] < 1 else \
        amp_wrapper()
    runner = make_runner(tmp_path / 'nan', optim_wrapper=ours,
                         hook=dict(type='NanDetectHook'))
    runner.train()
    assert_same(params(runner), params(ref))
    theirs = list(ref.message_hub.get_scalar('train/grad_norm').data[0])
    assert list(
        runner.message_hub.get_scalar('train/grad_norm').data[0]) == theirs
    assert len(theirs) == 4


def test_amp_style_rewritten_wrapper_is_checked(tmp_path):
    # What tools/train.py --amp does: the config names a plain AMP wrapper
    # type; the hook must still protect it, and put it back afterwards.
    probe = Probe()
    runner = make_runner(tmp_path, probe=probe,
                         hook=dict(type='NanDetectHook'),
                         optim_wrapper=copy.deepcopy(amp_wrapper()))
    runner.train()
    assert probe.wrapper_types == [('CpuAmpOptimWrapper',
                                    [('CpuAmpOptimWrapper', True)])] * 4
    assert type(runner.optim_wrapper) is cpu_amp.CpuAmpOptimWrapper
    assert sentinel_of(runner.optim_wrapper) is None
    assert _scales(runner) == [SCALE] * 4


def test_drop_under_amp_keeps_the_scale_and_an_overflow_is_no_trigger(
        tmp_path):
    probe = Probe()
    # Sample 2 (iteration 1): NaN loss term; sample 5 (iteration 2): an
    # ordinary GradScaler overflow, which is no trigger.
    runner = make_runner(tmp_path, faults={2: 'nan_term', 5: 'overflow'},
                         probe=probe, optim_wrapper=amp_wrapper(),
                         hook=dict(type='NanDetectHook', policy='drop'))
    runner.train()
    hub = runner.message_hub
    assert hub.get_scalar('train/samples_dropped').current() == 1
    assert hub.get_scalar('train/nan_skipped').current() == 0
    # The recomputed step was applied at the same loss scale: it is that
    # step by hand on sample 3 alone; the overflow halved the scale
    # afterwards, as GradScaler does.
    before, after = probe.before[1], probe.after[1]
    assert_same(after[0], _step_by_hand(runner, before, 3))
    before, after = (probe.before[1][1]['loss_scaler'],
                     probe.after[1][1]['loss_scaler'])
    assert after['scale'] == before['scale'] == SCALE
    # A successful step for GradScaler, as the step of a clean batch is.
    assert after['_growth_tracker'] == before['_growth_tracker'] + 1
    assert _scales(runner) == [SCALE, SCALE, SCALE, SCALE / 2]
    assert_same(probe.after[2][0], probe.before[2][0])
