"""``nan_quarantine.json``: the samples a run must never load again.

One entry per sample: every index of the train dataset that loads it (a
``RepeatDataset`` or ``ConcatDataset`` may hold it more than once), its
image file when one is known (from its data info, or its metainfo: a label
where the dataset has no data infos), why it was quarantined, and where::

    {"format": "mmnanhook-quarantine", "version": 1,
     "samples": [{"file": "data/coco/train2017/000123.jpg", "indices": [122],
                  "reason": "the annotation declares the image 640x320 ...",
                  "iter": 3, "epoch": 0, "rank": 0, "source": "drop"}]}

``mmnan scan CONFIG --quarantine OUT`` writes the same format (``source``
``"scan"``), so a reviewed list can start a run (``quarantine=PATH``).
Written atomically (a temporary file renamed over the old one), readable
as the rest of the work dir (its mode from the umask). A fresh run never
overwrites an earlier run's list: it is kept beside it (:func:`keep_previous`).
"""
from __future__ import annotations

import json
import logging
import os
import os.path as osp
import tempfile
import time
import uuid
from typing import Any, Dict, Iterable, List, Optional

from .._log import log

FORMAT = 'mmnanhook-quarantine'
VERSION = 1
FILE_NAME = 'nan_quarantine.json'


class QuarantineError(ValueError):
    """A quarantine file that cannot be used: names the file and why."""


class QuarantinedSample(object):
    """One sample a run never loads again.

    Args:
        indices (list[int]): Indices of the train dataset that load it.
        file (str, optional): Its image file.
        reason (str): Why it was quarantined.
        iter (int, optional): The iteration it failed in.
        epoch (int, optional): The epoch.
        rank (int, optional): The rank whose batch held it.
        source (str): ``'drop'``, ``'skip'``, ``'rewind'``, ``'scan'`` or
            ``'crash'`` (in flight when a run's process died:
            :mod:`._flight`).
    """

    __slots__ = ('indices', 'file', 'reason', 'iter', 'epoch', 'rank',
                 'source')

    def __init__(self, indices: Iterable[int], file: Optional[str] = None,
                 reason: str = '', iter: Optional[int] = None,
                 epoch: Optional[int] = None, rank: Optional[int] = None,
                 source: str = 'drop') -> None:
        self.indices = sorted(set(int(i) for i in indices))
        self.file = file
        self.reason = reason
        self.iter = iter
        self.epoch = epoch
        self.rank = rank
        self.source = source

    def to_dict(self) -> Dict[str, Any]:
        return dict((k, getattr(self, k)) for k in self.__slots__)

    def describe(self) -> str:
        """Its file and dataset indices, in words."""
        indices = 'dataset index %s' % ', '.join(map(str, self.indices))
        return '%s (%s)' % (self.file, indices) if self.file else indices

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> QuarantinedSample:
        return cls(**dict((k, data[k]) for k in cls.__slots__ if k in data))

    def __repr__(self):
        return 'QuarantinedSample(%s)' % ', '.join(
            '%s=%r' % (k, getattr(self, k)) for k in self.__slots__)


def read_quarantine(path: str, dataset_length: Optional[int] = None
                    ) -> List[QuarantinedSample]:
    """The samples of a quarantine file.

    Args:
        path (str): The file.
        dataset_length (int, optional): Length of the train dataset; an
            index outside it is an error.

    Returns:
        list[QuarantinedSample]

    Raises:
        QuarantineError: Naming ``path``: unreadable, not JSON, not this
            format, or an index that is not one of the dataset.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        raise QuarantineError('quarantine file %s cannot be read: %s: %s' %
                              (path, type(error).__name__, error))
    if not isinstance(data, dict) or data.get('format') != FORMAT:
        raise QuarantineError(
            'quarantine file %s is not an mmnanhook quarantine list (no '
            '"format": "%s")' % (path, FORMAT))
    if data.get('version') != VERSION:
        raise QuarantineError('quarantine file %s has version %r; this '
                              'mmnanhook reads version %d' %
                              (path, data.get('version'), VERSION))
    samples = []
    for n, entry in enumerate(data.get('samples') or []):
        indices = entry.get('indices') if isinstance(entry, dict) else None
        if (not isinstance(indices, list) or not indices or not all(
                isinstance(i, int) and not isinstance(i, bool)
                for i in indices)):
            raise QuarantineError(
                'quarantine file %s: sample #%d has no list of integer '
                '"indices"' % (path, n))
        bad = [i for i in indices if i < 0 or (
            dataset_length is not None and i >= dataset_length)]
        if bad:
            raise QuarantineError(
                'quarantine file %s: sample #%d names index %d, outside the '
                'train dataset (%s samples)' % (
                    path, n, bad[0], dataset_length
                    if dataset_length is not None else 'no negative'))
        samples.append(QuarantinedSample.from_dict(entry))
    return samples


def write_quarantine(path: str,
                     samples: Iterable[QuarantinedSample]) -> None:
    """Write ``samples`` to ``path`` atomically.

    Raises:
        OSError: The directory is not writable (the caller decides).
    """
    write_json_atomically(path, dict(
        format=FORMAT, version=VERSION,
        samples=[s.to_dict() for s in samples]))


def write_json_atomically(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path``: whole or not at all (a temporary
    file in the same directory, fsynced, renamed over ``path``).

    Raises:
        OSError: The directory is not writable (the caller decides).
    """
    tmp = osp.join(osp.dirname(osp.abspath(path)), '.%s.%s' % (
        osp.basename(path), uuid.uuid4().hex))
    # Not mkstemp: its 0600 would hide the list from whoever reads the work
    # dir (a reviewer, another account's job).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, 'w') as f:
            json.dump(data, f, indent=1)
            f.write('\n')
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if osp.exists(tmp):
            os.unlink(tmp)
        raise


def keep_previous(path: str) -> Optional[str]:
    """Move an earlier run's list at ``path`` aside, named by when that run
    wrote it (``nan_quarantine.20260102_030405.json``), and say so.

    Returns:
        str | None: Where it is now; ``None`` when there was none.
    """
    try:
        stamp = time.strftime('%Y%m%d_%H%M%S',
                              time.localtime(os.stat(path).st_mtime))
    except OSError:
        return None
    stem, ext = osp.splitext(path)
    kept, n = '%s.%s%s' % (stem, stamp, ext), 1
    while osp.exists(kept):
        kept, n = '%s.%s_%d%s' % (stem, stamp, n, ext), n + 1
    try:
        os.replace(path, kept)
    except OSError:
        # Another rank of the run moved it first.
        return None
    log('mmnanhook: %s is the list of an earlier run (this one does not '
        'resume it): kept as %s' % (path, kept), logging.WARNING)
    return kept


def check_writable(path: str) -> None:
    """Raise :class:`QuarantineError` unless ``path`` can be written.

    Creates the directory; writes nothing else.
    """
    directory = osp.dirname(osp.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, delete=True)
        probe.close()
    except OSError as error:
        raise QuarantineError('quarantine file %s cannot be written: %s' %
                              (path, error))
