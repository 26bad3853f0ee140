"""Checks of one training batch for the data faults that end in NaN losses.

The most common cause of a NaN loss in mmdet/mmrotate is a degenerate
ground-truth box: a zero width or height reaches ``log(gw / pw)`` in the
delta box coders.  These checks look at the raw ``data_batch`` as the
hook saw it (``{'inputs': [...], 'data_samples': [...]}`` from
``pseudo_collate``) and describe every problem in words, per sample.

Boxes are recognised by duck typing, so neither mmdet nor mmrotate has to be
importable: an object with a ``tensor`` attribute is a box structure, named
by its class (``HorizontalBoxes``, ``RotatedBoxes``, ``QuadriBoxes``); a
plain ``(N, 4)``, ``(N, 5)`` or ``(N, 8)`` tensor is taken by its width.

This module also splits a batch into sub-batches, which the diagnosis uses
to find the samples that fail on their own.

Over 500 lines because it is one concern, what of a sample's data is wrong:
its input, its boxes and its other targets (keypoints, maps, a target
image) are checked by one walk of the batch into one finding per sample.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .._batch import batch_size, split_batch  # noqa: F401 - re-exported
from .._batch import file_of
from .._boxes import as_box_tensor, rbox_corners
from .._format import format_value
from .._inputs import per_sample
from ..quarantine import sample_index
from ..records import (NONFINITE_DATA, DataProblem, ProblemCategory,
                       SampleFinding)
from ._tensors import count_nonfinite

# Smallest box side in pixels that is not degenerate.  Only sides this close
# to zero make ``log(w)`` or ``1 / w`` overflow in float32 box coders; real
# but tiny objects (a few tenths of a pixel after resizing) are left alone,
# so the check does not blame innocent samples.
DEFAULT_MIN_SIZE = 1e-3

# Angle ranges (radians) of mmrotate 1.x ``angle_version``s, as its
# ``norm_angle`` produces them.
ANGLE_RANGES = {
    'oc': (0.0, math.pi / 2),
    'le90': (-math.pi / 2, math.pi / 2),
    'le135': (-math.pi / 4, 3 * math.pi / 4),
}

# Angles exactly on a range bound are legitimate; allow float rounding.
_ANGLE_TOL = 1e-4

# Enough to identify a bad annotation without flooding the report.
MAX_PROBLEMS_PER_SAMPLE = 10


def angle_range_from_config(cfg: Any) -> Optional[Tuple[float, float]]:
    """The rotated-box angle range of a config, from its ``angle_version``.

    The top-level ``angle_version`` (mmrotate configs define one) wins;
    otherwise the first one found in the model/dataset settings is used.

    Args:
        cfg (mmengine.Config | dict): The training config.

    Returns:
        tuple[float, float] | None: ``(low, high)`` in radians, or ``None``
        when the config names no known angle version.
    """
    if hasattr(cfg, 'to_dict'):
        cfg = cfg.to_dict()
    version = _find_key(cfg, 'angle_version')
    return ANGLE_RANGES.get(version) if isinstance(version, str) else None


def _find_key(obj, key):
    """Breadth-first search of nested dicts/lists for ``key``."""
    queue = [obj]
    while queue:
        item = queue.pop(0)
        if isinstance(item, Mapping):
            if key in item:
                return item[key]
            queue.extend(item.values())
        elif isinstance(item, (list, tuple)):
            queue.extend(item)
    return None


def _num(value):
    # A coordinate or size (a tensor element or a float) for a problem text.
    return format_value(float(value))


def _metainfo(sample):
    meta = getattr(sample, 'metainfo', None)
    return meta if isinstance(meta, Mapping) else {}


def sample_img_path(sample: Any) -> Optional[str]:
    """The image path in a data sample's metainfo, or ``None``.

    Args:
        sample: A data sample (e.g. ``DetDataSample``).
    """
    meta = _metainfo(sample)
    path = meta.get('img_path', meta.get('filename'))
    if path is None:
        # A sample without an input image: its target's (mmagic's GANs).
        path = file_of(meta)
    return None if path is None else str(path)


def _image_hw(sample):
    """(height, width) the boxes refer to: ``img_shape`` after resizing."""
    meta = _metainfo(sample)
    shape = meta.get('img_shape', meta.get('ori_shape'))
    if shape is None or len(shape) < 2:
        return None
    return float(shape[0]), float(shape[1])


def _sides(kind, t):
    """(width, height, label) of each box; label names the pair in messages."""
    if kind == 'hbox':
        return t[:, 2] - t[:, 0], t[:, 3] - t[:, 1], ('width', 'height')
    if kind == 'rbox':
        return t[:, 2], t[:, 3], ('width', 'height')
    # Quadrilateral: the longest edge and area / longest edge, i.e. the
    # thickness; both equal the sides for a rectangle, and the thickness is
    # zero for collinear points.
    pts = t.view(-1, 4, 2)
    nxt = pts.roll(-1, dims=1)
    edges = (nxt - pts).norm(dim=-1).max(dim=-1)[0]
    area = 0.5 * (pts[..., 0] * nxt[..., 1] -
                  nxt[..., 0] * pts[..., 1]).sum(-1).abs()
    thickness = torch.where(edges > 0, area / edges.clamp(min=1e-30),
                            torch.zeros_like(area))
    return edges, thickness, ('length', 'thickness')


def _extent(kind, t):
    """Axis-aligned (x1, y1, x2, y2) extent of each box."""
    if kind == 'hbox':
        return t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    pts = rbox_corners(t) if kind == 'rbox' else t.view(-1, 4, 2)
    mins, maxs = pts.min(dim=1)[0], pts.max(dim=1)[0]
    return mins[:, 0], mins[:, 1], maxs[:, 0], maxs[:, 1]


def _side_problem(index, name, value):
    symbol = name[0]
    if value == 0:
        what = 'zero'
    elif value < 0:
        what = 'negative'
    else:
        what = 'near-zero'
    return DataProblem(
        ProblemCategory.DEGENERATE,
        'gt box {} has {} {} ({}={})'.format(index, what, name, symbol,
                                             _num(value)), index)


def check_boxes(boxes: Any, image_hw: Optional[Tuple[float, float]] = None,
                angle_range: Optional[Tuple[float, float]] = None,
                min_size: float = DEFAULT_MIN_SIZE) -> List[DataProblem]:
    """Describe the problems of a set of ground-truth boxes.

    Args:
        boxes: ``HorizontalBoxes`` (x1, y1, x2, y2), ``RotatedBoxes``
            (cx, cy, w, h, angle), ``QuadriBoxes`` (8 polygon coordinates)
            or a plain tensor/array with 4, 5 or 8 columns.
        image_hw (tuple[float, float], optional): Height and width of the
            image the boxes are in; boxes entirely outside it are reported.
        angle_range (tuple[float, float], optional): Allowed rotated-box
            angles in radians (see :func:`angle_range_from_config`).
        min_size (float): Box sides at or below this many pixels are
            degenerate.

    Returns:
        list[DataProblem]: One per problem, e.g. the text
        ``'gt box 3 has zero height (h=0)'``; empty when the boxes are fine
        or not recognised.
    """
    kind, t = as_box_tensor(boxes)
    if kind is None or t.shape[0] == 0:
        return []
    # Whole-tensor tests first (float64, as the texts print them), then
    # words for the flagged boxes only: a sample may hold thousands.
    finite = torch.isfinite(t).all(dim=1)
    width, height, names = _sides(kind, t)
    small = (torch.stack([width, height], 1) <= min_size) & finite[:, None]
    flagged = ~finite | small.any(dim=1)
    outside = None
    if image_hw is not None:
        img_h, img_w = image_hw
        x1, y1, x2, y2 = _extent(kind, t)
        outside = finite & ((x2 <= 0) | (y2 <= 0) | (x1 >= img_w) |
                            (y1 >= img_h))
        flagged |= outside
    off = None
    if kind == 'rbox' and angle_range is not None:
        low, high = angle_range
        angle = t[:, 4]
        off = finite & ~((low - _ANGLE_TOL <= angle) &
                         (angle <= high + _ANGLE_TOL))
        flagged |= off
    problems = []
    for i in flagged.nonzero(as_tuple=True)[0].tolist():
        if not bool(finite[i]):
            coords = ', '.join(_num(v) for v in t[i].tolist())
            problems.append(DataProblem(
                ProblemCategory.NONFINITE_BOX,
                'gt box {} has non-finite coordinates ({})'.format(i, coords),
                i))
            continue
        for side, name, value in zip((0, 1), names,
                                     (float(width[i]), float(height[i]))):
            if bool(small[i, side]):
                problems.append(_side_problem(i, name, value))
        if outside is not None and bool(outside[i]):
            problems.append(DataProblem(
                ProblemCategory.OUTSIDE,
                'gt box {} lies outside the {}x{} image '
                '(x {}..{}, y {}..{})'.format(
                    i, int(img_w), int(img_h), _num(x1[i]), _num(x2[i]),
                    _num(y1[i]), _num(y2[i])), i))
        if off is not None and bool(off[i]):
            problems.append(DataProblem(
                ProblemCategory.ANGLE,
                'gt box {} has angle {} rad outside the configured range '
                '[{}, {}]'.format(i, _num(angle[i]), _num(low), _num(high)),
                i))
    return problems


def _nonfinite_problem(tensor, what,
                       category=ProblemCategory.NONFINITE_INPUT):
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        return None
    counts = count_nonfinite(tensor)
    nan, inf = counts['nan'], counts['inf']
    if not nan and not inf:
        return None
    return DataProblem(category,
                       '{} has {} NaN and {} Inf values'.format(what, nan,
                                                                inf))


def _float_tensor(value):
    """``value`` as a floating-point tensor (a numpy array viewed, not
    copied where it can be), or ``None``: not a float array."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    # Duck-typed numpy: mmpose packs gt_instances' keypoints as arrays.
    if getattr(getattr(value, 'dtype', None), 'kind', None) == 'f' and \
            hasattr(value, '__array__'):
        import numpy as np
        return torch.from_numpy(np.ascontiguousarray(value))
    return None


