"""What was in flight when a training process died: a record per step.

A process can die inside a step without any exception of Python's: a
signal in a C++ op (SIGSEGV), the OOM killer's SIGKILL. Nothing of the
run's own then says which samples it was training on. Each rank keeps one
small file, ``{work_dir}/nan_flight/{run}.rank{r}.rec``, rewritten before
every train step (its iteration, epoch and the image file of each sample)
and marked done after it, and has ``faulthandler`` write the Python stack
of a fatal signal beside it (``.stack``), unless the process already has
it enabled elsewhere. A run that ends, by any path Python sees, deletes
its rank's files; the next run with the hook in that work dir (or ``mmnan
inspect WORK_DIR``) finds what a died run left: a step not marked done.

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
from typing import Any, Iterable, List, NamedTuple, Optional

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
    """

    run: str
    rank: int
    pid: int
    iter: int
    epoch: int
    files: List[Optional[str]]
    time: float
    stack: str = ''

    def describe(self) -> str:
        """One line: where the process was and what it held."""
        files = ', '.join(f or '(no file name)' for f in self.files) or \
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
              files: Optional[Iterable[Optional[str]]]) -> None:
        """Before a train step: what it trains on.

        Args:
            iter (int): The iteration.
            epoch (int): The epoch.
            files (list, optional): Per sample, its image file.
        """
        files = list(files or [])
        body = self._body(iter, epoch, files)
        self._seq += 1
        self._slot = self._seq % 2
        os.pwrite(self._fd, _HEADER.pack(_MAGIC, self._seq, _IN_STEP,
                                         len(body), zlib.crc32(body)) + body,
                  self._slot * _SLOT)

    def _body(self, iter, epoch, files):
        record = dict(self._meta, iter=iter, epoch=epoch, time=time.time(),
                      files=files)
        body = json.dumps(record).encode()
        while len(body) > _SLOT - _HEADER.size and record['files']:
            # A bounded record: the files that fit, and how many did not.
            record['files'] = record['files'][:len(record['files']) // 2]
            record['more'] = len(files) - len(record['files'])
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
            flight = Flight(str(record['run']), int(record['rank']),
                            int(record['pid']), int(record['iter']),
                            int(record['epoch']), list(record['files']),
                            float(record['time']),
                            _stack(path[:-len('.rec')] + '.stack'))
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
            run died in go (the policy's choice: ``'drop'``); those of
            :func:`culprits`, with source ``'crash'``.

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
        _quarantine(quarantine, culprits(flights), runner.logger)
    try:
        return FlightRecorder(directory, run, get_dist_info()[0])
    except OSError as error:
        runner.logger.warning(
            'mmnanhook: no record of the samples in flight (%s): a process '
            'that dies inside a step will leave no trace of them' % error)
        return None


def _quarantine(quarantine, flights, logger):
    added = []
    for flight in flights:
        for file in flight.files:
            reason = ('in flight when run %s died in train iteration %d' %
                      (flight.run, flight.iter))
            sample = quarantine.add(file, reason, iter=flight.iter,
                                    epoch=flight.epoch, rank=flight.rank,
                                    source='crash') if file else None
            if sample is not None:
                added.append(sample)
    if not added:
        return
    try:
        quarantine.save()
    except OSError as error:
        logger.warning('mmnanhook: the quarantine list is not written (%s): '
                       'quarantined in this run only' % error)
    for sample in added:
        logger.warning('mmnanhook: quarantined %s (dataset index %s), in '
                       'flight when the last run died: never loaded again' %
                       (sample.file, ', '.join(map(str, sample.indices))))
