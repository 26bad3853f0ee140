"""What one trigger leads to, asked once, before anything is done.

:meth:`Policy.plan <mmnanhook.recovery.Policy.plan>` takes what is known when
a trigger fires (:class:`Circumstances`) and answers with one frozen
:class:`Plan`: what to undo, who diagnoses, whether to rewind, drop or
quarantine, and what the step comes to, fallbacks included. The trigger
procedure (:mod:`mmnanhook._trigger`, or the sentinel alone without the hook)
carries it out in that order; after the diagnosis the plan's
:meth:`Plan.decide` turns what was found (:class:`Answer`) into the final
:class:`Decision` along the rows the plan already holds, and asks nothing of
the policy again.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import NonFiniteError
from ..records import Culprit, Kind, NonFiniteEvent
from ._answer import Answer
from ._samples import data_culprits, raised_by_nonfinite, received


class Action(enum.Enum):
    """What becomes of the step of a trigger."""

    APPLY = 'apply'  #: apply it as MMEngine would have (``'warn'``)
    SKIP = 'skip'  #: leave it out: gradients zeroed, ``train/nan_skipped``
    DROP = 'drop'  #: recompute it without the answer's samples
    RAISE = 'raise'  #: raise :class:`~mmnanhook.NonFiniteError`
    PROPAGATE = 'propagate'  #: let the forward's own exception go on


@dataclasses.dataclass(frozen=True)
class Circumstances(object):
    """What is known of a trigger when it fires, before anything is done.

    Args:
        event (NonFiniteEvent): The trigger.
        consecutive_skips (int): Update steps left out in a row before it.
        together (bool): Every rank of a distributed run handles it with
            the others (they exchange what they find).
        diverged (bool): Something diverged before it (the evidence of
            :func:`~mmnanhook.diagnosis.evidence_before`) or the weights
            are not finite: on any rank, under DDP. Looked at only where
            the trigger's policy is ``'rewind'``.
        rewind_to (int, optional): The iteration of the snapshot a rewind
            would go back to (``-1``: the state training started from).
        no_rewind (str, optional): Why no rewind can go back (no snapshot
            old enough; the ranks do not hold the same one).
        consecutive_rewinds (int): Rewinds in a row without ``cooldown``
            clean update steps in between.
        in_backward (bool): The trigger is an exception raised in backward:
            it propagates whatever the policy (told what was found).
        out_of_memory (bool): A forward that raised ran out of memory: a
            replay would too.
        replays (bool): The run replays a failing iteration (``replay``).
    """

    event: NonFiniteEvent
    consecutive_skips: int = 0
    together: bool = False
    diverged: bool = False
    rewind_to: Optional[int] = None
    no_rewind: Optional[str] = None
    consecutive_rewinds: int = 0
    in_backward: bool = False
    out_of_memory: bool = False
    replays: bool = True


@dataclasses.dataclass(frozen=True)
class Decision(object):
    """What a trigger comes to, once its diagnosis is in.

    Args:
        action (Action): What becomes of the step.
        message (str): The event's message with what the answer adds (the
            diagnosis, the verified fix, the bundle, why it escalates): the
            error's text, or the note on an exception that propagates.
    """

    action: Action
    message: str

    def error(self, event: NonFiniteEvent,
              answer: Answer) -> NonFiniteError:
        """The :class:`~mmnanhook.NonFiniteError` of ``Action.RAISE``."""
        return NonFiniteError(
            self.message, event.trigger.value, iter=event.iter,
            rank=event.rank, bad_ranks=event.bad_ranks, bundle=answer.bundle,
            report=answer.report_dict())


@dataclasses.dataclass(frozen=True)
class Plan(object):
    """What one trigger leads to, in the order it is carried out.

    1. log the event at ``level``;
    2. ``undo``: put back what the failing forward wrote (BN statistics);
    3. the ranks in ``diagnosers`` replay and diagnose it (told whether it
       rewinds), and under DDP every rank exchanges its finding;
    4. ``drop``: the samples the diagnosis singles out are left out of a
       recomputation of the step (and quarantined once it is applied);
       ``quarantine``: the samples of a data diagnosis are quarantined;
    5. ``rewind_to``: go back to that snapshot and lower the LR;
    6. :meth:`decide`: the step's fate, ``action``, along the rows below,
       carried out by :func:`~._executor.carry_out`.

    Args:
        event (NonFiniteEvent): The trigger.
        policy (str): The policy that handles it.
        level (int): Its log level: an error when it stops training.
        action (Action): What the step comes to when the plan goes as
            planned.
        undo (bool): Put back what the failing forward wrote, first.
        diagnosers (tuple[int]): The ranks that replay and diagnose it.
        diagnose (bool): Whether anything replays it here at all.
        rewind_to (int, optional): The snapshot's iteration to go back to.
        drop (bool): Prepare a recomputation without the samples the
            diagnosis singles out (``action`` is ``DROP``).
        quarantine (bool): Quarantine the samples of a data diagnosis.
        escalate (str, optional): Why it raises whatever the policy.
        nonfinite_only (bool): A forward that raised: ``action`` holds only
            when non-finite values made it raise; else it propagates.
    """

    event: NonFiniteEvent
    policy: str
    level: int
    action: Action
    undo: bool = False
    diagnosers: Tuple[int, ...] = ()
    diagnose: bool = True
    rewind_to: Optional[int] = None
    drop: bool = False
    quarantine: bool = False
    escalate: Optional[str] = None
    nonfinite_only: bool = False

    def after_diagnosis(self, event: NonFiniteEvent,
                        report: Optional[Any] = None,
                        findings: Optional[Sequence[Any]] = None
                        ) -> Tuple[bool, List[Culprit]]:
        """What the diagnosis leads to before the step's fate.

        Args:
            event (NonFiniteEvent): The trigger, its micro-step found.
            report (Report, optional): This rank's diagnosis.
            findings (tuple[RankFinding], optional): Under DDP, every
                rank's: they decide whether the failure is the data's.

        Returns:
            tuple: Whether to prepare the drop (an update step's always: the
            preparation says why nothing can be dropped; a forward that
            raised only on data), and the samples to quarantine now (a data
            diagnosis under ``quarantine``; a drop's are quarantined once
            its step is applied).
        """
        if findings is None:
            data = report is not None and report.kind == Kind.DATA
            samples = [Culprit(s) for s in report.samples] if data else []
        else:
            data, samples = data_culprits(event, findings)
        if self.drop:
            return data or not self.nonfinite_only, []
        return False, samples if self.quarantine and data else []

    def decide(self, answer: Answer) -> Decision:
        """The step's fate, from what the diagnosis found.

        * a forward that raised (``nonfinite_only``) for any reason but
          non-finite values, on any rank it raised on (a rank that only
          received the failure aside), propagates with the answer as a note;
        * ``DROP`` with nothing to drop (no sample singled out, the ranks
          could not agree, ``answer.drop`` is ``None``) is a ``SKIP``;
        * a forward under ``'warn'`` propagates, noted;
        * else ``action``.
        """
        message = '\n'.join(line for line in (
            self.event.message, answer.text(), self.escalate) if line)
        if self.nonfinite_only and not _nonfinite(answer):
            return Decision(Action.PROPAGATE, answer.text())
        action = self.action
        if action is Action.DROP and answer.drop is None:
            action = Action.SKIP
        if action is Action.PROPAGATE:
            return Decision(action, answer.text())
        return Decision(action, message)


def _nonfinite(answer: Answer) -> bool:
    """Whether non-finite values made a forward raise, on every rank it
    raised on (a rank that only received the failure aside)."""
    findings = answer.findings
    if findings is not None:
        return not any(f.raises and not received(f, findings)
                       for f in findings)
    return raised_by_nonfinite(answer.report)
