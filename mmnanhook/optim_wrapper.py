"""Optim wrappers that stop non-finite losses and gradients before the step.

:class:`NanDetectMixin` adds the tier-1 checks to any ``OptimWrapper``: the
registered :class:`NanDetectOptimWrapper` / :class:`NanDetectAmpOptimWrapper`
use it directly, and :func:`install_nan_detect` re-classes an already-built
wrapper (what ``NanDetectHook`` does, so that ``--amp`` rewriting the
wrapper type does not remove the protection).

The decision is taken once per update step, after backward: DDP has then
all-reduced the gradients, and the rank-local loss flags are all-reduced in
one small tensor, so every rank takes the same decision in the same
iteration. Loss, gradient norm, loss scale and flags reach the host in one
sync.
"""
import logging
import math
import warnings
from contextlib import contextmanager

import torch
from mmengine.dist import all_reduce, get_dist_info
from mmengine.logging import MessageHub, MMLogger
from mmengine.model import is_model_wrapper
from mmengine.optim import AmpOptimWrapper, OptimWrapper, OptimWrapperDict
from mmengine.registry import OPTIM_WRAPPERS

from . import checks, compat
from .errors import NonFiniteError

POLICIES = ('raise', 'skip', 'warn')

# Wrappers of these modules run backward and step inside an engine
# (DeepSpeed, ColossalAI) that exposes no gradients before the step.
_UNSUPPORTED_MODULES = ('mmengine._strategy', )


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool)


def validate_options(policy='raise', max_skips=10, min_loss_scale=1.0,
                     max_overflow_skips=20):
    """Check the wrapper options and return them as a dict.

    Args:
        policy (str): ``'raise'``, ``'skip'`` or ``'warn'``.
        max_skips (int): Consecutive skipped update steps after which
            ``'skip'`` raises.
        min_loss_scale (float, optional): Under AMP, a loss scale below this
            is a trigger; ``None`` disables the check.
        max_overflow_skips (int, optional): Under AMP, more consecutive
            overflow skips than this are a trigger; ``None`` disables it.

    Raises:
        ValueError: Naming the first bad option.
    """
    if policy not in POLICIES:
        raise ValueError('policy must be one of %s, got %r'
                         % (', '.join(map(repr, POLICIES)), policy))
    if not _is_count(max_skips) or max_skips < 0:
        raise ValueError('max_skips must be an int >= 0, got %r'
                         % (max_skips, ))
    if min_loss_scale is not None and (
            isinstance(min_loss_scale, bool)
            or not isinstance(min_loss_scale, (int, float))
            or not math.isfinite(min_loss_scale) or min_loss_scale < 0):
        raise ValueError('min_loss_scale must be a finite number >= 0 or '
                         'None, got %r' % (min_loss_scale, ))
    if max_overflow_skips is not None and (not _is_count(max_overflow_skips)
                                           or max_overflow_skips < 0):
        raise ValueError('max_overflow_skips must be an int >= 0 or None, '
                         'got %r' % (max_overflow_skips, ))
    return dict(policy=policy, max_skips=max_skips,
                min_loss_scale=min_loss_scale,
                max_overflow_skips=max_overflow_skips)


def _log(message, level):
    MMLogger.get_current_instance().log(level, message)


def _result_text(result):
    # What a listener's answer adds to the error message.
    lines = []
    if result.get('summary'):
        lines.append(result['summary'])
    if result.get('bundle'):
        lines.append('bundle: %s' % result['bundle'])
    return '\n'.join(lines)


