"""The dataset pass: every sample of a config's train dataset through its
pipeline, checked as the loss will see it (``mmnan scan``, and the dataset
part of ``mmnan doctor``).

Per sample: GT boxes (non-finite, degenerate, outside the image, angle out of
range), a declared image size that is not the file's, a pipeline that
raises; labels outside ``[0, num_classes)``; segmentation maps whose values
are neither a class nor the ignore index (0/255 binary masks), and maps that
are all ignore under ``avg_non_ignore`` (a mean over no pixel).

The fast mode (``mmnan scan --fast``) reads each sample's data info and its
image file's header only, neither decoding the image nor running the
pipeline: the declared size against the file's, and the annotated boxes and
labels.

Slightly over 500 lines: the two modes share their pass (workers, streaming,
resuming, the checks' context); the progress record is its own module
(``_journal``).
"""
import contextlib
import functools
import gc
import io
import multiprocessing
import os
import os.path as osp
import random
import signal
import sys

import numpy as np
import torch

from .._format import one_line
from .._mmengine import wrapped_datasets
from ..errors import DatasetError
from ..diagnosis import (angle_range_from_config, annotation_of, check_batch,
                         check_boxes, declared_size)
from ..diagnosis._data import capped, declared_size_problem
from ..records import DataProblem, ProblemCategory, SampleFinding
from ..sentinel import capture_rng, restore_rng
from ._rules import config_dicts

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

    def __init__(self, angle_range=None, num_classes=None,
                 ignore_index=IGNORE_INDEX, avg_non_ignore=False):
        self.angle_range = angle_range
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.avg_non_ignore = avg_non_ignore

    @classmethod
    def of(cls, cfg):
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


def opencv_threads_of(cfg):
    """OpenCV's threads for the pipeline: the config's
    ``env_cfg.mp_cfg.opencv_num_threads``, which mmengine's Runner sets
    before its dataloader workers run it (0, its default: none of its own).
    """
    mp_cfg = (cfg.get('env_cfg') or {}).get('mp_cfg') or {}
    return mp_cfg.get('opencv_num_threads', 0)


def load_config(config_path, doing='build the train dataset of'):
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


def build_dataset(cfg, config_path):
    """(train dataset, :class:`DatasetContext`) of a loaded config.

    Raises:
        DatasetError: Its dataset cannot be built (one line).
    """
    from mmengine.registry import DATASETS
    try:
        with _frozen_heap():
            dataset = DATASETS.build(cfg.train_dataloader.dataset)
    except Exception as error:  # noqa: BLE001 - any failure is bad input
        raise DatasetError(one_line(
            'cannot build the train dataset of {}: {}: {}'.format(
                config_path, type(error).__name__, error)))
    return dataset, DatasetContext.of(cfg)


def _data_info(dataset, index):
    # mmengine's BaseDataset knows a sample's image and declared size
    # without running the pipeline; a plain torch Dataset does not.
    get_info = getattr(dataset, 'get_data_info', None)
    info = get_info(index) if get_info is not None else None
    return info if isinstance(info, dict) else {}


def label_problems(labels, num_classes):
    """GT labels outside ``[0, num_classes)`` (a CUDA focal loss reads out
    of bounds silently: mmdet #2903).

    Args:
        labels (torch.Tensor | sequence[int], optional): One sample's.
        num_classes (int, optional): The model's.
    """
    if labels is None or num_classes is None or not len(labels):
        return []
    if isinstance(labels, torch.Tensor):
        labels = labels.cpu().numpy()
    labels = np.asarray(labels, dtype=np.int64)
    bad = np.unique(labels[(labels < 0) | (labels >= num_classes)]).tolist()
    if not bad:
        return []
    return [DataProblem(ProblemCategory.LABEL, (
        'GT label(s) {} outside 0..{} (the model has num_classes={}; '
        'mmdet #2903)').format(bad, num_classes - 1, num_classes))]


