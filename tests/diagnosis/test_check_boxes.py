"""``check_boxes`` tests a sample's boxes as whole tensors and words only the
flagged ones: on samples of many boxes of every kind, it must say exactly what
the box-by-box check it replaced said (kept here as the reference), in the
same order."""
import math

import numpy as np
import pytest
import torch

from mmnanhook._boxes import as_box_tensor
from mmnanhook.diagnosis import check_boxes
from mmnanhook.diagnosis._data import (_ANGLE_TOL, DEFAULT_MIN_SIZE,
                                       _extent, _num, _side_problem, _sides)
from mmnanhook.records import DataProblem, ProblemCategory


def _box_by_box(boxes, image_hw=None, angle_range=None,
                min_size=DEFAULT_MIN_SIZE):
    """The loop over boxes ``check_boxes`` was before it was vectorised."""
    kind, t = as_box_tensor(boxes)
    if kind is None or t.shape[0] == 0:
        return []
    problems = []
    finite = torch.isfinite(t).all(dim=1)
    width, height, names = _sides(kind, t)
    x1, y1, x2, y2 = _extent(kind, t)
    for i in range(t.shape[0]):
        if not bool(finite[i]):
            coords = ', '.join(_num(v) for v in t[i].tolist())
            problems.append(DataProblem(
                ProblemCategory.NONFINITE_BOX,
                'gt box {} has non-finite coordinates ({})'.format(i, coords),
                i))
            continue
        for name, value in zip(names, (float(width[i]), float(height[i]))):
            if value <= min_size:
                problems.append(_side_problem(i, name, value))
        if image_hw is not None:
            img_h, img_w = image_hw
            if x2[i] <= 0 or y2[i] <= 0 or x1[i] >= img_w or y1[i] >= img_h:
                problems.append(DataProblem(
                    ProblemCategory.OUTSIDE,
                    'gt box {} lies outside the {}x{} image '
                    '(x {}..{}, y {}..{})'.format(
                        i, int(img_w), int(img_h), _num(x1[i]), _num(x2[i]),
                        _num(y1[i]), _num(y2[i])), i))
        if kind == 'rbox' and angle_range is not None:
            angle = float(t[i, 4])
            low, high = angle_range
            if not low - _ANGLE_TOL <= angle <= high + _ANGLE_TOL:
                problems.append(DataProblem(
                    ProblemCategory.ANGLE,
                    'gt box {} has angle {} rad outside the configured range '
                    '[{}, {}]'.format(i, _num(angle), _num(low), _num(high)),
                    i))
    return problems


def _many(width, n=3000, seed=0):
    """``n`` boxes of ``width`` columns, a tenth of each kind of fault."""
    rng = np.random.RandomState(seed)
    xy = rng.uniform(-20, 120, (n, 2))
    wh = rng.uniform(0, 30, (n, 2))
    kind = rng.randint(0, 10, n)
    wh[kind == 1, 0] = 0                        # zero width
    wh[kind == 2, 1] = rng.uniform(0, 2e-3, (kind == 2).sum())  # near zero
    wh[kind == 3] *= -1                         # negative sides
    wh[kind == 4, 0] = DEFAULT_MIN_SIZE         # on the threshold,
    xy[kind == 4, 0] = 0                        # exactly (x2 - x1 too)
    xy[kind == 5] += 500                        # outside
    if width == 4:
        boxes = np.concatenate([xy, xy + wh], 1)
    elif width == 5:
        angle = rng.uniform(-math.pi, math.pi, (n, 1))
        angle[kind == 6] = math.pi / 2 + _ANGLE_TOL  # on the bound's slack
        boxes = np.concatenate([xy, wh, angle], 1)
    else:
        x, y, w, h = xy[:, 0], xy[:, 1], wh[:, 0], wh[:, 1]
        corners = np.stack([np.stack(c, 1) for c in (
            (x, y), (x + w, y), (x + w, y + h), (x, y + h))], 1)
        corners[kind == 6, :, 1] = y[kind == 6, None]  # collinear points
        boxes = corners.reshape(n, 8)
    boxes[kind == 7, rng.randint(0, width)] = np.nan
    boxes[kind == 8, 0] = np.inf
    return torch.from_numpy(boxes)


@pytest.mark.parametrize('width', [4, 5, 8], ids=['hbox', 'rbox', 'qbox'])
@pytest.mark.parametrize('image_hw', [None, (64.0, 96.0)])
def test_whole_tensor_checks_say_what_the_box_by_box_ones_said(width,
                                                               image_hw):
    boxes = _many(width)
    angle_range = (-math.pi / 2, math.pi / 2)
    found = check_boxes(boxes, image_hw, angle_range)
    expected = _box_by_box(boxes, image_hw, angle_range)
    assert len(found) > 1000
    assert [(p.category, p.text, p.box) for p in found] == [
        (p.category, p.text, p.box) for p in expected]
    categories = set(p.category for p in found)
    assert {ProblemCategory.NONFINITE_BOX,
            ProblemCategory.DEGENERATE} <= categories
    if image_hw is not None:
        assert ProblemCategory.OUTSIDE in categories
    if width == 5:
        assert ProblemCategory.ANGLE in categories


def test_float32_boxes_and_arrays_alike():
    boxes = _many(4, n=500, seed=1).float()
    assert [p.text for p in check_boxes(boxes.numpy(), (64, 96))] == [
        p.text for p in _box_by_box(boxes, (64, 96))]
    assert check_boxes(boxes[:0]) == []