class NanDetectMixin(object):
    """Checks losses and gradients of an ``OptimWrapper`` before each step.

    Put first in the bases of an ``OptimWrapper`` subclass. Every loss
    passed to :meth:`backward` is recorded (without a sync); at the update
    step the gradient norm is computed once, before clipping, and clipping
    reuses it. A trigger builds a :class:`~mmnanhook.checks.NonFiniteEvent`,
    hands it to the listener (``NanDetectHook``) and applies the policy:
    ``'raise'`` a :class:`~mmnanhook.NonFiniteError`, ``'skip'`` the step
    (parameters and optimizer state untouched, gradients zeroed), or
    ``'warn'`` and step as MMEngine would have.

    Under AMP (an enabled ``loss_scaler``) non-finite gradients are ordinary
    overflows that the scaler skips; the triggers are a non-finite loss, a
    scale below ``min_loss_scale`` and more than ``max_overflow_skips``
    consecutive overflows.

    Args:
        *args: Passed to the wrapped class.
        policy (str): ``'raise'`` (default), ``'skip'`` or ``'warn'``.
        max_skips (int): Consecutive skipped steps after which ``'skip'``
            raises. Defaults to 10.
        min_loss_scale (float, optional): AMP loss scale below which training
            is considered broken. Defaults to 1.
        max_overflow_skips (int, optional): Consecutive AMP overflow skips
            tolerated. Defaults to 20.
        **kwargs: Passed to the wrapped class.
    """

    def __init__(self, *args, policy='raise', max_skips=10,
                 min_loss_scale=1.0, max_overflow_skips=20, **kwargs):
        super().__init__(*args, **kwargs)
        self._nan_configure(
            None,
            validate_options(policy, max_skips, min_loss_scale,
                             max_overflow_skips))

    def _nan_configure(self, listener, options, message_hub=None):
        self._nan_listener = listener
        self._nan_options = dict(options)
        self._nan_message_hub = message_hub
        # (iter, unscaled loss, loss terms or None) of each backward since
        # the last update step.
        self._nan_micro = []
        self._nan_pending = None
        self._nan_model = None
        self._nan_clip = None
        self._nan_skipped = 0
        self._nan_consecutive_skips = 0
        self._nan_overflows = 0

    # -- recording ---------------------------------------------------------

    @contextmanager
    def optim_context(self, model):
        # Remembered only to name parameters on the failure path.
        self._nan_model = model
        with super().optim_context(model):
            yield

    def update_params(self, loss, *args, **kwargs):
        listener = self._nan_listener
        terms = listener.loss_terms(loss) if listener is not None else None
        # backward() receives the loss divided for accumulation; report the
        # loss the model returned.
        self._nan_pending = (loss, terms)
        try:
            super().update_params(loss, *args, **kwargs)
        finally:
            self._nan_pending = None

    def backward(self, loss, **kwargs):
        pending, self._nan_pending = self._nan_pending, None
        reported, terms = pending if pending is not None else (loss, None)
        self._nan_micro.append((self._nan_info('iter'), reported.detach(),
                                terms))
        if not torch.is_anomaly_enabled():
            try:
                super().backward(loss, **kwargs)
            except Exception as exc:
                self._nan_backward_failed(exc, None)
                raise
            return
        # Anomaly mode prints the forward traceback of a failing backward op
        # only as a warning; keep it instead of letting filters drop it.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            try:
                super().backward(loss, **kwargs)
                failure = None
            except Exception as exc:  # noqa: BLE001 - re-raised below
                failure = exc
        forward_tb, others = checks.anomaly_traceback(caught)
        for w in others:
            warnings.warn_explicit(w.message, w.category, w.filename,
                                   w.lineno, source=w.source)
        if failure is not None and not self._nan_backward_failed(
                failure, forward_tb):
            raise failure

    def _nan_backward_failed(self, exc, forward_tb):
        """Report an exception raised in backward.

        Returns:
            bool: True when it was handled as an AMP overflow (not re-raised).
        """
        if (forward_tb is not None and self._nan_scaler() is not None
                and checks.is_anomaly_nan_error(exc)):
            # Anomaly mode stopped a scaled backward that overflowed into NaN.
            # GradScaler would have skipped that step: make it see the
            # overflow through a non-finite gradient, as it normally does.
            self._nan_poison_grads()
            self._inner_count += 1
            _log('mmnanhook: anomaly mode raised in a scaled backward (%s); '
                 'handled as an AMP overflow' % exc, logging.INFO)
            return True
        self._nan_micro = []
        rank, world_size = get_dist_info()
        message = '%s raised in backward at %s: %s' % (
            type(exc).__name__, self._nan_where(rank, world_size), exc)
        if forward_tb is not None:
            compat.add_exception_note(
                exc, 'Forward call that caused it (anomaly mode, recorded by '
                'mmnanhook):\n' + forward_tb)
        event = checks.NonFiniteEvent(
            'exception', message, iter=self._nan_info('iter'),
            epoch=self._nan_info('epoch'), rank=rank, world_size=world_size,
            exception=exc, forward_traceback=forward_tb)
        extra = _result_text(self._nan_notify(event, logging.ERROR))
        if extra:
            compat.add_exception_note(exc, extra)
        return False

    def _nan_poison_grads(self):
        for group in self.optimizer.param_groups:
            for p in group['params']:
                if p.requires_grad:
                    if p.grad is None:
                        p.grad = torch.full_like(p, float('nan'))
                    else:
                        p.grad.detach().fill_(float('nan'))
                    return

    # -- the update step ---------------------------------------------------

    def step(self, **kwargs):
        if not self._nan_check_step():
            return
        try:
            super().step(**kwargs)
        finally:
            self._nan_clip = None

    def _clip_grad(self):
        plan, self._nan_clip = self._nan_clip, None
        if plan is None:
            return super()._clip_grad()
        params, total = plan
        if total is not None:
            checks.clip_grads_with_norm_(params,
                                         self.clip_grad_kwargs['max_norm'],
                                         total)
        elif params:
            # train/grad_norm is already logged for this step.
            self.clip_func(params, **self.clip_grad_kwargs)

    def _nan_params(self):
        """Parameters with a gradient (as ``_clip_grad`` selects them), and
        those gradients."""
        params, grads = [], []
        for group in self.optimizer.param_groups:
            for p in group['params']:
                # Reading .grad is slow on old torch: once per parameter.
                grad = p.grad
                if grad is not None and p.requires_grad:
                    params.append(p)
                    grads.append(grad)
        return params, grads

    def _nan_clips_by_norm(self):
        return (bool(self.clip_grad_kwargs)
                and getattr(self, 'grad_name', None) == 'grad_norm')

    def _nan_scaler(self):
        scaler = getattr(self, 'loss_scaler', None)
        if scaler is None or not scaler.is_enabled():
            return None
        return scaler

    def _nan_hub(self):
        # The runner's hub when the hook gave it; self.message_hub is the hub
        # that was current when the wrapper was built, possibly another one.
        return self._nan_message_hub or MessageHub.get_current_instance()

    def _nan_info(self, key):
        return self._nan_hub().get_info(key)

    def _nan_check_step(self):
        """Check the update step; return whether to apply it."""
        micro, self._nan_micro = self._nan_micro, []
        params, grads = self._nan_params()
        clips = self._nan_clips_by_norm()
        norm_type = self.clip_grad_kwargs.get('norm_type', 2.0) if clips \
            else 2.0
        # Exact only when clipping reuses the norm.
        norms = checks.GradNorms(grads, norm_type,
                                 exact=clips)
        total = norms.total
        scaler = self._nan_scaler()
        scale = compat.grad_scaler_scale(scaler) if scaler else None
        if scale is not None:
            # Gradients are still multiplied by the scale here. For a scale
            # that is a power of two (GradScaler's default) this equals the
            # norm after unscale_ exactly.
            total = total * scale.double().reciprocal().float().to(
                total.device)
        (grad_norm, loss_scale, loss_values, bad_ranks, grads_bad, rank,
         world_size) = self._nan_sync(total, scale,
                                      [loss for _, loss, _ in micro])
        bad_micro = [i for i, v in enumerate(loss_values)
                     if not math.isfinite(v)]

        hub = self._nan_hub()
        hub.update_scalar('train/grad_norm', grad_norm)
        if loss_scale is not None:
            hub.update_scalar('train/loss_scale', loss_scale)

        bad_grads = norms.nonfinite() if grads_bad else []
        norm_overflow = (not math.isfinite(grad_norm)) and not bad_grads
        trigger, reasons = None, []
        if bad_ranks:
            trigger = 'loss'
        overflow = False
        if grads_bad:
            if scale is not None and not norm_overflow:
                overflow = True
            elif scale is None or clips:
                trigger = trigger or 'grad'
        if scale is not None:
            opts = self._nan_options
            self._nan_overflows = self._nan_overflows + 1 if overflow else 0
            limit = opts['max_overflow_skips']
            if limit is not None and self._nan_overflows > limit:
                trigger = trigger or 'amp_scale'
                reasons.append(
                    '%d consecutive AMP overflow skips exceed '
                    'max_overflow_skips=%d' % (self._nan_overflows, limit))
            low = opts['min_loss_scale']
            if low is not None and loss_scale < low:
                trigger = trigger or 'amp_scale'
                reasons.append('the AMP loss scale %s fell below '
                               'min_loss_scale=%s' %
                               (checks.format_value(loss_scale),
                                checks.format_value(low)))

        if trigger is None:
            self._nan_consecutive_skips = 0
            self._nan_plan_clip(params, total, grad_norm)
            hub.update_scalar('train/nan_skipped', self._nan_skipped)
            return True

        event = self._nan_event(trigger, micro, bad_micro, bad_ranks,
                                params, norms, grad_norm, norm_overflow,
                                bad_grads, loss_scale, reasons, rank,
                                world_size)
        return self._nan_apply_policy(event, params, total, grad_norm)

    def _nan_sync(self, total, scale, losses):
        """Bring norm, scale, losses and the ranks' flags to the host at once.

        Returns:
            tuple: ``grad_norm``, ``loss_scale`` (None without AMP), the loss
            values, the ranks whose loss was non-finite, whether any rank's
            gradient norm was, this rank and the world size.
        """
        device = total.device
        scalars = [total.float()]
        if scale is not None:
            scalars.append(scale.float().to(device))
        losses = [loss.float().sum().to(device) for loss in losses]
        packed = [torch.stack(scalars + losses)]
        rank, world_size = get_dist_info()
        if world_size > 1:
            # Slot r: rank r's loss was non-finite; slot world_size + r: its
            # gradient norm was. Summed over ranks, every rank sees both.
            flags = torch.zeros(2 * world_size, device=device)
            if losses:
                flags[rank] = (~torch.isfinite(
                    torch.stack(losses))).any().float()
            flags[world_size + rank] = (~torch.isfinite(total)).float()
            all_reduce(flags, op='sum')
            packed.append(flags)
        values = torch.cat(packed).tolist()  # the one host sync
        grad_norm = values[0]
        loss_scale = values[1] if scale is not None else None
        loss_values = values[len(scalars):len(scalars) + len(losses)]
        if world_size > 1:
            flags = values[len(scalars) + len(losses):]
            bad_ranks = [r for r in range(world_size) if flags[r] > 0]
            grads_bad = any(v > 0 for v in flags[world_size:])
        else:
            bad = any(not math.isfinite(v) for v in loss_values)
            bad_ranks = [rank] if bad else []
            grads_bad = not math.isfinite(grad_norm)
        return (grad_norm, loss_scale, loss_values, bad_ranks, grads_bad,
                rank, world_size)

    def _nan_plan_clip(self, params, total, grad_norm):
        if not self.clip_grad_kwargs:
            return
        if self._nan_clips_by_norm() and math.isfinite(grad_norm):
            self._nan_clip = (params, total)
        else:
            self._nan_clip = (params, None)

    def _nan_apply_policy(self, event, params, total, grad_norm):
        opts = self._nan_options
        policy = opts['policy']
        level = logging.WARNING if policy == 'warn' else logging.ERROR
        result = self._nan_notify(event, level)
        message = event.message
        if result:
            message += '\n' + _result_text(result)
        escalate = (policy == 'skip'
                    and self._nan_consecutive_skips >= opts['max_skips'])
        if escalate:
            message += ("\npolicy 'skip' already skipped %d consecutive "
                        'update steps (max_skips=%d)' %
                        (self._nan_consecutive_skips, opts['max_skips']))
        if policy == 'raise' or escalate:
            raise NonFiniteError(
                message, event.trigger, iter=event.iter, rank=event.rank,
                bad_ranks=event.bad_ranks, bundle=result.get('bundle'),
                report=result.get('report'))
        if policy == 'skip':
            self._nan_skipped += 1
            self._nan_consecutive_skips += 1
            self.zero_grad()
            self._nan_hub().update_scalar('train/nan_skipped',
                                          self._nan_skipped)
            return False
        self._nan_consecutive_skips = 0
        self._nan_plan_clip(params, total, grad_norm)
        self._nan_hub().update_scalar('train/nan_skipped', self._nan_skipped)
        return True

    def _nan_notify(self, event, level):
        """Hand ``event`` to the listener, or log it without one.

        Returns:
            dict: The listener's answer (``bundle``, ``summary``, ``report``);
            empty without a listener.
        """
        if self._nan_listener is None:
            _log(event.message, level)
            return {}
        try:
            return self._nan_listener.on_nonfinite(event) or {}
        except Exception:  # noqa: BLE001 - the policy must still apply
            _log(event.message, level)
            MMLogger.get_current_instance().exception(
                'mmnanhook: the NaN listener failed; applying the policy '
                'anyway')
            return {}

    # -- describing a trigger (failure path only) --------------------------

    def _nan_where(self, rank, world_size):
        return 'iter %s (epoch %s), rank %d of %d' % (
            self._nan_info('iter'), self._nan_info('epoch'), rank, world_size)

    def _nan_param_names(self, params, indices):
        model = self._nan_model
        if model is not None and is_model_wrapper(model):
            model = model.module
        names = {}
        if model is not None:
            names = {id(p): n for n, p in model.named_parameters()}
        return [
            names.get(id(params[i]),
                      'param #%d %s' % (i, tuple(params[i].shape)))
            for i in indices
        ]

    def _nan_event(self, trigger, micro, bad_micro, bad_ranks, params, norms,
                   grad_norm, norm_overflow, bad_grads, loss_scale, reasons,
                   rank, world_size):
        parts = []
        shown = micro[bad_micro[0]] if bad_micro else (
            micro[-1] if micro else None)
        losses, bad_losses = {}, []
        if shown is not None:
            terms = shown[2] if shown[2] is not None else {'loss': shown[1]}
            losses, bad_losses = checks.describe_losses(terms)
        loss_text = ', '.join('%s=%s' % (k, checks.format_value(v))
                              for k, v in losses.items())
        bad_iters = [micro[i][0] for i in bad_micro]
        if bad_ranks:
            text = 'non-finite loss'
            if bad_losses:
                text += ' (%s)' % ', '.join(bad_losses)
            if world_size > 1:
                text += ' on rank%s %s' % ('s' if len(bad_ranks) > 1 else '',
                                           ', '.join(map(str, bad_ranks)))
            if len(micro) > 1 and bad_iters:
                text += ' in the micro-step of iter %s' % ', '.join(
                    map(str, bad_iters))
            parts.append(text)
        if loss_text:
            parts.append('losses%s: %s' % (
                ' of rank %d' % rank if world_size > 1 else '', loss_text))
        grad_text = 'grad_norm=%s' % checks.format_value(grad_norm)
        names = []
        if bad_grads:
            names = self._nan_param_names(params, bad_grads[:checks.MAX_NAMES])
            grad_text += '; %d of %d parameters have non-finite gradients: ' \
                '%s' % (len(bad_grads), len(params),
                        checks.format_names(names, len(bad_grads)))
        elif norm_overflow:
            grad_text += (
                '; every gradient is finite (largest |grad| %s) but their '
                '%s norm overflows, which would make clip_grad zero them' %
                (checks.format_value(norms.largest_abs()),
                 norms.total.dtype))
        if loss_scale is not None:
            grad_text += '; AMP loss_scale=%s' % checks.format_value(
                loss_scale)
        parts.append(grad_text)
        parts.extend(reasons)
        head = {
            'loss': 'Non-finite loss',
            'grad': 'Non-finite gradient',
            'amp_scale': 'AMP loss scale collapsed',
        }[trigger]
        message = '%s at %s: %s' % (head, self._nan_where(rank, world_size),
                                    '; '.join(parts))
        return checks.NonFiniteEvent(
            trigger, message, iter=self._nan_info('iter'),
            epoch=self._nan_info('epoch'), rank=rank, world_size=world_size,
            bad_ranks=bad_ranks, losses=losses, nonfinite_losses=bad_losses,
            bad_loss_iters=bad_iters, grad_norm=grad_norm,
            nonfinite_grads=names, nonfinite_grad_count=len(bad_grads),
            loss_scale=loss_scale)


