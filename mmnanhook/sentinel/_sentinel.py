"""Tier 1 of one ``OptimWrapper``: the check, and the acts of its step.

The installation (:mod:`._install`) binds five methods onto a wrapper
instance that delegate to its :class:`WrapperSentinel`: every loss handed to
``backward`` is recorded without a sync; at the update step the gradient
norm is computed once, before clipping, and clipping reuses it
(:meth:`WrapperSentinel.measure`; :meth:`~WrapperSentinel.admit` for a step
to be applied). A trigger's event goes to the listener with the step as an
:class:`UpdateStep`; :func:`mmnanhook.recovery.carry_out` carries the
decision out on it: apply, skip (gradients zeroed, parameters and optimizer
state untouched), recompute without samples (:func:`._drop.recompute`, which
measures its own step) or raise.
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
from mmengine.dist import get_dist_info
from mmengine.logging import MessageHub, MMLogger

from .. import compat
from .._anomaly import capture_anomaly_warnings, is_anomaly_nan_error
from .._log import log
from .._mmengine import unwrap_model
from ..errors import NonFiniteError
from ..records import NonFiniteEvent, Trigger
from ..recovery import Answer, Circumstances, Step, carry_out
from ._check import StepCheck, StepContext, StepOutcome
from ._drop import recompute
from .._norms import clip_grads_with_norm_
from ._shards import local_grads


class WrapperSentinel(object):
    """Tier 1 of one ``OptimWrapper``: a :class:`StepCheck` plus MMEngine.

    Args:
        options (CheckOptions): Policy and limits.
        listener (Listener, optional): Told about loss terms and triggers.
        message_hub (MessageHub, optional): Where scalars are logged and the
            iteration is read; the current instance when not given.
        policy (Policy, optional): The run's; one of ``options`` by default.
    """

    def __init__(self, options: Any, listener: Optional[Any] = None,
                 message_hub: Optional[MessageHub] = None,
                 policy: Optional[Any] = None) -> None:
        self.check = StepCheck(options, policy)
        # Built before the training graphs, to free what a raising backward
        # leaves queued (see compat.BackwardDrain).
        self.drain = compat.BackwardDrain()
        self.listener = listener
        self.message_hub = message_hub
        # Set by the listener after a rewind: the LR multiplier of the steps.
        self.lr_factor = None
        # (loss, terms) handed from update_params to backward.
        self.pending = None
        # What the last check measured (StepOutcome), for the listener to
        # read after the step.
        self.outcome = None
        # Waits for what must be settled before an update step changes the
        # parameters (the newest rewind snapshot's copy), or None.
        self.settle = None
        self._model = None
        # (params, total norm or None) for the _clip_grad of this step.
        self._clip = None
        # (weakref to the model, ids of its FSDP1-sharded parameters).
        self._shards = None
        # Samples dropped so far, on every rank (train/samples_dropped).
        self.samples_dropped = 0
        # Every sentinel of one install (an OptimWrapperDict's members,
        # set by install_nan_detect): train/nan_skipped is one counter of
        # the run, their skips together; ``None``: this one alone.
        self.peers = None
        # The ranks of a distributed run (sentinel._ranks.Ranks), set
        # by the listener that catches a forward that raises: every backward
        # waits for their vote.
        self.ranks = None

    @property
    def options(self) -> Any:
        """The :class:`~mmnanhook.options.CheckOptions` in force."""
        return self.check.options

    @property
    def hub(self) -> MessageHub:
        # The runner's hub when the hook gave it; the wrapper's own
        # message_hub is whichever was current when it was built.
        return self.message_hub or MessageHub.get_current_instance()

    def _context(self):
        hub = self.hub
        return StepContext(hub.get_info('iter'), hub.get_info('epoch'),
                           self._name_params)

    def loss_terms(self, loss: torch.Tensor
                   ) -> Optional[Dict[str, Any]]:
        """The listener's loss terms of ``loss``, or ``None``."""
        if self.listener is None:
            return None
        return self.listener.loss_terms(loss)

    # -- recording ---------------------------------------------------------

    def optim_context(self, wrapper: Any, prev: Callable[..., Any],
                      model: torch.nn.Module) -> Any:
        # Kept (weakly) only to name parameters on the failure path.
        self._model = weakref.ref(model)
        return prev(model)

    def update_params(self, wrapper: Any, prev: Callable[..., Any],
                      loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # backward() receives the loss divided for accumulation; report the
        # loss the model returned.
        self.pending = (loss, self.loss_terms(loss))
        try:
            return prev(loss, *args, **kwargs)
        finally:
            self.pending = None

    def backward(self, wrapper: Any, prev: Callable[..., Any],
                 loss: torch.Tensor, **kwargs: Any) -> Any:
        if self.ranks is not None:
            # No rank enters DDP's gradient all-reduce while another rank's
            # forward raised: that one would never come.
            self.ranks.before_backward()
        pending, self.pending = self.pending, None
        reported, terms = pending if pending is not None else (loss, None)
        self.check.record(self.hub.get_info('iter'), reported, terms)
        if not torch.is_anomaly_enabled():
            try:
                return prev(loss, **kwargs)
            except Exception as exc:
                self.drain()
                self._backward_failed(wrapper, exc, None)
                raise
        with capture_anomaly_warnings() as anomaly:
            try:
                prev(loss, **kwargs)
                failure = None
            except Exception as exc:  # noqa: BLE001 - re-raised below
                failure = exc
                self.drain()
        if failure is not None and not self._backward_failed(
                wrapper, failure, anomaly.traceback):
            raise failure

    def _backward_failed(self, wrapper, exc, forward_tb):
        """Report an exception raised in backward.

        Returns:
            bool: True when it was handled as an AMP overflow (not re-raised).
        """
        if (forward_tb is not None and _scaler(wrapper) is not None
                and is_anomaly_nan_error(exc)):
            # Anomaly mode stopped a scaled backward that overflowed into NaN.
            # GradScaler would have skipped that step: make it see the
            # overflow through a non-finite gradient, as it normally does.
            _poison_grads(wrapper)
            wrapper._inner_count += 1
            log('mmnanhook: anomaly mode raised in a scaled backward (%s); '
                'handled as an AMP overflow' % exc, logging.INFO)
            return True
        self.check.forget()
        context = self._context()
        rank, world_size = get_dist_info()
        message = '%s raised in backward at %s: %s' % (
            type(exc).__name__, context.where(rank, world_size), exc)
        if forward_tb is not None:
            compat.add_exception_note(
                exc, 'Forward call that caused it (anomaly mode, recorded by '
                'mmnanhook):\n' + forward_tb)
        event = NonFiniteEvent(
            Trigger.EXCEPTION, message, iter=context.iter,
            epoch=context.epoch, rank=rank, world_size=world_size,
            exception='%s: %s' % (type(exc).__name__, exc),
            forward_traceback=forward_tb)
        extra = self._backward_note(event)
        if extra:
            compat.add_exception_note(exc, extra)
        return False

    def _backward_note(self, event):
        """What the listener's diagnosis adds to an exception raised in
        backward (logged here without one)."""
        if self.listener is not None:
            try:
                return self.listener.on_backward_raised(event)
            except Exception:  # noqa: BLE001 - the exception goes on
                MMLogger.get_current_instance().exception(
                    'mmnanhook: the NaN listener failed')
        log(event.message, logging.ERROR)
        return None

    # -- the update step ---------------------------------------------------

    def step(self, wrapper: Any, prev: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
        applied = self.check_step(wrapper)
        if self.listener is not None:
            self.listener.on_resolved(applied)
        if not applied:
            if getattr(prev, '_with_counter', False):
                # A param scheduler's counter: a skipped step is still a call
                # of optim_wrapper.step() to it, as an AMP overflow skip is.
                wrapper._global_step += 1
            return None
        # Lowered for this step only: the schedulers never see it.
        groups = wrapper.optimizer.param_groups if self.lr_factor else ()
        scheduled = [group['lr'] for group in groups]
        for group in groups:
            group['lr'] = group['lr'] * self.lr_factor
        try:
            return prev(*args, **kwargs)
        finally:
            self._clip = None
            for group, lr in zip(groups, scheduled):
                group['lr'] = lr

    def clip_grad(self, wrapper: Any,
                  prev: Callable[[], Any]) -> Any:
        clip, self._clip = self._clip, None
        if clip is None:
            return prev()
        params, total = clip
        if total is not None:
            clip_grads_with_norm_(params, wrapper.clip_grad_kwargs['max_norm'],
                                  total)
        elif params:
            # train/grad_norm is already logged for this step.
            wrapper.clip_func(params, **wrapper.clip_grad_kwargs)
        return None

    def check_step(self, wrapper: Any) -> bool:
        """Check the update step, carry out the decision of a trigger;
        return whether to apply the step."""
        measured = self.measure(wrapper)
        event = measured.outcome.event
        if event is None:
            self.admit(wrapper, measured)
            return True
        step = UpdateStep(self, wrapper, measured)
        self._respond(event, step)
        return step.applied

    def measure(self, wrapper: Any,
                again: bool = False) -> 'Measured':
        """Measure the update step of ``wrapper`` (no decision).

        Args:
            wrapper (OptimWrapper): The optim wrapper stepped.
            again (bool): A recomputation of the step (``'drop'``): its
                loss scale is logged already.
        """
        params, grads = _params_with_grads(wrapper)
        clips = _clips_by_norm(wrapper)
        norm_type = wrapper.clip_grad_kwargs.get('norm_type', 2.0) \
            if clips else 2.0
        scaler = _scaler(wrapper)
        scale = compat.grad_scaler_scale(scaler) if scaler else None
        grads, sharded = local_grads(params, grads, self._sharded_ids(),
                                     norm_type)
        outcome = self.check.check(params, grads, norm_type, clips=clips,
                                   scale=scale, context=self._context(),
                                   sharded=sharded)
        # A trigger that raises keeps check_step's frame, and what it
        # measured, in the error's traceback: no gradient may be among it
        # (the parameters are the model's).
        del grads
        self._tell(outcome, again)
        return Measured(params, clips, outcome)

    def admit(self, wrapper: Any, measured: 'Measured') -> None:
        """What an update step to be applied records: the check passed,
        its norm logged, its clipping prepared."""
        self.check.passed()
        self._count('train/nan_skipped', self.skipped_in_run())
        outcome = measured.outcome
        # Only the norm of a step that is applied: a skipped step's
        # non-finite norm would stay in the windows LogProcessor smooths.
        self.hub.update_scalar('train/grad_norm', outcome.grad_norm)
        if wrapper.clip_grad_kwargs:
            reuse = measured.clips and math.isfinite(outcome.grad_norm)
            self._clip = (measured.params,
                          outcome.total if reuse else None)

    def _tell(self, outcome, again):
        """What every checked step logs and tells the listener."""
        hub = self.hub
        if outcome.loss_scale is not None and not again:
            hub.update_scalar('train/loss_scale', outcome.loss_scale)
        self.outcome = outcome
        if self.settle is not None:
            self.settle()
        if self.check.spikes is None:
            return
        if outcome.spikes and self.listener is not None:
            self.listener.on_spike(outcome.spikes)
        elif outcome.spikes:
            for spike in outcome.spikes:
                log('mmnanhook: %r' % spike, logging.WARNING)
        self._count('train/spikes', len(self.check.spikes.spikes))

    def _count(self, key, value):
        """Log a counter where it changed (or is not yet): LogProcessor
        shows a counter's current value, which stays; an update costs about
        10 us."""
        hub = self.hub
        logged = hub.log_scalars.get(key)
        if logged is None or logged.current() != value:
            hub.update_scalar(key, value)

    def skip(self, wrappers: List[Any], spike: bool = False,
             undo: Optional[Callable[[], Any]] = None) -> None:
        """Leave the update step out: what its forwards wrote put back
        (``undo``), gradients zeroed, counted in ``train/nan_skipped``.

        Args:
            wrappers (list[OptimWrapper]): Whose gradients are zeroed.
            spike (bool): A spike's step: counted among the consecutive
                skips only.
            undo (callable, optional): Puts the buffers back.
        """
        self.check.skip(spike)
        if undo is not None:
            undo()
        for wrapper in wrappers:
            wrapper.zero_grad()
        self.hub.update_scalar('train/nan_skipped', self.skipped_in_run())

    def skipped_in_run(self) -> int:
        """Update steps left out so far by this sentinel and its peers:
        a GAN's discriminator step left out is not undone in the counter by
        its generator's step applied after it."""
        return sum(s.check.skipped for s in self.peers or [self])

    def _sharded_ids(self):
        """ids of the parameters FSDP1 shards in the model, or ``None``."""
        model = self._model() if self._model is not None else None
        if model is None:
            return None
        if self._shards is None or self._shards[0]() is not model:
            # Once per model: walking its modules costs per step otherwise.
            self._shards = (weakref.ref(model),
                            compat.fsdp_sharded_params(model))
        return self._shards[1]

    def _respond(self, event, step: 'UpdateStep') -> None:
        """The trigger ``event`` carried out on ``step`` by the listener;
        alone, or when the listener fails before the step's fate (the
        policy must still apply), by the plan without a diagnosis."""
        if self.listener is not None:
            try:
                self.listener.on_trigger(event, step)
                return
            except NonFiniteError:
                raise
            except Exception:  # noqa: BLE001 - the policy must still apply
                MMLogger.get_current_instance().exception(
                    'mmnanhook: the NaN listener failed; applying the policy '
                    'anyway')
        self.carry_out_alone(event, step)

    def carry_out_alone(self, event: NonFiniteEvent,
                        step: 'UpdateStep') -> None:
        """``event``'s plan carried out on ``step`` without a diagnosis
        (logged here)."""
        plan = self.check.policy.plan(Circumstances(
            event, self.check.consecutive_skips, replays=False))
        log(event.message, plan.level)
        carry_out(plan.decide(Answer()), event, Answer(), step)

    def _name_params(self, params, indices):
        model = self._model() if self._model is not None else None
        if model is not None:
            model = unwrap_model(model)
        names = {}
        if model is not None:
            names = {id(p): n for n, p in model.named_parameters()}
        return [names.get(id(params[i]),
                          'param #%d %s' % (i, tuple(params[i].shape)))
                for i in indices]


class Measured(NamedTuple):
    """What :meth:`WrapperSentinel.measure` found of an update step: the
    parameters with a gradient, whether clipping is by the norm, and the
    check's :class:`~._check.StepOutcome`."""

    params: List[torch.Tensor]
    clips: bool
    outcome: StepOutcome


class UpdateStep(Step):
    """The update step of one optim wrapper, as a trigger's decision acts
    on it (:func:`~mmnanhook.recovery.carry_out`).

    Args:
        sentinel (WrapperSentinel): The wrapper's sentinel.
        wrapper (OptimWrapper): The optim wrapper stepped.
        measured (Measured): What its check measured.

    Attributes:
        applied (bool): Whether the step (or its recomputation) is to be
            applied, once the decision is carried out.
    """

    def __init__(self, sentinel: WrapperSentinel, wrapper: Any,
                 measured: Measured) -> None:
        self.sentinel = sentinel
        self.wrapper = wrapper
        self.measured = measured
        self.applied = False

    def apply(self) -> None:
        self.sentinel.admit(self.wrapper, self.measured)
        self.applied = True

    def leave_out(self, undo: Optional[Callable[[], None]]) -> None:
        spike = self.measured.outcome.event.trigger == Trigger.SPIKE
        self.sentinel.skip([self.wrapper], spike=spike, undo=undo)
        # Left out after all (the listener failed after a recomputation, and
        # the plan without a diagnosis skips): nothing of it is applied.
        self.applied = False

    def recompute(self, drop: Any) -> Optional[bool]:
        why = recompute(self.sentinel, self.wrapper, drop)
        if why is not None:
            log('mmnanhook: %s; skipped' % why, logging.WARNING)
            return None
        self.applied = True
        return True

    def stop(self) -> None:
        # Training ends here; nothing will apply these gradients.
        _release_grads(self.wrapper)


def _params_with_grads(wrapper):
    """Parameters with a gradient (as ``_clip_grad`` selects them), and
    those gradients."""
    params, grads = [], []
    for group in wrapper.optimizer.param_groups:
        for p in group['params']:
            # Reading .grad is slow on old torch: once per parameter.
            grad = p.grad
            if grad is not None and p.requires_grad:
                params.append(p)
                grads.append(grad)
    return params, grads


def _clips_by_norm(wrapper):
    return (bool(wrapper.clip_grad_kwargs)
            and getattr(wrapper, 'grad_name', None) == 'grad_norm')


def _scaler(wrapper):
    scaler = getattr(wrapper, 'loss_scaler', None)
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler


def _poison_grads(wrapper):
    for group in wrapper.optimizer.param_groups:
        for p in group['params']:
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.full_like(p, float('nan'))
                else:
                    p.grad.detach().fill_(float('nan'))
                return


def _release_grads(optim_wrapper):
    """Free the gradients of an optim wrapper's parameters (``None``).

    ``set_to_none`` exists since torch 1.7 and is the default since 2.0; on
    older defaults the zeroed gradients would stay allocated.
    """
    optim_wrapper.optimizer.zero_grad(set_to_none=True)
