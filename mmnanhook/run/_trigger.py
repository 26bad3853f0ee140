"""One trigger of a run, from its plan to what became of the step.

:class:`TriggerProcedure` is the one place a trigger is carried out. It
gathers what is known when the trigger fires (:class:`~mmnanhook.recovery.
Circumstances`: did something diverge, where a rewind would go back to, the
limits so far), asks the policy once for the :class:`~mmnanhook.recovery.
Plan`, and carries it out in the plan's order, calling each room below it:
the log line; the buffers put back (:mod:`~mmnanhook.sentinel`); the replay
and the bundle (:mod:`~mmnanhook.diagnosis`, :mod:`~mmnanhook.bundle`); under
DDP the exchange of every rank's finding; the drop prepared or the samples
quarantined (:mod:`~mmnanhook.quarantine`); the rewind; then the plan's
decision, carried out by :func:`~mmnanhook.recovery.carry_out` on the update
step (:class:`~mmnanhook.sentinel.UpdateStep`) or on the train step whose
forward raised (:class:`_ForwardStep`), and the quarantine of what a drop
left out once it is applied.
"""
from __future__ import annotations

import functools
import traceback
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Tuple

import torch

from .. import compat
from .._mmengine import is_ddp, unwrap_model
from ..diagnosis import Diagnostician, DiagnosisRequest, evidence_before
from ..errors import NonFiniteError, PeerForwardFailed
from ..records import NonFiniteEvent, Trigger
from ..recovery import (Answer, Circumstances, Plan, Step, carry_out,
                        drop_decision, rank_finding)
from ..sentinel import (Recomputation, UpdateStep, forward_event,
                        is_out_of_memory)


class _History(NamedTuple):
    """The run's history up to a trigger: its records (the trigger's last)
    and the evidence of a divergence before it, or ``None``."""

    records: List[dict]
    evidence: Optional[dict]


