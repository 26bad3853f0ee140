"""The tier-1 decision of one optimizer, one update step at a time.

Framework-free (torch, and mmengine's process-group helpers, which work
without a Runner): :class:`StepCheck` sees the losses of the micro-steps, the
gradients and an optional AMP loss scale, and says whether the step may be
applied. The MMEngine adapter (:mod:`._sentinel`) feeds it from an
``OptimWrapper``; tests can feed it from plain torch.

The decision is taken once per update step, after backward: DDP has then
all-reduced the gradients, and the rank-local loss flags are all-reduced in
one small tensor, so every rank takes the same decision in the same
iteration. Loss, gradient norm, loss scale and flags reach the host in one
sync.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from mmengine.dist import all_reduce, get_dist_info

from .._format import MAX_NAMES, format_names, format_value
from .._losses import describe_losses
from ..records import NonFiniteEvent, Trigger
from ..recovery import Policy
from .._norms import GradNorms
from ._spikes import SpikeDetector

_HEADS = {
    Trigger.LOSS: 'Non-finite loss',
    Trigger.GRAD: 'Non-finite gradient',
    Trigger.AMP_SCALE: 'AMP loss scale collapsed',
}


class MicroStep(object):
    """One backward since the last update step.

    Args:
        iter (int, optional): Its training iteration.
        loss (torch.Tensor): The loss the model returned (detached).
        terms (dict, optional): Its loss terms, when ``parse_losses`` made it.
    """

    __slots__ = ('iter', 'loss', 'terms')

    def __init__(self, iter: Optional[int], loss: torch.Tensor,
                 terms: Optional[Dict[str, Any]] = None) -> None:
        self.iter = iter
        self.loss = loss
        self.terms = terms


class StepContext(object):
    """Where an update step happens, for messages (failure path).

    Args:
        iter (int, optional): Training iteration.
        epoch (int, optional): Training epoch.
        name_params (callable, optional): ``f(params, indices) ->
            list[str]``, the names of ``params[i]`` for each index;
            ``'param #i (shape)'`` without.
    """

    def __init__(self, iter: Optional[int] = None,
                 epoch: Optional[int] = None,
                 name_params: Optional[Callable[..., List[str]]] = None
                 ) -> None:
        self.iter = iter
        self.epoch = epoch
        self.name_params = name_params

    def where(self, rank: int, world_size: int) -> str:
        return 'iter %s (epoch %s), rank %d of %d' % (self.iter, self.epoch,
                                                      rank, world_size)


class StepOutcome(object):
    """What :meth:`StepCheck.check` measured and decided.

    Attributes:
        grad_norm (float): Total gradient norm before clipping (unscaled).
        loss_scale (float | None): AMP loss scale, without AMP ``None``.
        total (torch.Tensor): ``grad_norm`` as a tensor, for clip reuse.
        event (NonFiniteEvent | None): The trigger, ``None`` when clean.
        loss (float | None): The step's total loss (mean over micro-steps
            and ranks).
        spikes (list[Spike]): Spikes of this step (usually none).
    """

    __slots__ = ('grad_norm', 'loss_scale', 'total', 'event', 'loss',
                 'spikes')

    def __init__(self, grad_norm: float, loss_scale: Optional[float],
                 total: torch.Tensor, event: Optional[NonFiniteEvent] = None,
                 loss: Optional[float] = None,
                 spikes: Optional[Iterable[Any]] = None) -> None:
        self.grad_norm = grad_norm
        self.loss_scale = loss_scale
        self.total = total
        self.event = event
        self.loss = loss
        self.spikes = list(spikes or [])


class StepCheck(object):
    """Checks every update step of one optimizer before it is applied.

    Every loss given to :meth:`record` (without a sync) is checked at the
    next :meth:`check`, together with the gradient norm; what a trigger
    leads to is :class:`~mmnanhook.recovery.Policy`'s to decide, and
    :meth:`skip` / :meth:`passed` count how it went.

    Under AMP (a ``scale`` given to :meth:`check`) non-finite gradients are
    ordinary overflows that the scaler skips; the triggers are a non-finite
    loss, a scale below ``min_loss_scale`` and more than
    ``max_overflow_skips`` consecutive overflows.

    Args:
        options (CheckOptions): Policy and limits.
        policy (Policy, optional): The run's; one of ``options`` by default.
    """

    def __init__(self, options: Any, policy: Optional[Policy] = None
                 ) -> None:
        self.options = options
        self.policy = policy or Policy(options)
        self.spikes = None if options.spike_policy is None else \
            SpikeDetector(options.spike_window, options.spike_warmup,
                          options.spike_factor)
        self.micro = []
        self.skipped = 0
        self.consecutive_skips = 0
        self.overflows = 0
        # Update steps checked and losses recorded so far: the bypass guard
        # and the hook compare them around a train step.
        self.checks = 0
        self.records = 0

    def record(self, iter: Optional[int], loss: torch.Tensor,
               terms: Optional[Dict[str, Any]] = None) -> None:
        """Keep the loss of one backward for the next :meth:`check`.

        Args:
            iter (int, optional): Training iteration of the backward.
            loss (torch.Tensor): The loss (detached here).
            terms (dict, optional): Its loss terms
                (:func:`~mmnanhook._losses.loss_terms`).
        """
        self.records += 1
        self.micro.append(MicroStep(iter, loss.detach(), terms))

    def forget(self) -> None:
        """Drop the recorded losses (after a backward that raised)."""
        self.micro = []

    def check(self, params: List[torch.Tensor], grads: List[torch.Tensor],
              norm_type: float = 2.0, clips: bool = False,
              scale: Optional[torch.Tensor] = None,
              context: Optional[StepContext] = None,
              sharded: Optional[List[bool]] = None) -> StepOutcome:
        """Measure one update step and decide whether it triggers.

        Args:
            params (list[torch.Tensor]): Parameters with a gradient.
            grads (list[torch.Tensor]): Their gradients.
            norm_type (float): The p of the norm (the clip's, when clipping).
            clips (bool): Whether the step clips by this norm: then the norm
                is computed exactly as ``clip_grad_norm_`` would.
            scale (torch.Tensor, optional): The AMP loss scale the gradients
                are multiplied by; ``None`` without AMP.
            context (StepContext, optional): For the event's message.
            sharded (list[bool], optional): Per gradient, whether it is this
                rank's shard of a gradient split across ranks (FSDP; see
                :mod:`._shards`): the norm is then the global one, the
                shards' powers summed over the ranks in the one all-reduce.

        Returns:
            StepOutcome: With ``event`` set when the step triggers.
        """
        self.checks += 1
        micro, self.micro = self.micro, []
        norms = GradNorms(grads, norm_type, exact=clips, sharded=sharded)
        (grad_norm, loss_scale, loss_values, mean_loss, bad_ranks,
         grad_ranks, rank, world_size, total) = _sync(
             norms, scale, [m.loss for m in micro])
        outcome = StepOutcome(grad_norm, loss_scale, total, loss=mean_loss)

        grads_bad = bool(grad_ranks) or not math.isfinite(grad_norm)
        bad_grads = norms.nonfinite() if grads_bad else []
        # Sharded gradients: another rank's shard can be the non-finite one
        # (unsharded ones are equal on every rank after DDP's all-reduce).
        elsewhere = [r for r in grad_ranks
                     if r != rank] if sharded is not None else []
        norm_overflow = (not math.isfinite(grad_norm)) and not bad_grads \
            and not elsewhere
        trigger, reasons = None, []
        if bad_ranks:
            trigger = Trigger.LOSS
        overflow = False
        if grads_bad:
            if scale is not None and not norm_overflow:
                overflow = True
            elif scale is None or clips:
                trigger = trigger or Trigger.GRAD
        if scale is not None:
            trigger = self._amp_trigger(trigger, overflow, loss_scale,
                                        reasons)
        context = context or StepContext()
        if trigger is None:
            if self.spikes is not None:
                outcome.spikes = self.spikes.observe(context.iter, mean_loss,
                                                     grad_norm)
            if outcome.spikes and self.policy.spike_triggers():
                outcome.event = _spike_event(outcome.spikes, context, micro,
                                             grad_norm, loss_scale, rank,
                                             world_size)
            return outcome
        bad_micro = [i for i, v in enumerate(loss_values)
                     if not math.isfinite(v)]
        outcome.event = _event(trigger, context, micro, bad_micro, bad_ranks,
                               params, norms, grad_norm, norm_overflow,
                               elsewhere, bad_grads, loss_scale, reasons,
                               rank, world_size)
        return outcome

    def _amp_trigger(self, trigger, overflow, loss_scale, reasons):
        opts = self.options
        self.overflows = self.overflows + 1 if overflow else 0
        limit = opts.max_overflow_skips
        if limit is not None and self.overflows > limit:
            trigger = trigger or Trigger.AMP_SCALE
            reasons.append('%d consecutive AMP overflow skips exceed '
                           'max_overflow_skips=%d' % (self.overflows, limit))
        low = opts.min_loss_scale
        if low is not None and loss_scale < low:
            trigger = trigger or Trigger.AMP_SCALE
            reasons.append('the AMP loss scale %s fell below '
                           'min_loss_scale=%s' %
                           (format_value(loss_scale), format_value(low)))
        return trigger

    def passed(self) -> None:
        """Note a clean (or applied) update step: it ends a run of skips."""
        self.consecutive_skips = 0

    def skip(self, spike: bool = False) -> None:
        """Count an update step that is not applied."""
        if not spike:
            self.skipped += 1
        self.consecutive_skips += 1


def _sync(norms, scale, losses):
    """Bring norm, scale, losses and the ranks' flags to the host at once.

    With sharded gradients (:attr:`GradNorms.sharded`) the shards' powers
    ride in the flags' all-reduce (the inf-norm's maximum needs one more),
    and the global norm is made before the host sync.

    Returns:
        tuple: ``grad_norm``, ``loss_scale`` (None without AMP), the loss
        values, their mean over the micro-steps and the ranks (the same on
        every rank), the ranks whose loss was non-finite, those whose
        (local) gradient norm was, this rank, the world size and the norm as
        a tensor (unscaled; what clipping reuses).
    """
    total = norms.total
    device = total.device
    losses = [_scalar(loss, device) for loss in losses]
    rank, world_size = get_dist_info()
    sharded = norms.sharded is not None
    power_by_sum = sharded and not math.isinf(norms.norm_type)
    flags = None
    if world_size > 1:
        # Slot r: rank r's loss was non-finite; slot world_size + r: its
        # gradient norm was; then its mean loss over the ranks and, for
        # sharded gradients, the shards' powers. Summed over ranks, every
        # rank sees them all, and judges spikes alike.
        flags = torch.zeros(2 * world_size + 1 + power_by_sum, device=device)
        if losses:
            stacked = torch.stack(losses)
            flags[rank] = (~torch.isfinite(stacked)).any().float()
            flags[2 * world_size] = stacked.mean() / world_size
        flags[world_size + rank] = (~torch.isfinite(total)).float()
        if power_by_sum:
            flags[-1] = norms.power
        # mmengine's all_reduce moves the flags to the backend's device.
        all_reduce(flags, op='sum')
        if power_by_sum:
            total = norms.finish(flags[-1])
        elif sharded:
            power = norms.power.clone()
            all_reduce(power, op='max')
            total = norms.finish(power)
    if scale is not None:
        # Gradients are still multiplied by the scale here. For a scale
        # that is a power of two (GradScaler's default) this equals the
        # norm after unscale_ exactly.
        total = total * scale.double().reciprocal().float().to(total.device)
    scalars = [total.float()]
    if scale is not None:
        scalars.append(scale.float().to(device))
    packed = torch.stack(scalars + losses)
    if flags is not None:
        packed = torch.cat([packed, flags])
    values = packed.tolist()  # the one host sync
    grad_norm = values[0]
    loss_scale = values[1] if scale is not None else None
    loss_values = values[len(scalars):len(scalars) + len(losses)]
    if world_size > 1:
        flags = values[len(scalars) + len(losses):]
        bad_ranks = [r for r in range(world_size) if flags[r] > 0]
        # A sharded norm can overflow only once summed over the ranks.
        grad_ranks = [r for r in range(world_size)
                      if flags[world_size + r] > 0]
        mean_loss = flags[2 * world_size] if losses else None
    else:
        bad = any(not math.isfinite(v) for v in loss_values)
        bad_ranks = [rank] if bad else []
        grad_ranks = [] if math.isfinite(grad_norm) else [rank]
        mean_loss = (sum(loss_values) / len(loss_values)
                     if loss_values else None)
    return (grad_norm, loss_scale, loss_values, mean_loss, bad_ranks,
            grad_ranks, rank, world_size, total)


def _scalar(loss, device):
    """``loss`` summed, as a float32 scalar on ``device``: the loss itself
    when it is one already (each op is a few microseconds of host time)."""
    if loss.dim() or loss.dtype is not torch.float32 \
            or loss.device != device:
        return loss.float().sum().to(device)
    return loss


def _param_names(context, params, indices):
    if context.name_params is not None:
        return context.name_params(params, indices)
    return ['param #%d %s' % (i, tuple(params[i].shape)) for i in indices]


def _event(trigger, context, micro, bad_micro, bad_ranks, params, norms,
           grad_norm, norm_overflow, elsewhere, bad_grads, loss_scale,
           reasons, rank, world_size):
    # Failure path only: the syncs here do not count against tier 1.
    parts = []
    shown = micro[bad_micro[0]] if bad_micro else (
        micro[-1] if micro else None)
    losses, bad_losses = {}, []
    if shown is not None:
        terms = shown.terms if shown.terms is not None else {
            'loss': shown.loss}
        losses, bad_losses = describe_losses(terms)
    loss_text = ', '.join('%s=%s' % (k, format_value(v))
                          for k, v in losses.items())
    bad_iters = [micro[i].iter for i in bad_micro]
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
    grad_text = 'grad_norm=%s' % format_value(grad_norm)
    names = []
    if bad_grads:
        names = _param_names(context, params, bad_grads[:MAX_NAMES])
        grad_text += '; %d of %d parameters have non-finite gradients: ' \
            '%s' % (len(bad_grads), len(params),
                    format_names(names, len(bad_grads)))
    elif elsewhere:
        grad_text += ('; this rank\'s gradient shards are finite, those of '
                      'rank%s %s are not (or their norm overflows)' % (
                          's' if len(elsewhere) > 1 else '',
                          ', '.join(map(str, elsewhere))))
    elif norm_overflow:
        grad_text += (
            '; every gradient is finite (largest |grad| %s) but their '
            '%s norm overflows, which would make clip_grad zero them' %
            (format_value(norms.largest_abs()), norms.total.dtype))
    if loss_scale is not None:
        grad_text += '; AMP loss_scale=%s' % format_value(loss_scale)
    parts.append(grad_text)
    parts.extend(reasons)
    message = '%s at %s: %s' % (_HEADS[trigger],
                                context.where(rank, world_size),
                                '; '.join(parts))
    return NonFiniteEvent(
        trigger, message, iter=context.iter, epoch=context.epoch, rank=rank,
        world_size=world_size, bad_ranks=bad_ranks, losses=losses,
        nonfinite_losses=bad_losses, bad_loss_iters=bad_iters,
        grad_norm=grad_norm, nonfinite_grads=names,
        nonfinite_grad_count=len(bad_grads), loss_scale=loss_scale,
        shared=world_size > 1)


def _spike_event(spikes, context, micro, grad_norm, loss_scale, rank,
                 world_size):
    """The event of a step whose finite loss or gradient norm spiked."""
    shown = micro[-1] if micro else None
    losses = {}
    if shown is not None:
        terms = shown.terms if shown.terms is not None else {
            'loss': shown.loss}
        losses, _ = describe_losses(terms)
    message = 'Spike at %s: %s' % (context.where(rank, world_size), '; '.join(
        repr(spike) for spike in spikes))
    return NonFiniteEvent(
        Trigger.SPIKE, message, iter=context.iter, epoch=context.epoch,
        rank=rank, world_size=world_size, losses=losses, grad_norm=grad_norm,
        loss_scale=loss_scale, spikes=[s.to_dict() for s in spikes],
        shared=world_size > 1)
