"""ImageNet- and ADE20K-layout datasets for the mmpretrain and mmseg zoo
tests (the package's :mod:`mmnanhook.demo.synthetic` writes the detection
formats a user can try mmnanhook on).

The same textures and shapes as the package's writers; equal arguments give
byte-identical files.
"""
import os
import os.path as osp

import numpy as np

from mmnanhook.demo.synthetic import (_class_color, _clean_hboxes, _fill,
                                      _hbox_polygon, _image_rng, _texture,
                                      _write_image)



IMAGENET_SPLIT = 'train'
IMAGENET_ANN_FILE = 'meta/train.txt'
ADE_IMG_DIR = 'images/training'
ADE_ANN_DIR = 'annotations/training'


def make_imagenet_dataset(root, num_images=8, image_size=64, seed=0,
                          num_classes=4):
    """Write an ImageNet-layout classification dataset (mmpretrain ``ImageNet``).

    ``train/<class>/<name>.png`` files and ``meta/train.txt`` with one
    ``<relative path> <label>`` line per image; labels are ImageNet-1k
    indices ``0 .. num_classes - 1``.

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


def make_ade20k_dataset(root, num_images=8, image_size=64, seed=0,
                        num_classes=150):
    """Write an ADE20K-layout segmentation dataset (mmseg ``ADE20KDataset``).

    ``images/training/<name>.jpg`` and ``annotations/training/<name>.png``
    label maps: 0 is "other" (ignored under ``reduce_zero_label``), objects
    carry labels ``1 .. num_classes``.

    Args:
        root (str): Directory to write into (created if missing).
        num_images (int): Number of images.
        image_size (int): Side of the square images, in pixels.
        seed (int): Seed; equal arguments give byte-identical files.
        num_classes (int): Largest label value written.

    Returns:
        dict: ``data_root``, ``img_dir``, ``ann_dir`` and ``images``.
    """
    for sub in (ADE_IMG_DIR, ADE_ANN_DIR):
        os.makedirs(osp.join(root, sub), exist_ok=True)
    names = []
    for i in range(num_images):
        rng = _image_rng(seed, i)
        img = _texture(rng, image_size)
        seg = np.zeros((image_size, image_size), np.uint8)
        boxes, _ = _clean_hboxes(rng, image_size, num_classes)
        for x1, y1, x2, y2 in boxes:
            label = 1 + rng.randint(num_classes)
            _fill(img, _hbox_polygon((x1, y1, x2, y2)),
                  _class_color(label, num_classes + 1))
            seg[y1:y2, x1:x2] = label
        name = '%06d' % i
        _write_image(osp.join(root, ADE_IMG_DIR, name + '.jpg'), img)
        _write_image(osp.join(root, ADE_ANN_DIR, name + '.png'), seg)
        names.append(name)
    return dict(data_root=osp.abspath(root), img_dir=ADE_IMG_DIR,
                ann_dir=ADE_ANN_DIR, images=names)
