"""Tier 1 on an MMEngine ``OptimWrapper``: the check bound onto the instance.

MMEngine wraps methods of the built wrapper *on the instance* before any hook
runs: every param scheduler replaces ``optim_wrapper.step`` with a counting
function that calls the ``step`` of the class the wrapper had at that moment.
Re-classing the wrapper later would change nothing that ``update_params``
calls. So mmnanhook never touches the class: :func:`install_nan_detect` binds
five small methods onto the instance, each wrapping what the instance
resolved before (the scheduler's counter included, whose ``_with_counter``
marker it carries on), and puts one :class:`WrapperSentinel` into one
attribute. The bindings delegate to it; without it they pass straight
through. :meth:`NanDetectHandle.remove` puts back exactly what was there.

A scheduler built *after* the install wraps the bound ``step`` in turn,
which still runs the check; and whatever replaces it without calling it is
caught by the bypass guard (:mod:`._guard`).
"""
import logging
import math
import types
import weakref

import torch
from mmengine.dist import get_dist_info
from mmengine.logging import MessageHub, MMLogger
from mmengine.optim import AmpOptimWrapper, OptimWrapper, OptimWrapperDict
from mmengine.registry import OPTIM_WRAPPERS

from .. import compat
from .._log import log
from .._mmengine import unwrap_model
from .._anomaly import capture_anomaly_warnings, is_anomaly_nan_error
from ..errors import NonFiniteError
from ..options import CheckOptions
from ..records import NonFiniteEvent, Trigger
from ._check import StepCheck, StepContext, answer_text
from ._norms import clip_grads_with_norm_
from ._shards import local_grads
from ._supported import check_supported

# The one attribute the install adds to a wrapper instance.
ATTRIBUTE = '_nan_detect'

# Wrapper method -> WrapperSentinel method it delegates to.
_BINDINGS = (
    ('update_params', 'update_params'),
    ('backward', 'backward'),
    ('step', 'step'),
    ('_clip_grad', 'clip_grad'),
    ('optim_context', 'optim_context'),
)

class Listener(object):
    """What a wrapper's sentinel tells its listener (``NanDetectHook``).

    Both methods are optional to override; the defaults do nothing.
    """

    def loss_terms(self, loss):
        """The loss terms ``parse_losses`` produced for ``loss``, if known.

        Args:
            loss (torch.Tensor): The loss handed to ``update_params``.

        Returns:
            dict | None: name -> detached tensor.
        """
        return None

    def on_nonfinite(self, event):
        """Called on a trigger, inside the step, before the policy acts.

        Args:
            event (NonFiniteEvent): What was non-finite (or spiked).

        Returns:
            dict | None: ``bundle`` / ``summary`` / ``report`` to add to the
            error; ``escalate``: a reason to raise whatever the policy.
        """
        return None

    def on_spike(self, spikes):
        """Called for the spikes of an update step, whatever the policy.

        Args:
            spikes (list[Spike]): This step's spikes.
        """

    def on_resolved(self, applied):
        """Called after the policy acted on an update step.

        Args:
            applied (bool): Whether the step (or, under ``'drop'``, its
                recomputation) is applied.
        """

    def on_step(self, outcome):
        """Called after every checked update step, before the policy acts.

        Args:
            outcome (StepOutcome): What the check measured: the loss and
                gradient norm as every rank sees them.
        """


