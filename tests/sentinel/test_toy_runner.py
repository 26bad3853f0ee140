"""Tier 1 on a real MMEngine Runner with a toy model (mmengine only).

The toy model and the runner factory are :mod:`mmnan_testing.toy`.
"""
import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from mmengine.hooks import Hook
from mmengine.optim import OptimWrapper

from mmnanhook import (NanDetectHook, NanDetectOptimWrapper,
                       install_nan_detect)
from mmnanhook.records import Report
from mmnanhook.recovery import Answer
from mmnanhook.sentinel import sentinel_of
from mmnan_testing.toy import (BOUND, Probe, ToyModel,
                                   TwoOptimizerModel, assert_same,
                                   assert_state_same, log_text, make_runner,
                                   params, train_error, two_optimizers)


# -- what triggers, and what the error says --------------------------------


def test_nan_loss_term_is_named_and_step_not_applied(tmp_path):
    probe = Probe()
    runner = make_runner(tmp_path, faults={3: 'nan_term'},
                         hook=dict(type='NanDetectHook'), probe=probe)
    err = train_error(runner)
    assert isinstance(err, FloatingPointError)
    assert (err.trigger, err.iter, err.rank) == ('loss', 1, 0)
    text = str(err)
    assert 'loss_aux=nan' in text and 'iter 1' in text and 'rank 0' in text
    assert 'loss_main=' in text and 'acc' not in text
    # The poisoned step never reached the parameters.
    assert_same(params(runner), probe.before[1][0])
    assert all(torch.isfinite(p).all() for p in params(runner).values())


def test_inf_loss_with_finite_gradients_triggers(tmp_path):
    runner = make_runner(tmp_path, faults={2: 'inf_target'},
                         hook=dict(type='NanDetectHook'))
    err = train_error(runner)
    assert (err.trigger, err.iter) == ('loss', 1)
    assert 'loss_aux=inf' in str(err)
    # The gradients were finite: only the loss check could catch it.
    norm = runner.message_hub.get_scalar('train/grad_norm').current()
    assert math.isfinite(norm)


def test_nan_gradient_of_one_parameter_is_named(tmp_path):
    runner = make_runner(tmp_path, faults={4: 'nan_grad'},
                         hook=dict(type='NanDetectHook'))
    err = train_error(runner)
    assert (err.trigger, err.iter) == ('grad', 2)
    text = str(err)
    assert '1 of 5 parameters' in text and 'head.bias' in text
    assert 'fc.weight' not in text and 'non-finite loss' not in text


@pytest.mark.parametrize('clip', [True, False])
def test_huge_finite_gradients_overflowing_the_norm(tmp_path, clip):
    optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))
    if clip:
        optim_wrapper['clip_grad'] = dict(max_norm=1.0)
    runner = make_runner(tmp_path, faults={2: 'huge_grad'},
                         hook=dict(type='NanDetectHook'),
                         optim_wrapper=optim_wrapper)
    err = train_error(runner)
    assert (err.trigger, err.iter) == ('grad', 1)
    assert 'every gradient is finite' in str(err)
    assert 'non-finite gradients' not in str(err)


# -- the norm: computed once, logged always, reused for clipping ------------


class _CountClipCalls(Hook):
    """Counts calls of the wrapper's own (norm-computing) clip function."""

    def __init__(self):
        self.calls = 0

    def before_train(self, runner):
        clip_func = runner.optim_wrapper.clip_func

        def counting_clip(*args, **kwargs):
            self.calls += 1
            return clip_func(*args, **kwargs)

        runner.optim_wrapper.clip_func = counting_clip


@pytest.mark.parametrize('norm_type', [2.0, 1.0, float('inf')])
def test_clipping_reuses_the_norm_and_matches_mmengine(tmp_path, norm_type):
    optim_wrapper = dict(
        optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
        clip_grad=dict(max_norm=0.05, norm_type=norm_type))
    counter = _CountClipCalls()
    ref = make_runner(tmp_path / 'ref', probe=counter,
                      optim_wrapper=copy.deepcopy(optim_wrapper))
    ref.train()
    assert counter.calls == 4
    counter = _CountClipCalls()
    runner = make_runner(tmp_path / 'nan', optim_wrapper=optim_wrapper,
                         hook=dict(type='NanDetectHook'), probe=counter)
    runner.train()
    assert counter.calls == 0
    assert_same(params(runner), params(ref))
    ours = runner.message_hub.get_scalar('train/grad_norm').data[0]
    theirs = ref.message_hub.get_scalar('train/grad_norm').data[0]
    assert list(ours) == list(theirs)
    # Clipping was active, so the comparison means something.
    assert min(theirs) > 0.05


