"""The one place a trigger's decision is carried out on its step.

:func:`carry_out` takes a :class:`~._plan.Decision` and the
:class:`~._answer.Answer` it was made from (the prepared drop) and acts on a
:class:`Step`: the update step of one optim wrapper (the sentinel's) or a
train step whose forward raised (the run's). The step's own kind only says
how each act is done; which act is done, and what a drop that cannot be
used falls back to (``SKIP``), is decided here and nowhere else.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..records import NonFiniteEvent
from ._answer import Answer
from ._plan import Action, Decision


class Step(object):
    """A step a decision is carried out on: what :func:`carry_out` may do
    to it. Each kind of step implements the acts its decisions can ask."""

    def apply(self) -> None:
        """Let the step be applied as it is (``'warn'``)."""
        raise NotImplementedError

    def leave_out(self, undo: Optional[Callable[[], None]]) -> None:
        """Leave the step out: gradients zeroed, counted as skipped.

        Args:
            undo (callable, optional): Puts back what its forwards wrote
                (a drop's, when the drop fell back).
        """
        raise NotImplementedError

    def recompute(self, drop: Any) -> Optional[bool]:
        """The step again without the samples of ``drop`` (a
        :class:`~mmnanhook.sentinel.Recomputation`).

        Returns:
            bool | None: Whether the recomputed step was applied (``False``:
            it triggered in turn and its own decision was carried out);
            ``None`` when it cannot be used (the log says why).
        """
        raise NotImplementedError

    def stop(self) -> None:
        """Let go of what the step holds: training stops."""
        raise NotImplementedError

    def propagate(self, note: str) -> None:
        """Let the forward's own exception go on, ``note`` added."""
        raise NotImplementedError


def carry_out(decision: Decision, event: NonFiniteEvent, answer: Answer,
              step: Step,
              dropped: Optional[Callable[[object], None]] = None) -> Action:
    """Carry ``decision`` out on ``step``.

    Args:
        decision (Decision): The plan's decision on what was found.
        event (NonFiniteEvent): The trigger (its error's).
        answer (Answer): What was found: the bundle, the drop prepared.
        step (Step): The step it is carried out on.
        dropped (callable, optional): Given the drop once its recomputed
            step is applied (its samples to quarantine).

    Returns:
        Action: What became of the step: ``APPLY``, ``SKIP``, ``DROP``
        (recomputed) or ``PROPAGATE``; ``RAISE`` raises
        :class:`~mmnanhook.NonFiniteError`.
    """
    action, undo = decision.action, None
    if action is Action.PROPAGATE:
        step.propagate(decision.message)
        return action
    if action is Action.DROP:
        applied = step.recompute(answer.drop)
        if applied is not None:
            if applied and dropped is not None:
                dropped(answer.drop)
            return action
        action, undo = Action.SKIP, answer.drop.undo
    if action is Action.RAISE:
        step.stop()
        raise decision.error(event, answer)
    if action is Action.SKIP:
        step.leave_out(undo)
        return action
    step.apply()
    return Action.APPLY
