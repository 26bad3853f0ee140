"""Tier 1 through MMEngine's param schedulers, and the bypass guard.

Every zoo config has a ``param_scheduler``: each scheduler replaces
``optim_wrapper.step`` on the instance with a counting function before any
hook runs. These tests train the toy model with the zoo's schedule shape
(LinearLR warmup by iteration + MultiStepLR) and compare with the same run
without mmnanhook.
"""
import glob
import os.path as osp
import warnings

import pytest
import torch
from mmengine.hooks import Hook
from mmengine.optim import OptimWrapper

from mmnanhook import CheckBypassedError, NonFiniteError
from mmnanhook.sentinel import sentinel_of
from mmnan_testing import legs
from mmnan_testing.toy import Probe, ToyModel, assert_same, make_runner

SCHEDULE = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=3),
    dict(type='MultiStepLR', by_epoch=False, milestones=[4], gamma=0.1),
    dict(type='CosineAnnealingMomentum', by_epoch=False, eta_min=0.5,
         begin=0, end=8),
]
_SCHEDULER_WARNINGS = ('has been overridden', 'before `optimizer.step()`')


class SchedulerProbe(Probe):
    """Also records LR, momentum and what the schedulers see, per iteration.
    """

    def __init__(self):
        super().__init__()
        self.lr, self.momentum, self.global_step, self.marked = [], [], [], []

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        super().after_train_iter(runner, batch_idx, data_batch, outputs)
        groups = runner.optim_wrapper.param_groups
        self.lr.append([g['lr'] for g in groups])
        self.momentum.append([g['momentum'] for g in groups])
        self.global_step.append(runner.optim_wrapper._global_step)
        self.marked.append(
            getattr(runner.optim_wrapper.step, '_with_counter', False))


def _train(tmp_path, hook=None, faults=None, max_iters=8, extra_hooks=(),
           **kwargs):
    probe = SchedulerProbe()
    torch.manual_seed(0)  # the same initial weights in every run
    runner = make_runner(tmp_path, hook=hook, probe=probe, faults=faults,
                         max_iters=max_iters, param_scheduler=SCHEDULE,
                         **kwargs)
    for extra in extra_hooks:
        runner.register_hook(extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        error = None
        try:
            runner.train()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            error = exc
    texts = [str(w.message) for w in caught]
    bad = [t for t in texts if any(s in t for s in _SCHEDULER_WARNINGS)]
    return runner, probe, error, bad


def test_schedulers_see_the_same_run_with_and_without_the_hook(tmp_path):
    ref, ref_probe, error, bad = _train(tmp_path / 'ref')
    assert error is None and not bad
    runner, probe, error, bad = _train(tmp_path / 'hook',
                                       hook=dict(type='NanDetectHook'))
    assert error is None and not bad
    assert probe.lr == ref_probe.lr and probe.momentum == ref_probe.momentum
    assert probe.global_step == ref_probe.global_step == list(range(8))
    assert probe.marked == [True] * 8
    assert_same(probe.after[7][0], ref_probe.after[7][0])
    # The warmup really moved the LR: the comparison means something.
    assert len(set(lr[0] for lr in probe.lr)) >= 3
    norms = runner.message_hub.get_scalar('train/grad_norm').data[0]
    assert len(norms) == 8


class _BeforeInstall(Hook):
    """What the built wrapper holds on the instance before mmnanhook."""

    def before_run(self, runner):
        self.attrs = dict(vars(runner.optim_wrapper))


def test_removal_gives_the_scheduler_its_own_step_back(tmp_path):
    seen = _BeforeInstall()
    runner, _, error, _ = _train(tmp_path, hook=dict(type='NanDetectHook'),
                                 extra_hooks=[seen])
    assert error is None
    ow = runner.optim_wrapper
    assert seen.attrs['step']._with_counter
    assert vars(ow)['step'] is seen.attrs['step']
    assert vars(ow).keys() == seen.attrs.keys()
    assert sentinel_of(ow) is None
    assert not {'backward', 'update_params', '_clip_grad',
                'optim_context'} & set(vars(ow))


def test_fault_is_caught_through_the_scheduler_counter(tmp_path):
    runner, probe, error, bad = _train(tmp_path, faults={6: 'nan_term'},
                                       hook=dict(type='NanDetectHook'))
    assert isinstance(error, NonFiniteError) and not bad
    assert (error.trigger, error.iter) == ('loss', 3)
    assert_same({n: p.detach() for n, p in runner.model.named_parameters()},
                 probe.before[3][0])


def test_skip_keeps_the_schedule_and_its_step_count(tmp_path):
    faults = {0: 'nan_term', 6: 'nan_term'}
    ref, ref_probe, _, _ = _train(tmp_path / 'ref', faults=faults)
    runner, probe, error, bad = _train(
        tmp_path / 'skip', faults=faults,
        hook=dict(type='NanDetectHook', policy='skip'))
    assert error is None and not bad
    # The first update step was skipped: the schedulers still saw it called.
    assert probe.global_step == ref_probe.global_step
    assert probe.lr == ref_probe.lr and probe.momentum == ref_probe.momentum
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 2
    assert_same(probe.after[0][0], probe.before[0][0])


def test_configured_wrapper_is_checked_through_the_scheduler(tmp_path):
    runner, probe, error, bad = _train(
        tmp_path, faults={6: 'nan_term'},
        optim_wrapper=dict(type='NanDetectOptimWrapper',
                           optimizer=dict(type='SGD', lr=0.1, momentum=0.9)))
    assert isinstance(error, NonFiniteError) and not bad
    assert error.iter == 3


# -- the bypass guard ------------------------------------------------------


class _RebindStep(Hook):
    """Replaces optim_wrapper.step after mmnanhook installed its check, with
    a function that calls the class's step directly (bypassing it)."""

    priority = 'LOW'

    def before_train(self, runner):
        ow = runner.optim_wrapper

        def rebound_step(**kwargs):
            return OptimWrapper.step(ow, **kwargs)

        ow.step = rebound_step


class _DirectStepModel(ToyModel):
    """A train_step that steps the torch optimizer itself."""

    def train_step(self, data, optim_wrapper):
        data = self.data_preprocessor(data, True)
        losses = self(**data, mode='loss')
        parsed, log_vars = self.parse_losses(losses)
        parsed.backward()
        optim_wrapper.optimizer.step()
        optim_wrapper.optimizer.zero_grad()
        return log_vars


def test_guard_stops_a_step_rebound_after_the_install(tmp_path):
    probe = Probe()
    runner = make_runner(tmp_path, hook=dict(type='NanDetectHook'),
                         probe=probe, param_scheduler=SCHEDULE)
    runner.register_hook(_RebindStep())
    with pytest.raises(CheckBypassedError) as info:
        runner.train()
    text = str(info.value)
    assert 'train iteration 0' in text and 'rebound_step' in text
    assert 'replaced on the instance' in text
    assert runner.iter == 0


def test_guard_stops_a_train_step_that_steps_the_optimizer(tmp_path):
    runner = make_runner(tmp_path, hook=dict(type='NanDetectHook'),
                         model=_DirectStepModel())
    with pytest.raises(CheckBypassedError, match='optimizer.step'):
        runner.train()


def test_checking_is_logged_only_once_the_check_ran(tmp_path):
    runner = make_runner(tmp_path, hook=dict(type='NanDetectHook'),
                         model=_DirectStepModel())
    with pytest.raises(CheckBypassedError):
        runner.train()
    assert 'mmnanhook: checking' not in _log(runner)
    runner = make_runner(tmp_path / 'ok', hook=dict(type='NanDetectHook'),
                         param_scheduler=SCHEDULE, log_level='INFO')
    runner.train()
    text = _log(runner)
    assert 'mmnanhook: checking OptimWrapper' in text
    assert 'the check ran for the update step of iter 0' in text
    assert text.count('mmnanhook: checking') == 1


def _log(runner):
    return ''.join(
        open(p).read() for p in glob.glob(osp.join(runner.log_dir, '*.log')))


def test_guard_does_not_fire_on_accumulation_micro_steps(tmp_path):
    runner = make_runner(
        tmp_path, hook=dict(type='NanDetectHook'), param_scheduler=SCHEDULE,
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
                           accumulative_counts=2))
    runner.train()
    assert torch.isfinite(runner.model.fc.weight).all()