def segmentation_problems(sample, context):
    """A segmentation map with values that are neither a class nor the
    ignore index, or with every pixel ignored under ``avg_non_ignore``."""
    seg = getattr(getattr(sample, 'gt_sem_seg', None), 'data', None)
    if seg is None or context.num_classes is None:
        return []
    values = set(int(v) for v in seg.unique().tolist())
    problems = []
    stray = sorted(v for v in values if v != context.ignore_index
                   and not 0 <= v < context.num_classes)
    if stray:
        problems.append(DataProblem(ProblemCategory.MASK, (
            'segmentation map values {} are neither a class (0..{}) nor the '
            'ignore index {}: a binary mask stored as 0/255? (mmseg #1609, '
            '#1313, #2111)').format(stray, context.num_classes - 1,
                                    context.ignore_index)))
    elif context.num_classes == 2 and values == {0, context.ignore_index}:
        problems.append(DataProblem(ProblemCategory.MASK, (
            'binary segmentation map stored as 0/{0}: with num_classes=2 the '
            'foreground is the ignore index {0} and never learned (mmseg '
            '#1609)').format(context.ignore_index)))
    if values == {context.ignore_index} and context.avg_non_ignore:
        problems.append(DataProblem(ProblemCategory.ALL_IGNORE, (
            'every pixel is the ignore index {} and the loss has '
            'avg_non_ignore=True: a mean over no pixel is NaN (mmseg '
            '#1388, #1409)').format(context.ignore_index)))
    return problems


def check_sample(dataset, index, context):
    """(:class:`SampleFinding`, pipeline output or ``None``) of one sample
    (``index`` in the dataset)."""
    info = _data_info(dataset, index)
    # The sample's random augmentations drawn from its index: the same
    # findings whatever the workers, the order, an interruption. The CPU
    # generator alone: torch.manual_seed's visit of every device type
    # costs 30 times as much (90 us a sample).
    random.seed(index)
    np.random.seed(index % 2**32)
    torch.default_generator.manual_seed(index)
    try:
        item = dataset[index]
    except Exception as error:  # noqa: BLE001 - it would stop training too
        return SampleFinding(index, info.get('img_path'), [DataProblem(
            ProblemCategory.PIPELINE, one_line(
                'the pipeline failed: {}: {}'.format(
                    type(error).__name__, error)))]), None
    sample = item['data_samples']
    batch = {'inputs': [item['inputs']], 'data_samples': [sample]}
    result = check_batch(batch, angle_range=context.angle_range,
                         declared=[declared_size(dataset, info)])[0]
    result.index = index
    result.problems.extend(label_problems(
        getattr(getattr(sample, 'gt_instances', None), 'labels', None),
        context.num_classes))
    result.problems.extend(segmentation_problems(sample, context))
    return result, item


# EXIF's orientation tag; 5 to 8 turn the image by 90 degrees.
_ORIENTATION = 0x0112

# How the fast mode learns the file's size, and what follows from a
# mismatch (the full pass: ``as loaded (ori_shape)``).
_BY_HEADER = ('by its header: boxes beyond its real border pass the '
              'dataset\'s filter and the pipeline clips them')


class ImageLoading(object):
    """How a train pipeline loads its image files, as far as the fast mode
    needs to know without running it.

    Args:
        orientation (bool): Whether the loader turns an image by its EXIF
            orientation (mmcv's ``cv2`` and ``pillow`` backends do for the
            ``'color'`` and ``'grayscale'`` color types).
        backend_args (dict, optional): The loader's file backend arguments.
    """

    def __init__(self, orientation=True, backend_args=None):
        self.orientation = orientation
        self.backend_args = backend_args

    @classmethod
    def of(cls, dataset):
        """Read from the first image loader of a dataset's pipeline (that of
        the first dataset it wraps); mmcv's defaults without one."""
        for node in wrapped_datasets(dataset):
            for step in getattr(getattr(node, 'pipeline', None),
                                'transforms', None) or []:
                if hasattr(step, 'color_type') and hasattr(
                        step, 'imdecode_backend'):
                    return cls(
                        step.color_type in ('color', 'grayscale')
                        and step.imdecode_backend in ('cv2', 'pillow'),
                        getattr(step, 'backend_args', None))
        return cls()


def header_size(path, loading):
    """``(width, height)`` of an image file as the pipeline loads it, read
    from its header alone (PIL opens files lazily: no pixel is decoded).

    Args:
        path (str): The file (a URI goes through mmengine's file backends,
            which fetch the whole file).
        loading (ImageLoading): How the pipeline loads it.

    Raises:
        Exception: The file cannot be read or is no image PIL knows.
    """
    from PIL import Image
    source = path
    if '://' in path:
        from mmengine import fileio
        source = io.BytesIO(fileio.get(path,
                                       backend_args=loading.backend_args))
    with Image.open(source) as image:
        width, height = image.size
        # Only where the header held it: PNG's getexif decodes otherwise.
        orientation = (image.getexif().get(_ORIENTATION)
                       if 'exif' in image.info else None)
    if loading.orientation and orientation in (5, 6, 7, 8):
        return height, width
    return width, height


