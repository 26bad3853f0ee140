"""``policy='drop'`` on the toy model: the failing update step recomputed
without the sample that broke it, bitwise equal to that step done by hand;
no false drop; what the logs keep.

Sample ``2k`` / ``2k + 1`` is in iteration ``k`` (batch size 2).
"""
import math

import pytest
import torch

from mmnanhook import NanDetectHook, NanDetectOptimWrapper
from mmnanhook._batch import (UnknownBatchError, leave_out_refused,
                              split_batch)
from mmnanhook.quarantine import QuarantineError
from mmnanhook.memory import restore_rng
from mmnanhook.records import Kind, Report, SampleFinding
from mmnanhook.recovery import samples_to_drop
from mmnan_testing.plain import PlainDataset, plain_runner, two_targets
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


def _yolov5_batch(places):
    """A batch as mmyolo's ``yolov5_collate`` makes it: 3 stacked images,
    ``data_samples`` one dict whose ``bboxes_labels`` rows are ``[place,
    label, x1, y1, x2, y2]`` (the label is the row's number here)."""
    rows = torch.tensor([[float(p), float(k), 0., 0., 4., 4.]
                         for k, p in enumerate(places)])
    return {'inputs': torch.arange(3.).view(3, 1, 1, 1).expand(3, 3, 2, 2),
            'data_samples': {'bboxes_labels': rows,
                             'masks': torch.arange(float(len(places)))}}


@pytest.mark.parametrize('places', [
    # Five boxes: sample 0 has two, 1 one, 2 two.
    [0, 0, 1, 2, 2],
    # As many boxes as samples (3), out of order: a row's place, not its
    # position, says whose it is.
    [2, 0, 1]])
def test_yolov5_collate_rows_go_with_their_sample(places):
    """Issue 63: a sample left out of mmyolo's batch kept its box rows, so
    the replay without it raised in the head's loss (``IndexError: index 1
    is out of bounds for dimension 0 with size 1``)."""
    batch = _yolov5_batch(places)
    sub = split_batch(batch, [0, 2])
    assert torch.equal(sub['inputs'][:, 0, 0, 0], torch.tensor([0., 2.]))
    rows = sub['data_samples']['bboxes_labels']
    kept = [k for k, p in enumerate(places) if p != 1]
    # The rows of samples 0 and 2, sample 2 now at place 1.
    assert rows[:, 1].tolist() == [float(k) for k in kept]
    assert rows[:, 0].tolist() == [
        0. if places[k] == 0 else 1. for k in kept]
    assert sub['data_samples']['masks'].tolist() == [float(k) for k in kept]
    alone = split_batch(batch, [1])['data_samples']['bboxes_labels']
    assert alone.tolist() == [[0., float(places.index(1)), 0., 0., 4., 4.]]
    assert leave_out_refused(batch) is None


def test_a_layout_that_is_not_known_is_never_guessed_at():
    unknown = {'inputs': torch.zeros(2, 4), 'targets': torch.ones(4)}
    why = leave_out_refused(unknown)
    assert why == "the batch['targets'] is a tensor of 4 rows in a batch of 2"
    with pytest.raises(UnknownBatchError, match='4 rows in a batch of 2'):
        split_batch(unknown, [0])
    assert leave_out_refused([torch.zeros(2, 4), torch.ones(2)]) == \
        'the batch is a list, not a dict'
    bad_rows = _yolov5_batch([0, 1, 2])
    bad_rows['data_samples']['masks'] = torch.zeros(2)
    assert 'not one row per box' in leave_out_refused(bad_rows)
    report = Report(kind=Kind.DATA, samples=[SampleFinding(1)])
    assert samples_to_drop(report, 2) == ([1], None)
    indices, reason = samples_to_drop(report, 2, refused=why)
    assert indices is None and 'cannot be left out of the batch' in reason


def test_drop_declines_a_batch_it_does_not_know_and_skips(tmp_path):
    """A collate of the user's whose layout is not known, a NaN input in
    iteration 1 under ``'drop'``: the drop is declined in one log line and
    the step left out as ``'skip'`` would; the run completes. Before, the
    batch was split anyway (its ``targets`` shared whole) and the step
    taken again raised in the model: the run died."""
    runner = plain_runner(tmp_path, PlainDataset(8, nan=[3]),
                          dict(policy='drop'), max_iters=4,
                          collate=two_targets)
    runner.train()
    assert runner.iter == 4
    assert _scalar(runner, 'train/nan_skipped') == 1
    assert _scalar(runner, 'train/samples_dropped') is None
    text = log_text(runner)
    assert text.count("policy 'drop': sample(s) 1 cannot be left out of the "
                      'batch: its layout is not one mmnanhook knows '
                      "(the batch['targets'] is a tensor of 4 rows in a "
                      'batch of 2): the step is skipped') == 1, text[-3000:]
