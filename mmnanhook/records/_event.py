"""The event of a trigger: what tier 1 saw, as every room receives it."""
from __future__ import annotations

import copy
import enum
from typing import Dict, Optional, Sequence, Union


class _StrEnum(str, enum.Enum):

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)


class Trigger(_StrEnum):
    """What made tier 1 act."""

    LOSS = 'loss'  #: a loss term was non-finite
    GRAD = 'grad'  #: a gradient, or the gradient norm, was non-finite
    EXCEPTION = 'exception'  #: backward raised (e.g. anomaly mode)
    AMP_SCALE = 'amp_scale'  #: the AMP loss scale collapsed
    SPIKE = 'spike'  #: a finite loss or gradient norm far above its band


TRIGGERS = tuple(t.value for t in Trigger)

# The scalars of one history record (as MessageHub's ``train/<field>``): what
# tier 1 keeps per iteration and a bundle's ``history.json`` / plot show.
HISTORY_FIELDS = ('loss', 'grad_norm', 'lr', 'loss_scale')


class NonFiniteEvent(object):
    """What was non-finite in one update step, handed to listeners.

    Args:
        trigger (Trigger | str): What triggered.
        message (str): Human-readable description.
        iter (int, optional): Global training iteration of the update step.
        epoch (int, optional): Training epoch.
        rank (int): Rank that builds the event.
        world_size (int): Number of ranks.
        bad_ranks (list[int]): Ranks whose loss was non-finite.
        losses (dict): Loss term name -> float (non-finite values kept).
        nonfinite_losses (list[str]): Names of the non-finite loss terms.
        bad_loss_iters (list[int]): Iterations (micro-steps under gradient
            accumulation) whose loss was non-finite on this rank.
        grad_norm (float, optional): Total gradient norm before clipping,
            unscaled under AMP.
        nonfinite_grads (list[str]): Parameters with non-finite gradients,
            at most :data:`mmnanhook._format.MAX_NAMES`.
        nonfinite_grad_count (int): How many parameters have them.
        loss_scale (float, optional): AMP loss scale used for the step.
        exception (str, optional): ``'Type: message'`` of the exception
            raised in backward, for ``Trigger.EXCEPTION``. Only its text: the
            exception object's traceback would keep the autograd graph alive.
        forward_traceback (str, optional): Anomaly mode's traceback of the
            forward op involved, when it was on.
        spikes (list[dict], optional): The spikes of this step
            (``Trigger.SPIKE``).
        shared (bool): Every rank of a distributed run has this event, in
            the same step (the update step's check, a forward vote): the
            ranks then exchange their findings and act alike.
        bad_grad_iter (int, optional): The micro-step whose gradients alone
            are not finite, once a replay of each has found it (a
            gradient-only fault under accumulation; :meth:`at_micro_step`).
    """

    def __init__(self, trigger: Union[Trigger, str], message: str,
                 iter: Optional[int] = None, epoch: Optional[int] = None,
                 rank: int = 0, world_size: int = 1,
                 bad_ranks: Optional[Sequence[int]] = None,
                 losses: Optional[Dict[str, float]] = None,
                 nonfinite_losses: Optional[Sequence[str]] = None,
                 bad_loss_iters: Optional[Sequence[int]] = None,
                 grad_norm: Optional[float] = None,
                 nonfinite_grads: Optional[Sequence[str]] = None,
                 nonfinite_grad_count: int = 0,
                 loss_scale: Optional[float] = None,
                 exception: Optional[str] = None,
                 forward_traceback: Optional[str] = None,
                 spikes: Optional[Sequence[dict]] = None,
                 shared: bool = False,
                 bad_grad_iter: Optional[int] = None) -> None:
        if trigger not in TRIGGERS:
            raise ValueError('unknown trigger %r; one of %s' %
                             (trigger, ', '.join(TRIGGERS)))
        self.trigger = Trigger(trigger)
        self.message = message
        self.iter = iter
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size
        self.bad_ranks = list(bad_ranks or [])
        self.losses = dict(losses or {})
        self.nonfinite_losses = list(nonfinite_losses or [])
        self.bad_loss_iters = list(bad_loss_iters or [])
        self.grad_norm = grad_norm
        self.nonfinite_grads = list(nonfinite_grads or [])
        self.nonfinite_grad_count = nonfinite_grad_count
        self.loss_scale = loss_scale
        self.exception = exception
        self.forward_traceback = forward_traceback
        self.spikes = list(spikes or [])
        self.shared = bool(shared)
        self.bad_grad_iter = bad_grad_iter

    def at_micro_step(self, iter: Optional[int]) -> NonFiniteEvent:
        """This event with its micro-step found: a copy whose
        ``bad_grad_iter`` is ``iter``."""
        located = copy.copy(self)
        located.bad_grad_iter = iter
        return located

    @property
    def fail_iter(self) -> Optional[int]:
        """The iteration whose batch to replay: the bad micro-step's (by its
        loss, or by its gradients alone), if any."""
        if self.bad_loss_iters:
            return self.bad_loss_iters[0]
        return self.iter if self.bad_grad_iter is None else self.bad_grad_iter

    def __repr__(self):
        return 'NonFiniteEvent(%s)' % self.message
