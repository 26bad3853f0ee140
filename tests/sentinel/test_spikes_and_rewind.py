"""Spikes (finite values far above their band) and ``policy='rewind'``.

The toy model's loss is O(1); its ``spike`` fault makes one sample's loss a
thousand times that, finite. Under ``'rewind'`` the hook keeps snapshots of
good states and goes back to the newest one before the divergence began.
"""
import math
import os
import os.path as osp
import random

import pytest
import torch

from mmengine.hooks import Hook

from mmnanhook import NanDetectHook, compat
from mmnanhook.records import JOURNAL_FILE, Incident
from mmnanhook.sentinel import SeriesBand, SpikeDetector
from mmnan_testing.cli import run_report
from mmnan_testing.toy import (Probe, assert_same, assert_state_same,
                                   log_text, make_runner, params,
                                   train_error)

# Small bands, so that short runs get past the warm-up.
SPIKES = dict(spike_window=10, spike_warmup=5)
# The toy model diverges by itself at make_runner's default LR.
STABLE = dict(optimizer=dict(type='SGD', lr=0.01, momentum=0.9))
# Sample 2k / 2k+1 is in iteration k.
ITERS = 16


def _scalar(runner, name):
    buffer = runner.message_hub.log_scalars.get(name)
    return buffer.current() if buffer is not None else None


def test_no_false_spike_on_noise_and_warmup_and_a_real_one():
    rng = random.Random(0)
    band = SeriesBand(window=50, warmup=20, factor=4.0)
    # A warmup curve falling from 20 to 1, then noise of a factor 2 around
    # it, the spread of per-batch losses of a detector.
    values = [20.0 * 0.9**i for i in range(30)] + [
        math.exp(rng.uniform(-0.7, 0.7)) for _ in range(500)]
    assert [v for v in values if band.judge(v) is not None] == []
    assert band.judge(10.0) is not None
    # The spike did not widen the band.
    assert band.judge(10.0) is not None
    detector = SpikeDetector(window=10, warmup=5)
    for i in range(10):
        assert detector.observe(i, 1.0 + 0.01 * i, 2.0) == []
    (spike, ) = detector.observe(10, 50.0, 2.1)
    assert (spike.series, spike.iter) == ('loss', 10)
    assert spike.factor > 40 and 'loss spike at iter 10' in repr(spike)


def _band_by_definition(values, factor, threshold=6.0):
    """The band of the module docstring, from the values themselves."""
    import statistics
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return median, max(median * factor,
                       median + threshold * 1.4826 * mad)


@pytest.mark.parametrize('seed', range(4))
def test_band_judges_as_its_definition(seed):
    rng = random.Random(seed)
    window, warmup, factor = 12, 5, 3.0
    band = SeriesBand(window=window, warmup=warmup, factor=factor)
    kept = []
    spikes = 0
    for _ in range(400):
        # Noise, repeats (ties in the ordered window), negatives, spikes.
        value = rng.choice([rng.uniform(0.5, 1.5), 1.0, -0.5,
                            rng.uniform(3.0, 40.0)])
        expected = None
        if len(kept) >= warmup:
            median, high = _band_by_definition(kept, factor)
            if value > high:
                expected = (median, high)
        judged = band.judge(value)
        if expected is None:
            assert judged is None
            kept = (kept + [value])[-window:]
        else:
            spikes += 1
            assert judged == pytest.approx(expected)
        assert list(band.values) == kept
    assert spikes > 10


def test_clean_run_has_no_spike(tmp_path):
    runner = make_runner(tmp_path, hook=dict(type='NanDetectHook', **SPIKES),
                         max_iters=ITERS, n=2 * ITERS, optim_wrapper=STABLE)
    runner.train()
    assert _scalar(runner, 'train/spikes') == 0