def _target_file(sample, name):
    """The file a target image field was loaded from, or ``None``: mmagic
    packs the image of a pipeline key ``k`` as ``k_img`` and keeps its file
    as ``k_path`` (``gt_img``, ``gt_path``): the sample's ``img_path`` is
    its input's, another file."""
    if not name.endswith('_img'):
        return None
    path = _metainfo(sample).get(name[:-len('_img')] + '_path')
    return None if path is None else str(path)


def nonfinite_targets(sample: Any) -> List[DataProblem]:
    """The ground-truth fields of a data sample that hold NaN/Inf, other
    than its boxes (:func:`check_boxes` reads those).

    A target is as much the forward's data as the input: mmpose packs a
    NaN keypoint of an annotation into ``gt_instances.keypoints`` and, its
    codec's labels, ``gt_instance_labels.keypoint_labels``, where the RLE
    loss's flow model raises on it (torch's distributions validate their
    argument) and a SimCC or heatmap loss turns NaN. Every floating field
    of every ``gt_*`` member is read (``gt_instances``,
    ``gt_instance_labels``, ``gt_fields``, mmagic's ``gt_img``, ...), so no
    codebase's names need to be known.

    Args:
        sample: A data sample (an mmengine ``BaseDataElement``).

    Returns:
        list[DataProblem]: One per field that is not finite.
    """
    keys = getattr(sample, 'keys', None)
    if not callable(keys):
        return []
    problems = []
    for name in sorted(keys()):
        if not name.startswith('gt_'):
            continue
        field = getattr(sample, name, None)
        items = getattr(field, 'items', None)
        for key, value in (items() if callable(items) else [(None, field)]):
            if name == 'gt_instances' and key == 'bboxes':
                continue
            what = name if key is None else '{}.{}'.format(name, key)
            path = _target_file(sample, name) if key is None else None
            problem = _nonfinite_problem(
                _float_tensor(value),
                what if path is None else '{} ({})'.format(what, path),
                ProblemCategory.NONFINITE_TARGET)
            if problem:
                problems.append(problem)
    return problems


