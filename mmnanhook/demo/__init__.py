"""``mmnan demo`` and what it trains on: tiny real detectors (the configs of
``mmnanhook::``) on synthetic datasets with planted defects.

* :mod:`.synthetic`: deterministic COCO / VOC / DOTA datasets, each in the
  layout its OpenMMLab dataset class reads, with optional planted defects;
  for trying mmnanhook without real data.
* :func:`make_imagenet_dataset` / :func:`make_ade20k_dataset`: ImageNet and
  ADE20K layouts in the same textures (mmpretrain, mmseg).
* :func:`make_coco_keypoints_dataset`: a COCO person-keypoints layout,
  stick figures on the same textures (mmpose).
* :func:`make_pairs_dataset` / :func:`make_image_folder`: LQ/GT pairs and an
  image folder in the same textures (mmagic's restoration and
  unconditional GAN configs).
* :func:`tiny_config` / :func:`make_dataset`: a tiny detector config pointed
  at such a dataset.
* :func:`run_demo`: the demo itself.
"""
from . import synthetic
from ._classes import (ADE_ANN_DIR, ADE_IMG_DIR, IMAGENET_ANN_FILE,
                       IMAGENET_SPLIT, make_ade20k_dataset,
                       make_imagenet_dataset)
from ._keypoints import KEYPOINTS_ANN_FILE, make_coco_keypoints_dataset
from ._pairs import (PAIRS_ANN_FILE, PAIRS_GT_DIR, PAIRS_LQ_DIR,
                     make_image_folder, make_pairs_dataset)
from ._run import demo_dataset, run_demo
from ._tiny import (TINY_CONFIGS, config_dir, dataset_kind, make_dataset,
                    tiny_config)

__all__ = [
    'ADE_ANN_DIR', 'ADE_IMG_DIR', 'IMAGENET_ANN_FILE', 'IMAGENET_SPLIT',
    'KEYPOINTS_ANN_FILE', 'make_coco_keypoints_dataset',
    'PAIRS_ANN_FILE', 'PAIRS_GT_DIR', 'PAIRS_LQ_DIR', 'make_image_folder',
    'make_pairs_dataset',
    'TINY_CONFIGS', 'config_dir', 'dataset_kind', 'demo_dataset',
    'make_ade20k_dataset', 'make_dataset', 'make_imagenet_dataset',
    'run_demo', 'synthetic', 'tiny_config'
]
