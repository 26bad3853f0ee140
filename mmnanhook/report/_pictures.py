"""Pictures of the samples a report implicates.

For each implicated sample, two pictures:

* ``input``: the image *as the model saw it*: the batch after the model's
  data preprocessor, de-normalized with its mean / std and channel order,
  the padding cut off; every GT box drawn (horizontal boxes as rectangles,
  rotated and quadrilateral boxes as polygons), the offending ones in red
  and labelled with their problem.
* ``file``: when the image file can be read, the file's own pixels (EXIF
  orientation *not* applied) with the annotation's boxes in the file's
  coordinates, and the image size the annotation declares as a dashed
  frame: a declared-size mismatch or an EXIF rotation shows at a glance.

Failure path only; everything is drawn with OpenCV (which mmcv brings).
"""
from __future__ import annotations

import copy
import os.path as osp
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import cv2
import numpy as np
import torch

from .. import compat
from .._boxes import as_box_tensor, rbox_corners
from ..records import DataProblem

# BGR colours.
_GOOD = (60, 180, 75)
_BAD = (30, 30, 230)
_FRAME = (200, 130, 0)
_MAX_SIDE = 640


class Picture(object):
    """One drawn picture.

    Attributes:
        index (int): The sample's position in the batch.
        view (str): ``'input'`` or ``'file'``.
        title (str): What it shows.
        image (numpy.ndarray): ``H x W x 3`` uint8, BGR.
    """

    def __init__(self, index: int, view: str, title: str,
                 image: np.ndarray) -> None:
        self.index = index
        self.view = view
        self.title = title
        self.image = image

    @property
    def name(self) -> str:
        """Its file name in a bundle."""
        return 'sample{}_{}.png'.format(self.index, self.view)

    def png(self) -> bytes:
        """The PNG bytes."""
        ok, data = cv2.imencode('.png', self.image)
        if not ok:
            raise ValueError('cannot encode {}'.format(self.name))
        return data.tobytes()

    def rgb(self) -> np.ndarray:
        """``H x W x 3`` uint8 RGB, as visualizer backends take it."""
        return self.image[:, :, ::-1].copy()


def _polygons(boxes):
    """(kind, list of N x 2 int point arrays) of boxes, or (None, [])."""
    kind, t = as_box_tensor(boxes)
    if kind is None:
        return None, []
    if kind == 'hbox':
        x1, y1, x2, y2 = t.unbind(-1)
        pts = torch.stack([torch.stack([x1, y1], -1),
                           torch.stack([x2, y1], -1),
                           torch.stack([x2, y2], -1),
                           torch.stack([x1, y2], -1)], 1)
    elif kind == 'rbox':
        pts = rbox_corners(t)
    else:
        pts = t.view(-1, 4, 2)
    pts = compat.nan_to_num(pts, nan=0.0, posinf=1e4, neginf=-1e4)
    return kind, [p.round().to(torch.int64).numpy() for p in pts]


def _label(image, text, origin, color):
    x, y = int(origin[0]), int(origin[1])
    h, w = image.shape[:2]
    (tw, th), _ = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, 0.4, 1)
    x = min(max(x, 0), max(w - tw - 2, 0))
    y = min(max(y, th + 2), h - 2)
    cv2.rectangle(image, (x, y - th - 2), (x + tw + 2, y + 2), (255, 255, 255),
                  -1)
    cv2.putText(image, text, (x + 1, y), cv2.FONT_HERSHEY_SIMPLEX, 0.4, color,
                1, cv2.LINE_AA)


def _bad_boxes(problems):
    """Box index -> its first problem's text, for problems naming a box."""
    bad = {}
    for problem in problems:
        if isinstance(problem, DataProblem) and problem.box is not None:
            bad.setdefault(problem.box, problem.text)
    return bad