def test_grad_norm_and_skip_count_logged_without_clip(tmp_path):
    runner = make_runner(tmp_path, hook=dict(type='NanDetectHook'),
                         max_iters=3)
    runner.train()
    norms = runner.message_hub.get_scalar('train/grad_norm').data[0]
    assert len(norms) == 3 and all(v > 0 and math.isfinite(v) for v in norms)
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 0


# -- policies ---------------------------------------------------------------


def test_skip_leaves_parameters_and_optimizer_state_bitwise(tmp_path):
    probe = Probe()
    runner = make_runner(
        tmp_path, faults={2: 'nan_term'}, probe=probe,
        hook=dict(type='NanDetectHook', policy='skip'),
        optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.01)))
    runner.train()
    params_before, state_before = probe.before[1]
    params_after, state_after = probe.after[1]
    assert_same(params_after, params_before)
    assert_state_same(state_after['state'], state_before['state'])
    # Training went on around the skipped step.
    assert not torch.equal(probe.after[2][0]['fc.weight'],
                           probe.before[2][0]['fc.weight'])
    assert runner.iter == 4
    skipped = runner.message_hub.get_scalar('train/nan_skipped')
    assert skipped.current() == 1
    assert 'Non-finite loss' in log_text(runner)


def test_skip_zeroes_gradients_when_step_is_called_directly():
    model = ToyModel()
    ow = NanDetectOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1),
                               policy='skip')
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = model([torch.ones(4)], fault=['nan_term'], mode='loss')
    ow.backward(losses['loss_main'] + losses['loss_aux'])
    ow.step()
    assert_same({n: p.detach() for n, p in model.named_parameters()},
                 before)
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0
               for p in model.parameters())


def test_max_skips_raises_after_consecutive_skips(tmp_path):
    hook = dict(type='NanDetectHook', policy='skip', max_skips=2)
    faults = {2: 'nan_term', 4: 'nan_term', 6: 'nan_term'}
    err = train_error(make_runner(tmp_path / 'a', faults=faults,
                                    hook=hook))
    assert (err.trigger, err.iter) == ('loss', 3)
    assert 'max_skips=2' in str(err)
    # Skips that are not consecutive never add up.
    runner = make_runner(tmp_path / 'b', faults={2: 'nan_term',
                                                 6: 'nan_term'},
                         hook=dict(hook, max_skips=1), max_iters=5)
    runner.train()
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 2


def test_warn_steps_as_mmengine_would(tmp_path):
    faults = {2: 'inf_target'}
    ref = make_runner(tmp_path / 'ref', faults=faults)
    ref.train()
    runner = make_runner(tmp_path / 'warn', faults=faults,
                         hook=dict(type='NanDetectHook', policy='warn'))
    runner.train()
    assert_same(params(runner), params(ref))
    assert 'Non-finite loss' in log_text(runner)


# -- gradient accumulation --------------------------------------------------


def test_accumulation_checks_every_micro_step_decides_at_update(tmp_path):
    probe = Probe()
    # Iterations 2 and 3 form one update; the bad loss is in iteration 2 and
    # its gradients are finite, so only the micro-step loss check sees it.
    runner = make_runner(
        tmp_path, faults={4: 'inf_target'}, probe=probe,
        hook=dict(type='NanDetectHook'),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1),
                           accumulative_counts=2))
    err = train_error(runner)
    assert (err.trigger, err.iter) == ('loss', 3)
    assert 'micro-step of iter 2' in str(err)
    assert_same(params(runner), probe.before[2][0])


