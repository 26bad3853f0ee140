"""Batch checks of the tier-2 diagnosis: boxes, inputs, batch splitting."""
import math

import torch
from mmengine.config import Config
from mmengine.structures import BaseDataElement, InstanceData

from mmnanhook.diagnosis._data import (ANGLE_RANGES, angle_range_from_config,
                                       batch_size, check_batch, check_boxes,
                                       split_batch)


def test_horizontal_box_problems_are_described_per_box():
    boxes = torch.tensor([
        [0., 0., 10., 10.],  # fine
        [5., 5., 5., 9.],  # zero width
        [1., 8., 4., 2.],  # negative height
        [1., 1., 1 + 2**-11, 3.],  # near-zero width
        [float('nan'), 0., 3., 3.],
        [40., 40., 50., 50.],  # outside a 32x32 image
        [2., 2., 2.4, 2.4],  # tiny but not degenerate
    ])
    problems = check_boxes(boxes, image_hw=(32, 32))
    assert [p.text for p in problems] == [
        'gt box 1 has zero width (w=0)',
        'gt box 2 has negative height (h=-6)',
        'gt box 3 has near-zero width (w=0.000488281)',
        'gt box 4 has non-finite coordinates (nan, 0, 3, 3)',
        'gt box 5 lies outside the 32x32 image (x 40..50, y 40..50)',
    ]
    assert [p.category for p in problems] == [
        'degenerate', 'degenerate', 'degenerate', 'nonfinite_box', 'outside']
    assert [p.box for p in problems] == [1, 2, 3, 4, 5]


def test_rotated_and_quadrilateral_boxes_by_width():
    le90 = ANGLE_RANGES['le90']
    rboxes = torch.tensor([
        [10., 10., 4., 2., 0.3],  # fine
        [10., 10., 0., 2., 0.3],  # zero width
        [10., 10., 4., 2., 2.0],  # angle above pi/2
        [10., 10., 4., 2., math.pi / 2],  # on the bound: fine
    ])
    problems = check_boxes(rboxes, image_hw=(32, 32), angle_range=le90)
    assert [p.text for p in problems] == [
        'gt box 1 has zero width (w=0)',
        'gt box 2 has angle 2 rad outside the configured range '
        '[-1.5708, 1.5708]',
    ]
    assert problems[1].category == 'angle'
    assert check_boxes(rboxes[2:3], angle_range=None) == []
    quads = torch.tensor([
        [0., 0., 4., 0., 4., 3., 0., 3.],  # a 4x3 rectangle
        [0., 0., 2., 2., 4., 4., 6., 6.],  # collinear
    ])
    assert [p.text for p in check_boxes(quads)] == [
        'gt box 1 has zero thickness (t=0)']


def test_angle_range_from_config():
    cfg = Config(dict(angle_version='le135',
                      model=dict(bbox_head=dict(angle_version='oc'))))
    assert angle_range_from_config(cfg) == ANGLE_RANGES['le135']
    nested = Config(dict(model=dict(
        bbox_head=dict(bbox_coder=dict(angle_version='oc')))))
    assert angle_range_from_config(nested) == (0.0, math.pi / 2)
    assert angle_range_from_config(dict(model=dict(type='RetinaNet'))) is None


def _sample(path, boxes):
    sample = BaseDataElement(metainfo=dict(img_path=path, img_shape=(16, 16)))
    sample.gt_instances = InstanceData(bboxes=torch.tensor(boxes))
    return sample


def test_check_batch_reports_every_sample_with_its_path():
    bad_input = torch.rand(3, 16, 16)
    bad_input[0, 1, 2] = float('inf')
    batch = {
        'inputs': [torch.zeros(3, 16, 16, dtype=torch.uint8), bad_input],
        'data_samples': [
            _sample('a.jpg', [[1., 1., 5., 5.]]),
            _sample('b.jpg', [[1., 1., 5., 5.], [2., 3., 8., 3.]])],
    }
    assert [s.to_dict() for s in check_batch(batch)] == [
        {'index': 0, 'img_path': 'a.jpg', 'problems': []},
        {'index': 1, 'img_path': 'b.jpg', 'problems': [
            'input has 0 NaN and 1 Inf values',
            'gt box 1 has zero height (h=0)']},
    ]
    assert [p.category for p in check_batch(batch)[1].problems] == [
        'nonfinite_input', 'degenerate']


def test_split_batch_keeps_per_sample_entries_only():
    batch = {'inputs': torch.arange(6.).view(3, 2),
             'data_samples': ['a', 'b', 'c'],
             'meta': {'scale': 2.0, 'ids': [7, 8, 9]}}
    assert batch_size(batch) == 3
    sub = split_batch(batch, [2])
    assert torch.equal(sub['inputs'], torch.tensor([[4., 5.]]))
    assert sub['data_samples'] == ['c']
    assert sub['meta'] == {'scale': 2.0, 'ids': [9]}
    assert batch_size({'other': 1}) is None