@pytest.mark.parametrize('spike_policy', ['warn', 'skip', 'raise'])
def test_spike_policies(tmp_path, spike_policy):
    # The last iteration: applied ('warn'), the huge update would make the
    # next ones diverge.
    probe = Probe()
    runner = make_runner(
        tmp_path, faults={30: 'spike'}, probe=probe, max_iters=ITERS,
        n=2 * ITERS, log_level='INFO', optim_wrapper=STABLE,
        hook=dict(type='NanDetectHook', spike_policy=spike_policy, **SPIKES))
    if spike_policy == 'raise':
        error = train_error(runner)
        assert (error.trigger, error.iter) == ('spike', 15)
        assert 'loss spike at iter 15' in str(error)
        assert_same(params(runner), probe.before[15][0])
        return
    runner.train()
    assert _scalar(runner, 'train/spikes') >= 1
    assert 'loss spike at iter 15' in log_text(runner)
    changed = not torch.equal(probe.after[15][0]['fc.weight'],
                              probe.before[15][0]['fc.weight'])
    assert changed == (spike_policy == 'warn')
    assert _scalar(runner, 'train/nan_skipped') == 0


def test_spikes_off(tmp_path):
    runner = make_runner(tmp_path, faults={24: 'spike'}, max_iters=ITERS,
                         n=2 * ITERS, optim_wrapper=STABLE,
                         hook=dict(type='NanDetectHook', spike_policy=None))
    runner.train()
    assert _scalar(runner, 'train/spikes') is None


def _journal(work_dir):
    """The incidents of the run's journal in ``work_dir``."""
    with open(osp.join(str(work_dir), JOURNAL_FILE)) as f:
        return [Incident.from_line(line) for line in f]


def _rewind_hook(**kwargs):
    options = dict(type='NanDetectHook', policy='rewind',
                   spike_policy='rewind', snapshot_interval=4, cooldown=3,
                   lr_factor=0.1, **SPIKES)
    options.update(kwargs)
    return options


def test_rewind_restores_the_snapshot_bitwise_and_lowers_the_lr(tmp_path):
    probe = Probe()
    # Two spikes in a row: the second tells of a divergence.
    runner = make_runner(tmp_path, faults={20: 'spike', 22: 'spike'},
                         probe=probe, max_iters=ITERS, n=2 * ITERS,
                         hook=_rewind_hook(), log_level='INFO',
                         optim_wrapper=STABLE)
    lrs = []

    class LrSeen(NanDetectHook.__mro__[1]):  # an mmengine Hook
        priority = 'VERY_LOW'

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            lrs.append(runner.optim_wrapper.param_groups[0]['lr'])

    runner.register_hook(LrSeen())
    runner.train()
    assert _scalar(runner, 'train/rewinds') == 1
    assert 'rewound to the state after iter 7' in log_text(runner)
    # The first spike (iter 10) was skipped: a single bad batch. The second
    # (iter 11) went back to the snapshot after iter 7, the newest before
    # the divergence began at 10.
    assert_same(probe.after[11][0], probe.after[7][0])
    assert_state_same(probe.after[11][1]['state'], probe.after[7][1]['state'])
    # No scheduler: the group's LR is the configured one between steps.
    assert len(set(lrs)) == 1
    hook = [h for h in runner.hooks if isinstance(h, NanDetectHook)][0]
    records = {r['iter']: r for r in hook._history.records()}
    assert records[11]['rewind'] == 7
    assert records[12]['lr'] == pytest.approx(0.01 * 0.1)
    assert records[15]['lr'] == pytest.approx(0.01)
    assert 'loss' in records[10]['spike']
    # The work dir's journal (issue 68): each spike, what became of its
    # step, the rewind from where to where and at which LR.
    journal = _journal(tmp_path)
    assert [(i.kind.value, i.iter, i.act) for i in journal
            if i.kind == 'trigger' or i.series == 'loss'] == [
        ('spike', 10, None), ('trigger', 10, 'skip'), ('spike', 11, None),
        ('trigger', 11, 'rewind')]
    rewind = journal[-2]
    assert (rewind.trigger, rewind.rewind_to, rewind.lr_factor) == (
        'spike', 7, pytest.approx(0.1))
    assert rewind.lr == pytest.approx(0.01 * 0.1)
    assert (journal[-1].kind, journal[-1].reason) == ('end', 'finished')