class WrapperSentinel(object):
    """Tier 1 of one ``OptimWrapper``: a :class:`StepCheck` plus MMEngine.

    Every loss given to ``backward`` is recorded (without a sync); at the
    update step the gradient norm is computed once, before clipping, and
    clipping reuses it. A trigger's event goes to the listener, then the
    policy applies: ``'raise'`` a :class:`~mmnanhook.NonFiniteError`,
    ``'skip'`` the step (parameters and optimizer state untouched, gradients
    zeroed), ``'warn'`` and step as MMEngine would have.

    Args:
        options (CheckOptions): Policy and limits.
        listener (Listener, optional): Told about loss terms and triggers.
        message_hub (MessageHub, optional): Where scalars are logged and the
            iteration is read; the current instance when not given.
    """

    def __init__(self, options, listener=None, message_hub=None):
        self.check = StepCheck(options)
        # Built before the training graphs, to free what a raising backward
        # leaves queued (see compat.BackwardDrain).
        self.drain = compat.BackwardDrain()
        self.listener = listener
        self.message_hub = message_hub
        # Set by the listener after a rewind: the LR multiplier of the steps.
        self.lr_factor = None
        self._pending = None
        self._model = None
        # (params, total norm or None) for the _clip_grad of this step.
        self._clip = None
        # (weakref to the model, ids of its FSDP1-sharded parameters).
        self._shards = None
        # The DropPlan being recomputed (policy='drop'), while it is.
        self._dropping = None
        # Samples dropped so far, on every rank (train/samples_dropped).
        self.samples_dropped = 0
        # The ranks of a distributed run (sentinel._distributed.Ranks), set
        # by the listener that catches a forward that raises: every backward
        # waits for their vote.
        self.ranks = None

    @property
    def options(self):
        """The :class:`~mmnanhook.options.CheckOptions` in force."""
        return self.check.options

    @property
    def hub(self):
        # The runner's hub when the hook gave it; the wrapper's own
        # message_hub is whichever was current when it was built.
        return self.message_hub or MessageHub.get_current_instance()

    def _context(self):
        hub = self.hub
        return StepContext(hub.get_info('iter'), hub.get_info('epoch'),
                           self._name_params)

    # -- recording ---------------------------------------------------------

    def optim_context(self, wrapper, prev, model):
        # Kept (weakly) only to name parameters on the failure path.
        self._model = weakref.ref(model)
        return prev(model)

    def update_params(self, wrapper, prev, loss, *args, **kwargs):
        terms = (self.listener.loss_terms(loss)
                 if self.listener is not None else None)
        # backward() receives the loss divided for accumulation; report the
        # loss the model returned.
        self._pending = (loss, terms)
        try:
            return prev(loss, *args, **kwargs)
        finally:
            self._pending = None

    def backward(self, wrapper, prev, loss, **kwargs):
        if self.ranks is not None:
            # No rank enters DDP's gradient all-reduce while another rank's
            # forward raised: that one would never come.
            self.ranks.before_backward()
        pending, self._pending = self._pending, None
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
        extra = answer_text(self._notify(event, logging.ERROR))
        if extra:
            compat.add_exception_note(exc, extra)
        return False

    # -- the update step ---------------------------------------------------

    def step(self, wrapper, prev, *args, **kwargs):
        applied = self._check_step(wrapper)
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

    def clip_grad(self, wrapper, prev):
        plan, self._clip = self._clip, None
        if plan is None:
            return prev()
        params, total = plan
        if total is not None:
            clip_grads_with_norm_(params, wrapper.clip_grad_kwargs['max_norm'],
                                  total)
        elif params:
            # train/grad_norm is already logged for this step.
            wrapper.clip_func(params, **wrapper.clip_grad_kwargs)
        return None

    def _check_step(self, wrapper):
        """Check the update step; return whether to apply it."""
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
        # A raise below keeps this frame in the error's traceback: it must
        # not hold the gradients (the parameters are the model's anyway).
        del grads
        hub = self.hub
        # A recomputation (policy='drop') has the same scale, logged already.
        if outcome.loss_scale is not None and self._dropping is None:
            hub.update_scalar('train/loss_scale', outcome.loss_scale)
        if self.listener is not None:
            self.listener.on_step(outcome)
        if self.check.spikes is not None:
            if outcome.spikes and self.listener is not None:
                self.listener.on_spike(outcome.spikes)
            elif outcome.spikes:
                for spike in outcome.spikes:
                    log('mmnanhook: %r' % spike, logging.WARNING)
            hub.update_scalar('train/spikes', len(self.check.spikes.spikes))
        apply, answer = True, {}
        if outcome.event is None:
            self.check.passed()
        elif self._dropping is not None:
            # The recomputed step failed too: not applied either.
            log('mmnanhook: the update step recomputed without sample(s) '
                 '%s is not usable either (%s): skipped' % (
                     self._dropping.indices,
                     outcome.event.message.split('\n')[0]), logging.WARNING)
            self.check.skip()
            apply = False
        else:
            policy = (self.options.spike_policy
                      if outcome.event.trigger == Trigger.SPIKE else
                      self.options.policy)
            answer = self._notify(
                outcome.event, logging.ERROR if policy == 'raise' else
                logging.WARNING)
            try:
                apply = self.check.resolve(outcome.event, answer)
            except NonFiniteError:
                # Training ends here; nothing will apply these gradients.
                compat.release_grads(wrapper)
                raise
        if not apply and answer.get('drop') is not None:
            return self._drop(wrapper, answer['drop'])
        hub.update_scalar('train/nan_skipped', self.check.skipped)
        if not apply:
            if self._dropping is not None:
                self._dropping.undo()
            wrapper.zero_grad()
            return False
        # Only the norm of a step that is applied: a skipped step's
        # non-finite norm would stay in the windows LogProcessor smooths.
        hub.update_scalar('train/grad_norm', outcome.grad_norm)
        if wrapper.clip_grad_kwargs:
            reuse = clips and math.isfinite(outcome.grad_norm)
            self._clip = (params, outcome.total if reuse else None)
        return True

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

    def _drop(self, wrapper, plan):
        """Recompute the update step without ``plan.indices``; check it.

        Same weights, optimizer state, LR and loss scale (nothing was
        applied); every micro-step since the last update step again, from
        the RNG state before its original forward, its loss divided for
        accumulation as the original was.

        Returns:
            bool: Whether to apply the recomputed step.
        """
        wrapper.zero_grad()
        # (The listener put the buffers back before its diagnosis replayed
        # the step: the recompute starts from them too.)
        self.check.forget()
        # backward() counts each micro-step again: the accumulation factor
        # (scale_loss) and should_update() must see the original counts.
        count = wrapper._inner_count
        self._dropping = plan
        try:
            for k, forward in enumerate(plan.forwards):
                wrapper._inner_count = count - len(plan.forwards) + k
                try:
                    loss = forward()
                except Exception:
                    if self.ranks is not None:
                        # The other ranks wait in this backward's vote.
                        self.ranks.vote(True)
                    raise
                terms = (self.listener.loss_terms(loss)
                         if self.listener is not None else None)
                self._pending = (loss, terms)
                wrapper.backward(wrapper.scale_loss(loss))
        except Exception as error:  # noqa: BLE001 - falls back to skip
            self._pending = None
            self.check.forget()
            wrapper._inner_count = count
            self._dropping = None
            log('mmnanhook: recomputing the update step without sample(s) '
                 '%s raised %s: %s; skipped' % (plan.indices,
                                                type(error).__name__, error),
                 logging.WARNING)
            plan.abandon(wrapper, self)
            return False
        wrapper._inner_count = count
        try:
            applied = self._check_step(wrapper)
        finally:
            self._dropping = None
        if applied:
            self.check.passed()
            plan.applied(self)
        return applied

    def _notify(self, event, level):
        """Hand ``event`` to the listener, or log it without one.

        Returns:
            dict: The listener's answer; empty without a listener.
        """
        if self.listener is None:
            log(event.message, level)
            return {}
        try:
            return self.listener.on_nonfinite(event) or {}
        except Exception:  # noqa: BLE001 - the policy must still apply
            log(event.message, level)
            MMLogger.get_current_instance().exception(
                'mmnanhook: the NaN listener failed; applying the policy '
                'anyway')
            return {}

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