def nonfinite_data(findings: Iterable[SampleFinding]
                   ) -> List[SampleFinding]:
    """The findings of the samples whose inputs or targets are not finite.

    Args:
        findings (list[SampleFinding]): :func:`check_batch`'s answer.
    """
    return [f for f in findings if f.categories.intersection(NONFINITE_DATA)]


def _per_sample_inputs(inputs, n):
    """The input tensor(s) of each of the ``n`` samples, as lists; inputs
    that do not split into ``n`` (a tensor of another first dimension) are
    the first sample's."""
    split = per_sample(inputs)
    if len(split) == n:
        return split
    if isinstance(inputs, torch.Tensor):
        return [[inputs]] + [[] for _ in range(n - 1)]
    return [[] for _ in range(n)]


def size_mismatch_problem(declared: Optional[Tuple[int, int]],
                          sample: Any) -> Optional[DataProblem]:
    """The problem of an annotation that declares another image size.

    Datasets drop boxes outside the *declared* size at load time, and the
    pipeline clips to the image as loaded: a box beyond the real border
    passes the first and is clipped, often to zero size, by the second. A
    wrong export, or an EXIF orientation the loader applied, does that.

    Args:
        declared (tuple[int, int], optional): ``(width, height)`` the
            annotation gives.
        sample: The data sample; its ``ori_shape`` is the loaded image's.

    Returns:
        DataProblem | None: The problem, or ``None`` when the sizes agree.
    """
    shape = _metainfo(sample).get('ori_shape')
    if shape is None or len(shape) < 2:
        return None
    return declared_size_problem(
        declared, (int(shape[1]), int(shape[0])),
        'as loaded (ori_shape): boxes beyond its real border passed the '
        'dataset\'s filter and the pipeline clipped them')


