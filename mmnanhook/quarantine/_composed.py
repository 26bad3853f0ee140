"""Composed samples: one sample made of several dataset samples.

mmdet's ``Mosaic`` and ``MixUp`` (under ``MultiImageMixDataset``) draw
partners from the dataset with ``get_indexes``; ``CachedMosaic`` and
``CachedMixUp`` draw them from a cache each transform keeps; mmyolo's
``Mosaic`` and ``MixUp`` are handed the dataset whose pipeline they are in
(or draw from their cache, ``use_cached=True``). What a transform draws from
is seen in each call, never taken from its attributes (mmyolo's keeps an
empty cache when it draws from the dataset). All of it happens in the
loader's worker processes, out of reach of the sampler.
:class:`ComposedGuard` binds onto those transform instances before the
workers start (they inherit them, and the blocked flags, when they fork):

* each composed sample names its parts in its metainfo (:data:`PARTS`:
  ``[[dataset index, img_path], ...]``, packed by ``PackDetInputs``), so the
  diagnosis can trace a non-finite input to the image it came from and the
  quarantine name that file;
* a quarantined part is never drawn again: partners are drawn anew while one
  is blocked, and blocked entries leave the caches. Both read one shared
  byte while nothing is quarantined, and only then draw from ``random``
  again, so a run without a quarantine keeps its data and RNG draws.

Worker processes forked before the guard (``IterBasedTrainLoop`` starts
them when it is built, before any hook runs) are replaced at the first
quarantine (:mod:`._workers`).
"""
from __future__ import annotations

import ctypes
import multiprocessing
from typing import (Any, Collection, Dict, Iterable, Iterator, List,
                    Optional, Tuple)

import numpy as np

from .._mmengine import wrapped_datasets
from .._patch import set_attribute
from ._index import sample_index

# The metainfo key of a composed sample's parts.
PARTS = 'mmnan_parts'
# Draws of partners before giving up on finding unquarantined ones.
_DRAWS = 100


def _steps(pipeline):
    """The transform instances of a pipeline (a list, or a ``Compose``)."""
    steps = getattr(pipeline, 'transforms', pipeline)
    return list(steps) if isinstance(steps, (list, tuple)) else []


def mixers(dataset: Any) -> Iterator[Tuple[Any, Any, List[Any]]]:
    """Every transform that composes samples in ``dataset``'s pipelines.

    Yields:
        tuple: ``(transform, source, steps)``: the dataset its partners'
        indices refer to (its own for a cached one, the wrapped one under
        ``MultiImageMixDataset``), and the pipeline it is a step of.
    """
    for current in wrapped_datasets(dataset):
        steps = _steps(getattr(current, 'pipeline', None))
        # A wrapper's pipeline (MultiImageMixDataset) draws from the dataset
        # it wraps; a dataset's own pipeline from that dataset (mmyolo's
        # Mosaic is handed it), or from a cache of its samples (mmdet's
        # CachedMosaic).
        inner = getattr(current, 'dataset', None)
        source = current if inner is None else inner
        for step in steps:
            if callable(getattr(step, 'get_indexes', None)):
                yield step, source, steps


def parts_of(results: Dict[str, Any]) -> List[List[Any]]:
    """``[[index, img_path], ...]`` of the samples a loaded (or composed)
    sample's results are made of: itself and its own parts."""
    own = [[results.get('sample_idx'), results.get('img_path')]]
    return own + [list(p) for p in results.get(PARTS) or ()]


def _shared_flags(n):
    # Fork-inherited shared memory, written by the main process only.
    return np.frombuffer(multiprocessing.RawArray(ctypes.c_uint8, max(n, 1)),
                         dtype=np.uint8)


