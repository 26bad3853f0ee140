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
decision, carried out on the step by the sentinel, and the quarantine of what
a drop left out once it is applied. It returns what became of the step.
"""
from __future__ import annotations

import traceback
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from .. import compat
from .._mmengine import is_ddp, unwrap_model
from ..diagnosis import diagnose_in_run, evidence_before
from ..errors import PeerForwardFailed
from ..records import NonFiniteEvent, Trigger
from ..recovery import (Action, Answer, Circumstances, Plan, drop_decision,
                        rank_finding)
from ..sentinel import Exchange, forward_event, is_out_of_memory


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
        states (StateLedger): Which of the run's bundles hold a model state.
        communicating (list[tuple]): The model's modules that communicate in
            their forward (DDP).
        config_findings (list[ConfigFinding]): What the config rules found
            in the run's config; a report names those that explain it.
        start_weight (float, optional): The largest ``|weight|`` training
            started from (exploding updates).
    """

    def __init__(self, run, states, communicating=(), config_findings=(),
                 start_weight=None):
        self.run = run
        self.states = states
        self.communicating = list(communicating)
        self.config_findings = list(config_findings)
        self.start_weight = start_weight

    # -- the entry points --------------------------------------------------

    def update_step(self, event: NonFiniteEvent, sentinel,
                    wrapper) -> Action:
        """A trigger of the update step (a spike that triggers included).

        Args:
            event (NonFiniteEvent): The trigger.
            sentinel (WrapperSentinel): The sentinel of ``wrapper``: it
                carries out the step's part of the decision.
            wrapper (OptimWrapper): The optim wrapper whose step it is.

        Returns:
            Action: What became of the step: ``APPLY`` (apply it as it is),
            ``SKIP`` or ``DROP`` (recomputed and applied); ``RAISE`` raises.
        """
        plan, found = self._plan(
            event, consecutive_skips=sentinel.check.consecutive_skips)
        event, answer = self._carry_out(plan, found)
        done = sentinel.carry_out(wrapper, event, plan.decide(answer),
                                  answer)
        if done is Action.DROP:
            # What the train step returns: the recomputed step's values.
            self.run.step.dropped = answer.drop
            self.run.quarantine.record(answer.drop.found, event, 'drop',
                                       self.run.logger)
        return done

    def backward_raised(self, event: NonFiniteEvent) -> str:
        """An exception raised in backward (it propagates whatever the
        policy): what the diagnosis adds to it."""
        plan, found = self._plan(event, in_backward=True)
        return self._carry_out(plan, found)[1].text()

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
                Exchange(ranks)(rank_finding(
                    ranks.rank, iter=event.iter, raises=True,
                    error='%s: %s' % (type(exc).__name__, exc)))
            return None
        event, answer = self._carry_out(plan, found)
        decision = plan.decide(answer)
        if decision.action is Action.PROPAGATE:
            if decision.message:
                compat.add_exception_note(exc, decision.message)
            return None
        # The frames' locals hold the failed forward's activations.
        traceback.clear_frames(exc.__traceback__)
        if decision.action is Action.RAISE:
            raise decision.error(event, answer)
        if decision.action is Action.DROP:
            micro = run.micro_buffers or run.buffers
            taken = run.dropper.again(answer.drop, run.memory.steps(),
                                      train_step, sentinel,
                                      getattr(micro, 'restore', None))
            if taken is not None:
                outputs, applied = taken
                if applied:
                    run.quarantine.record(answer.drop.found, event, 'drop',
                                          run.logger)
                return outputs
            # Taken again, it raised on a rank: every rank skips it.
        sentinel.skip(run.handle.wrappers,
                      undo=getattr(run.buffers, 'restore', None))
        return {}

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

    # -- carrying it out -----------------------------------------------------

    def _carry_out(self, plan: Plan,
                   history: _History) -> Tuple[NonFiniteEvent, Answer]:
        """Every part of ``plan`` but the step's fate, in its order.

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
        found = diagnose_in_run(
            run.runner, event, run.memory, history.records, run.options,
            plan.level, plan.rewind_to is not None, plan.diagnosers,
            ranks=run.ranks if event.shared else None,
            collectives=guard.step_collectives() if guard else None,
            communicating=self.communicating, states=self.states,
            divergence=history.evidence, start_weight=self.start_weight,
            config_findings=self.config_findings)
        event, report, findings = found.event, found.report, found.findings
        prepare, quarantine = plan.after_diagnosis(event, report, findings)
        drop = self._drop(event, report, findings) if prepare else None
        if quarantine:
            run.quarantine.record(quarantine, event, plan.policy, run.logger)
        if plan.rewind_to is not None:
            run.rewound_at = run.rewinder.go_back(
                plan.rewind_to, unwrap_model(run.runner.model),
                run.handle.wrappers, run.handle.sentinels)
        return event, Answer(bundle=found.bundle, report=report, drop=drop,
                             findings=findings)

    def _drop(self, event, report, findings):
        """The step to recompute without the samples the diagnosis singles
        out (alone), or this rank's part of the drop every rank takes (DDP);
        ``None`` when none can be made (said in the log)."""
        run = self.run
        memory, undo = run.memory, run.buffers.restore
        if findings is None:
            return run.dropper.plan(event, report, memory, undo)
        decision = drop_decision(
            findings, event.world_size,
            run.forward_guard.communicates(self.communicating),
            is_ddp(run.runner.model))
        if decision.reason is not None:
            # The same on every rank: it says why.
            return run.dropper.plan(event, None, memory, undo, decision)
        try:
            mine = run.dropper.plan(event, None, memory, undo, decision)
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


def _weights_broken(model):
    # Failure path: a sync per parameter is fine here.
    return any(not bool(torch.isfinite(p).all()) for p in model.parameters())
