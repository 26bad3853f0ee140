"""What ``mmnan scan --quarantine OUT`` keeps on disk while it runs, so that
its findings are there before it ends and an interrupted scan can go on
(``--resume``).

Two files, each rewritten whole and atomically (a temporary file renamed over
it, :func:`~mmnanhook.quarantine._file.write_json_atomically`), never
appended to: ``OUT`` itself, a quarantine list of the samples found so far
that a reviewer or a run can read at any moment, and ``OUT.progress``::

    {"format": "mmnanhook-scan-progress", "version": 1,
     "scan": {"config": "/abs/config.py", "mode": "full", "samples": 1200,
              "show": null, "digest": "3f0c..."},
     "next": 480,
     "findings": [{"index": 3, "img_path": "...", "pictures": [],
                   "problems": [["degenerate", "gt box 0 has ...", 0]]}]}

every index below ``next`` scanned, ``findings`` the bad ones among them.
The list is written before the record, so a kill between the two leaves a
record that is behind the list, never ahead of it: the resumed scan redoes
those samples and rewrites the list. Rewriting rather than appending a
journal keeps ``OUT`` a complete, valid list at every instant (no torn last
line to recover, no merge step); the saves are spaced so that they cost at
most a twentieth of the scan (:attr:`ScanJournal.interval`, stretched when a
save is slow).
"""
from __future__ import annotations

import hashlib
import json
import os
import os.path as osp
import time
from typing import Any, Dict, List, Optional, Tuple

from .._mmengine import wrapped_datasets
from ..errors import DatasetError
from ..quarantine import (QuarantinedSample, write_json_atomically,
                          write_quarantine)
from ..records import DataProblem, SampleFinding

FORMAT = 'mmnanhook-scan-progress'
VERSION = 1
SUFFIX = '.progress'


def _ann_files(dataset):
    # The annotation files of a dataset and of those it wraps
    # (RepeatDataset, ConcatDataset): what makes the same config another
    # dataset once they are edited.
    files = [getattr(node, 'ann_file', None)
             for node in wrapped_datasets(dataset)]
    return [ann for ann in files if isinstance(ann, str) and ann]


def scan_identity(cfg: Any, config_path: str, dataset: Any, context: Any,
                  fast: bool, show: Optional[str]) -> Dict[str, Any]:
    """What a scan is of, as its progress record states it: a record of
    another scan is not resumed.

    Args:
        cfg (mmengine.Config): The loaded config.
        config_path (str): Its file.
        dataset: The train dataset built from it.
        context (DatasetContext): What the checks read of the config.
        fast (bool): The fast mode (annotations and headers only).
        show (str, optional): The pictures' directory.

    Returns:
        dict: ``config``, ``mode``, ``samples``, ``show`` and ``digest`` (of
        the dataset's config, the checks' settings, the first and last
        image, and each annotation file's size and modification time).
    """
    def stat(path: str) -> Optional[List[int]]:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return [st.st_size, st.st_mtime_ns]

    get_info = getattr(dataset, 'get_data_info', None)
    ends = [get_info(i).get('img_path') for i in sorted({0, len(dataset) - 1})
            ] if get_info is not None and len(dataset) else []
    what = [cfg.train_dataloader.dataset, sorted(vars(context).items()),
            ends, [[f, stat(f)] for f in _ann_files(dataset)]]
    digest = hashlib.sha1(json.dumps(what, sort_keys=True, default=str)
                          .encode('utf-8')).hexdigest()
    return dict(config=osp.abspath(config_path),
                mode='fast' if fast else 'full', samples=len(dataset),
                show=None if show is None else osp.abspath(show),
                digest=digest)


def _differences(recorded, identity):
    """How a recorded scan differs from this one, in words."""
    said = []
    if recorded.get('config') != identity['config']:
        said.append('config {}'.format(recorded.get('config')))
    if recorded.get('mode') != identity['mode']:
        said.append('the {} mode'.format(recorded.get('mode')))
    if recorded.get('samples') != identity['samples']:
        said.append('{} samples, not {}'.format(recorded.get('samples'),
                                                identity['samples']))
    if recorded.get('show') != identity['show']:
        said.append('pictures into {}'.format(recorded.get('show')))
    if not said and recorded.get('digest') != identity['digest']:
        said.append('a dataset config or annotation file that has changed '
                    'since')
    return said