def test_rewind_of_a_single_bad_batch_is_a_skip(tmp_path):
    probe = Probe()
    runner = make_runner(tmp_path, faults={12: 'nan_term'}, probe=probe,
                         max_iters=ITERS, n=2 * ITERS, hook=_rewind_hook(),
                         optim_wrapper=STABLE)
    runner.train()
    assert _scalar(runner, 'train/rewinds') is None
    assert _scalar(runner, 'train/nan_skipped') == 1
    assert_same(probe.after[6][0], probe.before[6][0])


def test_max_rewinds_raises(tmp_path):
    faults = {2 * i: 'spike' for i in range(10, ITERS)}
    runner = make_runner(tmp_path, faults=faults, max_iters=ITERS,
                         n=2 * ITERS, hook=_rewind_hook(max_rewinds=2),
                         optim_wrapper=STABLE)
    error = train_error(runner)
    assert error.trigger == 'spike'
    assert 'max_rewinds=2' in str(error)
    # The journal ends with the trigger that stopped the run, and how.
    trigger, end = _journal(tmp_path)[-2:]
    assert (trigger.kind, trigger.act, trigger.iter) == ('trigger', 'raise',
                                                         error.iter)
    assert (end.kind, end.iter) == ('end', error.iter)
    assert end.reason.startswith('NonFiniteError: ')


def test_rewind_needs_the_hook():
    from mmnanhook import NanDetectOptimWrapper
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match='needs NanDetectHook'):
        NanDetectOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1),
                              policy='rewind')


@pytest.mark.parametrize('option,value', [
    ('spike_policy', 'ignore'), ('spike_window', 1), ('spike_warmup', 0),
    ('spike_factor', 0.5), ('spike_factor', dict(acc=2.0)),
    ('snapshot_interval', 0),
    ('snapshot_device', 'gpu0'), ('max_snapshots', 0), ('lr_factor', 0.0),
    ('lr_factor', 2.0), ('cooldown', -1), ('max_rewinds', 0),
])
def test_bad_rewind_and_spike_options_name_themselves(option, value):
    with pytest.raises(ValueError, match=option):
        NanDetectHook(**{option: value})


class _Losses(Probe):
    """Also records the total loss of every iteration."""

    def __init__(self):
        super().__init__()
        self.loss = {}

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        super().after_train_iter(runner, batch_idx, data_batch, outputs)
        self.loss[runner.iter] = float(outputs['loss'].detach())


def test_nonfinite_after_an_lr_blowup_is_a_divergence(tmp_path):
    # No warmup and an LR far too high: the loss grows, then overflows.
    optim = dict(optimizer=dict(type='SGD', lr=30.0))
    ref = _Losses()
    reference = make_runner(tmp_path / 'ref', probe=ref, max_iters=ITERS,
                            n=2 * ITERS, optim_wrapper=optim)
    reference.train()  # MMEngine alone trains on through the NaN
    losses = [ref.loss[i] for i in sorted(ref.loss)]
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v)][0]
    # Where the rise that ends in the NaN began, without mmnanhook.
    began = bad - 1
    while began > 0 and losses[began - 1] < losses[began]:
        began -= 1
    assert bad - began >= 3
    runner = make_runner(tmp_path / 'hook', max_iters=ITERS, n=2 * ITERS,
                         optim_wrapper=optim,
                         hook=dict(type='NanDetectHook', **SPIKES))
    error = train_error(runner)
    assert error.iter == bad
    report = error.report
    assert report['kind'] == 'divergence'
    divergence = report['divergence']
    assert divergence['began_at'] == began
    assert 'training diverged from iter %d' % divergence['began_at'] in \
        report['summary']
    assert any('lower the learning rate' in h for h in report['hints'])


