"""What was in flight when a training process died: a record per step.

A process can die inside a step without any exception of Python's: a
signal in a C++ op (SIGSEGV), the OOM killer's SIGKILL. Nothing of the
run's own then says which samples it was training on. Each rank keeps one
small file, ``{work_dir}/nan_flight/{run}.rank{r}.rec``, rewritten before
every train step (its iteration, epoch, and each sample's dataset index
and image file where known) and marked done after it, and has ``faulthandler`` write the Python stack
of a fatal signal beside it (``.stack``), unless the process already has
it enabled elsewhere. A run that ends, by any path Python sees, deletes
its rank's files; the next run with the hook in that work dir (or ``mmnan
inspect WORK_DIR``) finds what a died run left: a step not marked done.
Under ``policy='drop'`` that run tries the step's samples one at a time
(:mod:`._trial`) and quarantines the one whose trial dies.

The record costs one ``pwrite`` before and one after each step (no fsync:
a process that dies leaves the page cache to the kernel, which writes it).
Two slots alternate, each with a sequence number and a CRC, so a process
killed mid-write leaves the previous record readable.
"""
from __future__ import annotations

import faulthandler
import glob
import json
import os
import os.path as osp
import struct
import time
import zlib
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence

from ..records import SampleId
from ._trial import try_alone

DIR_NAME = 'nan_flight'
_MAGIC = b'MMNANFL1'
# magic, sequence number, state, body length, body CRC.
_HEADER = struct.Struct('<8sQBII')
_STATE_AT = 16
_SLOT = 16384
_IN_STEP, _DONE = 0, 1


class Flight(NamedTuple):
    """The last step one rank of a run began.

    Args:
        run (str): The run (its timestamp).
        rank (int): The rank.
        pid (int): Its process.
        iter (int): The train iteration.
        epoch (int): Its epoch.
        files (list): Per sample of the batch, its image file (``None``
            where its metainfo has none).
        time (float): When the step began (``time.time()``).
        stack (str): What ``faulthandler`` wrote of a fatal signal (the
            Python stack of each thread); empty when nothing.
        indices (list, optional): Per sample, its dataset index (``None``
            where unknown); ``None`` for a record without them (written
            before they were recorded).
    """

    run: str
    rank: int
    pid: int
    iter: int
    epoch: int
    files: List[Optional[str]]
    time: float
    stack: str = ''
    indices: Optional[List[Optional[int]]] = None

    @property
    def samples(self) -> List[SampleId]:
        """Who each sample in flight was."""
        indices = list(self.indices or [])
        count = max(len(self.files), len(indices))
        indices += [None] * (count - len(indices))
        files = list(self.files) + [None] * (count - len(self.files))
        return [SampleId(i, f) for i, f in zip(indices, files)]

    def describe(self) -> str:
        """One line: where the process was and what it held."""
        files = ', '.join(_described(s) for s in self.samples) or \
            'no samples recorded'
        how = 'a fatal signal (the Python stack below)' if self.stack \
            else 'no Python exception (SIGKILL: the OOM killer, a job ' \
            'scheduler; or a signal without faulthandler)'
        return ('run %s, rank %d (pid %d) died in train iteration %d (epoch '
                '%d) by %s, with these samples in flight: %s' % (
                    self.run, self.rank, self.pid, self.iter, self.epoch,
                    how, files))


def flight_dir(work_dir: str) -> str:
    """``{work_dir}/nan_flight``."""
    return osp.join(work_dir, DIR_NAME)


