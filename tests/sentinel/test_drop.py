"""``policy='drop'`` on the toy model: the failing update step recomputed
without the sample that broke it, bitwise equal to that step done by hand;
no false drop; what the logs keep.

Sample ``2k`` / ``2k + 1`` is in iteration ``k`` (batch size 2).
"""
import math

import pytest
import torch

from mmnanhook import NanDetectHook, NanDetectOptimWrapper
from mmnanhook.quarantine import QuarantineError
from mmnanhook.memory import restore_rng
from mmnan_testing.toy import (Probe, ToyBNModel, ToyDataset, ToyModel,
                                   TwoOptimizerModel, assert_same, log_text,
                                   make_runner, two_optimizers)

MOMENTUM = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))


def _scalar(runner, name):
    buffer = runner.message_hub.log_scalars.get(name)
    return buffer.current() if buffer is not None else None


def _by_hand(probe, steps, model_type=ToyModel, counts=None):
    """The update step of ``steps``, ``(iter, batch)`` of its micro-steps
    (each loss divided by their number, or by ``counts``), from the state
    the probe saw before the first (parameters, optimizer state, buffers)
    and each micro-step's RNG state before its forward, as
    BaseModel.train_step, OptimWrapper and SGD do it.

    Returns:
        tuple: Parameters and buffers after the step, by name; the last
        micro-step's loss.
    """
    first = steps[0][0]
    model = model_type()
    model.load_state_dict(dict(probe.before[first][0],
                               **probe.buffers_before[first]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(probe.before[first][1])
    for it, batch in steps:
        restore_rng(probe.rng[it])
        data = model.data_preprocessor(batch, True)
        loss, _ = model.parse_losses(model(**data, mode='loss'))
        (loss / (counts or len(steps))).backward()
    optimizer.step()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.detach().clone() for n, b in model.named_buffers()},
            float(loss.detach()))


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
    expected, _, loss = _by_hand(probe, [(2, _batch(data, 5))])
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
    expected, _, _ = _by_hand(probe, [(2, _batch(data, 5)),
                                      (3, _batch(data, 6, 7))])
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


BN_CASES = [
    # (accumulative_counts, the micro-steps of the update step): the bad
    # sample 4 in iteration 2, the update step alone or with iteration 3.
    (1, [(2, (5, ))]),
    (2, [(2, (5, )), (3, (6, 7))]),
]


@pytest.mark.parametrize('counts,steps', BN_CASES, ids=['plain', 'accum'])
def test_drop_redoes_bn_statistics_and_dropout_from_the_same_state(
        tmp_path, counts, steps):
    probe = Probe()
    runner = make_runner(tmp_path, faults={4: 'nan_term'}, probe=probe,
                         model=ToyBNModel(),
                         optim_wrapper=dict(MOMENTUM,
                                            accumulative_counts=counts),
                         hook=dict(type='NanDetectHook', policy='drop'))
    runner.train()
    data = ToyDataset(16, {4: 'nan_term'})
    expected, buffers, _ = _by_hand(
        probe, [(i, _batch(data, *s)) for i, s in steps], ToyBNModel)
    update = steps[-1][0]
    # BN running statistics as if the bad sample had never been seen, and
    # the dropout masks the original forward drew.
    assert_same(probe.after[update][0], expected)
    assert_same(probe.buffers_after[update], buffers)
    assert _scalar(runner, 'train/samples_dropped') == 1