# -- what else touches the built wrapper before before_train ---------------


def test_auto_scale_lr_is_applied_once_and_checked(tmp_path):
    scale = dict(enable=True, base_batch_size=1)
    ref, ref_probe, _, _ = _train(tmp_path / 'ref', auto_scale_lr=scale)
    runner, probe, error, bad = _train(
        tmp_path / 'hook', auto_scale_lr=scale, faults={6: 'nan_term'},
        hook=dict(type='NanDetectHook', policy='skip'))
    assert error is None and not bad
    # Batch 2 over a base of 1: twice the configured LR, as without the hook.
    assert probe.lr == ref_probe.lr
    assert ref_probe.lr[-1][0] == pytest.approx(2 * 0.1 * 0.1)
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 1


@pytest.mark.skipif(legs.RESUME_BROKEN is not None,
                    reason=str(legs.RESUME_BROKEN))
def test_resumed_run_is_checked_and_schedules_as_without_the_hook(tmp_path):
    first = make_runner(tmp_path / 'first', param_scheduler=SCHEDULE,
                        max_iters=4,
                        default_hooks=dict(checkpoint=dict(
                            type='CheckpointHook', interval=2,
                            by_epoch=False)))
    first.train()
    checkpoint = osp.join(first.work_dir, 'iter_2.pth')
    ref, ref_probe, error, _ = _train(tmp_path / 'ref', load_from=checkpoint,
                                      resume=True)
    assert error is None and ref.iter == 8
    # Sample 8 is batch 4: iteration 4 where the resumed loop skips the 2
    # batches already trained, else iteration 2 + 4 (mmengine < 0.10.3).
    runner, probe, error, bad = _train(
        tmp_path / 'hook', load_from=checkpoint, resume=True,
        faults={8: 'nan_term'}, hook=dict(type='NanDetectHook'))
    assert not bad
    assert isinstance(error, NonFiniteError) and error.iter == (
        4 if legs.RESUME_SKIPS_TRAINED_BATCHES else 6)
    assert probe.lr == ref_probe.lr[:len(probe.lr)]
    assert probe.global_step == ref_probe.global_step[:len(probe.lr)]


@pytest.mark.skipif(not hasattr(torch, 'compile'),
                    reason='torch.compile needs torch >= 2.0')
def test_compiled_train_step_is_checked(tmp_path):
    # cfg.compile wraps model.train_step after before_run; dynamo traces it
    # (the eager backend: the tracing is what meets mmnanhook's code).
    runner, probe, error, bad = _train(
        tmp_path, faults={6: 'nan_term'}, hook=dict(type='NanDetectHook'),
        cfg=dict(compile=dict(backend='eager')))
    assert isinstance(error, NonFiniteError) and error.iter == 3
    assert_same({n: p.detach() for n, p in runner.model.named_parameters()},
                 probe.before[3][0])
    # The listener and its replay ran outside dynamo's tracing (issue 44):
    # the forward's NaN located, the bundle written.
    assert error.bundle and osp.isdir(error.bundle)
    assert error.report['kind'] == 'forward'
    assert 'mmnan_testing/toy.py' in error.report['location']