# -- binding onto an instance ----------------------------------------------


def _binding(name, delegate, prev):
    """A method for ``name`` that hands ``prev`` to the sentinel's
    ``delegate``, or calls ``prev`` when the wrapper has no sentinel."""

    def method(self, *args, **kwargs):
        sentinel = self.__dict__.get(ATTRIBUTE)
        if sentinel is None:
            return prev(*args, **kwargs)
        return getattr(sentinel, delegate)(self, prev, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = 'mmnanhook.' + name
    method.__doc__ = getattr(prev, '__doc__', None)
    # Markers others put on what they wrapped stay visible: a param
    # scheduler looks for `_with_counter` on optim_wrapper.step.
    source = getattr(prev, '__func__', prev)
    method.__dict__.update((k, v) for k, v in vars(source).items()
                           if not k.startswith('__'))
    return method


def bind(wrapper):
    """Bind the delegating methods onto ``wrapper``.

    Returns:
        dict: name -> (had an instance attribute, its value, the binding),
        for :func:`unbind`.
    """
    saved = {}
    own = vars(wrapper)
    for name, delegate in _BINDINGS:
        had, old = name in own, own.get(name)
        # A bound method, not a plain function: a param scheduler built
        # later takes ``step.__func__`` / ``__self__`` apart.
        bound = types.MethodType(
            _binding(name, delegate, getattr(wrapper, name)), wrapper)
        own[name] = bound
        saved[name] = (had, old, bound)
    return saved


def unbind(wrapper, saved):
    """Undo :func:`bind`.

    A binding that something else has wrapped since (a scheduler built after
    the install) stays; with the sentinel gone it only passes through.
    """
    own = vars(wrapper)
    for name, (had, old, bound) in saved.items():
        if own.get(name) is not bound:
            continue
        if had:
            own[name] = old
        else:
            del own[name]


def sentinel_of(wrapper):
    """The :class:`WrapperSentinel` checking ``wrapper``, or ``None``."""
    return vars(wrapper).get(ATTRIBUTE)


class _SelfChecking(object):
    """Makes a registered wrapper class check itself from construction."""

    def __init__(self, *args, policy='raise', max_skips=10,
                 min_loss_scale=1.0, max_overflow_skips=20,
                 spike_policy='warn', spike_window=50, spike_warmup=20,
                 spike_factor=None, **kwargs):
        options = CheckOptions(policy, max_skips, min_loss_scale,
                               max_overflow_skips, spike_policy, spike_window,
                               spike_warmup, spike_factor)
        if options.needs_hook():
            raise ValueError(options.needs_hook())
        super().__init__(*args, **kwargs)
        bind(self)
        vars(self)[ATTRIBUTE] = WrapperSentinel(options)


@OPTIM_WRAPPERS.register_module()
class NanDetectOptimWrapper(_SelfChecking, OptimWrapper):
    """``OptimWrapper`` that checks every step (see :class:`WrapperSentinel`).

    Args:
        *args: ``OptimWrapper`` arguments.
        policy (str): ``'raise'`` (default), ``'skip'`` or ``'warn'``.
        max_skips (int): Consecutive skipped steps after which ``'skip'``
            raises. Defaults to 10.
        min_loss_scale (float, optional): AMP loss scale below which training
            is considered broken. Defaults to 1.
        max_overflow_skips (int, optional): Consecutive AMP overflow skips
            tolerated. Defaults to 20.
        spike_policy (str, optional): ``None``, ``'warn'`` (default),
            ``'skip'`` or ``'raise'`` (see ``NanDetectHook``).
        spike_window, spike_warmup, spike_factor: The spike band (see
            ``NanDetectHook``).
        **kwargs: ``OptimWrapper`` arguments.

    Example:
        >>> optim_wrapper = dict(type='NanDetectOptimWrapper',
        ...                      optimizer=dict(type='SGD', lr=0.01),
        ...                      policy='raise')
    """


@OPTIM_WRAPPERS.register_module()
class NanDetectAmpOptimWrapper(_SelfChecking, AmpOptimWrapper):
    """``AmpOptimWrapper`` that checks every step; options as
    :class:`NanDetectOptimWrapper`.

    Example:
        >>> optim_wrapper = dict(type='NanDetectAmpOptimWrapper',
        ...                      optimizer=dict(type='SGD', lr=0.01),
        ...                      loss_scale='dynamic', min_loss_scale=1.0)
    """


def members(optim_wrapper):
    """The ``OptimWrapper`` instances of a wrapper or ``OptimWrapperDict``."""
    if isinstance(optim_wrapper, OptimWrapperDict):
        return list(optim_wrapper.values())
    return [optim_wrapper]


class NanDetectHandle(object):
    """What :func:`install_nan_detect` changed; :meth:`remove` undoes it."""

    def __init__(self, entries):
        self._entries = entries

    @property
    def wrappers(self):
        """The checked ``OptimWrapper`` instances."""
        return [entry[0] for entry in self._entries]

    @property
    def sentinels(self):
        """Their :class:`WrapperSentinel` objects, in the same order."""
        return [entry[1] for entry in self._entries]

    def remove(self):
        """Restore every wrapper's attributes exactly as they were."""
        entries, self._entries = self._entries, []
        for wrapper, _, previous, saved in reversed(entries):
            unbind(wrapper, saved)
            if previous is None:
                vars(wrapper).pop(ATTRIBUTE, None)
            else:
                vars(wrapper)[ATTRIBUTE] = previous


def install_nan_detect(optim_wrapper, listener=None, message_hub=None,
                       **options):
    """Add the checks to an already-built optim wrapper.

    Binds the checks onto each wrapper instance (an ``OptimWrapperDict``'s
    members one by one), whatever was bound there before; a wrapper that
    already checks itself (a configured ``NanDetectOptimWrapper``) only gets
    a new sentinel with ``listener`` and ``options`` until removal. Nothing
    is changed unless every member is supported.

    Args:
        optim_wrapper (OptimWrapper | OptimWrapperDict): Built wrapper.
        listener (Listener, optional): Told about loss terms and triggers,
            e.g. ``NanDetectHook``.
        message_hub (MessageHub, optional): Where scalars are logged and the
            iteration is read; the current instance when not given.
        **options: See :class:`~mmnanhook.options.CheckOptions`.

    Returns:
        NanDetectHandle: Call ``remove()`` to restore the wrappers.

    Raises:
        RuntimeError: For an unsupported wrapper (e.g. DeepSpeed).
        ValueError: For a bad option.
    """
    options = CheckOptions(**options)
    wrappers = members(optim_wrapper)
    for wrapper in wrappers:
        check_supported(wrapper)
    entries = []
    for wrapper in wrappers:
        previous = sentinel_of(wrapper)
        saved = bind(wrapper) if previous is None else {}
        sentinel = WrapperSentinel(options, listener, message_hub)
        vars(wrapper)[ATTRIBUTE] = sentinel
        entries.append((wrapper, sentinel, previous, saved))
    return NanDetectHandle(entries)