def test_drop_after_resuming_between_two_update_steps(tmp_path, monkeypatch):
    # mmengine 0.10.7 resumes with torch.load's default weights_only, True
    # since torch 2.6 (legs.RESUME_BROKEN): torch's own switch back.
    monkeypatch.setenv('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')
    accumulate = dict(MOMENTUM, accumulative_counts=2)
    first = make_runner(
        tmp_path, model=ToyBNModel(), optim_wrapper=accumulate, max_iters=3,
        default_hooks=dict(checkpoint=dict(type='CheckpointHook',
                                           interval=3, by_epoch=False)))
    first.train()
    # Resumed at iteration 3: it is an update step of its own, the first
    # train step of the run.
    probe = Probe()
    runner = make_runner(tmp_path, faults={6: 'nan_term'}, probe=probe,
                         model=ToyBNModel(), optim_wrapper=accumulate,
                         max_iters=5, resume=True, log_level='INFO',
                         hook=dict(type='NanDetectHook', policy='drop'))
    runner.train()
    text = log_text(runner)
    assert 'listener failed' not in text
    assert "recomputing the update step of iter 3 without sample(s) [0] " \
        'of the batch of iter 3' in text
    data = ToyDataset(16, {6: 'nan_term'})
    # Its loss divided by 2 still: OptimWrapper.scale_loss divides by
    # accumulative_counts, however many micro-steps are left.
    expected, buffers, _ = _by_hand(probe, [(3, _batch(data, 7))],
                                    ToyBNModel, counts=2)
    assert_same(probe.after[3][0], expected)
    assert_same(probe.buffers_after[3], buffers)


@pytest.mark.parametrize('bad', [0, 4])
@pytest.mark.parametrize('policy,logged', [('skip', 2), ('drop', 3)])
def test_a_bad_earlier_micro_step_leaves_no_value_in_the_log_windows(
        tmp_path, policy, logged, bad):
    # Iterations 0 and 1, 2 and 3 make one update step each; the bad sample
    # is in the first micro-step of one (the run's first iteration too).
    runner = make_runner(tmp_path, faults={bad: 'nan_term'},
                         optim_wrapper=dict(MOMENTUM, accumulative_counts=2),
                         hook=dict(type='NanDetectHook', policy=policy))
    runner.train()
    hub = runner.message_hub
    for name in ('train/loss', 'train/loss_aux'):
        values = list(hub.get_scalar(name).data[0])
        # The other update step's two, and the recomputed last micro-step
        # of 'drop'.
        assert len(values) == logged, name
        assert all(math.isfinite(v) for v in values), name


def test_a_gradient_fault_in_an_earlier_micro_step_is_dropped_there(
        tmp_path):
    probe = Probe()
    # Sample 4 (iteration 2) makes NaN gradients from a finite loss; the
    # trigger comes at the update step, iteration 3.
    runner = make_runner(
        tmp_path, faults={4: 'nan_grad'}, probe=probe, log_level='INFO',
        optim_wrapper=dict(MOMENTUM, accumulative_counts=2),
        hook=dict(type='NanDetectHook', policy='drop'))
    runner.train()
    assert "recomputing the update step of iter 3 without sample(s) [0] " \
        'of the batch of iter 2' in log_text(runner)
    data = ToyDataset(16, {4: 'nan_grad'})
    expected, _, _ = _by_hand(probe, [(2, _batch(data, 5)),
                                      (3, _batch(data, 6, 7))])
    assert_same(probe.after[3][0], expected)


def test_drop_without_the_hook_is_refused_at_build_time():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="policy 'drop' needs NanDetectHook"):
        NanDetectOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1),
                              policy='drop')


def test_the_fixes_advise_drop_only_where_it_drops(tmp_path):
    # One optimizer: 'drop' recomputes the step; an OptimWrapperDict: it
    # only skips, and the fix says so instead of advising it.
    plain = make_runner(tmp_path / 'plain', faults={4: 'nan_term'},
                        log_level='INFO',
                        hook=dict(type='NanDetectHook', policy='skip'))
    plain.train()
    assert "`NanDetectHook(policy='drop')` does it" in log_text(plain)
    two = make_runner(tmp_path / 'two', model=TwoOptimizerModel(),
                      optim_wrapper=two_optimizers, faults={4: 'nan_term'},
                      log_level='INFO',
                      hook=dict(type='NanDetectHook', policy='skip'))
    two.train()
    text = log_text(two)
    assert "`NanDetectHook(policy='drop')` does it" not in text
    assert "`NanDetectHook(policy='drop')` would only skip the step here " \
        '(an OptimWrapperDict steps several optimizers)' in text
