"""The dataset pass: every sample of a config's train dataset through its
pipeline, checked as the loss will see it (``mmnan scan``, and the dataset
part of ``mmnan doctor``).

Per sample: GT boxes (non-finite, degenerate, outside the image, angle out of
range), a declared image size that is not the file's, a pipeline that
raises; labels outside ``[0, num_classes)``; segmentation maps whose values
are neither a class nor the ignore index (0/255 binary masks), and maps that
are all ignore under ``avg_non_ignore`` (a mean over no pixel).
"""
import multiprocessing
import os
import os.path as osp
import sys

from .._format import one_line
from ..diagnosis import (angle_range_from_config, annotation_of, check_batch,
                         declared_size)
from ..records import DataProblem, ProblemCategory, SampleFinding
from ._rules import config_dicts

# mmseg's default ignore index.
IGNORE_INDEX = 255


class DatasetError(Exception):
    """The config cannot be loaded or its train dataset cannot be built."""



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


def build_dataset(cfg, config_path):
    """(train dataset, :class:`DatasetContext`) of a loaded config.

    Raises:
        DatasetError: Its dataset cannot be built (one line).
    """
    from mmengine.registry import DATASETS
    try:
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


def label_problems(sample, num_classes):
    """GT labels outside ``[0, num_classes)`` (a CUDA focal loss reads out
    of bounds silently: mmdet #2903)."""
    instances = getattr(sample, 'gt_instances', None)
    labels = getattr(instances, 'labels', None)
    if labels is None or num_classes is None or not len(labels):
        return []
    bad = sorted(set(int(v) for v in labels.tolist()
                     if not 0 <= int(v) < num_classes))
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
    result.problems.extend(label_problems(sample, context.num_classes))
    result.problems.extend(segmentation_problems(sample, context))
    return result, item


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
    dataset, context, show = _WORK
    found = []
    for index in indices:
        result, item = check_sample(dataset, index, context)
        if result.problems:
            paths = show_sample(show, dataset, result, item) if show else []
            found.append((result, paths))
    return len(indices), found


def _quiet_worker():
    import torch
    # One thread a worker: the workers are the parallelism.
    torch.set_num_threads(1)


def check_dataset(dataset, context, show=None, workers=1):
    """Check every sample, in index order, yielding as each chunk is done.

    Args:
        dataset: The train dataset.
        context (DatasetContext): What the checks need of the config.
        show (str, optional): Directory for the flagged samples' pictures.
        workers (int): Processes checking chunks at once (forked, so they
            share the dataset as built; 1: this process alone).

    Yields:
        tuple[int, list]: Samples checked, and ``(SampleFinding, picture
        paths)`` of the flagged ones among them.
    """
    global _WORK
    chunks = [range(i, min(i + CHUNK, len(dataset)))
              for i in range(0, len(dataset), CHUNK)]
    _WORK = (dataset, context, show)
    try:
        forks = 'fork' in multiprocessing.get_all_start_methods()
        if workers <= 1 or not forks:
            for chunk in chunks:
                yield _check_chunk(chunk)
            return
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


def scan_config(config_path, progress=True, show=None, workers=1,
                on_finding=None):
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

    Returns:
        tuple[int, list[SampleFinding], dict]: The number of samples
        scanned, a :class:`~mmnanhook.records.SampleFinding` for each bad
        sample (``index``: its dataset index; a sample whose pipeline raises,
        e.g. an unreadable image, is a bad sample) and the paths of the
        pictures written for each (dataset index -> list of paths).

    Raises:
        DatasetError: The config cannot be loaded, its train dataset cannot
            be built or ``show`` cannot be written; the message is one line.
    """
    from mmengine.utils import ProgressBar

    dataset, context = build_dataset(load_config(config_path), config_path)
    if show is not None:
        try:
            os.makedirs(show, exist_ok=True)
        except OSError as error:
            raise DatasetError('cannot write pictures into {}: {}'.format(
                show, error.strerror or error))
    bar = ProgressBar(len(dataset), file=sys.stderr) if progress else None
    bad, shown = [], {}
    for checked, found in check_dataset(dataset, context, show, workers):
        for result, paths in found:
            bad.append(result)
            if show is not None:
                shown[result.index] = paths
            if on_finding is not None:
                on_finding(result, paths)
        for _ in range(checked if bar is not None else 0):
            bar.update()
    return len(dataset), bad, shown
