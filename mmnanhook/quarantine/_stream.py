"""Quarantined samples out of a dataloader iterator that is already running.

``IterBasedTrainLoop`` calls ``iter(dataloader)`` before any hook runs, and
``InfiniteSampler``'s iterator never ends: a sampler swapped in
``before_train`` is never read by it. torch's ``_BaseDataLoaderIter`` draws
every index batch in the main process through ``next(self._sampler_iter)``
(the single-process iterator when it loads, the multi-process one when it
sends indices to a worker; torch 1.7 to 2.x), so :func:`install_stream`
wraps that iterator: each index batch handed out from then on has its
quarantined indices replaced. The iterator is not rebuilt (that would draw a
new base seed from the torch RNG); the wrapper only reads from it, so while
nothing is quarantined every batch is the object torch would have used.

A persistent iterator's ``_reset`` (each epoch) draws a new index iterator
from the batch sampler, whose sampler :func:`.install_sampler` wrapped.
The record of each sample's index (:class:`~._identity.Drawn`) stays
outermost: it records the indices loaded, the substitutes included.
"""
from __future__ import annotations

from numbers import Integral
from typing import Any, Callable, Iterator, List

from ._identity import inside_drawn


class IndexStream(object):
    """The index batches of ``source`` with quarantined indices replaced.

    Args:
        source: The iterator torch's dataloader iterator drew from.
        substitute (Substitutes): Gives each index.
    """

    def __init__(self, source: Iterator[Any], substitute: Any) -> None:
        self.source = source
        self.substitute = substitute

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.source)
        if isinstance(batch, Integral):  # batch_size=None: one index
            return self.substitute(batch)
        if not isinstance(batch, list) or not any(
                isinstance(i, Integral) and i in self.substitute.blocked
                for i in batch):
            return batch
        return [self.substitute(i) if isinstance(i, Integral) else i
                for i in batch]


def live_iterators(runner: Any) -> List[Any]:
    """torch dataloader iterators of ``runner``'s training already started:
    ``IterBasedTrainLoop``'s, and the one a loader with persistent workers
    keeps."""
    found = []
    iterator = getattr(runner.train_loop, 'dataloader_iterator', None)
    for candidate in (getattr(iterator, '_iterator', None),
                      getattr(runner.train_dataloader, '_iterator', None)):
        if (getattr(candidate, '_sampler_iter', None) is not None
                and all(candidate is not f for f in found)):
            found.append(candidate)
    return found


def install_stream(runner: Any, substitute: Any) -> Callable[[], None]:
    """Wrap the index stream of every live iterator of ``runner``.

    Returns:
        callable: Puts the iterators' own index streams back.
    """
    wrapped = []
    for iterator in live_iterators(runner):
        holder = inside_drawn(iterator)
        name = '_sampler_iter' if holder is iterator else 'source'
        stream = IndexStream(getattr(holder, name), substitute)
        setattr(holder, name, stream)
        wrapped.append((holder, name, stream))

    def remove() -> None:
        for holder, name, stream in wrapped:
            if getattr(holder, name) is stream:
                setattr(holder, name, stream.source)

    return remove