@OPTIM_WRAPPERS.register_module()
class NanDetectOptimWrapper(NanDetectMixin, OptimWrapper):
    """``OptimWrapper`` with the tier-1 checks (see :class:`NanDetectMixin`).

    Example:
        >>> optim_wrapper = dict(type='NanDetectOptimWrapper',
        ...                      optimizer=dict(type='SGD', lr=0.01),
        ...                      policy='raise')
    """


@OPTIM_WRAPPERS.register_module()
class NanDetectAmpOptimWrapper(NanDetectMixin, AmpOptimWrapper):
    """``AmpOptimWrapper`` with the tier-1 checks (see :class:`NanDetectMixin`).

    Example:
        >>> optim_wrapper = dict(type='NanDetectAmpOptimWrapper',
        ...                      optimizer=dict(type='SGD', lr=0.01),
        ...                      loss_scale='dynamic', min_loss_scale=1.0)
    """


_NAN_DETECT_CLASSES = {
    OptimWrapper: NanDetectOptimWrapper,
    AmpOptimWrapper: NanDetectAmpOptimWrapper,
}


def nan_detect_class(cls):
    """The class that adds the checks to ``cls`` (created once per class).

    Args:
        cls (type): An ``OptimWrapper`` subclass.
    """
    if issubclass(cls, NanDetectMixin):
        return cls
    if cls not in _NAN_DETECT_CLASSES:
        _NAN_DETECT_CLASSES[cls] = type('NanDetect' + cls.__name__,
                                        (NanDetectMixin, cls),
                                        {'__module__': cls.__module__})
    return _NAN_DETECT_CLASSES[cls]


