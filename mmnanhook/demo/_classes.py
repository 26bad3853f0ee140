"""Synthetic datasets labelled by class rather than by box: an image's class
(mmpretrain's ImageNet layout) and a pixel's (mmseg's ADE20K layout), in the
same textures and shapes as :mod:`.synthetic`'s detection writers; equal
arguments give byte-identical files.

* ImageNet (mmpretrain ``ImageNet`` / ``CustomDataset``):
  ``train/<class>/<name>.png`` and ``meta/train.txt``, one
  ``<relative path> <label>`` line an image.
* ADE20K (mmseg ``ADE20KDataset``): ``images/training/<name>.jpg`` and
  ``annotations/training/<name>.png`` label maps.

``mmnan drill`` writes them as the stand-in of a config's data that is not
on this machine; the zoo tests train the shipped configs on them.
"""
from __future__ import annotations

import os
import os.path as osp
from typing import Any, Dict

import numpy as np

from .synthetic import (_class_color, _clean_hboxes, _fill, _hbox_polygon,
                        _image_rng, _texture, _write_image)

IMAGENET_SPLIT = 'train'
IMAGENET_ANN_FILE = 'meta/train.txt'
ADE_IMG_DIR = 'images/training'
ADE_ANN_DIR = 'annotations/training'


def make_imagenet_dataset(root: str, num_images: int = 8,
                          image_size: int = 64, seed: int = 0,
                          num_classes: int = 4) -> Dict[str, Any]:
    """Write an ImageNet-layout classification dataset (mmpretrain
    ``ImageNet``).

    ``train/<class>/<name>.png`` files and ``meta/train.txt`` with one
    ``<relative path> <label>`` line per image; labels are class indices
    ``0 .. num_classes - 1``, in turn.

    Args:
        root (str): Directory to write into (created if missing).
        num_images (int): Number of images.
        image_size (int): Side of the square images, in pixels.
        seed (int): Seed; equal arguments give byte-identical files.
        num_classes (int): How many classes the labels cycle through.

    Returns:
        dict: ``data_root``, ``ann_file``, ``images`` (relative paths) and
        ``labels``.
    """
    names, labels, lines = [], [], []
    for i in range(num_images):
        rng = _image_rng(seed, i)
        label = i % num_classes
        img = _texture(rng, image_size)
        size = image_size // 2
        x, y = rng.randint(0, image_size - size + 1, 2)
        _fill(img, _hbox_polygon((x, y, x + size, y + size)),
              _class_color(label, num_classes))
        name = 'n%05d/%06d.png' % (label, i)
        path = osp.join(root, IMAGENET_SPLIT, name)
        os.makedirs(osp.dirname(path), exist_ok=True)
        _write_image(path, img)
        names.append(name)
        labels.append(label)
        lines.append('%s %d' % (name, label))
    os.makedirs(osp.join(root, osp.dirname(IMAGENET_ANN_FILE)), exist_ok=True)
    with open(osp.join(root, IMAGENET_ANN_FILE), 'w') as f:
        f.write('\n'.join(lines) + '\n')
    return dict(data_root=osp.abspath(root), ann_file=IMAGENET_ANN_FILE,
                images=names, labels=labels)


def make_ade20k_dataset(root: str, num_images: int = 8, image_size: int = 64,
                        seed: int = 0, num_classes: int = 150,
                        reduce_zero_label: bool = True) -> Dict[str, Any]:
    """Write an ADE20K-layout segmentation dataset (mmseg ``ADE20KDataset``).

    ``images/training/<name>.jpg`` and ``annotations/training/<name>.png``
    label maps: 1-3 objects on a background of 0.

    Args:
        root (str): Directory to write into (created if missing).
        num_images (int): Number of images.
        image_size (int): Side of the square images, in pixels.
        seed (int): Seed; equal arguments give byte-identical files.
        num_classes (int): How many classes the objects are of.
        reduce_zero_label (bool): The dataset reads 0 as "other" (ignored)
            and ``k`` as class ``k - 1`` (ADE20K's own): objects carry
            labels ``1 .. num_classes``; else ``0 .. num_classes - 1`` (the
            background then is class 0, as a dataset without "other" has
            it).

    Returns:
        dict: ``data_root``, ``img_dir``, ``ann_dir`` and ``images``.
    """
    for sub in (ADE_IMG_DIR, ADE_ANN_DIR):
        os.makedirs(osp.join(root, sub), exist_ok=True)
    first = 1 if reduce_zero_label else 0
    names = []
    for i in range(num_images):
        rng = _image_rng(seed, i)
        img = _texture(rng, image_size)
        seg = np.zeros((image_size, image_size), np.uint8)
        boxes, _ = _clean_hboxes(rng, image_size, num_classes)
        for x1, y1, x2, y2 in boxes:
            label = first + rng.randint(num_classes)
            _fill(img, _hbox_polygon((x1, y1, x2, y2)),
                  _class_color(label, num_classes + 1))
            seg[y1:y2, x1:x2] = label
        name = '%06d' % i
        _write_image(osp.join(root, ADE_IMG_DIR, name + '.jpg'), img)
        _write_image(osp.join(root, ADE_ANN_DIR, name + '.png'), seg)
        names.append(name)
    return dict(data_root=osp.abspath(root), img_dir=ADE_IMG_DIR,
                ann_dir=ADE_ANN_DIR, images=names)