def test_accumulation_replays_the_bad_micro_steps_batch(tmp_path):
    from mmnanhook.bundle import DATA_BATCH, load_bundle
    # The bad loss is in iteration 2; the update step (and the trigger) is
    # iteration 3, whose own batch is clean.
    runner = make_runner(
        tmp_path, faults={4: 'nan_term'}, hook=dict(type='NanDetectHook'),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1),
                           accumulative_counts=2))
    err = train_error(runner)
    assert (err.trigger, err.iter) == ('loss', 3)
    batch = load_bundle(err.bundle).load(DATA_BATCH)
    assert batch['fault'] == ['nan_term', '']
    # The replay of that batch reproduced the NaN term.
    assert err.report['kind'] != 'not_reproduced'
    assert err.report['nonfinite_losses'] == ['loss_aux']


def test_accumulation_skip_drops_the_whole_window(tmp_path):
    probe = Probe()
    runner = make_runner(
        tmp_path, faults={4: 'nan_term'}, probe=probe,
        hook=dict(type='NanDetectHook', policy='skip'),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
                           accumulative_counts=2), max_iters=6)
    runner.train()
    assert_same(probe.after[3][0], probe.before[2][0])
    assert not torch.equal(probe.after[5][0]['fc.weight'],
                           probe.before[4][0]['fc.weight'])
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 1


# -- anomaly mode -----------------------------------------------------------


@pytest.mark.parametrize('anomaly,user,expected', [
    ('always', False, [True] * 4),
    ('never', True, [False] * 4),
    ('on_trigger', True, [False] * 4),
    (2, False, [True, True, False, False]),
])
def test_anomaly_mode_only_around_train_iterations(tmp_path, anomaly, user,
                                                   expected):
    state = torch.is_anomaly_enabled()
    torch.autograd.set_detect_anomaly(user)
    try:
        runner = make_runner(tmp_path, val=True,
                             hook=dict(type='NanDetectHook', anomaly=anomaly))
        runner.train()
        assert torch.is_anomaly_enabled() == user
    finally:
        torch.autograd.set_detect_anomaly(state)
    seen = runner.model.anomaly_seen
    assert [on for mode, on in seen if mode == 'loss'] == expected
    val = [on for mode, on in seen if mode != 'loss']
    assert val and all(on == user for on in val)


def test_anomaly_restored_and_patches_removed_after_exception(tmp_path):
    assert not torch.is_anomaly_enabled()
    runner = make_runner(tmp_path, faults={2: 'nan_term'},
                         hook=dict(type='NanDetectHook', anomaly='always'))
    # Anomaly mode itself raises in backward: the error propagates as it
    # is, the trigger's diagnosis attached.
    with pytest.raises(RuntimeError, match='returned nan values') as info:
        runner.train()
    shown = '\n'.join([str(info.value)] +
                      list(getattr(info.value, '__notes__', [])))
    assert 'recorded by mmnanhook' in shown
    assert not torch.is_anomaly_enabled()
    assert 'train_step' not in vars(runner.model)
    assert 'parse_losses' not in vars(runner.model)
    assert type(runner.optim_wrapper) is OptimWrapper
    assert not [k for k in vars(runner.optim_wrapper) if k.startswith('_nan')]
    assert not set(vars(runner.optim_wrapper)) & set(BOUND)


def _shown(exc):
    return str(exc) + '\n'.join(getattr(exc, '__notes__', []))


def test_inplace_error_keeps_type_and_gains_forward_traceback(tmp_path):
    runner = make_runner(tmp_path, faults={2: 'inplace'},
                         hook=dict(type='NanDetectHook', anomaly='always'))
    with pytest.raises(RuntimeError) as info:
        runner.train()
    exc = info.value
    assert type(exc) is RuntimeError
    assert 'modified by an inplace operation' in _shown(exc)
    assert 'h = h.sigmoid()' in _shown(exc)
    assert 'testing/toy.py' in _shown(exc)
    assert 'h = h.sigmoid()' in log_text(runner)
    assert not torch.is_anomaly_enabled()


def test_inplace_error_without_anomaly_propagates_unchanged(tmp_path):
    runner = make_runner(tmp_path, faults={2: 'inplace'},
                         hook=dict(type='NanDetectHook'))
    with pytest.raises(RuntimeError) as info:
        runner.train()
    assert type(info.value) is RuntimeError
    assert 'h = h.sigmoid()' not in _shown(info.value)
    assert 'raised in backward at iter 1' in log_text(runner)


