"""Which micro-step of an accumulated update step made its gradients
non-finite, when every loss was finite.

The check sees only the gradients summed over the micro-steps; a non-finite
loss names its micro-step, a gradient-only fault does not. Replaying each
micro-step's backward alone, from its own RNG state, finds it.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Tuple

import torch

from ..records import Trigger
from ..memory import restore_rng
from ._session import ReplaySession
from ._state import PreservedModelState, preserved_rng


def locate_micro_step(event: Any, model: torch.nn.Module,
                      steps: Sequence[Tuple[Any, ...]],
                      train_step: Optional[Any] = None) -> Any:
    """``event`` with the micro-step of a gradient-only trigger of several
    micro-steps found (:meth:`~mmnanhook.records.NonFiniteEvent.
    at_micro_step`); ``event`` itself otherwise.

    Args:
        event (NonFiniteEvent): The trigger.
        model (nn.Module): The unwrapped model, before the update step (its
            gradients and buffers are put back).
        steps (list[tuple]): ``(iter, data_batch, rng_state)`` of the
            micro-steps since the last update step, oldest first (none:
            nothing is replayed).
        train_step (OwnTrainStep, optional): The model's own
            ``train_step``, replayed up to the failing update step.
    """
    if (event.trigger != Trigger.GRAD or event.bad_loss_iters
            or len(steps) < 2):
        return event
    with preserved_rng(), torch.enable_grad(), \
            PreservedModelState(model) as state:
        for iter, batch, rng in steps:
            replay = ReplaySession(model, batch,
                                   functools.partial(restore_rng, rng),
                                   state, None, train_step).run()
            if replay.nonfinite_grad_count:
                return event.at_micro_step(iter)
    return event