def _members(optim_wrapper):
    if isinstance(optim_wrapper, OptimWrapperDict):
        return list(optim_wrapper.values())
    return [optim_wrapper]


def _check_supported(optim_wrapper):
    cls = type(optim_wrapper)
    engine = any(
        c.__module__.startswith(_UNSUPPORTED_MODULES) for c in cls.__mro__)
    if engine or not isinstance(optim_wrapper, OptimWrapper):
        raise RuntimeError(
            'mmnanhook cannot check %s.%s: it supports OptimWrapper, '
            'AmpOptimWrapper, their subclasses and the members of an '
            'OptimWrapperDict. Wrappers such as DeepSpeedOptimWrapper and '
            'ColossalAIOptimWrapper run backward and the step inside their '
            'engine, where the gradients cannot be checked before the step; '
            'remove NanDetectHook or use one of the supported wrappers.' %
            (cls.__module__, cls.__name__))


class NanDetectHandle(object):
    """What :func:`install_nan_detect` changed; :meth:`remove` undoes it."""

    def __init__(self, entries):
        self._entries = entries

    @property
    def wrappers(self):
        """The checked ``OptimWrapper`` instances."""
        return [entry[0] for entry in self._entries]

    def remove(self):
        """Restore every wrapper's class (or its own configuration)."""
        entries, self._entries = self._entries, []
        for optim_wrapper, original_class, saved in reversed(entries):
            if original_class is None:
                optim_wrapper._nan_configure(*saved)
                continue
            optim_wrapper.__class__ = original_class
            for name in [n for n in vars(optim_wrapper)
                         if n.startswith('_nan_')]:
                delattr(optim_wrapper, name)


