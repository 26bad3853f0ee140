"""Tier 2, once per trigger: replay the failing iteration and explain it.

* :mod:`._diagnose`: :func:`diagnose`, the replays and what they found.
* :mod:`._instrument`: forward / backward instrumentation as context
  managers that always remove what they installed.
* :mod:`._data`: checks of a batch's inputs and GT boxes.
* :mod:`._incident`: on a trigger in training, the diagnosis and the bundle.
"""
from ._data import (angle_range_from_config, batch_size, check_batch,
                    check_boxes, declared_size, declared_sizes, split_batch)
from ._diagnose import diagnose
from ._incident import default_dump_dir, handle_incident

__all__ = [
    'angle_range_from_config', 'batch_size', 'check_batch', 'check_boxes',
    'declared_size', 'declared_sizes', 'default_dump_dir', 'diagnose',
    'handle_incident', 'split_batch'
]