class FlightRecorder(object):
    """The record of one rank of one run; :meth:`remove` ends it.

    Args:
        directory (str): Where it is written (:func:`flight_dir`).
        run (str): The run (every rank's same timestamp).
        rank (int): This rank.

    Raises:
        OSError: The directory cannot be written (the caller decides).
    """

    def __init__(self, directory: str, run: str, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        base = osp.join(directory, '%s.rank%d' % (run, rank))
        self.path, self.stack_path = base + '.rec', base + '.stack'
        self._meta = dict(run=run, rank=rank, pid=os.getpid())
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC,
                           0o666)
        self._seq = 0
        self._slot = None
        self._stack = None
        if not faulthandler.is_enabled():
            self._stack = open(self.stack_path, 'w')
            faulthandler.enable(self._stack, all_threads=True)

    def begin(self, iter: int, epoch: int,
              files: Optional[Iterable[Optional[str]]],
              indices: Optional[Sequence[Optional[int]]] = None) -> None:
        """Before a train step: what it trains on.

        Args:
            iter (int): The iteration.
            epoch (int): The epoch.
            files (list, optional): Per sample, its image file.
            indices (list, optional): Per sample, its dataset index.
        """
        files = list(files or [])
        body = self._body(iter, epoch, files, list(indices or []))
        self._seq += 1
        self._slot = self._seq % 2
        os.pwrite(self._fd, _HEADER.pack(_MAGIC, self._seq, _IN_STEP,
                                         len(body), zlib.crc32(body)) + body,
                  self._slot * _SLOT)

    def _body(self, iter, epoch, files, indices):
        record = dict(self._meta, iter=iter, epoch=epoch, time=time.time(),
                      files=files, indices=indices)
        body = json.dumps(record).encode()
        count = max(len(files), len(indices))
        while len(body) > _SLOT - _HEADER.size and count:
            # A bounded record: the samples that fit, and how many did not.
            count //= 2
            record['files'] = files[:count]
            record['indices'] = indices[:count]
            record['more'] = max(len(files), len(indices)) - count
            body = json.dumps(record).encode()
        return body

    def end(self) -> None:
        """After the step began by :meth:`begin`: it is done."""
        if self._slot is not None:
            os.pwrite(self._fd, bytes([_DONE]), self._slot * _SLOT + _STATE_AT)

    def remove(self) -> None:
        """The run ends alive: its record, and every earlier one of this
        rank in the directory (a died run's, reported at this run's start),
        are deleted. Again: a no-op."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        os.close(fd)
        if self._stack is not None:
            faulthandler.disable()
            self._stack.close()
            self._stack = None
        rank = '.rank%d.' % self._meta['rank']
        for path in glob.glob(osp.join(osp.dirname(self.path), '*' + rank +
                                       '*')):
            try:
                os.unlink(path)
            except OSError:
                pass


def _read_record(path):
    with open(path, 'rb') as f:
        data = f.read(2 * _SLOT)
    best = None
    for at in (0, _SLOT):
        header = data[at:at + _HEADER.size]
        if len(header) < _HEADER.size:
            continue
        magic, seq, state, length, crc = _HEADER.unpack(header)
        body = data[at + _HEADER.size:at + _HEADER.size + length]
        if magic != _MAGIC or len(body) != length or zlib.crc32(body) != crc:
            continue
        if best is None or seq > best[0]:
            best = (seq, state, body)
    return best


def read_flights(directory: str, but: Optional[str] = None) -> List[Flight]:
    """The steps that runs' processes died in, as their records left them.

    Args:
        directory (str): :func:`flight_dir` of a work dir.
        but (str, optional): A run to leave out (the one starting now).

    Returns:
        list[Flight]: One per rank whose last step was not marked done, in
        the order of their runs and ranks; a record that cannot be read
        (foreign, torn in both slots) is left out.
    """
    flights = []
    for path in sorted(glob.glob(osp.join(directory, '*.rec'))):
        try:
            found = _read_record(path)
        except OSError:
            continue
        if found is None or found[1] != _IN_STEP:
            continue
        try:
            record = json.loads(found[2].decode())
            indices = record.get('indices')
            flight = Flight(str(record['run']), int(record['rank']),
                            int(record['pid']), int(record['iter']),
                            int(record['epoch']), list(record['files']),
                            float(record['time']),
                            _stack(path[:-len('.rec')] + '.stack'),
                            None if indices is None else [
                                None if i is None else int(i)
                                for i in indices])
        except (ValueError, KeyError, TypeError):
            continue
        if flight.run != but:
            flights.append(flight)
    return sorted(flights, key=lambda f: (f.run, f.rank))


def _stack(path):
    try:
        with open(path) as f:
            return f.read(65536).strip()
    except OSError:
        return ''


def culprits(flights: List[Flight]) -> List[Flight]:
    """The flights whose process died of a fatal signal, if any has a
    stack; else every one (a SIGKILL says nothing of which rank it was).
    Under DDP the other ranks of a crashed one are killed by the launcher:
    their samples were only in flight."""
    fatal = [f for f in flights if f.stack]
    return fatal or list(flights)


def start_flight(runner: Any, quarantine: Any = None
                 ) -> Optional[FlightRecorder]:
    """Say what the runs that died in ``runner``'s work dir had in flight,
    quarantine it when asked, and start this rank's record.

    Args:
        runner (Runner): In ``before_train``.
        quarantine (Quarantine, optional): Where the samples of the step a
            run died in go (the policy's choice: ``'drop'``): of those of
            :func:`culprits`, the ones whose trial alone dies
            (:func:`~._trial.try_alone`), or all of them when none does,
            with source ``'crash'``.

    Returns:
        FlightRecorder | None: ``None`` when the work dir cannot be written
        (said in the log; training goes on without the record).
    """
    from mmengine.dist import get_dist_info
    directory = flight_dir(runner.work_dir)
    run = str(getattr(runner, 'timestamp', None) or os.getpid())
    flights = read_flights(directory, but=run)
    for flight in flights:
        runner.logger.warning('mmnanhook: ' + flight.describe() + (
            '\n' + flight.stack if flight.stack else ''))
    if quarantine is not None and flights:
        _quarantine(runner, quarantine, culprits(flights))
    try:
        return FlightRecorder(directory, run, get_dist_info()[0])
    except OSError as error:
        runner.logger.warning(
            'mmnanhook: no record of the samples in flight (%s): a process '
            'that dies inside a step will leave no trace of them' % error)
        return None


def _described(sample):
    if sample.index is None:
        return sample.file or '(no file name)'
    if sample.file is None:
        return 'dataset index %d' % sample.index
    return '%s (dataset index %d)' % (sample.file, sample.index)


class _InFlight(NamedTuple):
    """One sample of a step a process died in, and that step."""

    flight: Flight
    sample: SampleId


def _resolved(quarantine, sample):
    """``sample`` with its dataset index where only its file was recorded
    (a batch whose index stream was not seen, a record of an earlier
    version), and its file from its data info where it had none."""
    index, file = sample.index, sample.file
    if file is not None:
        # A dataset with data infos keys a sample by its file (an index
        # recorded for another file was drawn anew by the dataset).
        found = quarantine.indices_of(file)
        if found and index not in found:
            index = found[0]
    elif index is not None:
        file = quarantine.file_of(index)
    return SampleId(index, file)


def _quarantine(runner, quarantine, flights):
    logger = runner.logger
    in_flight, seen = [], set()
    for flight in flights:
        for sample in flight.samples:
            sample = _resolved(quarantine, sample)
            key = sample.index if sample.index is not None else sample.file
            if key is None:
                logger.warning(
                    'mmnanhook: a sample in flight in run %s has neither a '
                    'dataset index nor a file: it cannot be quarantined' %
                    flight.run)
                continue
            if key not in seen:
                seen.add(key)
                in_flight.append(_InFlight(flight, sample))
    if not in_flight:
        return
    chosen = _choose(runner, in_flight)
    added = []
    for flight, sample in chosen:
        reason = ('in flight when run %s died in train iteration %d' %
                  (flight.run, flight.iter))
        entry = quarantine.add(sample.file, reason, sample.index,
                               iter=flight.iter, epoch=flight.epoch,
                               rank=flight.rank, source='crash')
        if entry is not None:
            added.append(entry)
    if not added:
        return
    try:
        quarantine.save()
    except OSError as error:
        logger.warning('mmnanhook: the quarantine list is not written (%s): '
                       'quarantined in this run only' % error)
    for entry in added:
        logger.warning('mmnanhook: quarantined %s, in flight when the last '
                       'run died: never loaded again' % entry.describe())


def _choose(runner, in_flight):
    """The samples of a died step to quarantine: those whose trial alone
    dies (or whose input is not finite); all of them when none does, or
    when they cannot be tried (the log says why)."""
    logger = runner.logger
    if len(in_flight) < 2:
        return in_flight
    logger.warning(
        'mmnanhook: trying the %d samples in flight one at a time, each in '
        'a child process (loaded through the train pipeline, its input '
        'checked, its forward and backward run alone with the model), to '
        'find the one that killed the run' % len(in_flight))
    trials, why = try_alone(runner, [s for _, s in in_flight])
    if trials is None:
        logger.warning('mmnanhook: the samples in flight cannot be tried '
                       'alone: %s; all %d are quarantined' % (
                           why, len(in_flight)))
        return in_flight
    for trial in trials:
        logger.warning('mmnanhook: sample %s in flight, tried alone: %s' % (
            _described(trial.sample), trial.detail))
    culprit = [each for each, trial in zip(in_flight, trials)
               if trial.culprit]
    if culprit:
        return culprit
    logger.warning(
        'mmnanhook: none of the %d samples in flight died alone (a crash '
        'that needs the whole batch, or not the data\'s: the OOM killer, '
        'another process\'s signal): all of them are quarantined' %
        len(in_flight))
    return in_flight