def install_nan_detect(optim_wrapper, listener=None, message_hub=None,
                       **options):
    """Add the checks to an already-built optim wrapper.

    Re-classes each wrapper (an ``OptimWrapperDict``'s members one by one)
    to ``NanDetect<Class>``; a wrapper that already has the checks (e.g. a
    configured ``NanDetectOptimWrapper``) only gets ``listener`` and
    ``options``. Nothing is changed unless every member is supported.

    Args:
        optim_wrapper (OptimWrapper | OptimWrapperDict): Built wrapper.
        listener (optional): Object with ``on_nonfinite(event)`` and
            ``loss_terms(loss)``, e.g. ``NanDetectHook``.
        message_hub (MessageHub, optional): Where scalars are logged and the
            iteration is read; the current instance when not given.
        **options: See :func:`validate_options`.

    Returns:
        NanDetectHandle: Call ``remove()`` to restore the wrappers.

    Raises:
        RuntimeError: For an unsupported wrapper (e.g. DeepSpeed).
        ValueError: For a bad option.
    """
    options = validate_options(**options)
    members = _members(optim_wrapper)
    for member in members:
        _check_supported(member)
    entries = []
    for member in members:
        if isinstance(member, NanDetectMixin):
            entries.append((member, None,
                            (member._nan_listener, member._nan_options,
                             member._nan_message_hub)))
        else:
            entries.append((member, type(member), None))
            member.__class__ = nan_detect_class(type(member))
        member._nan_configure(listener, options, message_hub)
    return NanDetectHandle(entries)