def _finding_to_json(finding, paths):
    return dict(index=finding.index, img_path=finding.img_path,
                pictures=list(paths),
                problems=[[None if p.category is None else str(p.category),
                           p.text, p.box] for p in finding.problems])


def _finding_from_json(data):
    return SampleFinding(data['index'], data.get('img_path'), [
        DataProblem(category, text, box)
        for category, text, box in data['problems']]), data['pictures']


class ScanJournal(object):
    """The quarantine list and the progress record of one scan.

    Args:
        quarantine (str): The list's path; the record is beside it
            (``quarantine + '.progress'``).
        identity (dict): What the scan is of (:func:`scan_identity`).
        interval (float): Least seconds between two saves.
    """

    def __init__(self, quarantine: str, identity: Dict[str, Any],
                 interval: float = 1.0) -> None:
        self.quarantine = quarantine
        self.path = quarantine + SUFFIX
        self.identity = identity
        self.interval = interval
        self._wait = 0.0
        self._saved = None

    def resume(self) -> Tuple[int, List[Tuple[SampleFinding, List[str]]]]:
        """Where the recorded scan stopped.

        Returns:
            tuple[int, list]: The first index not scanned, and
            ``(SampleFinding, picture paths)`` of the bad samples before it;
            ``(0, [])`` when there is no record (the scan ended, or never
            began).

        Raises:
            DatasetError: The record is not one, or of another scan.
        """
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return 0, []
        except (OSError, ValueError) as error:
            raise DatasetError('cannot resume from {}: {}: {}'.format(
                self.path, type(error).__name__, error))
        if (not isinstance(data, dict) or data.get('format') != FORMAT
                or data.get('version') != VERSION):
            raise DatasetError('cannot resume from {}: not a version {} '
                               'scan progress record'.format(self.path,
                                                             VERSION))
        said = _differences(data.get('scan') or {}, self.identity)
        if said:
            raise DatasetError(
                'cannot resume from {}: it is the progress of another scan '
                '({}); start again without --resume'.format(
                    self.path, '; '.join(said)))
        try:
            return int(data['next']), [_finding_from_json(f)
                                       for f in data['findings']]
        except (KeyError, TypeError, ValueError) as error:
            raise DatasetError('cannot resume from {}: a damaged record '
                               '({}: {})'.format(self.path,
                                                 type(error).__name__, error))

    def update(self, done: int, found: List[Tuple[Any, List[str]]],
               force: bool = False) -> None:
        """Save the list and the record, unless the last save is too recent.

        Args:
            done (int): Every index below it has been scanned.
            found (list): ``(SampleFinding, picture paths)`` of the bad
                samples among them.
            force (bool): Save whatever the time.

        Raises:
            OSError: Either file cannot be written.
        """
        now = time.time()
        if not force and self._saved is not None and \
                now - self._saved < self._wait:
            return
        # An interrupt may come amid a chunk, its first findings reported:
        # the chunk is scanned again on resuming, they are found again.
        found = [item for item in found if item[0].index < done]
        self._write_list(found)
        write_json_atomically(self.path, dict(
            format=FORMAT, version=VERSION, scan=self.identity, next=done,
            findings=[_finding_to_json(f, paths) for f, paths in found]))
        self._saved = time.time()
        # A save that takes long (a huge list, a slow disk) waits 20 times
        # its own length before the next one.
        self._wait = max(self.interval, 20 * (self._saved - now))

    def finish(self, found: List[Tuple[Any, List[str]]]) -> None:
        """The complete list, and no record left: the scan has ended.

        Args:
            found (list): ``(SampleFinding, picture paths)`` of every bad
                sample.

        Raises:
            OSError: The list cannot be written.
        """
        self._write_list(found)
        if osp.exists(self.path):
            os.unlink(self.path)

    def _write_list(self, found):
        write_quarantine(self.quarantine, [QuarantinedSample(
            [finding.index], finding.img_path,
            '; '.join(p.text for p in finding.problems), source='scan')
            for finding, _ in found])
