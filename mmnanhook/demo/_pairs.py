"""Deterministic synthetic image datasets of mmagic's layouts: LQ/GT pairs
for restoration, and a folder of images for unconditional generation.

* :func:`make_pairs_dataset`: ``gt/*.png``, ``lq/*.png`` (each GT downscaled
  by ``scale``, as DIV2K's ``X4`` folders hold) and a ``meta_info.txt``
  listing the file names, one a line: what mmagic's ``BasicImageDataset``
  reads with ``ann_file='meta_info.txt'``, ``data_prefix=dict(img='lq',
  gt='gt')``.
* :func:`make_image_folder`: ``*.png`` in one folder, what
  ``BasicImageDataset`` reads with ``data_prefix=dict(gt='')`` (mmagic's
  unconditional GAN configs).

The images are :mod:`.synthetic`'s textures (its per-image seeding):
equal arguments give byte-identical files.
"""
from __future__ import annotations

import os
import os.path as osp
from typing import Any, Dict

import cv2

from .synthetic import _image_rng, _texture, _write_image

# The pairs' layout under the dataset root.
PAIRS_GT_DIR = 'gt'
PAIRS_LQ_DIR = 'lq'
PAIRS_ANN_FILE = 'meta_info.txt'


def _name(index: int) -> str:
    return '%06d.png' % index


def make_pairs_dataset(root: str, num_images: int = 4, gt_size: int = 128,
                       scale: int = 4, seed: int = 0) -> Dict[str, Any]:
    """Write a super-resolution dataset of LQ/GT pairs (mmagic
    ``BasicImageDataset``).

    Args:
        root (str): Directory to write into (created if missing).
        num_images (int): Number of pairs.
        gt_size (int): Side of the square GT images, in pixels; a multiple
            of ``scale``.
        scale (int): How many times smaller the LQ images are.
        seed (int): Seed; equal arguments give byte-identical files.

    Returns:
        dict: ``data_root``, ``gt_dir``, ``lq_dir``, ``ann_file`` (absolute
        paths), ``images`` (the file names, the same in both folders),
        ``gt_size``, ``lq_size`` and ``scale``.
    """
    if gt_size % scale:
        raise ValueError('gt_size %d is not a multiple of scale %d'
                         % (gt_size, scale))
    lq_size = gt_size // scale
    for sub in (PAIRS_GT_DIR, PAIRS_LQ_DIR):
        os.makedirs(osp.join(root, sub), exist_ok=True)
    names = []
    for i in range(num_images):
        gt = _texture(_image_rng(seed, i), gt_size)
        # Area averaging: the downscale that aliases least (DIV2K's LR
        # images are bicubic; which one does not matter to a stand-in).
        lq = cv2.resize(gt, (lq_size, lq_size), interpolation=cv2.INTER_AREA)
        name = _name(i)
        _write_image(osp.join(root, PAIRS_GT_DIR, name), gt)
        _write_image(osp.join(root, PAIRS_LQ_DIR, name), lq)
        names.append(name)
    with open(osp.join(root, PAIRS_ANN_FILE), 'w') as f:
        f.write('\n'.join(names) + '\n')
    absolute = osp.abspath(root)
    return dict(data_root=absolute,
                gt_dir=osp.join(absolute, PAIRS_GT_DIR),
                lq_dir=osp.join(absolute, PAIRS_LQ_DIR),
                ann_file=osp.join(absolute, PAIRS_ANN_FILE), images=names,
                gt_size=gt_size, lq_size=lq_size, scale=scale)


def make_image_folder(root: str, num_images: int = 4, image_size: int = 64,
                      seed: int = 0) -> Dict[str, Any]:
    """Write a folder of images for unconditional generation (mmagic
    ``BasicImageDataset`` with ``data_prefix=dict(gt='')``).

    Args:
        root (str): Directory to write into (created if missing).
        num_images (int): Number of images.
        image_size (int): Side of the square images, in pixels.
        seed (int): Seed; equal arguments give byte-identical files.

    Returns:
        dict: ``data_root`` and ``img_dir`` (the same absolute path: the
        images lie in the root), ``images`` (the file names) and
        ``image_size``.
    """
    os.makedirs(root, exist_ok=True)
    names = []
    for i in range(num_images):
        name = _name(i)
        _write_image(osp.join(root, name),
                     _texture(_image_rng(seed, i), image_size))
        names.append(name)
    absolute = osp.abspath(root)
    return dict(data_root=absolute, img_dir=absolute, images=names,
                image_size=image_size)