def check_annotation(dataset, index, context, loading):
    """(:class:`SampleFinding`, ``None``) of one sample from its data info
    and its image file's header: no decoding, no pipeline.

    The boxes are checked as annotated, against the image's real size (the
    declared one where the file cannot be read), and so are the labels; the
    instances marked ``ignore_flag`` are left out, as mmdet's
    ``PackDetInputs`` leaves them out of the GT the loss sees.

    Args:
        dataset: The train dataset.
        index (int): The sample's index in it.
        context (DatasetContext): What the checks need of the config.
        loading (ImageLoading): How the pipeline loads its image files.
    """
    info = _data_info(dataset, index)
    path = info.get('img_path')
    problems, real = [], None
    if path is not None:
        try:
            real = header_size(str(path), loading)
        except Exception as error:  # noqa: BLE001 - the loader would fail
            problems.append(DataProblem(
                ProblemCategory.PIPELINE, one_line(
                    'the image file cannot be read: {}: {}'.format(
                        type(error).__name__, error))))
    declared = declared_size(dataset, info)
    mismatch = None if real is None else declared_size_problem(
        declared, real, _BY_HEADER)
    problems.extend([mismatch] if mismatch else [])
    kept = [instance for instance in info.get('instances') or []
            if not instance.get('ignore_flag')]
    boxes = [instance['bbox'] for instance in kept if 'bbox' in instance]
    size = real or declared
    try:
        if boxes:
            problems.extend(check_boxes(
                np.asarray(boxes, dtype=np.float64),
                None if size is None else (size[1], size[0]),
                context.angle_range))
        labels = label_problems(
            [instance['bbox_label'] for instance in kept
             if 'bbox_label' in instance], context.num_classes)
    except (TypeError, ValueError) as error:
        # Ragged or non-numeric boxes or labels: what a scan is for.
        problems.append(DataProblem(ProblemCategory.PIPELINE, one_line(
            'the annotation cannot be read as boxes and labels: {}: '
            '{}'.format(type(error).__name__, error))))
        labels = []
    result = SampleFinding(index, path, capped(problems))
    result.problems.extend(labels)
    return result, None


def show_sample(directory, dataset, finding, item):
    """Write the pictures of one flagged sample; return their paths."""
    from ..report import finding_pictures, pipeline_image
    image = sample = None
    if item is not None and getattr(item.get('inputs'), 'dim',
                                    lambda: 0)() == 3:
        image, sample = pipeline_image(item['inputs']), item['data_samples']
    info = _data_info(dataset, finding.index)
    paths = []
    for picture in finding_pictures(finding, image, sample,
                                    annotation_of(dataset, info)):
        path = osp.join(directory, picture.name)
        with open(path, 'wb') as f:
            f.write(picture.png())
        paths.append(path)
    return paths


# What the worker processes check: set before they fork, so that they
# inherit the dataset instead of unpickling it; ``None`` otherwise.
_WORK = None
# Samples a worker checks per task: large enough to pay for the round trip,
# small enough that findings come out as they are found.
CHUNK = 16


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


def _quiet_worker():
    # A worker's thread count is for its life: nothing to put back.
    torch.set_num_threads(1)
    # Ctrl-C and a kill are the parent's to handle: it ends the pool and
    # saves what is done; a worker dies as the parent terminates it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def check_dataset(dataset, context, show=None, workers=1, start=0,
                  fast=False, opencv_threads=0):
    """Check every sample from ``start`` on, in index order, yielding as each
    chunk is done.

    Args:
        dataset: The train dataset.
        context (DatasetContext): What the checks need of the config.
        show (str, optional): Directory for the flagged samples' pictures.
        workers (int): Processes checking chunks at once (forked, so they
            share the dataset as built; 1: this process alone).
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
            forks = 'fork' in multiprocessing.get_all_start_methods()
            if workers <= 1 or not forks:
                with _one_torch_thread():
                    for chunk in chunks:
                        yield _check_chunk(chunk)
                return
            with _frozen_heap():
                pool = multiprocessing.get_context('fork').Pool(
                    workers, initializer=_quiet_worker)
            try:
                for done in pool.imap(_check_chunk, chunks):
                    yield done
            finally:
                pool.terminate()
                pool.join()
    finally:
        _WORK = None
        restore_rng(rng)


def scan_config(config_path, progress=True, show=None, workers=1,
                on_finding=None, fast=False, quarantine=None, resume=False):
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
