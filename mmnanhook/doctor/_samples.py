"""What one sample of the dataset pass is checked for, and its pictures.

The full pass (:func:`check_sample`): the sample through the train
pipeline, checked as the loss will see it. The fast mode
(:func:`check_annotation`): its data info and its image file's header only.
The pass over the dataset (workers, streaming, resuming) is
:mod:`._dataset`'s.
"""
from __future__ import annotations

import io
import os.path as osp
import random
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._format import one_line
from .._mmengine import wrapped_datasets
from ..diagnosis import (annotation_of, capped, check_batch, check_boxes,
                         declared_size, declared_size_problem)
from ..records import DataProblem, ProblemCategory, SampleFinding


def _data_info(dataset, index):
    # mmengine's BaseDataset knows a sample's image and declared size
    # without running the pipeline; a plain torch Dataset does not.
    get_info = getattr(dataset, 'get_data_info', None)
    info = get_info(index) if get_info is not None else None
    return info if isinstance(info, dict) else {}


def label_problems(labels: Optional[Union[torch.Tensor, Sequence[int]]],
                   num_classes: Optional[int]) -> List[DataProblem]:
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


def segmentation_problems(sample: Any,
                          context: Any) -> List[DataProblem]:
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


def check_sample(dataset: Any, index: int,
                 context: Any) -> Tuple[SampleFinding, Any]:
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

    def __init__(self, orientation: bool = True,
                 backend_args: Optional[Dict[str, Any]] = None) -> None:
        self.orientation = orientation
        self.backend_args = backend_args

    @classmethod
    def of(cls, dataset: Any) -> ImageLoading:
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


def header_size(path: str, loading: ImageLoading) -> Tuple[int, int]:
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


def check_annotation(dataset: Any, index: int, context: Any,
                     loading: ImageLoading) -> Tuple[SampleFinding, None]:
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


def show_sample(directory: str, dataset: Any, finding: SampleFinding,
                item: Any) -> List[str]:
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