class _StepLr(Hook):
    """The LR of every iteration as the schedulers left it (``seen``) and as
    ``optimizer.step`` used it (``used``; absent for a step not applied)."""

    priority = 'VERY_LOW'

    def __init__(self):
        self.seen, self.used = {}, {}

    def before_train(self, runner):
        optimizer = runner.optim_wrapper.optimizer
        step = optimizer.step

        def recording_step(*args, **kwargs):
            self.used[runner.iter] = optimizer.param_groups[0]['lr']
            return step(*args, **kwargs)

        optimizer.step = recording_step

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.seen[runner.iter] = runner.optim_wrapper.param_groups[0]['lr']


# Warmup, then a step down at 13: inside the second rewind's cooldown.
SCHEDULE = [dict(type='LinearLR', start_factor=0.5, by_epoch=False, begin=0,
                 end=6),
            dict(type='MultiStepLR', by_epoch=False, milestones=[13],
                 gamma=0.5)]


def test_rewind_under_schedulers_compounds_the_factor_and_keeps_the_schedule(
        tmp_path):
    iters = 20
    ref_lr = _StepLr()
    reference = make_runner(tmp_path / 'ref', max_iters=iters, n=2 * iters,
                            optim_wrapper=STABLE, param_scheduler=SCHEDULE)
    reference.register_hook(ref_lr)
    reference.train()
    scheduled = ref_lr.seen
    assert len(set(scheduled.values())) > 2
    # Spikes at 10 and 11: a divergence, rewound; the spike at 12, inside
    # the cooldown, is rewound again, the factor compounded.
    lr = _StepLr()
    runner = make_runner(tmp_path / 'hook', max_iters=iters, n=2 * iters,
                         faults={20: 'spike', 22: 'spike', 24: 'spike'},
                         optim_wrapper=STABLE, param_scheduler=SCHEDULE,
                         hook=_rewind_hook(), log_level='INFO')
    runner.register_hook(lr)
    runner.train()
    assert _scalar(runner, 'train/rewinds') == 2
    # What the schedulers set is what they set without any rewind ...
    assert lr.seen == scheduled
    for ours, theirs in zip(runner.param_schedulers,
                            reference.param_schedulers):
        assert ours.state_dict() == theirs.state_dict()
    # ... and the steps used it lowered: x0.1 after the first rewind, x0.01
    # after the second, for the 3 clean steps of the cooldown, then not.
    assert sorted(lr.used) == [i for i in range(iters) if i not in (10, 11,
                                                                    12)]
    factor = {13: 0.01, 14: 0.01, 15: 0.01}
    for i, used in lr.used.items():
        assert used == pytest.approx(scheduled[i] * factor.get(i, 1.0)), i
    assert 'LR x 0.01 for 3 update steps' in log_text(runner)
    # The lowered LR is the fix, and training on is its test: the first
    # rewind's did not hold (12 was rewound again), the second's did.
    assert ('refuted: the LR x 0.1 after the last rewind did not hold (3 of '
            'its 3 update steps left)') in log_text(runner)
    assert ('verified: the LR x 0.01 after the last rewind held for 3 clean '
            'update steps (up to iter 15)') in log_text(runner)
    dumps = osp.join(runner.work_dir, 'nan_dumps')
    fixes = [run_report(osp.join(dumps, d))['fixes']
             for d in sorted(os.listdir(dumps))]
    assert len(fixes) == 2 and all(
        [(f['kind'], f['status']) for f in each] == [('lower_lr', 'untested')]
        and f['detail'].startswith('verified by training on') and
        "policy='rewind'" in f['fix'] for each in fixes for f in each)


@pytest.mark.skipif(
    compat.cpu_grad_scaler() is None,
    reason='needs a CPU GradScaler (torch.amp.GradScaler("cpu"), torch >= '
    '2.3); AmpOptimWrapper itself requires a GPU')
