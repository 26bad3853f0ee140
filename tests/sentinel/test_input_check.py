"""Tier 1's input check on a real Runner: a sample whose (float) input is
NaN is stopped after the data preprocessor, before any op of the model,
named, and the policy applies; no op ever sees it (the replays of the
diagnosis included), and the hook leaves nothing of its own behind.
"""
import math

import pytest
import torch

from mmnanhook.sentinel import InputCheck
from mmnan_testing.toy import (ToyModel, log_text, make_runner, params,
                               train_error)

HOOK = dict(type='NanDetectHook')
# Sample 3: position 1 of iteration 1's batch.
FAULTS = {3: 'nan_input'}


def _watch(model):
    """Per call of ``model.fc``: whether its input was finite."""
    seen = []
    model.fc.register_forward_pre_hook(
        lambda module, args: seen.append(bool(torch.isfinite(args[0]).all())))
    return seen


def test_the_default_policy_stops_the_step_before_the_forward(tmp_path):
    model = ToyModel()
    seen = _watch(model)
    runner = make_runner(tmp_path, FAULTS, hook=HOOK, model=model)
    error = train_error(runner)
    assert error.iter == 1 and error.trigger == 'exception'
    assert 'input check at iter 1' in str(error)
    assert 'the input of sample 1 is not finite' in str(error)
    report = error.report
    assert report['kind'] == 'data'
    assert [s['index'] for s in report['samples']] == [1]
    assert report['samples'][0]['problems'] == [
        'input has 4 NaN and 0 Inf values']
    # No op of the model saw the NaN: not the step, not a replay.
    assert seen and all(seen)
    assert all(bool(torch.isfinite(p).all()) for p in params(runner).values())
    # The hook is gone with the run.
    assert not model.data_preprocessor._forward_hooks


@pytest.mark.parametrize('policy', ['drop', 'skip'])
def test_the_policy_applies_before_the_forward(tmp_path, policy):
    model = ToyModel()
    seen = _watch(model)
    runner = make_runner(tmp_path, FAULTS, hook=dict(HOOK, policy=policy),
                         model=model)
    runner.train()
    assert runner.iter == 4
    hub = runner.message_hub
    if policy == 'drop':
        assert hub.get_scalar('train/samples_dropped').current() == 1
        assert 'train/nan_skipped' not in hub.log_scalars or \
            hub.get_scalar('train/nan_skipped').current() == 0
    else:
        assert hub.get_scalar('train/nan_skipped').current() == 1
    assert seen and all(seen)
    assert all(math.isfinite(float(p.abs().max()))
               for p in params(runner).values())
    assert 'input check at iter 1' in log_text(runner)
    assert not model.data_preprocessor._forward_hooks


def test_integer_inputs_arm_nothing():
    model = ToyModel()
    check = InputCheck(model)
    nan = {'inputs': [torch.full((4, ), float('nan'))]}

    def step():
        data = model.data_preprocessor(nan, True)
        return model(data['inputs'], mode='tensor')

    # A batch of uint8 images: the next call is not looked at, even when
    # what the preprocessor returns is not finite.
    check.arm({'inputs': [torch.zeros(4, dtype=torch.uint8)]})
    step()
    check.arm(nan)
    with pytest.raises(Exception, match='sample 0 is not finite'):
        step()
    # The model's forward raised on entry: no op of it ran.
    assert len(model.anomaly_seen) == 1
    # Armed for one call only.
    step()
    check.remove()
    assert not model.data_preprocessor._forward_hooks
    assert not model._forward_pre_hooks