class _Source(object):
    """A dataset partners are drawn from, and which of its indices are
    blocked."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.flags = _shared_flags(len(dataset))

    def blocked(self, index: Optional[int]) -> bool:
        return index is not None and 0 <= index < len(self.flags) and bool(
            self.flags[index])

    def block(self, file: str) -> None:
        for index in sample_index(self.dataset).indices(file):
            self.flags[index] = 1


class ComposedGuard(object):
    """Parts recorded, quarantined ones never drawn, in one train dataset.

    Args:
        dataset: The train dataset, in the main process, before its worker
            processes start.

    Attributes:
        bound (bool): Whether any transform of it composes samples.
    """

    def __init__(self, dataset: Any) -> None:
        self._on = _shared_flags(1)
        self._sources = {}
        self._undo = []
        for step, source, steps in mixers(dataset):
            if source is None:
                continue
            key = id(source)
            if key not in self._sources:
                self._sources[key] = _Source(source)
            self._bind(step, self._sources[key])
            for packer in steps:
                keys = getattr(packer, 'meta_keys', None)
                if isinstance(keys, (list, tuple)) and PARTS not in keys:
                    self._pack(packer, keys)

    @property
    def bound(self) -> bool:
        return bool(self._undo)

    def block(self, file: str) -> None:
        """Never draw the samples that load ``file`` as parts again (in the
        workers too: the flags are shared)."""
        for source in self._sources.values():
            source.block(file)
        self._on[0] = 1

    def remove(self) -> None:
        """Unbind from the transforms (the main process's copies): each
        attribute as it was, an instance attribute of its own included."""
        while self._undo:
            self._undo.pop()()

    def _set(self, obj, name, value):
        self._undo.append(set_attribute(obj, name, value))

    def _pack(self, packer, keys):
        # mmdet 3.1's PackDetInputs asserts every meta key is in the
        # results: a sample no step composed (a Mosaic switched off) has
        # no parts.
        transform = packer.transform

        def packed(results: Dict[str, Any]) -> Any:
            results.setdefault(PARTS, [])
            return transform(results)

        self._set(packer, 'meta_keys', tuple(keys) + (PARTS, ))
        self._set(packer, 'transform', packed)

    def _bind(self, step, source):
        """Guard ``step``'s draws. What it draws from is seen in each call
        (its own cache, or a dataset it is handed), not taken from its
        attributes: mmyolo's Mosaic keeps an empty ``results_cache`` even
        when it draws from the dataset."""
        on = self._on
        get_indexes, transform = step.get_indexes, step.transform
        # The parts the step drew inside its transform (a cache's entries,
        # or a dataset's samples); whether its transform runs.
        drawn, inside = [], [False]

        def blocked(entry: Dict[str, Any]) -> bool:
            return any(source.blocked(i) for i, _ in parts_of(entry))

        def guarded_get_indexes(pool: Any) -> Any:
            indexes = get_indexes(pool)
            if pool is source.dataset:
                if on[0]:
                    for _ in range(_DRAWS):
                        if not any(source.blocked(i)
                                   for i in _as_list(indexes)):
                            break
                        indexes = get_indexes(pool)
                if inside[0]:
                    drawn[:] = [[i, pool.get_data_info(i).get('img_path')]
                                for i in _as_list(indexes)]
            elif pool is getattr(step, 'results_cache', None):
                drawn[:] = [p for i in _as_list(indexes)
                            for p in parts_of(pool[i])]
            return indexes

        def guarded_transform(results: Dict[str, Any]) -> Any:
            cache = getattr(step, 'results_cache', None)
            if on[0] and isinstance(cache, list):
                cache[:] = [e for e in cache if not blocked(e)]
            del drawn[:]
            own = list(results.get(PARTS) or ())
            # Loaded before the transform by a wrapper (MultiImageMixDataset):
            # each partner with its own parts.
            mixed = results.get('mix_results') or ()
            inside[0] = True
            try:
                out = transform(results)
            finally:
                inside[0] = False
            parts = [p for r in mixed for p in parts_of(r)] if mixed else \
                list(drawn)
            if out is not None and parts:
                out[PARTS] = own + parts
            return out

        self._set(step, 'get_indexes', guarded_get_indexes)
        self._set(step, 'transform', guarded_transform)


def _as_list(indexes):
    return list(indexes) if isinstance(indexes, (list, tuple)) else [indexes]


def part_image(source: Any, index: int) -> Optional[np.ndarray]:
    """The image of ``source``'s sample ``index`` as its pipeline loads it,
    before any transform composes (failure path: no RNG drawn).

    Returns:
        numpy.ndarray | None: ``results['img']``.
    """
    steps = _steps(getattr(source, 'pipeline', None))
    if not any(callable(getattr(s, 'get_indexes', None)) for s in steps):
        # What MultiImageMixDataset loads a partner with.
        results = source[index]
        return None if results is None else results.get('img')
    results = source.get_data_info(index)
    for step in steps:
        if callable(getattr(step, 'get_indexes', None)) or results is None:
            break
        results = step(results)
    return None if results is None else results.get('img')


def quarantined_part(sample: Any, files: Collection[str]) -> Optional[str]:
    """The first part of a composed data sample that loads one of
    ``files``, or ``None``."""
    meta = getattr(sample, 'metainfo', None) or {}
    for _, path in meta.get(PARTS) or ():
        if path in files:
            return path
    return None


def guard_composed(runner: Any, files: Iterable[str]) -> ComposedGuard:
    """Bind a :class:`ComposedGuard` onto ``runner``'s train dataset, the
    quarantined ``files`` blocked (worker processes that already run are
    :mod:`._workers`' concern).

    Returns:
        ComposedGuard: Its ``block`` is called for each file quarantined
        later.
    """
    loader = runner.train_dataloader
    context = getattr(loader, 'multiprocessing_context', None) or \
        multiprocessing.get_context()
    if getattr(loader, 'num_workers', 0) and \
            context.get_start_method() != 'fork':
        # The bound transforms are closures: a spawned worker could not
        # unpickle the dataset.
        runner.logger.warning(
            'mmnanhook: the train dataloader starts its workers with %r, '
            'not fork: Mosaic/MixUp partners are not checked against the '
            'quarantine' % context.get_start_method())
        return ComposedGuard(None)
    guard = ComposedGuard(loader.dataset)
    for file in files:
        guard.block(file)
    return guard