class TriggerProcedure(object):
    """Carries out the plan of every trigger of one run.

    Args:
        run (HookRun): The run: its parts (ranks, snapshots, the dropper,
            the quarantine) and what it kept of the current step.
        diagnostician (Diagnostician): Diagnoses the run's triggers.
        communicating (list[tuple]): The model's modules that communicate in
            their forward (DDP).
    """

    def __init__(self, run: Any, diagnostician: Diagnostician,
                 communicating: Iterable[Tuple[str, Any]] = ()) -> None:
        self.run = run
        self.diagnostician = diagnostician
        self.communicating = list(communicating)

    # -- the entry points --------------------------------------------------

    def update_step(self, event: NonFiniteEvent, step: UpdateStep) -> None:
        """A trigger of the update step (a spike that triggers included),
        carried out on ``step``.

        Args:
            event (NonFiniteEvent): The trigger.
            step (UpdateStep): The update step of the optim wrapper.
        """
        plan, found = self._plan(
            event,
            consecutive_skips=step.sentinel.check.consecutive_skips)
        event, answer = self._prepare(plan, found, step.wrapper)
        self._carry_out(plan, event, answer, step,
                        functools.partial(self._dropped, event))

    def _dropped(self, event: NonFiniteEvent, drop: Recomputation) -> None:
        """An update step recomputed without samples is applied."""
        # What the train step returns: the recomputed step's values.
        self.run.step.dropped = drop
        self._quarantine_drop(event, drop)

    def _quarantine_drop(self, event: NonFiniteEvent,
                         drop: Recomputation) -> None:
        run = self.run
        run.quarantine.record(drop.found, event, 'drop', run.logger)

    def backward_raised(self, event: NonFiniteEvent) -> str:
        """An exception raised in backward (it propagates whatever the
        policy): what the diagnosis adds to it."""
        plan, found = self._plan(event, in_backward=True)
        event, answer = self._prepare(plan, found)
        self._note(plan, event, answer, 'propagate')
        return answer.text()

    def forward_raised(self, exc: Exception,
                       train_step: Callable) -> Optional[dict]:
        """A train step whose forward raised (on this rank or, under DDP,
        on another).

        Args:
            exc (Exception): What the forward raised (``PeerForwardFailed``
                on a rank whose own forward went fine).
            train_step (callable): ``batch -> outputs``: the model's own
                ``train_step`` with the loop's other arguments.

        Returns:
            dict | None: The outputs of the step skipped (empty) or taken
            again (``'drop'``); ``None``: re-raise ``exc``.
        """
        run = self.run
        ranks, sentinel = run.ranks, run.sentinel
        peer = isinstance(exc, PeerForwardFailed)
        if run.forward_guard is not None:
            # The others may wait in a collective of this forward first.
            run.forward_guard.abandon(not peer)
        # Every rank votes once, before anything else: the others wait in it.
        failed = exc.ranks if peer else (
            ranks.vote(True) if ranks is not None else None)
        event = forward_event(run.runner.iter, run.runner.epoch, exc, failed,
                              ranks is not None)
        plan, found = self._plan(
            event, consecutive_skips=sentinel.check.consecutive_skips,
            replays=peer or run.options.replay,
            out_of_memory=not peer and is_out_of_memory(exc))
        if not plan.diagnose:
            if ranks is not None:
                # Every rank stops: this one re-raises, the others learn why.
                ranks.exchange(rank_finding(
                    ranks.rank, iter=event.iter, raises=True,
                    error='%s: %s' % (type(exc).__name__, exc)))
            self._note(plan, event, None, 'propagate')
            return None
        event, answer = self._prepare(plan, found)
        step = _ForwardStep(run, exc, train_step)
        self._carry_out(plan, event, answer, step,
                        functools.partial(self._quarantine_drop, event))
        return step.outputs

    # -- what became of the step, in the journal ------------------------------

    def _carry_out(self, plan: Plan, event: NonFiniteEvent, answer: Answer,
                   step: Step, dropped: Callable) -> None:
        """The plan's decision carried out on ``step``; the trigger noted
        in the run's journal with what became of the step (a raise too)."""
        try:
            action = carry_out(plan.decide(answer), event, answer, step,
                               dropped=dropped)
        except NonFiniteError:
            self._note(plan, event, answer, 'raise')
            raise
        self._note(plan, event, answer, action.value)

    def _note(self, plan: Plan, event: NonFiniteEvent,
              answer: Optional[Answer], act: str) -> None:
        """The trigger in the journal, then the samples it quarantined."""
        run = self.run
        rewind = {}
        if plan.rewind_to is not None and run.rewound_at is not None:
            # The step is left out and the state put back: a rewind.
            act, factor = 'rewind', run.rewinder.factor
            groups = run.handle.wrappers[0].optimizer.param_groups
            rewind = dict(rewind_to=run.rewound_at, lr_factor=factor,
                          lr=groups[0]['lr'] * factor if groups else None)
        run.journal.triggered(event, plan.policy, answer, act, **rewind)
        if run.quarantine is not None:
            run.journal.quarantined(run.quarantine.samples)

    # -- the plan ------------------------------------------------------------

    def _plan(self, event: NonFiniteEvent,
              **known) -> Tuple[Plan, _History]:
        """The trigger's plan, from what is known now; and the run's
        history up to it, with the evidence of a divergence before it."""
        run = self.run
        records = run.history.records() + [run.event_record(event)]
        evidence = evidence_before(
            event, records, run.spike_detector, run.options.check.spike_window,
            run.spike_norms,
            run.rewinder.store if run.rewinder is not None else None,
            run.param_norms)
        ranks = run.ranks if event.shared else None
        if run.rewinder is not None:
            known.update(self._rewind_known(event, evidence, ranks))
        plan = run.policy.plan(Circumstances(
            event, together=ranks is not None, **known))
        return plan, _History(records, evidence)

    def _rewind_known(self, event, evidence, ranks):
        """Whether something diverged before ``event`` (on any rank), and
        where a rewind would go back to."""
        run = self.run
        diverged = evidence is not None or _weights_broken(
            unwrap_model(run.runner.model))
        if ranks is not None:
            diverged = bool(ranks.reduce(diverged, 'max'))
        if not diverged:
            return {}
        snapshot, why = run.rewinder.target(
            evidence.began_at if evidence is not None else event.iter, ranks)
        return dict(diverged=True, no_rewind=why,
                    rewind_to=snapshot.iter if snapshot is not None else None,
                    consecutive_rewinds=run.rewinder.consecutive)

    # -- what comes before the step's fate ------------------------------------

    def _prepare(self, plan: Plan, history: _History,
                 wrapper: Optional[Any] = None
                 ) -> Tuple[NonFiniteEvent, Answer]:
        """Every part of ``plan`` but the step's fate, in its order: what
        :func:`~mmnanhook.recovery.carry_out` then decides the fate with.

        Args:
            plan (Plan): The trigger's plan.
            history (_History): The run's history records and evidence.
            wrapper (OptimWrapper, optional): The optim wrapper whose
                update step triggered (the diagnosis of a model with its
                own train_step replays up to it).

        Returns:
            tuple: The event (its failing micro-step found) and the
            :class:`~mmnanhook.recovery.Answer`.
        """
        run = self.run
        event = plan.event
        message = event.message
        if event.forward_traceback:
            message += ('\nForward call that caused it (anomaly mode):\n' +
                        event.forward_traceback)
        run.logger.log(plan.level, 'mmnanhook: ' + message)
        if event.trigger != Trigger.SPIKE:
            run.step.triggered = True
        if plan.undo:
            run.buffers.restore()
        guard = run.forward_guard
        ranks = run.ranks if event.shared else None
        request = DiagnosisRequest(
            event, history.records, plan.level, plan.rewind_to is not None,
            plan.diagnosers, together=ranks is not None,
            divergence=history.evidence,
            collectives=guard.step_collectives() if guard else None,
            wrapper=wrapper)
        diagnosis = self.diagnostician.diagnose(request)
        # Once on every rank, whatever the diagnosis did: the others wait
        # in it.
        findings = tuple(ranks.exchange(diagnosis.finding)) \
            if ranks is not None else None
        diagnosis = self.diagnostician.write(request, diagnosis, findings)
        event, report = diagnosis.event, diagnosis.report
        prepare, quarantine = plan.after_diagnosis(event, report, findings)
        drop = self._drop(event, report, findings) if prepare else None
        if quarantine:
            run.quarantine.record(quarantine, event, plan.policy, run.logger)
        if plan.rewind_to is not None:
            run.rewound_at = run.rewinder.go_back(
                plan.rewind_to, unwrap_model(run.runner.model),
                run.handle.wrappers, run.handle.sentinels)
        return event, Answer(bundle=diagnosis.bundle, report=report,
                             drop=drop, findings=findings)

    def _drop(self, event, report, findings):
        """The step to recompute without the samples the diagnosis singles
        out (alone), or this rank's part of the drop every rank takes (DDP);
        ``None`` when none can be made (said in the log)."""
        run = self.run
        memory, undo = run.memory, run.buffers.restore
        if findings is None:
            return run.dropper.prepare(event, report, memory, undo)
        decision = drop_decision(
            findings, event.world_size,
            run.forward_guard.communicates(self.communicating),
            is_ddp(run.runner.model))
        if decision.reason is not None:
            # The same on every rank: it says why.
            return run.dropper.prepare(event, None, memory, undo, decision)
        try:
            mine = run.dropper.prepare(event, None, memory, undo, decision)
        except Exception:  # noqa: BLE001 - every rank must learn it
            run.logger.exception("mmnanhook: policy 'drop': this rank's "
                                 'part could not be prepared')
            mine = None
        if not run.ranks.reduce(mine is not None, 'min'):
            run.logger.warning("mmnanhook: policy 'drop': a rank could not "
                               'prepare its part of the step: every rank '
                               'skips it')
            return None
        return mine


