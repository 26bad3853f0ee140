"""A trigger of a training run diagnosed where it happened, in one call.

The trigger procedure (:mod:`mmnanhook.run`) hands over what the run kept
(the batches and RNG states of the update step's micro-steps, the history)
and which ranks diagnose, and gets back :class:`Diagnosed`: the micro-step
found, the failing one replayed with the run put back as it was after every
replay, the bundle written (and named in the run's state ledger), the
pictures sent to the visualizer, the heap trimmed; under DDP every rank's
finding, exchanged once on every rank whatever the diagnosis did.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from .._mmengine import unwrap_model
from ..records import NonFiniteEvent, RankFinding, Report, Trigger
from ..recovery import rank_finding
from ..report import to_visualizer
from ..sentinel import Exchange
from ._incident import handle_incident
from ._local import local_replays
from ._micro import locate_micro_step
from ._state import preserved_run


class Diagnosed(NamedTuple):
    """What a trigger's diagnosis in the run came to.

    Args:
        event (NonFiniteEvent): The trigger, its failing micro-step found.
        report (Report, optional): This rank's diagnosis.
        findings (tuple[RankFinding], optional): Under DDP, every rank's.
        bundle (str, optional): The bundle this rank wrote.
    """

    event: NonFiniteEvent
    report: Optional[Report] = None
    findings: Optional[Tuple[RankFinding, ...]] = None
    bundle: Optional[str] = None


def diagnose_in_run(runner, event: NonFiniteEvent, memory,
                    history: List[dict], options, level: int, rewind: bool,
                    diagnosers: Sequence[int], ranks=None,
                    collectives: Optional[Sequence] = None,
                    communicating: Sequence = (), states=None,
                    **incident) -> Diagnosed:
    """Diagnose ``event`` of the run where ``diagnosers`` say, write its
    bundle, and under DDP exchange every rank's finding.

    Args:
        runner (Runner): The runner.
        event (NonFiniteEvent): The trigger.
        memory (StepMemory): The micro-steps kept since the last update.
        history (list[dict]): The run's history records, the trigger's last.
        options (HookOptions): The hook's options.
        level (int): The log level of the diagnosis.
        rewind (bool): The policy goes back to a snapshot.
        diagnosers (list[int]): The ranks that replay it.
        ranks (Ranks, optional): Under DDP, when every rank handles it:
            they exchange their findings, once each, whatever the diagnosis
            did (one that fails is logged; the policy still applies).
        collectives (list, optional): Under DDP, the collectives the step
            called and what each returned (``ForwardGuard.step_collectives``):
            the replays run on this rank alone, answered from them.
        communicating (list[tuple]): Under DDP, the modules that communicate
            in their forward, made local in the replays.
        states (StateLedger): Which of the run's bundles hold a state.
        **incident: The rest of :func:`~._incident.handle_incident`'s
            arguments (``divergence``, ``start_weight``, ...).
    """
    exchange = Exchange(ranks) if ranks is not None else None
    found = None
    try:
        if event.rank in diagnosers:
            event, found = _incident(
                runner, event, memory, history, options, level, rewind,
                collectives, communicating, exchange=exchange, states=states,
                diagnosers=diagnosers, **incident)
    except Exception:  # noqa: BLE001 - the policy applies, on every rank
        if ranks is None:
            raise
        runner.logger.exception('mmnanhook: the diagnosis failed')
    findings = None
    if exchange is not None:
        # Once on every rank, whatever the diagnosis did; a rank whose
        # forward raised and said nothing stops them all.
        raises = (event.trigger == Trigger.EXCEPTION
                  and event.rank in event.bad_ranks)
        findings = tuple(exchange(rank_finding(
            event.rank, iter=event.fail_iter, raises=raises,
            error=event.exception)))
    report = found.report if found is not None else None
    bundle = found.bundle if found is not None else None
    # Under DDP every rank records what the writer wrote (it cannot know);
    # alone, only a bundle written holds a state to name.
    if diagnosers and options.max_dumps and (findings is not None
                                             or bundle is not None):
        states.record(event, event.iter if event.iter is not None else
                      runner.iter, findings,
                      report.kind if report is not None else None,
                      diagnosers)
    return Diagnosed(event, report, findings, bundle)


def _incident(runner, event, memory, history, options, level, rewind,
              collectives, communicating, **incident):
    """The replays and the bundle of this rank: ``(event, Incident)``."""
    if not options.replay and not options.max_dumps:
        return event, None
    model = unwrap_model(runner.model)
    replays: Callable = contextlib.nullcontext if collectives is None else \
        functools.partial(local_replays, communicating, collectives)
    # A replay leaves no trace: what it sets outside tensors (the
    # preprocessor's next input size, a head's last assignment, the
    # MessageHub's runtime info) is put back as the run had it.
    with preserved_run(runner, model):
        with replays():
            event = locate_micro_step(
                event, model, memory.steps() if options.replay else [])
        data_batch, rng_state = memory.get(event.fail_iter)
        if data_batch is None:
            runner.logger.error(
                'mmnanhook: no batch kept for iteration %s: no replay and no '
                'bundle' % (event.fail_iter, ))
            return event, None
        found = handle_incident(
            runner, event, data_batch, rng_state, history, options,
            level=level, rewind=rewind, replays=replays,
            start_attributes=memory.attributes(event.fail_iter), **incident)
    to_visualizer(getattr(runner, 'visualizer', None), found.report,
                  found.pictures, event.iter, runner.logger)
    # What the diagnosis allocated is free now: give it back.
    _trim_heap()
    runner.logger.log(logging.INFO, 'mmnanhook: diagnosis and bundle took '
                      '%.2f s' % found.seconds)
    return event, found


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