def declared_size_problem(declared: Optional[Tuple[int, int]],
                          real: Tuple[int, int],
                          how: str) -> Optional[DataProblem]:
    """The problem of a declared image size that is not the real one.

    Args:
        declared (tuple[int, int], optional): ``(width, height)`` the
            annotation gives.
        real (tuple[int, int]): ``(width, height)`` of the image as the
            pipeline loads it.
        how (str): How ``real`` was learnt and what follows, the end of the
            sentence.

    Returns:
        DataProblem | None: The problem, or ``None`` when the sizes agree.
    """
    if declared is None:
        return None
    width, height = real
    dw, dh = int(declared[0]), int(declared[1])
    if (dw, dh) == (width, height):
        return None
    text = ('the annotation declares the image {}x{} (width x height) but '
            'the file is {}x{} {}'.format(dw, dh, width, height, how))
    if (dw, dh) == (height, width):
        text += ('; the declared size is the file\'s turned by 90 degrees: '
                 'an EXIF orientation the image loader applied')
    return DataProblem(ProblemCategory.SIZE_MISMATCH, text)


def annotations(dataset: Any, data_batch: Any,
                infos: Optional[Dict[int, Any]] = None,
                identities: Optional[Sequence[Any]] = None
                ) -> List[Optional[Dict[str, Any]]]:
    """What the annotations say of a batch's images: size and boxes.

    The data info of each sample's dataset index, or (index unknown) of
    the sample that loads its ``img_path`` (through dataset wrappers such as
    ``RepeatDataset``, with the dataset's
    :class:`~mmnanhook.quarantine.SampleIndex`, built once per dataset).

    Args:
        dataset: The train dataset (an mmengine ``BaseDataset``).
        data_batch (dict): The batch.
        infos (dict, optional): Filled with batch position -> the sample's
            data info as the dataset gives it (what its pipeline is given).
        identities (list[SampleId], optional): Per sample, its dataset
            index and file (:func:`~mmnanhook.quarantine.name_samples`).

    Returns:
        list: One ``{'declared': (width, height) | None, 'boxes': [[...]]}``
        per sample (boxes in the file's own coordinates, as annotated), or
        ``None`` where the sample was not found.
    """
    samples = (data_batch or {}).get('data_samples') or []
    if not isinstance(samples, (list, tuple)):
        # mmyolo's yolov5_collate: no sample's metainfo.
        samples = []
    n = max(len(samples), len(identities or ()))
    identities = list(identities or []) + [None] * n
    found = [None] * n
    wanted = {}
    if hasattr(dataset, 'get_data_info'):
        for i, who in enumerate(identities):
            if who is not None and who.index is not None:
                info = dataset.get_data_info(who.index)
                if isinstance(info, dict) and (who.file is None or str(
                        info.get('img_path')) == who.file):
                    found[i] = annotation_of(dataset, info)
                    if infos is not None:
                        infos[i] = info
    for i, s in enumerate(samples):
        if found[i] is None:
            wanted[sample_img_path(s)] = i
    while dataset is not None and not hasattr(dataset, 'get_data_info'):
        dataset = getattr(dataset, 'dataset', None)
    wanted.pop(None, None)
    if dataset is None or not wanted:
        return found
    index = sample_index(dataset)
    for path, i in wanted.items():
        _, info = index.first(path)
        if info is not None:
            found[i] = annotation_of(dataset, info)
            if infos is not None:
                infos[i] = info
    return found


