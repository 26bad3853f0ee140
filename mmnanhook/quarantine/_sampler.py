"""Never loading a quarantined sample again, whatever the loader looks like.

The dataloader's sampler runs in the main process, also with worker
processes (``persistent_workers=True`` included: their dataset copies only
load the indices they are sent). :class:`QuarantineSampler` wraps the
sampler the batch sampler draws from (``DefaultSampler``,
``InfiniteSampler``; under a ``BatchSampler`` or mmdet's
``AspectRatioBatchSampler``) and gives another, good index in place of a
quarantined one, drawn at random from a generator seeded by the run's seed
and rank. Batch sizes, iterations per epoch and so the LR schedule stay what
they would have been.
"""
import random


class QuarantineSampler(object):
    """A sampler that never yields a quarantined index.

    Args:
        sampler: The sampler it wraps (every other attribute is its own:
            ``dataset``, ``set_epoch``, ...).
        blocked (set[int]): The quarantined indices; read at every index,
            so indices quarantined later are replaced from then on.
        length (int): Length of the dataset indices are drawn from.
        seed (int): Seed of the substitutes' generator.
    """

    def __init__(self, sampler, blocked, length, seed=0):
        self.sampler = sampler
        self.blocked = blocked
        self.length = length
        self._rng = random.Random(seed)

    def __iter__(self):
        for index in self.sampler:
            if index in self.blocked:
                index = self._substitute()
            yield index

    def _substitute(self):
        if len(self.blocked) >= self.length:
            raise RuntimeError('mmnanhook: every sample of the train dataset '
                               'is quarantined')
        while True:
            index = self._rng.randrange(self.length)
            if index not in self.blocked:
                return index

    def __len__(self):
        return len(self.sampler)

    def __getattr__(self, name):
        if name in ('sampler', 'blocked', 'length', '_rng'):
            raise AttributeError(name)
        return getattr(self.sampler, name)


def install_sampler(loader, blocked, seed=0):
    """Wrap ``loader``'s sampler in a :class:`QuarantineSampler`.

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
    wrapped = QuarantineSampler(sampler, blocked, len(loader.dataset), seed)
    batch_sampler.sampler = wrapped

    def remove():
        if batch_sampler.sampler is wrapped:
            batch_sampler.sampler = sampler

    return remove
