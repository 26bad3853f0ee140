"""``DrillSampler``: the first samples of the user's sampler, no more.

The drill shortens a run without changing which sampler orders the data:
the user's (``DefaultSampler``, ``InfiniteSampler``, a codebase's own) is
built as configured and cut after ``length`` indices of this rank.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

from mmengine.registry import DATA_SAMPLERS
from torch.utils.data import Sampler


@DATA_SAMPLERS.register_module()
class DrillSampler(Sampler):
    """The first ``length`` indices of ``sampler``.

    Args:
        dataset (Dataset): The dataset (given by the Runner).
        sampler (dict): The user's sampler config.
        length (int): Indices yielded per epoch.
        seed (int, optional): The run's seed (given by the Runner).
    """

    def __init__(self, dataset: Any, sampler: Dict[str, Any], length: int,
                 seed: Optional[int] = None) -> None:
        # No Sampler.__init__: its argument changed across torch versions,
        # and it keeps nothing (mmdet's batch samplers check the class).
        self.sampler = DATA_SAMPLERS.build(
            sampler, default_args=dict(dataset=dataset, seed=seed))
        self.length = length

    def __getattr__(self, name):
        # ``dataset``, ``seed``...: the user's sampler's (mmdet's batch
        # samplers read them). Not ``sampler`` itself, before it is set.
        if name == 'sampler':
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.length)

    def __len__(self):
        try:
            return min(self.length, len(self.sampler))
        except TypeError:  # an endless sampler
            return self.length

    def set_epoch(self, epoch: int) -> None:
        """Handed on to the user's sampler."""
        if hasattr(self.sampler, 'set_epoch'):
            self.sampler.set_epoch(epoch)
