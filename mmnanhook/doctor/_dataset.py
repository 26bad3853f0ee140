"""The dataset pass: every sample of a config's train dataset checked as
the loss will see it (``mmnan scan``, and the dataset part of ``mmnan
doctor``), in index order, over worker processes, its findings streamed and
resumable.

Per sample (:mod:`._samples`): GT boxes (non-finite, degenerate, outside the
image, angle out of range), a declared image size that is not the file's, a
pipeline that raises; labels outside ``[0, num_classes)``; segmentation maps
whose values are neither a class nor the ignore index (0/255 binary masks),
and maps that are all ignore under ``avg_non_ignore`` (a mean over no
pixel). The fast mode (``mmnan scan --fast``) reads each sample's data info
and its image file's header only. The progress record is :mod:`._journal`.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .._child import ChildFailed, can_fork, ordered_map
from .._format import one_line
from ..errors import DatasetError
from ..diagnosis import angle_range_from_config
from ..memory import capture_rng, restore_rng
from ._rules import config_dicts
from ._samples import (ImageLoading, check_annotation, check_sample,
                       show_sample)

# mmseg's default ignore index.
IGNORE_INDEX = 255


class DatasetContext(object):
    """What the checks need to know of the config.

    Args:
        angle_range (tuple, optional): Rotated boxes' angle range.
        num_classes (int, optional): The model's number of classes (the
            largest ``num_classes`` of its heads).
        ignore_index (int): Segmentation maps' ignore index.
        avg_non_ignore (bool): Whether a segmentation loss averages over the
            pixels not ignored only.
    """

    def __init__(self, angle_range: Optional[Tuple[float, float]] = None,
                 num_classes: Optional[int] = None,
                 ignore_index: int = IGNORE_INDEX,
                 avg_non_ignore: bool = False) -> None:
        self.angle_range = angle_range
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.avg_non_ignore = avg_non_ignore

    @classmethod
    def of(cls, cfg: Any) -> DatasetContext:
        """Read from a loaded config.

        Args:
            cfg (mmengine.Config): The config.
        """
        model = cfg.get('model') or {}
        nodes = [node for _, node in config_dicts(model)]
        counts = [d['num_classes'] for d in nodes
                  if isinstance(d.get('num_classes'), int)]
        ignores = [d['ignore_index'] for d in nodes
                   if isinstance(d.get('ignore_index'), int)]
        return cls(angle_range_from_config(cfg),
                   max(counts) if counts else None,
                   ignores[0] if ignores else IGNORE_INDEX,
                   any(d.get('avg_non_ignore') for d in nodes))


def opencv_threads_of(cfg: Any) -> int:
    """OpenCV's threads for the pipeline: the config's
    ``env_cfg.mp_cfg.opencv_num_threads``, which mmengine's Runner sets
    before its dataloader workers run it (0, its default: none of its own).
    """
    mp_cfg = (cfg.get('env_cfg') or {}).get('mp_cfg') or {}
    return mp_cfg.get('opencv_num_threads', 0)


def load_config(config_path: str,
                doing: str = 'build the train dataset of') -> Any:
    """The config of a file, its default scope made current.

    Args:
        config_path (str): The file.
        doing (str): What the error says could not be done.

    Raises:
        DatasetError: It cannot be loaded (one line).
    """
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    try:
        cfg = Config.fromfile(config_path)
        if cfg.get('default_scope') is not None:
            init_default_scope(cfg.default_scope)
    except Exception as error:  # noqa: BLE001 - any failure is bad input
        raise DatasetError(one_line('cannot {} {}: {}: {}'.format(
            doing, config_path, type(error).__name__, error)))
    return cfg


@contextlib.contextmanager
def _frozen_heap():
    """The objects that exist now left out of the garbage collector's
    passes meanwhile (``gc.freeze``).

    For a dataset's build: mmengine's ``BaseDataset`` ends it with a full
    ``gc.collect()``, which walks every object of the process (torch's and
    the codebases' imports), none of them the build's garbage: 160 of the
    210 ms a 1,200-image COCO set takes here. For a fork: the children's
    collections then leave the inherited objects alone instead of writing
    to (copying) every page that holds one, as Python's ``gc`` docs advise.
    A caller's own frozen objects stay frozen: unfreezing is all or nothing,
    so then nothing is done here.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# What to do about a dataset that cannot be built where the check runs.
WHERE_THE_DATA_IS = 'run where the data is'


def try_build_dataset(
        cfg: Any) -> Tuple[Any, Optional[DatasetContext], Optional[str]]:
    """(train dataset, :class:`DatasetContext`, ``None``) of a loaded
    config, or ``(None, None, error)`` when its dataset cannot be built here
    (its files missing, its codebase not installed), the error in one line
    (``FileNotFoundError: ...``).

    Args:
        cfg (mmengine.Config): The config.
    """
    from mmengine.registry import DATASETS
    try:
        with _frozen_heap():
            dataset = DATASETS.build(cfg.train_dataloader.dataset)
            # As the Runner does: a lazy_init dataset reads its files here.
            if hasattr(dataset, 'full_init'):
                dataset.full_init()
    except Exception as error:  # noqa: BLE001 - any failure is said
        return None, None, one_line('{}: {}'.format(type(error).__name__,
                                                    error))
    return dataset, DatasetContext.of(cfg), None


def build_dataset(cfg: Any,
                  config_path: str) -> Tuple[Any, DatasetContext]:
    """(train dataset, :class:`DatasetContext`) of a loaded config.

    Raises:
        DatasetError: Its dataset cannot be built (one line).
    """
    dataset, context, error = try_build_dataset(cfg)
    if error is not None:
        raise DatasetError('cannot build the train dataset of {}: {}; '
                           'nothing checked: {}'.format(
                               config_path, error, WHERE_THE_DATA_IS))
    return dataset, context


# What the worker processes check: set before they fork, so that they
# inherit the dataset instead of unpickling it; ``None`` otherwise.
_WORK = None
# Samples a worker checks per task: large enough to pay for the round trip,
# small enough that findings come out as they are found.
CHUNK = 16
# Seconds without a chunk done after which the workers are given up on (one
# killed by the OOM killer, or stopped): 16 samples take well under one.
STALL = 300.0


def _check_chunk(indices):
    dataset, context, show, check = _WORK
    found = []
    for index in indices:
        result, item = check(dataset, index, context)
        if result.problems:
            paths = show_sample(show, dataset, result, item) if show else []
            found.append((result, paths))
    return len(indices), found


@contextlib.contextmanager
def _opencv_threads(count):
    """OpenCV's threads set to ``count`` while the pass runs, as mmengine's
    Runner sets them for training's pipelines. Left at OpenCV's default
    (every core), each worker's resizes spread over every core and the
    workers contend; forked workers inherit the setting."""
    try:
        import cv2
    except ImportError:
        yield
        return
    before = cv2.getNumThreads()
    cv2.setNumThreads(count)
    try:
        yield
    finally:
        cv2.setNumThreads(before)


@contextlib.contextmanager
def _one_torch_thread():
    """One torch thread while this process checks samples: the workers
    are the parallelism. With torch's default (a thread a core), the
    pipeline's few tensor ops keep a second core spinning for no speed
    (6.4 s of CPU for the 3.6 s of a 1,200-image pass here; 3.6 s with one
    thread, in the same time)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _worker_check(indices):
    # A worker's thread count is for its life: nothing to put back.
    torch.set_num_threads(1)
    return _check_chunk(indices)


def check_dataset(dataset: Any, context: DatasetContext,
                  show: Optional[str] = None, workers: int = 1,
                  start: int = 0, fast: bool = False,
                  opencv_threads: int = 0
                  ) -> Iterator[Tuple[int, List[Tuple[Any, List[str]]]]]:
    """Check every sample from ``start`` on, in index order, yielding as each
    chunk is done.

    Args:
        dataset: The train dataset.
        context (DatasetContext): What the checks need of the config.
        show (str, optional): Directory for the flagged samples' pictures.
        workers (int): Processes checking chunks at once (forked
            strangers, :mod:`mmnanhook._child`, so they share the dataset
            as built; 1: this process alone).
        start (int): The first index checked.
        fast (bool): Check each data info and its image file's header only
            (:func:`check_annotation`), not the pipeline's output.
        opencv_threads (int): OpenCV's threads meanwhile
            (:func:`opencv_threads_of` the config).

    Yields:
        tuple[int, list]: Samples checked, and ``(SampleFinding, picture
        paths)`` of the flagged ones among them. A sample's random
        augmentations are seeded by its index, so the findings do not
        depend on ``workers`` nor ``start``.
    """
    global _WORK
    chunks = [range(i, min(i + CHUNK, len(dataset)))
              for i in range(start, len(dataset), CHUNK)]
    check = functools.partial(check_annotation,
                              loading=ImageLoading.of(dataset)) \
        if fast else check_sample
    _WORK = (dataset, context, show, check)
    # Each sample seeds the generators: the caller's states are put back.
    rng = capture_rng()
    try:
        with _opencv_threads(opencv_threads):
            if workers <= 1 or not can_fork():
                with _one_torch_thread():
                    for chunk in chunks:
                        yield _check_chunk(chunk)
                return
            with contextlib.closing(ordered_map(
                    _worker_check, chunks, workers, STALL)) as done:
                try:
                    with _frozen_heap():
                        # The workers fork at the first result asked for.
                        first = next(done, None)
                    if first is not None:
                        yield first
                    for each in done:
                        yield each
                except ChildFailed as error:
                    raise DatasetError('the check\'s worker processes '
                                       'failed: {}; --workers 1 checks in '
                                       'this process'.format(error))
    finally:
        _WORK = None
        restore_rng(rng)


def scan_config(
    config_path: str, progress: bool = True, show: Optional[str] = None,
    workers: int = 1,
    on_finding: Optional[Callable[[Any, List[str]], Any]] = None,
    fast: bool = False, quarantine: Optional[str] = None,
    resume: bool = False
) -> Tuple[int, List[Any], Dict[int, List[str]]]:
    """Check every sample of a config's training dataset.

    Args:
        config_path (str): An mmengine config file (``custom_imports`` and
            ``_base_`` are honoured).
        progress (bool): Show a progress bar (on stderr).
        show (str, optional): A directory to write each bad sample's
            pictures into (``sample<index>_input.png``: the pipeline's output
            with its GT boxes, the offending ones in red;
            ``sample<index>_file.png``: the file with the annotation's boxes).
        workers (int): Processes checking samples at once.
        on_finding (callable, optional): Called with ``(SampleFinding,
            picture paths)`` as each bad sample is found, in index order.
        fast (bool): Read each sample's data info and image header only
            (:func:`check_annotation`): no decoding, no pipeline.
        quarantine (str, optional): Write the bad samples there as a
            quarantine list while the scan runs (rewritten atomically, at
            most about once a second), with the scan's progress beside it
            (``quarantine + '.progress'``, removed at the end; see
            :mod:`._journal`).
        resume (bool): Go on from the progress beside ``quarantine``: its
            findings are reported again first, then the samples it had not
            reached are checked. Without a record, the scan starts at 0.

    Returns:
        tuple[int, list[SampleFinding], dict]: The number of samples
        scanned, a :class:`~mmnanhook.records.SampleFinding` for each bad
        sample (``index``: its dataset index; a sample whose pipeline raises,
        e.g. an unreadable image, is a bad sample) and the paths of the
        pictures written for each (dataset index -> list of paths).

    Raises:
        DatasetError: The config cannot be loaded, its train dataset cannot
            be built, ``show`` or ``quarantine`` cannot be written, or the
            progress to resume is of another scan; the message is one line.
    """
    from mmengine.utils import ProgressBar

    from ._journal import ScanJournal, scan_identity
    if resume and quarantine is None:
        raise ValueError('resume needs the quarantine file whose progress '
                         'it resumes')
    cfg = load_config(config_path)
    dataset, context = build_dataset(cfg, config_path)
    if show is not None:
        try:
            os.makedirs(show, exist_ok=True)
        except OSError as error:
            raise DatasetError('cannot write pictures into {}: {}'.format(
                show, error.strerror or error))
    journal, start, found = None, 0, []
    if quarantine is not None:
        journal = ScanJournal(quarantine, scan_identity(
            cfg, config_path, dataset, context, fast, show))
        if resume:
            start, found = journal.resume()
        _save(journal, start, found, force=True)
    bar = ProgressBar(len(dataset), file=sys.stderr) if progress else None
    for result, paths in found:
        if on_finding is not None:
            on_finding(result, paths)
    done = start
    if bar is not None and start:
        bar.update(start)
    try:
        with contextlib.closing(check_dataset(
                dataset, context, show, workers, start, fast,
                opencv_threads_of(cfg))) as chunks:
            for checked, new in chunks:
                for result, paths in new:
                    found.append((result, paths))
                    if on_finding is not None:
                        on_finding(result, paths)
                done += checked
                if bar is not None:
                    bar.update(checked)
                if journal is not None:
                    _save(journal, done, found)
    except BaseException:
        # Interrupted (Ctrl-C, a kill turned into an exception): what is
        # done is kept for --resume; a failing save keeps the last one.
        if journal is not None:
            with contextlib.suppress(DatasetError):
                _save(journal, done, found, force=True)
        raise
    if journal is not None:
        try:
            journal.finish(found)
        except OSError as error:
            raise DatasetError('cannot write {}: {}'.format(
                quarantine, error.strerror or error))
    shown = dict((result.index, paths) for result, paths in found) \
        if show is not None else {}
    return len(dataset), [result for result, _ in found], shown


def _save(journal, done, found, force=False):
    try:
        journal.update(done, found, force)
    except OSError as error:
        raise DatasetError('cannot write {}: {}'.format(
            journal.quarantine, error.strerror or error))
