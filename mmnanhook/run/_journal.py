"""The run's incident journal, written as it goes: ``nan_journal.jsonl``.

A long run meets its incidents one at a time; the journal keeps them in the
work dir, so that ``mmnan inspect WORK_DIR`` can tell the whole story after
the run (after a crash too). Rank 0 writes it, once every rank's findings
are exchanged: one :class:`~mmnanhook.records.Incident` a line, appended
with one ``write`` of the whole line to a file opened ``O_APPEND`` (a
process killed between two writes leaves whole lines), and ``fsync``-ed
(incidents are rare: a node that goes down keeps them too).

Bounded: a run appends at most :data:`MAX_RUN_BYTES` of incidents (about
4,000 lines), each line at most :data:`MAX_LINE` bytes (a long cause or list
of samples is cut, ``more`` counting the samples left out). Past its share,
the run counts what it leaves out, by kind, in one ``omitted`` line written
when the count reaches 1, 2, 4, 8, ... and at its end: the last one holds
the total. A run's start, end and those summaries are always written, unless
the whole file has reached :data:`MAX_FILE_BYTES` (then nothing more is, and
the log says so once).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import os.path as osp
import time
from typing import Any, Iterable, List, Optional, Sequence

from ..records import (JOURNAL_FILE, Incident, IncidentKind, crash_reason,
                       in_flight, quarantined_name)

MAX_RUN_BYTES = 1 << 20
MAX_FILE_BYTES = 64 << 20
# Below the 4096-byte PIPE_BUF of Linux, the size an append is whole at on
# any filesystem a work dir is likely on.
MAX_LINE = 4000
# What a cut cause or reason keeps.
_CUT = 480


class Journal(object):
    """The journal of one run; :meth:`close` ends it.

    Args:
        path (str, optional): The journal file; ``None``: this process
            writes none (a rank but 0).
        run (str): The run (its timestamp).
        max_run_bytes (int): What the run may append, start, end and
            summaries aside.
        max_file_bytes (int): Beyond this size of the file, nothing more is
            appended.
        logger (logging.Logger, optional): Where a journal that cannot be
            written is said.
    """

    def __init__(self, path: Optional[str], run: str,
                 max_run_bytes: int = MAX_RUN_BYTES,
                 max_file_bytes: int = MAX_FILE_BYTES,
                 logger: Optional[logging.Logger] = None) -> None:
        self.path = path
        self.run = run
        self.max_run_bytes = max_run_bytes
        self.max_file_bytes = max_file_bytes
        self.logger = logger
        self.written = 0
        self.omitted = collections.Counter()
        self._summary_at = 1
        self._summarised = 0
        # How many of the quarantine's samples are journaled (its list only
        # grows): the rest are new.
        self._quarantined = 0
        self._fd = None
        if path is not None:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND |
                                   os.O_CREAT, 0o666)
            except OSError as error:
                self._stop('cannot be opened (%s)' % error)

    @property
    def writes(self) -> bool:
        """Whether this process writes the journal."""
        return self._fd is not None

    # -- the incidents -------------------------------------------------------

    def started(self, runner: Any, policy: str, dump_dir: str,
                quarantine: Any = None, world_size: int = 1) -> None:
        """The run begins (or resumes) at ``runner.iter``.

        Args:
            runner (Runner): In ``before_train``.
            policy (str): The hook's policy.
            dump_dir (str): Where its bundles go.
            quarantine (Quarantine, optional): The run's quarantine: what it
                holds now was journaled by the runs that quarantined it.
            world_size (int): Its ranks.
        """
        if quarantine is not None:
            self._quarantined = len(quarantine.samples)
        self._write(self._incident(
            IncidentKind.START, iter=runner.iter, epoch=runner.epoch,
            world_size=world_size, policy=policy,
            resume=bool(getattr(runner, '_resume', False)),
            log_dir=getattr(runner, 'log_dir', None),
            dump_dir=osp.abspath(dump_dir),
            quarantine_file=osp.abspath(quarantine.path)
            if quarantine is not None else None), framing=True)

    def crashed(self, flights: Iterable[Any]) -> None:
        """What earlier runs that died inside a step had in flight (their
        records, found at this run's start).

        Args:
            flights (list[Flight]): One per rank of a died run.
        """
        for flight in flights:
            self._write(self._incident(
                IncidentKind.CRASH, iter=flight.iter, epoch=flight.epoch,
                rank=flight.rank, died_run=flight.run,
                reason=crash_reason(flight.stack), samples=in_flight(flight)))

    def quarantined(self, samples: Sequence[Any]) -> None:
        """The samples of the run's quarantine not journaled yet.

        Args:
            samples (list[QuarantinedSample]): The quarantine's whole list.
        """
        if len(samples) < self._quarantined:
            self._quarantined = 0
        for sample in samples[self._quarantined:]:
            self._write(self._incident(
                IncidentKind.QUARANTINE, iter=sample.iter, epoch=sample.epoch,
                rank=sample.rank, source=sample.source, reason=sample.reason,
                samples=[quarantined_name(sample.file, sample.indices)]))
        self._quarantined = len(samples)

    def spiked(self, spikes: Iterable[Any], policy: Optional[str]) -> None:
        """Finite spikes of a step.

        Args:
            spikes (list[Spike]): Its spikes.
            policy (str, optional): The spike policy.
        """
        for spike in spikes:
            self._write(self._incident(
                IncidentKind.SPIKE, iter=spike.iter, series=spike.series,
                value=spike.value, factor=spike.factor, policy=policy))

    def triggered(self, event: Any, policy: str, answer: Any, act: str,
                  rewind_to: Optional[int] = None, lr: Optional[float] = None,
                  lr_factor: Optional[float] = None) -> None:
        """A trigger, and what became of its step.

        Args:
            event (NonFiniteEvent): The trigger.
            policy (str): The policy that handled it.
            answer (Answer): What carrying its plan out found: the report,
                every rank's finding (DDP), the bundle.
            act (str): What became of the step (one of
                :data:`~mmnanhook.records.ACTS`).
            rewind_to (int, optional): The snapshot a rewind went back to.
            lr (float, optional): The LR after the rewind.
            lr_factor (float, optional): The factor it was lowered by.
        """
        report = answer.report if answer is not None else None
        findings = (answer.findings if answer is not None else None) or ()
        kind = report.kind if report is not None else None
        if kind is None:
            kind = next((f.kind for f in findings if f.culprit), None)
        self._write(self._incident(
            IncidentKind.TRIGGER, iter=event.iter, epoch=event.epoch,
            policy=policy, trigger=str(event.trigger),
            diagnosis=str(kind) if kind is not None else None,
            cause=cause_of(event, answer), act=act,
            bundle=answer.bundle if answer is not None else None,
            ranks=list(event.bad_ranks), samples=_named(report, findings),
            rewind_to=rewind_to, lr=lr, lr_factor=lr_factor))

    def ended(self, iter: int, epoch: int, how: str) -> None:
        """The run ends: ``how`` (``'finished'``, or its error)."""
        if sum(self.omitted.values()) != self._summarised:
            self._summary()
        self._write(self._incident(IncidentKind.END, iter=iter, epoch=epoch,
                                   reason=how), framing=True)

    def close(self) -> None:
        """Stop writing (again: a no-op)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # -- writing -------------------------------------------------------------

    def _incident(self, kind, **fields):
        return Incident(kind, self.run, time=time.time(), **fields)

    def _write(self, incident: Incident, framing: bool = False) -> None:
        if self._fd is None:
            return
        data = _bounded(incident).encode('utf-8')
        if not framing and self.written + len(data) > self.max_run_bytes:
            self.omitted[incident.kind.value] += 1
            if sum(self.omitted.values()) >= self._summary_at:
                self._summary_at *= 2
                self._summary()
            return
        try:
            if os.fstat(self._fd).st_size + len(data) > self.max_file_bytes:
                self._stop('has reached %d bytes: nothing more is written '
                           'to it' % self.max_file_bytes)
                return
            os.write(self._fd, data)
            os.fsync(self._fd)
        except OSError as error:
            self._stop('cannot be written (%s)' % error)
            return
        if not framing:
            self.written += len(data)

    def _summary(self):
        self._summarised = sum(self.omitted.values())
        self._write(self._incident(IncidentKind.OMITTED,
                                   counts=dict(self.omitted)), framing=True)

    def _stop(self, why):
        self.close()
        if self.logger is not None:
            self.logger.warning('mmnanhook: the incident journal %s %s: '
                                '`mmnan inspect` will not know what this run '
                                'meets from now on' % (self.path, why))


def start_journal(runner: Any, writes: bool) -> Journal:
    """The journal of ``runner``'s run, in its work dir.

    Args:
        runner (Runner): In ``before_train``.
        writes (bool): Whether this process writes it (rank 0).
    """
    return Journal(osp.join(runner.work_dir, JOURNAL_FILE) if writes
                   else None,
                   str(getattr(runner, 'timestamp', None) or os.getpid()),
                   logger=runner.logger)


def cause_of(event: Any, answer: Any) -> str:
    """A trigger's named cause in one line: the report's summary; under
    DDP, on a rank that did not diagnose, the culprit rank's sample or
    error; else the event's message."""
    report = answer.report if answer is not None else None
    if report is not None and report.summary:
        return _first_line(report.summary)
    for finding in (answer.findings if answer is not None else None) or ():
        for sample in finding.samples:
            return 'rank %d: sample %s (%s)%s' % (
                finding.rank, sample.index, _name(sample) or 'no img_path',
                ''.join(': ' + p.text for p in sample.problems[:1]))
        if finding.error:
            return "rank %d's forward raised %s" % (
                finding.rank, _first_line(finding.error))
    return _first_line(event.message)


def _named(report, findings):
    """The samples a trigger's diagnosis names: every rank's culprits
    (DDP), else this rank's implicated samples."""
    named = [_name(s) for f in findings for s in f.samples]
    if not findings and report is not None:
        named = [_name(s) for s in report.samples]
    return [n for n in named if n]


def _name(sample):
    """A sample finding's file, else its dataset index in words."""
    index = getattr(sample, 'dataset_index', None)
    return sample.img_path or (None if index is None else
                               quarantined_name(None, [index]))


def _first_line(text):
    return (text or '').strip().split('\n', 1)[0]


def _bounded(incident: Incident) -> str:
    """The incident's line, within :data:`MAX_LINE` bytes: a long cause or
    reason cut, then the samples halved (``more`` counts those left out)."""
    line = incident.to_line()
    if len(line.encode('utf-8')) <= MAX_LINE:
        return line
    cut = dict((name, getattr(incident, name)[:_CUT] + '...')
               for name in ('cause', 'reason')
               if len(getattr(incident, name) or '') > _CUT)
    incident = dataclasses.replace(incident, **cut)
    samples: List[str] = list(incident.samples)
    more = incident.more or 0
    line = incident.to_line()
    while len(line.encode('utf-8')) > MAX_LINE and samples:
        kept = samples[:len(samples) // 2]
        more += len(samples) - len(kept)
        samples = kept
        incident = dataclasses.replace(incident, samples=samples, more=more)
        line = incident.to_line()
    return line