def draw_boxes(image: np.ndarray, boxes: Any, problems: Iterable[Any] = (),
               scale: float = 1.0,
               offset: Tuple[int, int] = (0, 0)) -> List[int]:
    """Draw ``boxes`` on ``image`` (in place); offending ones red, labelled.

    Args:
        image (numpy.ndarray): ``H x W x 3`` uint8 BGR.
        boxes: Any box structure :mod:`mmnanhook.diagnosis` recognises.
        problems (list[DataProblem]): The sample's problems; those naming a
            box index mark that box.
        scale (float): Multiplies the coordinates (a resized picture).
        offset (tuple[int, int]): Added after scaling.

    Returns:
        list[int]: Indices of the boxes drawn red.
    """
    _, polygons = _polygons(boxes)
    bad = _bad_boxes(problems)
    for index, points in enumerate(polygons):
        pts = (points * scale).astype(np.int64) + np.asarray(offset)
        color = _BAD if index in bad else _GOOD
        thickness = 2 if index in bad else 1
        cv2.polylines(image, [pts.reshape(-1, 1, 2).astype(np.int32)], True,
                      color, thickness, cv2.LINE_AA)
        if index in bad:
            # A zero-size box is a point or a line: a ring makes it visible.
            center = pts.mean(axis=0)
            cv2.circle(image, (int(center[0]), int(center[1])), 6, _BAD, 1,
                       cv2.LINE_AA)
            _label(image, bad[index], pts.min(axis=0) - (0, 4), _BAD)
    return sorted(bad)


def _fit(image):
    """``image`` enlarged (small ones) or shrunk to about ``_MAX_SIDE``."""
    h, w = image.shape[:2]
    scale = float(_MAX_SIDE) / max(h, w, 1)
    if 0.9 < scale < 1.1:
        return image, 1.0
    size = (max(int(round(w * scale)), 1), max(int(round(h * scale)), 1))
    interp = cv2.INTER_NEAREST if scale > 1 else cv2.INTER_AREA
    return cv2.resize(image, size, interpolation=interp), scale


def _denormalized(model, data_batch):
    """The preprocessed batch as ``[(BGR uint8 image, data sample)]``."""
    preprocessor = getattr(model, 'data_preprocessor', None)
    if preprocessor is None:
        return None
    with torch.no_grad():
        data = preprocessor(copy.deepcopy(data_batch), True)
    inputs = data.get('inputs')
    samples = data.get('data_samples')
    if not isinstance(samples, (list, tuple)):
        # mmagic's preprocessor stacks the samples into one DataSample:
        # each sample's metainfo is the batch's own sample's.
        samples = data_batch.get('data_samples') if isinstance(
            data_batch, dict) else None
    if not isinstance(samples, (list, tuple)):
        samples = []
    if not torch.is_tensor(inputs) or inputs.dim() != 4:
        return None
    x = inputs.detach().float().cpu()
    if getattr(preprocessor, '_enable_normalize', False):
        x = x * preprocessor.std.cpu() + preprocessor.mean.cpu()
    if getattr(preprocessor, '_channel_conversion', False) and x.shape[1] == 3:
        x = x[:, [2, 1, 0]]  # back to the BGR the loader gave
    result = []
    for i, sample in enumerate(samples):
        image = pipeline_image(x[i].round())
        shape = getattr(sample, 'metainfo', {}).get('img_shape')
        if shape is not None:
            image = image[:int(shape[0]), :int(shape[1])]  # padding off
        result.append((np.ascontiguousarray(image), sample))
    return result


def _input_picture(index, image, sample, problems):
    image, scale = _fit(image.copy())
    gt = getattr(sample, 'gt_instances', None)
    boxes = getattr(gt, 'bboxes', None) if gt is not None else None
    bad = draw_boxes(image, boxes, problems, scale) if boxes is not None \
        else []
    title = 'sample {}: as the model saw it (after the data preprocessor, ' \
        'de-normalized, padding removed){}'.format(
            index, '; offending GT box(es) {} in red'.format(
                ', '.join(map(str, bad))) if bad else '')
    return Picture(index, 'input', title, image)


