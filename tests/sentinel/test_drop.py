"""``policy='drop'`` on the toy model: the failing update step recomputed
without the sample that broke it, bitwise equal to that step done by hand;
no false drop; what the logs keep.

Sample ``2k`` / ``2k + 1`` is in iteration ``k`` (batch size 2).
"""
import math

import pytest
import torch

from mmnanhook import NanDetectHook
from mmnanhook.quarantine import QuarantineError
from mmnanhook.testing.toy import (Probe, ToyDataset, ToyModel, assert_same,
                                   log_text, make_runner)

MOMENTUM = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))


def _scalar(runner, name):
    buffer = runner.message_hub.log_scalars.get(name)
    return buffer.current() if buffer is not None else None


def _by_hand(before, *batches):
    """The update step of ``batches`` (its micro-steps, each loss divided by
    their number) from the state ``before`` (parameters, optimizer state),
    as BaseModel.train_step, OptimWrapper and SGD do it."""
    model = ToyModel()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(before[0][name])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(before[1])
    for batch in batches:
        data = model.data_preprocessor(batch, True)
        loss, _ = model.parse_losses(model(**data, mode='loss'))
        (loss / len(batches)).backward()
    optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, \
        float(loss)


def _batch(data, *indices):
    return {'inputs': [data[i]['inputs'] for i in indices],
            'fault': [data[i]['fault'] for i in indices]}


def test_drop_applies_the_step_recomputed_without_the_bad_sample(tmp_path):
    probe = Probe()
    runner = make_runner(tmp_path, faults={4: 'nan_term'}, probe=probe,
                         optim_wrapper=MOMENTUM, log_level='INFO',
                         hook=dict(type='NanDetectHook', policy='drop'))
    runner.train()
    # Iteration 2 was applied, without sample 4: exactly the step on
    # sample 5 alone from the state before it.
    data = ToyDataset(16, {4: 'nan_term'})
    expected, loss = _by_hand(probe.before[2], _batch(data, 5))
    assert_same(probe.after[2][0], expected)
    assert _scalar(runner, 'train/samples_dropped') == 1
    assert _scalar(runner, 'train/nan_skipped') == 0
    # The windows LogProcessor smooths hold the recomputed step's values.
    losses = list(runner.message_hub.get_scalar('train/loss').data[0])
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert losses[2] == pytest.approx(loss)
    norms = list(runner.message_hub.get_scalar('train/grad_norm').data[0])
    assert len(norms) == 4 and all(math.isfinite(v) for v in norms)
    text = log_text(runner)
    assert "policy 'drop': recomputing the update step of iter 2 without " \
        'sample(s) [0]' in text
    # A handled trigger is a warning, never an error.
    assert ' - ERROR - ' not in text


def test_drop_under_accumulation_recomputes_every_micro_step(tmp_path):
    probe = Probe()
    # Iterations 2 and 3 make one update step; sample 4 (iteration 2, the
    # first micro-step) is bad, the trigger comes at the update (3).
    runner = make_runner(
        tmp_path, faults={4: 'nan_term'}, probe=probe,
        optim_wrapper=dict(MOMENTUM, accumulative_counts=2),
        hook=dict(type='NanDetectHook', policy='drop'))
    runner.train()
    data = ToyDataset(16, {4: 'nan_term'})
    expected, _ = _by_hand(probe.before[2], _batch(data, 5),
                           _batch(data, 6, 7))
    assert_same(probe.after[3][0], expected)
    assert _scalar(runner, 'train/samples_dropped') == 1
    assert _scalar(runner, 'train/nan_skipped') == 0


def test_no_false_drop_when_every_sample_fails_alone(tmp_path):
    probe = Probe()
    runner = make_runner(tmp_path, faults={4: 'nan_grad', 5: 'nan_grad'},
                         probe=probe, optim_wrapper=MOMENTUM,
                         hook=dict(type='NanDetectHook', policy='drop'))
    runner.train()
    assert_same(probe.after[2][0], probe.before[2][0])
    assert _scalar(runner, 'train/nan_skipped') == 1
    assert _scalar(runner, 'train/samples_dropped') is None
    assert "policy 'drop': every sample of the batch fails on its own: the " \
        'step is skipped' in log_text(runner)


def test_a_skipped_step_leaves_no_value_in_the_log_windows(tmp_path):
    runner = make_runner(tmp_path, faults={4: 'nan_term'},
                         optim_wrapper=MOMENTUM, log_level='INFO',
                         hook=dict(type='NanDetectHook', policy='skip'))
    runner.train()
    assert _scalar(runner, 'train/nan_skipped') == 1
    hub = runner.message_hub
    for name in ('train/loss', 'train/loss_aux', 'train/grad_norm'):
        values = list(hub.get_scalar(name).data[0])
        assert len(values) == 3, name  # 4 iterations, one not applied
        assert all(math.isfinite(v) for v in values), name
    assert ' - ERROR - ' not in log_text(runner)


def test_bad_quarantine_files_fail_at_build_time_naming_the_file(tmp_path):
    not_json = tmp_path / 'list.json'
    not_json.write_text('{"format": ')
    with pytest.raises(QuarantineError, match=str(not_json)):
        NanDetectHook(policy='drop', quarantine=str(not_json))
    foreign = tmp_path / 'foreign.json'
    foreign.write_text('{"samples": []}')
    with pytest.raises(QuarantineError, match='not an mmnanhook quarantine'):
        NanDetectHook(quarantine=str(foreign))
    with pytest.raises(ValueError, match='quarantine_skips'):
        NanDetectHook(quarantine_skips='yes')