def test_rewind_under_amp_restores_the_grad_scaler(tmp_path):
    from mmnan_testing import cpu_amp  # noqa: F401 - registers wrappers
    probe = Probe()
    # GradScaler overflows halve the scale at 2 (before the snapshot after
    # 7) and at 9 (after it); the spikes at 10 and 11 go back to 7.
    runner = make_runner(
        tmp_path, probe=probe, max_iters=ITERS, n=2 * ITERS,
        faults={4: 'overflow', 18: 'overflow_hard', 20: 'spike',
                22: 'spike'},
        optim_wrapper=dict(STABLE, type='CpuAmpOptimWrapper',
                           loss_scale='dynamic'),
        hook=_rewind_hook())
    runner.train()
    assert _scalar(runner, 'train/rewinds') == 1
    scale = [s['scale'] for s in (probe.after[i][1]['loss_scaler']
                                  for i in (7, 9, 11))]
    assert scale == [2.0**15, 2.0**14, 2.0**15]
    assert_state_same(probe.after[11][1]['loss_scaler'],
                      probe.after[7][1]['loss_scaler'])
    assert_state_same(probe.after[11][1]['state'], probe.after[7][1]['state'])
    assert_same(probe.after[11][0], probe.after[7][0])


def test_rewind_without_a_snapshot_older_than_the_divergence_stops(tmp_path):
    probe = Probe()
    # One snapshot kept: after 11 it is the only one. The spike at 8 was
    # skipped (one bad batch); the spike at 12 tells of a divergence that
    # began at 8, older than every snapshot left.
    runner = make_runner(tmp_path, probe=probe, max_iters=ITERS, n=2 * ITERS,
                         faults={16: 'spike', 24: 'spike'},
                         optim_wrapper=STABLE,
                         hook=_rewind_hook(max_snapshots=1))
    error = train_error(runner)
    assert (error.trigger, error.iter) == ('spike', 12)
    assert 'no snapshot older than iteration 8 to rewind to' in str(error)
    assert_same(params(runner), probe.before[12][0])
    assert _scalar(runner, 'train/rewinds') is None


def test_counters_are_logged_when_they_change(tmp_path):
    # Sample 4 is in iteration 2.
    runner = make_runner(tmp_path, faults={4: 'nan_term'}, max_iters=6,
                         hook=dict(type='NanDetectHook', policy='skip'),
                         optim_wrapper=STABLE)
    runner.train()
    hub = runner.message_hub
    # The value LogProcessor shows (a counter's current one), every
    # iteration; an entry only where it changed.
    assert list(hub.get_scalar('train/nan_skipped').data[0]) == [0, 1]
    assert list(hub.get_scalar('train/spikes').data[0]) == [0]
    assert len(hub.get_scalar('train/grad_norm').data[0]) == 5
    # A run with a hub of its own logs them there from its first step.
    again = make_runner(tmp_path / 'again', max_iters=2,
                        hook=dict(type='NanDetectHook'),
                        optim_wrapper=STABLE)
    again.train()
    assert again.message_hub.get_scalar('train/nan_skipped').current() == 0


def test_a_snapshot_copy_that_does_not_end_is_waited_for_within_a_bound(
        monkeypatch):
    # The copy's thread stuck (here: its norms never come): the step before
    # which the copy is waited for goes on after SETTLE_WITHIN, without
    # that snapshot, saying why (issue 52: no wait of ours is unbounded).
    import threading
    import time

    from mmnanhook.sentinel import _rewind
    release = threading.Event()
    monkeypatch.setattr(_rewind, 'SETTLE_WITHIN', 0.5)
    monkeypatch.setattr(_rewind, 'param_norms',
                        lambda model: release.wait(60))
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    store = _rewind.SnapshotStore(interval=1)
    store.take(0, model, [_optim_wrapper(optimizer)])
    start = time.monotonic()
    try:
        store.settle()
        assert time.monotonic() - start < 5
        assert len(store) == 0 and store.failed == (
            'the snapshot after iter 0 is not kept: its copy was not done '
            'after 0.5 s')
    finally:
        release.set()


def _optim_wrapper(optimizer):
    """mmengine's wrapper of ``optimizer`` (what a snapshot reads)."""
    from mmengine.optim import OptimWrapper
    return OptimWrapper(optimizer)
