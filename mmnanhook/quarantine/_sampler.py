"""Never loading a quarantined sample again, whatever the loader looks like.

The dataloader's sampler runs in the main process, also with worker
processes (``persistent_workers=True`` included: their dataset copies only
load the indices they are sent). :class:`QuarantineSampler` wraps the
sampler the batch sampler draws from (``DefaultSampler``,
``InfiniteSampler``; under a ``BatchSampler`` or mmdet's
``AspectRatioBatchSampler``) and gives another, good index in place of a
quarantined one (:class:`Substitutes`: drawn at random from a generator
seeded by the run's seed and rank, shared with :mod:`._stream`). Batch
sizes, iterations per epoch and so the LR schedule stay what they would have
been.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Set


class Substitutes(object):
    """A good index in place of a quarantined one.

    Args:
        blocked (set[int]): The quarantined indices; read at every index,
            so indices quarantined later are replaced from then on.
        length (int): Length of the dataset indices are drawn from.
        seed (int): Seed of the substitutes' generator.
    """

    def __init__(self, blocked: Set[int], length: int,
                 seed: int = 0) -> None:
        self.blocked = blocked
        self.length = length
        self._rng = random.Random(seed)

    def __call__(self, index):
        """``index``, or a good one drawn at random when it is blocked."""
        if index not in self.blocked:
            return index
        if len(self.blocked) >= self.length:
            raise RuntimeError('mmnanhook: every sample of the train dataset '
                               'is quarantined')
        while True:
            index = self._rng.randrange(self.length)
            if index not in self.blocked:
                return index


class QuarantineSampler(object):
    """A sampler that never yields a quarantined index.

    Args:
        sampler: The sampler it wraps (every other attribute is its own:
            ``dataset``, ``set_epoch``, ...).
        substitute (Substitutes): Gives each index it yields.
    """

    def __init__(self, sampler: Any, substitute: Substitutes) -> None:
        self.sampler = sampler
        self.substitute = substitute

    def __iter__(self):
        for index in self.sampler:
            yield self.substitute(index)

    def __len__(self):
        return len(self.sampler)

    def __getattr__(self, name):
        if name in ('sampler', 'substitute'):
            raise AttributeError(name)
        return getattr(self.sampler, name)


def install_sampler(loader: Any,
                    substitute: Substitutes) -> Callable[[], None]:
    """Wrap ``loader``'s sampler in a :class:`QuarantineSampler`.

    Args:
        loader (DataLoader): The train dataloader.
        substitute (Substitutes): The run's substitutes.

    Returns:
        callable: Puts the original sampler back.

    Raises:
        TypeError: A loader without a batch sampler drawing from a sampler
            (an iterable dataset): nothing to replace indices in.
    """
    batch_sampler = getattr(loader, 'batch_sampler', None)
    sampler = getattr(batch_sampler, 'sampler', None)
    if sampler is None:
        raise TypeError('the train dataloader has no batch sampler drawing '
                        'indices from a sampler')
    wrapped = QuarantineSampler(sampler, substitute)
    batch_sampler.sampler = wrapped

    def remove() -> None:
        if batch_sampler.sampler is wrapped:
            batch_sampler.sampler = sampler

    return remove
