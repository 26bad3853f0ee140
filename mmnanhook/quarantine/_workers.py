"""Worker processes that started before the quarantine's guard.

``IterBasedTrainLoop`` builds its dataloader iterator, and so forks its
worker processes, when the loop is built, before any hook runs: their copies
of the dataset never get the guard of :mod:`._composed` (a Mosaic/MixUp
partner that is quarantined could still be drawn there, and the samples they
compose name no parts). Once a file is quarantined, :class:`Handover` takes
that iterator's place: it first yields the batches those workers were
already building (sampled before the decision: in flight), then forks
workers anew from the main process's dataset, which holds the guard, and
continues the same index stream with them. Until then nothing changes: the
workers' random draws (augmentations, partners) stay those of a run without
mmnanhook.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Tuple

import torch

from ._identity import Drained


class _Given(object):
    """A batch sampler whose iterator is an index stream already running."""

    def __init__(self, stream: Iterator[Any]) -> None:
        self.stream = stream

    def __iter__(self):
        return self.stream


class Handover(object):
    """The iterator of a loop whose workers started before the guard, from a
    quarantine on.

    Args:
        old: torch's multi-process dataloader iterator those workers serve.
        loader (DataLoader): Its dataloader.
        wrapper: mmengine's ``_InfiniteDataloaderIterator`` that holds
            ``old`` (its ``_iterator``).

    Attributes:
        _sampler_iter: The index stream the fresh workers continue (torch's
            name: :func:`~._stream.install_stream` finds it).
    """

    def __init__(self, old: Any, loader: Any, wrapper: Any) -> None:
        self.old = old
        self.loader = loader
        self.wrapper = wrapper
        # Dispatched, not yet yielded (arrived out of order included).
        self.in_flight = len(old._task_info)
        self._sampler_iter = old._sampler_iter
        self.fresh = None
        # The old workers build what they were given, nothing more: the old
        # iterator ends once it has yielded all of it (the indices of those
        # batches still found through it).
        old._sampler_iter = Drained(old._sampler_iter)

    def __iter__(self):
        return self

    def __next__(self):
        if self.fresh is None:
            try:
                return next(self.old)
            except StopIteration:
                self.fresh = self._start()
        return next(self.fresh)

    def _start(self):
        """Fork fresh workers that continue the index stream; they take this
        iterator's place in the loop and in a persistent loader."""
        self.old._shutdown_workers()
        loader = self.loader
        if getattr(loader, '_iterator', None) is self.old:
            loader._iterator = None
        # Their base seed is one more torch draw: given back, so the run's
        # own random numbers stay as they were.
        states = [(torch.set_rng_state, torch.get_rng_state())]
        if getattr(loader, 'generator', None) is not None:
            states.append((loader.generator.set_state,
                           loader.generator.get_state()))
        real = loader.batch_sampler
        # DataLoader refuses a new batch sampler once built; for the one
        # iterator it builds now, it gives the running stream.
        object.__setattr__(loader, 'batch_sampler', _Given(
            self._sampler_iter))
        try:
            fresh = iter(loader)
        finally:
            object.__setattr__(loader, 'batch_sampler', real)
            for restore, state in states:
                restore(state)
        # Its next epoch (a finite sampler, a persistent loader) starts from
        # the real batch sampler again.
        fresh._index_sampler = real
        if getattr(self.wrapper, '_iterator', None) is self:
            self.wrapper._iterator = fresh
        return fresh


def stale_iterators(runner: Any) -> List[Tuple[Any, Any]]:
    """``(iterator, wrapper)`` of the train dataloader iterators whose
    worker processes already run (``IterBasedTrainLoop``'s)."""
    wrapper = getattr(runner.train_loop, 'dataloader_iterator', None)
    iterator = getattr(wrapper, '_iterator', None)
    if getattr(iterator, '_workers', None) and hasattr(
            iterator, '_tasks_outstanding'):
        return [(iterator, wrapper)]
    return []


def hand_over(runner: Any, stale: List[Tuple[Any, Any]]) -> None:
    """Put a :class:`Handover` in place of each stale iterator, and say so.

    Args:
        runner (Runner): The runner.
        stale (list[tuple]): :func:`stale_iterators`' answer, at the start.
    """
    loader = runner.train_dataloader
    for iterator, wrapper in stale:
        if getattr(wrapper, '_iterator', None) is not iterator:
            continue  # the loop started the loader again itself
        handover = Handover(iterator, loader, wrapper)
        wrapper._iterator = handover
        runner.logger.warning(
            'mmnanhook: the train dataloader\'s worker processes started '
            'with %s, before the quarantine could reach them: after the %d '
            'batch(es) they were building, workers started anew (their '
            'random draws start over from the run\'s seed) check the '
            'Mosaic/MixUp partners they draw against it'
            % (type(runner.train_loop).__name__, handover.in_flight))
