"""``mmnan demo`` and what it trains on: tiny real detectors (the configs of
``mmnanhook::``) on synthetic datasets with planted defects.

* :mod:`.synthetic`: deterministic COCO / VOC / DOTA / ImageNet / ADE20K
  datasets, each in the layout its OpenMMLab dataset class reads, with
  optional planted defects; for trying mmnanhook without real data.
* :func:`tiny_config` / :func:`make_dataset`: a tiny detector config pointed
  at such a dataset.
* :func:`run_demo`: the demo itself.
"""
from . import synthetic
from ._run import demo_dataset, run_demo
from ._tiny import (TINY_CONFIGS, config_dir, dataset_kind, make_dataset,
                    tiny_config)

__all__ = [
    'TINY_CONFIGS', 'config_dir', 'dataset_kind', 'demo_dataset',
    'make_dataset', 'run_demo', 'synthetic', 'tiny_config'
]
