"""A trigger of a training run diagnosed where it happened, in two steps.

The trigger procedure (:mod:`mmnanhook.run`) asks with one
:class:`DiagnosisRequest` and gets one :class:`~mmnanhook.records.Diagnosis`
back from :meth:`Diagnostician.diagnose`: the micro-step found, the failing
one replayed with the run put back as it was after every replay, and what
this rank tells the others. Under DDP the procedure exchanges every rank's
finding; :meth:`Diagnostician.write` then completes the report with them,
logs it, writes the bundle (named in the run's state ledger), sends the
pictures to the visualizer and trims the heap.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import time
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from .._mmengine import unwrap_model
from ..records import (Diagnosis, Divergence, NonFiniteEvent, RankFinding,
                       Trigger)
from ..recovery import raised_by_nonfinite, rank_finding
from ..report import to_visualizer
from ._incident import conclude, examine
from ._local import local_replays
from ._micro import locate_micro_step
from ._own_step import member_key, own_train_step
from ._state import preserved_run


@dataclasses.dataclass(frozen=True)
class DiagnosisRequest(object):
    """One trigger's diagnosis, as the trigger procedure asks for it.

    Args:
        event (NonFiniteEvent): The trigger.
        history (list[dict]): The run's history records, the trigger's last.
        level (int): The log level of the diagnosis.
        rewind (bool): The policy goes back to a snapshot.
        diagnosers (tuple[int]): The ranks that replay it.
        together (bool): Every rank handles it (DDP): a diagnosis that
            fails is logged, and this rank still has a finding to give.
        divergence (Divergence, optional): The evidence of a divergence
            before it.
        collectives (list, optional): Under DDP, the collectives the step
            called and what each returned (``ForwardGuard.step_collectives``):
            the replays run on this rank alone, answered from them.
        wrapper (OptimWrapper, optional): The optim wrapper whose update
            step triggered (``None``: a forward or backward that raised):
            a model with its own ``train_step`` is replayed up to it.
    """

    event: NonFiniteEvent
    history: List[dict]
    level: int
    rewind: bool
    diagnosers: Tuple[int, ...]
    together: bool = False
    divergence: Optional[Divergence] = None
    collectives: Optional[Sequence] = None
    wrapper: Optional[Any] = None


class Diagnostician(object):
    """Diagnoses the triggers of one run where they happen.

    Args:
        runner (Runner): The runner.
        memory (StepMemory): The micro-steps kept since the last update.
        options (HookOptions): The hook's options.
        states (StateLedger): Which of the run's bundles hold a state.
        communicating (list[tuple]): Under DDP, the modules that communicate
            in their forward, made local in the replays.
        start_weight (float, optional): The largest ``|weight|`` training
            started from (exploding updates).
        config_findings (list[ConfigFinding]): What the config rules found
            in the run's config; a report names those that explain it.
        drop_refused (str, optional): Why ``policy='drop'`` only skips in
            this run (:func:`~mmnanhook.recovery.drop_unavailable`): the
            diagnosis proposes no drop then.
    """

    def __init__(self, runner: Any, memory: Any, options: Any, states: Any,
                 communicating: Iterable[Tuple[str, Any]] = (),
                 start_weight: Optional[float] = None,
                 config_findings: Iterable[Any] = (),
                 drop_refused: Optional[str] = None) -> None:
        self.runner = runner
        self.memory = memory
        self.options = options
        self.states = states
        self.communicating = list(communicating)
        self.start_weight = start_weight
        self.config_findings = list(config_findings)
        self.drop_refused = drop_refused

    def diagnose(self, request: DiagnosisRequest) -> Diagnosis:
        """Replay and diagnose the trigger where ``request`` says (this
        rank one of its diagnosers); no bundle yet.

        Returns:
            Diagnosis: The event (its failing micro-step found), this
            rank's finding and report, and what its bundle is written from.
        """
        event = request.event
        try:
            if event.rank in request.diagnosers:
                return self._examine(request)
        except Exception:  # noqa: BLE001 - the policy applies, every rank
            if not request.together:
                raise
            self.runner.logger.exception('mmnanhook: the diagnosis failed')
        return Diagnosis(event, _bare_finding(event))

    def write(self, request: DiagnosisRequest, diagnosis: Diagnosis,
              findings: Optional[Tuple[RankFinding, ...]] = None
              ) -> Diagnosis:
        """Complete the report (with every rank's ``findings`` under DDP),
        log it, write the bundle and name it in the run's state ledger.

        Returns:
            Diagnosis: ``diagnosis`` with ``findings`` and the bundle, its
            material let go.
        """
        runner, options, event = self.runner, self.options, diagnosis.event
        bundle = None
        try:
            if diagnosis.material is not None:
                bundle = self._write(request, diagnosis, findings)
        except Exception:  # noqa: BLE001 - the policy applies, every rank
            if not request.together:
                raise
            runner.logger.exception('mmnanhook: the bundle failed')
        report = diagnosis.report
        # Under DDP every rank records what the writer wrote (it cannot
        # know); alone, only a bundle written holds a state to name.
        if request.diagnosers and options.max_dumps and (
                findings is not None or bundle is not None):
            self.states.record(
                event, event.iter if event.iter is not None else runner.iter,
                findings, report.kind if report is not None else None,
                request.diagnosers)
        return dataclasses.replace(diagnosis, findings=findings,
                                   bundle=bundle, material=None)

    def _write(self, request, diagnosis, findings):
        """The report completed, logged, its pictures, the bundle: its
        path (``None``: none)."""
        runner, event, material = self.runner, diagnosis.event, \
            diagnosis.material
        with preserved_run(runner, unwrap_model(runner.model)):
            bundle, pictures = conclude(
                runner, event, diagnosis.report, material, request.history,
                self.options, request.level, findings, self.config_findings,
                self.states, request.diagnosers)
        to_visualizer(getattr(runner, 'visualizer', None), diagnosis.report,
                      pictures, event.iter, runner.logger)
        seconds = time.time() - material.start
        del material, pictures
        # What the diagnosis allocated is free now: give it back.
        _trim_heap()
        runner.logger.log(logging.INFO, 'mmnanhook: diagnosis and bundle '
                          'took %.2f s' % seconds)
        return bundle

    def _examine(self, request):
        runner, options, memory = self.runner, self.options, self.memory
        event = request.event
        if not options.replay and not options.max_dumps:
            return Diagnosis(event, _bare_finding(event))
        model = unwrap_model(runner.model)
        replays = contextlib.nullcontext if request.collectives is None \
            else functools.partial(local_replays, self.communicating,
                                   request.collectives)
        # A GAN steps two optim wrappers in its own train_step: replayed
        # through it, up to the one that failed.
        train_step = own_train_step(model, runner.optim_wrapper, member_key(
            runner.optim_wrapper, request.wrapper))
        # A replay leaves no trace: what it sets outside tensors (the
        # preprocessor's next input size, a head's last assignment, the
        # MessageHub's runtime info) is put back as the run had it.
        with preserved_run(runner, model):
            with replays():
                event = locate_micro_step(
                    event, model, memory.steps() if options.replay else [],
                    train_step)
            data_batch, rng_state = memory.get(event.fail_iter)
            if data_batch is None:
                runner.logger.error(
                    'mmnanhook: no batch kept for iteration %s: no replay '
                    'and no bundle' % (event.fail_iter, ))
                return Diagnosis(event, _bare_finding(event))
            report, material = examine(
                runner, event, data_batch, rng_state, request.history,
                options, request.divergence, self.start_weight,
                request.rewind, replays, memory.attributes(event.fail_iter),
                self.drop_refused, memory.indices(event.fail_iter),
                train_step)
        finding = rank_finding(
            event.rank, report if options.replay else None, data_batch,
            event.fail_iter, raises=_raises(event) and not raised_by_nonfinite(
                report), error=event.exception)
        return Diagnosis(event, finding, report, material=material)


def _raises(event):
    """Whether this rank's forward raised (an exception trigger)."""
    return event.trigger == Trigger.EXCEPTION and event.rank in event.bad_ranks


def _bare_finding(event):
    """The finding of a rank that did not diagnose: whether its forward
    raised, and with what (a rank whose forward raised and said nothing
    stops them all)."""
    return rank_finding(event.rank, iter=event.fail_iter,
                        raises=_raises(event), error=event.exception)


def _trim_heap():
    """Hand the heap pages freed since to the OS (glibc ``malloc_trim``).

    A diagnosis allocates several iterations' worth of activations and
    bundle buffers and frees them all; glibc keeps freed pages in its arenas,
    so the process's resident memory would stay at the diagnosis's peak.
    Elsewhere (no glibc) a no-op.
    """
    try:
        libc = ctypes.CDLL('libc.so.6')
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