def _file_picture(index, path, annotation):
    raw = cv2.imread(path, cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if raw is None:
        return None
    h, w = raw.shape[:2]
    declared = (annotation or {}).get('declared')
    dw, dh = declared if declared else (w, h)
    canvas = np.full((max(h, int(dh)), max(w, int(dw)), 3), 245, np.uint8)
    canvas[:h, :w] = raw
    canvas, scale = _fit(canvas)
    if declared and tuple(declared) != (w, h):
        corner = (int(dw * scale) - 1, int(dh * scale) - 1)
        cv2.rectangle(canvas, (0, 0), corner, _FRAME, 1, cv2.LINE_4)
        _label(canvas, 'declared {}x{}'.format(int(dw), int(dh)),
               (corner[0] - 90, corner[1] - 4), _FRAME)
        _label(canvas, 'file {}x{}'.format(w, h), (4, int(h * scale) - 4),
               _FRAME)
    boxes = (annotation or {}).get('boxes')
    if boxes:
        draw_boxes(canvas, torch.tensor(boxes, dtype=torch.float64), (),
                   scale)
    title = 'sample {}: the file as stored ({}x{}, EXIF orientation not ' \
        'applied){}'.format(index, w, h, ' with the annotation\'s boxes'
                            if boxes else '')
    return Picture(index, 'file', title, canvas)


def finding_pictures(finding: Any, image: Optional[np.ndarray] = None,
                     sample: Any = None,
                     annotation: Optional[Dict[str, Any]] = None
                     ) -> List[Picture]:
    """The pictures of one implicated sample.

    Args:
        finding (SampleFinding): The sample (``index`` names the pictures).
        image (numpy.ndarray, optional): ``H x W x 3`` uint8 BGR, the image
            as the model saw it; no ``input`` picture without it.
        sample (DetDataSample, optional): Its data sample (GT boxes in the
            coordinates of ``image``).
        annotation (dict, optional): ``{'declared': (w, h), 'boxes':
            [[...], ...]}`` from the dataset, for the ``file`` picture.

    Returns:
        list[Picture]: ``input`` and (file readable) ``file`` pictures.
    """
    pictures = []
    if image is not None:
        pictures.append(_input_picture(finding.index, image, sample,
                                       finding.problems))
    path = finding.img_path
    if path and osp.isfile(path):
        picture = _file_picture(finding.index, path, annotation)
        if picture is not None:
            pictures.append(picture)
    return pictures


def pipeline_image(inputs: torch.Tensor) -> np.ndarray:
    """A pipeline's packed ``C x H x W`` image tensor as ``H x W x 3``
    uint8 (the channel order the loader gave)."""
    image = inputs.detach().cpu().clamp(0, 255).to(torch.uint8)
    image = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
    if image.shape[2] == 1:
        image = np.repeat(image, 3, axis=2)
    return image


def sample_pictures(model: Any, data_batch: Dict[str, Any],
                    samples: Sequence[Any],
                    annotations: Optional[Sequence[Any]] = None
                    ) -> List[Picture]:
    """Pictures of the implicated samples of a batch.

    Args:
        model (BaseModel): The (unwrapped) model, for its data preprocessor.
        data_batch (dict): The raw batch.
        samples (list[SampleFinding]): The samples to draw (``index``: the
            position in the batch).
        annotations (list, optional): Per batch sample, ``{'declared':
            (w, h), 'boxes': [[...], ...]}`` from the dataset, or ``None``.

    Returns:
        list[Picture]: ``input`` and (file readable) ``file`` pictures.
    """
    seen = _denormalized(model, data_batch) if samples else None
    pictures = []
    for finding in samples:
        i = finding.index
        image, sample = (seen[i] if seen is not None and 0 <= i < len(seen)
                         else (None, None))
        annotation = (annotations[i] if annotations
                      and 0 <= i < len(annotations) else None)
        pictures.extend(finding_pictures(finding, image, sample, annotation))
    return pictures


def _wrap(text, width):
    words, lines, line = str(text).split(), [], ''
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = (line + ' ' + word) if line else word
    if line:
        lines.append(line)
    return lines


def report_card(report: Any, iter: Optional[int] = None,
                width: int = 100) -> Picture:
    """The summary and hints of a report as a picture, for visualizer
    backends that take images but no text (TensorBoard, W&B...).

    Args:
        report (Report): The diagnosis.
        iter (int, optional): The trigger's iteration, for the title.
        width (int): Characters per line.
    """
    kind = report.kind.value if report.kind is not None else 'unknown'
    lines = ['mmnanhook: {} at iter {}'.format(kind, iter)] + [''] + \
        _wrap(report.summary, width)
    for hint in report.hints:
        lines.append('')
        lines.extend(_wrap('- ' + hint, width))
    height = 18 * len(lines) + 20
    card = np.full((height, 8 * width + 40, 3), 255, np.uint8)
    for row, text in enumerate(lines):
        color = _BAD if row == 0 else (40, 40, 40)
        cv2.putText(card, text.encode('ascii', 'replace').decode('ascii'),
                    (12, 24 + 18 * row), cv2.FONT_HERSHEY_SIMPLEX, 0.45,
                    color, 1, cv2.LINE_AA)
    return Picture(-1, 'report', 'report summary', card)