# -- the listener (the hook) and what it adds --------------------------------


class _AnsweringHook(NanDetectHook):
    """Its run's trigger procedure answers with a bundle path and a summary
    instead of its diagnosis."""

    def before_train(self, runner):
        super().before_train(runner)

        def prepare(plan, evidence, wrapper=None):
            self.events = getattr(self, 'events', []) + [plan.event]
            return plan.event, Answer(
                bundle='/dumps/iter_1',
                report=Report(summary='diagnosis: data'))

        self._run.procedure._prepare = prepare


class _FailingHook(NanDetectHook):
    """Its run's trigger procedure fails before the step's fate."""

    def before_train(self, runner):
        super().before_train(runner)

        def prepare(plan, evidence, wrapper=None):
            raise OSError('disk full')

        self._run.procedure._prepare = prepare


def test_listener_gets_the_event_first_and_its_answer_is_reported(tmp_path):
    hook = _AnsweringHook()
    runner = make_runner(tmp_path, faults={2: 'nan_term'}, hook=hook)
    err = train_error(runner)
    assert err.bundle == '/dumps/iter_1'
    assert 'diagnosis: data' in str(err) and '/dumps/iter_1' in str(err)
    (event, ) = hook.events
    assert (event.trigger, event.iter, event.epoch) == ('loss', 1, 0)
    assert event.nonfinite_losses == ['loss_aux']
    assert math.isnan(event.losses['loss_aux'])
    assert event.bad_ranks == [0] and event.world_size == 1


def test_a_failing_listener_does_not_stop_the_policy(tmp_path):
    runner = make_runner(tmp_path, faults={2: 'nan_term'},
                         hook=_FailingHook(policy='skip'))
    runner.train()
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 1
    assert 'disk full' in log_text(runner)


# -- options ----------------------------------------------------------------


@pytest.mark.parametrize('option,value', [
    ('anomaly', 'sometimes'), ('anomaly', -1), ('anomaly', True),
    ('policy', 'ignore'), ('max_skips', -1), ('max_skips', 1.5),
    ('min_loss_scale', -1.0), ('min_loss_scale', float('nan')),
    ('min_loss_scale', 'low'), ('max_overflow_skips', -2),
    ('dump_dir', 3), ('max_dumps', -1), ('max_dumps', True),
    ('replay', 'yes'), ('history', -5), ('dump_optimizer', 1),
])
def test_bad_option_names_itself(option, value):
    with pytest.raises(ValueError, match=option):
        NanDetectHook(**{option: value})


def test_good_options_accepted():
    hook = NanDetectHook(anomaly=5, policy='skip', max_skips=0,
                         min_loss_scale=None, max_overflow_skips=None,
                         dump_dir='/tmp/x', max_dumps=0, replay=False,
                         history=0, dump_optimizer=False)
    assert hook.options.check.policy == 'skip' and \
        hook.options.anomaly == 5


def test_bad_wrapper_option_names_itself():
    model = ToyModel()
    with pytest.raises(ValueError, match='policy'):
        NanDetectOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1),
                              policy='explode')


# -- how it is configured and installed --------------------------------------


def test_configured_wrapper_detects_without_the_hook(tmp_path):
    runner = make_runner(
        tmp_path, faults={2: 'nan_term'},
        optim_wrapper=dict(type='NanDetectOptimWrapper',
                           optimizer=dict(type='SGD', lr=0.1)))
    err = train_error(runner)
    assert (err.trigger, err.iter) == ('loss', 1)
    assert 'loss=nan' in str(err)