def annotation_of(dataset: Any, info: Dict[str, Any]) -> Dict[str, Any]:
    """What one data info says of its image: ``{'declared': (width,
    height) | None, 'boxes': [[...], ...]}``, boxes as annotated (in the
    file's own coordinates)."""
    boxes = [[float(v) for v in inst['bbox']]
             for inst in info.get('instances') or [] if 'bbox' in inst]
    return dict(declared=declared_size(dataset, info), boxes=boxes)


def declared_sizes(found: Optional[Sequence[Optional[Dict[str, Any]]]]
                   ) -> List[Optional[Tuple[int, int]]]:
    """The declared ``(width, height)`` of each sample of
    :func:`annotations`' answer."""
    return [a.get('declared') if a else None for a in found or []]


def declared_size(dataset: Any,
                  info: Dict[str, Any]) -> Optional[Tuple[int, int]]:
    """``(width, height)`` a data info declares, or ``None``.

    A size every info shares from the dataset's own ``img_shape`` setting
    (mmrotate's ``DOTADataset``) is a placeholder, not a declaration.
    """
    width, height = info.get('width'), info.get('height')
    if width is None or height is None:
        return None
    placeholder = getattr(dataset, 'img_shape', None)
    if placeholder is not None and tuple(placeholder)[:2] == (height, width):
        return None
    return int(width), int(height)


def check_batch(data_batch: Any,
                angle_range: Optional[Tuple[float, float]] = None,
                min_size: float = DEFAULT_MIN_SIZE,
                declared: Optional[Sequence[Optional[Tuple[int, int]]]] = None,
                identities: Optional[Sequence[Any]] = None
                ) -> List[SampleFinding]:
    """Check every sample of a batch for non-finite inputs and targets and
    bad GT boxes.

    Args:
        data_batch (dict): The batch as the dataloader produced it, e.g.
            ``{'inputs': [uint8 CHW tensors],
            'data_samples': [DetDataSample]}``.
        angle_range (tuple[float, float], optional): Allowed rotated-box
            angles in radians.
        min_size (float): Box sides at or below this are degenerate.
        declared (list, optional): Per sample, the ``(width, height)`` its
            annotation declares (:func:`declared_sizes`); a mismatch with
            the image as loaded is the sample's first problem.
        identities (list[SampleId], optional): Per sample, its dataset
            index and file (:func:`~mmnanhook.quarantine.name_samples`): a
            finding's file where its metainfo names none (mmyolo's
            ``yolov5_collate`` keeps no metainfo).

    Returns:
        list[SampleFinding]: One per sample of the batch (``problems`` may
        be empty); empty when the batch has no recognisable per-sample
        layout.
    """
    n = batch_size(data_batch)
    if not n or not isinstance(data_batch, Mapping):
        return []
    samples = data_batch.get('data_samples')
    if not isinstance(samples, (list, tuple)) or len(samples) != n:
        samples = [None] * n
    inputs = _per_sample_inputs(data_batch.get('inputs'), n)
    results = []
    declared = list(declared or []) + [None] * n
    identities = list(identities or []) + [None] * n
    for i, sample in enumerate(samples):
        problems = []
        mismatch = size_mismatch_problem(declared[i], sample)
        if mismatch:
            problems.append(mismatch)
        for tensor in inputs[i]:
            problem = _nonfinite_problem(tensor, 'input')
            if problem:
                problems.append(problem)
        gt = getattr(sample, 'gt_instances', None)
        boxes = getattr(gt, 'bboxes', None) if gt is not None else None
        if boxes is not None:
            problems.extend(
                check_boxes(boxes, _image_hw(sample), angle_range, min_size))
        problems.extend(nonfinite_targets(sample))
        who = identities[i]
        results.append(SampleFinding(
            i, sample_img_path(sample) or (who.file if who else None),
            capped(problems), who.index if who else None))
    return results


def capped(problems: List[DataProblem]) -> List[DataProblem]:
    """The first :data:`MAX_PROBLEMS_PER_SAMPLE` of one sample's problems,
    and how many more there were.

    Args:
        problems (list[DataProblem]): All of them.
    """
    if len(problems) <= MAX_PROBLEMS_PER_SAMPLE:
        return problems
    extra = len(problems) - MAX_PROBLEMS_PER_SAMPLE
    return problems[:MAX_PROBLEMS_PER_SAMPLE] + [
        DataProblem(None, '... and {} more'.format(extra))]