class _ForwardStep(Step):
    """A train step whose forward raised, as a trigger's decision acts on
    it.

    Args:
        run (HookRun): The run.
        exc (Exception): What the forward raised.
        train_step (callable): ``batch -> outputs``: the model's own
            ``train_step`` with the loop's other arguments.

    Attributes:
        outputs (dict | None): What the train step returns once the
            decision is carried out (``None``: re-raise ``exc``).
    """

    def __init__(self, run: Any, exc: Exception,
                 train_step: Callable) -> None:
        self.run = run
        self.exc = exc
        self.train_step = train_step
        self.outputs = None

    def propagate(self, note: str) -> None:
        if note:
            compat.add_exception_note(self.exc, note)

    def stop(self) -> None:
        self._let_go()

    def leave_out(self, undo: Optional[Callable[[], None]]) -> None:
        # Nothing of a raising forward reached backward: what it wrote is
        # put back whatever the drop's undo.
        self._let_go()
        run = self.run
        run.sentinel.skip(run.handle.wrappers,
                          undo=getattr(run.buffers, 'restore', None))
        self.outputs = {}

    def recompute(self, drop: Recomputation) -> Optional[bool]:
        self._let_go()
        run = self.run
        micro = run.micro_buffers or run.buffers
        taken = run.dropper.again(drop, run.memory.steps(), self.train_step,
                                  run.sentinel,
                                  getattr(micro, 'restore', None))
        if taken is None:
            # Taken again, it raised on a rank: every rank skips it.
            return None
        self.outputs, applied = taken
        return applied

    def _let_go(self):
        # The frames' locals hold the failed forward's activations.
        traceback.clear_frames(self.exc.__traceback__)


def _weights_broken(model):
    # Failure path: a sync per parameter is fine here.
    return any(not bool(torch.isfinite(p).all()) for p in model.parameters())