# A user's run that never imports mmnanhook itself: only the dotted type in
# its config names it (the project module on PYTHONPATH gives the model).
_DOTTED_RUN = r"""
import json, os, sys
from mmengine.runner import Runner
import replay_toys  # noqa: F401 - registers the toy model and dataset
assert 'mmnanhook' not in sys.modules
runner = Runner(
    model=dict(type='RandomSubsetRegressor', keep_prob=0.0),  # NaN loss
    work_dir=sys.argv[1], default_scope='mmengine',
    train_dataloader=dict(
        dataset=dict(type='ToyRegressionDataset'), batch_size=2,
        sampler=dict(type='DefaultSampler', shuffle=False),
        collate_fn=dict(type='pseudo_collate'), num_workers=0),
    train_cfg=dict(by_epoch=False, max_iters=2),
    optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
    default_hooks=dict(checkpoint=None, nan_detect=dict(
        type='mmnanhook.NanDetectHook', replay=False, max_dumps=0)))
hooks = [type(h).__module__ + '.' + type(h).__name__ for h in runner.hooks]
try:
    runner.train()
    error = None
except Exception as exc:
    error = type(exc).__module__ + '.' + type(exc).__name__
    trigger = getattr(exc, 'trigger', None)
print(json.dumps(dict(hooks=hooks, error=error, trigger=trigger)))
# Without the exit handlers: torch 1.7's autograd engine can hang in them
# after a backward (pytorch#47886), whatever ran the backward.
sys.stdout.flush()
os._exit(0)
"""


def test_dotted_type_works_without_custom_imports(tmp_path):
    from mmnan_testing.cli import PROJECT_DIR
    env = dict(os.environ, OMP_NUM_THREADS='1')
    # Prepended: an mmengine laid over the leg (make test-mmengine) stays.
    env['PYTHONPATH'] = os.pathsep.join(
        [PROJECT_DIR] + [p for p in [env.get('PYTHONPATH')] if p])
    out = subprocess.run(
        [sys.executable, '-c', _DOTTED_RUN, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert 'mmnanhook.hook.NanDetectHook' in result['hooks']
    assert result['error'] == 'mmnanhook.errors.NonFiniteError'
    assert result['trigger'] == 'loss'


def test_hook_installs_into_a_configured_wrapper_and_restores_it(tmp_path):
    runner = make_runner(
        tmp_path, hook=dict(type='NanDetectHook', policy='warn'),
        optim_wrapper=dict(type='NanDetectOptimWrapper', policy='skip',
                           optimizer=dict(type='SGD', lr=0.1)), max_iters=1)
    runner.train()
    ow = runner.optim_wrapper
    assert type(ow) is NanDetectOptimWrapper
    own = sentinel_of(ow)
    assert own.options.policy == 'skip' and own.listener is None


def test_optim_wrapper_dict_members_are_checked(tmp_path):
    probe = Probe()
    runner = make_runner(tmp_path, model=TwoOptimizerModel(),
                         optim_wrapper=two_optimizers,
                         faults={2: 'inf_target'},
                         hook=dict(type='NanDetectHook'), probe=probe)
    err = train_error(runner)
    assert (err.trigger, err.iter) == ('loss', 1)
    assert 'loss_aux=inf' in str(err)
    assert probe.wrapper_types == [
        ('OptimWrapperDict', [('OptimWrapper', True)] * 2)] * 2
    for member in runner.optim_wrapper.values():
        assert type(member) is OptimWrapper and sentinel_of(member) is None


def test_install_and_remove_restore_the_instance_exactly():
    model = ToyModel()
    ow = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    before = dict(vars(ow))
    handle = install_nan_detect(ow, policy='skip')
    assert sentinel_of(ow).options.policy == 'skip'
    assert set(BOUND) <= set(vars(ow))
    handle.remove()
    assert type(ow) is OptimWrapper
    assert vars(ow).keys() == before.keys()
    assert all(vars(ow)[k] is v for k, v in before.items())


def test_subclass_keeps_its_class_and_behaviour():

    class Custom(OptimWrapper):

        def custom(self):
            return 'still here'

    model = ToyModel()
    ow = Custom(torch.optim.SGD(model.parameters(), lr=0.1))
    handle = install_nan_detect(ow)
    assert sentinel_of(ow) is not None
    assert type(ow) is Custom and ow.custom() == 'still here'
    handle.remove()
    assert type(ow) is Custom and sentinel_of(ow) is None


def test_unsupported_wrapper_gets_a_clear_error():
    from mmengine._strategy.deepspeed import DeepSpeedOptimWrapper
    model = ToyModel()
    ow = DeepSpeedOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match='DeepSpeedOptimWrapper'):
        install_nan_detect(ow)
    assert type(ow) is DeepSpeedOptimWrapper
