"""A deterministic synthetic COCO-keypoints dataset (mmpose ``CocoDataset``).

The layout is COCO's person keypoints: ``images/*.png`` and
``annotations/person_keypoints_train.json``, one ``person`` category with the
17 COCO keypoint names and skeleton, and for each person an annotation with
``keypoints`` (17 ``[x, y, v]`` triples), ``num_keypoints``, ``bbox``
(``[x, y, w, h]``), ``area`` and ``iscrowd=0``: what mmpose's
``CocoDataset`` reads through xtcocotools (it skips an instance without
``bbox`` or ``keypoints``, and, top-down, a crowd, one with no labelled
keypoint or an empty box).

Each person is a stick figure drawn on the texture of
:mod:`mmnanhook.demo.synthetic` (whose per-image streams, textures and
image writer it shares), so a pose model has something to fit. Everything
depends only on the arguments: equal ones give byte-identical files.
"""
from __future__ import annotations

import json
import os
import os.path as osp
from typing import Any, Dict

import cv2
import numpy as np

from .synthetic import COCO_IMG_DIR, _image_rng, _texture, _write_image

KEYPOINTS_ANN_FILE = 'annotations/person_keypoints_train.json'

KEYPOINT_NAMES = (
    'nose', 'left_eye', 'right_eye', 'left_ear', 'right_ear',
    'left_shoulder', 'right_shoulder', 'left_elbow', 'right_elbow',
    'left_wrist', 'right_wrist', 'left_hip', 'right_hip', 'left_knee',
    'right_knee', 'left_ankle', 'right_ankle')
# COCO's skeleton, 1-based keypoint ids as the official json writes it.
SKELETON = ((16, 14), (14, 12), (17, 15), (15, 13), (12, 13), (6, 12),
            (7, 13), (6, 7), (6, 8), (7, 9), (8, 10), (9, 11), (2, 3),
            (1, 2), (1, 3), (2, 4), (3, 5), (4, 6), (5, 7))

# A person standing, facing the camera: each keypoint in its box, as
# fractions of the box's width and height.
_POSE = np.array([
    (0.50, 0.08), (0.55, 0.06), (0.45, 0.06), (0.60, 0.08), (0.40, 0.08),
    (0.72, 0.24), (0.28, 0.24), (0.82, 0.40), (0.18, 0.40), (0.88, 0.55),
    (0.12, 0.55), (0.62, 0.55), (0.38, 0.55), (0.63, 0.75), (0.37, 0.75),
    (0.64, 0.95), (0.36, 0.95)])


def _person(rng, size):
    """A box ``(x, y, w, h)`` inside the image and its 17 ``[x, y, v]``
    keypoints (a few occluded, ``v=1``, or unlabelled, ``[0, 0, 0]``)."""
    h = float(rng.randint(size // 2, 9 * size // 10 + 1))
    w = float(int(h * rng.uniform(0.4, 0.6)))
    x = float(rng.randint(0, int(size - w) + 1))
    y = float(rng.randint(0, int(size - h) + 1))
    jitter = rng.uniform(-0.04, 0.04, _POSE.shape)
    points = np.clip(_POSE + jitter, 0.0, 1.0) * (w - 1, h - 1) + (x, y)
    visible = np.full(len(_POSE), 2)
    visible[rng.choice(len(_POSE), 2, replace=False)] = 1
    # One unlabelled keypoint in some persons (never all: the dataset skips
    # a person without a labelled one).
    if rng.randint(2):
        visible[rng.randint(len(_POSE))] = 0
    keypoints = []
    for (px, py), v in zip(points, visible):
        keypoints.extend([0.0, 0.0, 0] if v == 0 else
                         [round(float(px), 1), round(float(py), 1), int(v)])
    return (x, y, w, h), keypoints


def _draw(img, keypoints, color):
    points = np.asarray(keypoints, dtype=np.float64).reshape(-1, 3)
    for a, b in SKELETON:
        pa, pb = points[a - 1], points[b - 1]
        if pa[2] > 0 and pb[2] > 0:
            cv2.line(img, (int(round(pa[0])), int(round(pa[1]))),
                     (int(round(pb[0])), int(round(pb[1]))), color, 2)
    for px, py, v in points:
        if v > 0:
            cv2.circle(img, (int(round(px)), int(round(py))), 2,
                       (255, 255, 255), -1)


def make_coco_keypoints_dataset(root: str, num_images: int = 8,
                                image_size: int = 128, seed: int = 0,
                                persons: int = 1) -> Dict[str, Any]:
    """Write a COCO person-keypoints dataset (for mmpose ``CocoDataset``).

    Args:
        root (str): Directory to write into (created if missing).
        num_images (int): Number of images.
        image_size (int): Side of the square images, in pixels.
        seed (int): Seed; equal arguments give byte-identical files.
        persons (int): People in each image: a top-down dataset makes one
            sample of each, so with one each a sample is its image.

    Returns:
        dict: ``data_root``, ``ann_file``, ``img_dir`` (absolute paths),
        ``classes`` (``('person',)``), ``images`` (file names),
        ``instances`` (the number of persons), and ``defects`` /
        ``defect_images`` (empty: nothing is planted), as
        :func:`~mmnanhook.demo.synthetic.make_coco_dataset` returns.
    """
    if persons < 1:
        raise ValueError('persons must be >= 1, got %r' % (persons, ))
    os.makedirs(osp.join(root, COCO_IMG_DIR), exist_ok=True)
    os.makedirs(osp.dirname(osp.join(root, KEYPOINTS_ANN_FILE)),
                exist_ok=True)
    images, annotations, names = [], [], []
    for i in range(num_images):
        # The detection datasets' stream for image i: its texture too.
        rng = _image_rng(seed, i)
        img = _texture(rng, image_size)
        name = '%06d.png' % i
        for _ in range(persons):
            (x, y, w, h), keypoints = _person(rng, image_size)
            color = tuple(int(c) for c in rng.randint(0, 256, 3))
            _draw(img, keypoints, color)
            annotations.append(dict(
                id=len(annotations) + 1, image_id=i + 1, category_id=1,
                iscrowd=0, bbox=[x, y, w, h], area=w * h,
                keypoints=keypoints,
                num_keypoints=int(sum(1 for v in keypoints[2::3] if v > 0))))
        _write_image(osp.join(root, COCO_IMG_DIR, name), img)
        names.append(name)
        images.append(dict(id=i + 1, file_name=name, width=image_size,
                           height=image_size))
    coco = dict(
        images=images, annotations=annotations,
        categories=[dict(id=1, name='person', supercategory='person',
                         keypoints=list(KEYPOINT_NAMES),
                         skeleton=[list(s) for s in SKELETON])])
    with open(osp.join(root, KEYPOINTS_ANN_FILE), 'w') as f:
        json.dump(coco, f, indent=1, sort_keys=True)
    absolute = osp.abspath(root)
    return dict(data_root=absolute, classes=('person', ), images=names,
                instances=len(annotations), defects=[], defect_images=[],
                ann_file=osp.join(absolute, KEYPOINTS_ANN_FILE),
                img_dir=osp.join(absolute, COCO_IMG_DIR))
