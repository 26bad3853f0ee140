"""Batches in flight: sampled before a quarantine, loaded after it.

With worker processes, up to ``num_workers * prefetch_factor`` index batches
were handed out before the decision; a quarantined sample in one of them
reaches the train step once more. It is left out there, before the forward,
by its dataset index (:mod:`._identity`) or its file (``img_path`` of its
metainfo, or of a composed sample's parts): a set lookup per sample, on the
host.
"""
from __future__ import annotations

from typing import (Any, Callable, Collection, Dict, List, NamedTuple,
                    Optional, Sequence, Tuple)

from .._batch import batch_size, sample_files, split_batch
from ..records import sample_name
from ._composed import quarantined_part


class Admitted(NamedTuple):
    """A batch without its quarantined samples.

    Args:
        batch: The batch itself when nothing is removed, the sub-batch of
            the others, or ``None`` when every sample is.
        indices (list, optional): The dataset index of each sample of
            ``batch`` (``None`` where unknown); ``None`` when none was known.
        removed (list[str]): The removed samples' names (file, or dataset
            index).
    """

    batch: Any
    indices: Optional[List[Optional[int]]]
    removed: List[str]


def without_quarantined(data_batch: Any,
                        indices: Optional[Sequence[Optional[int]]],
                        blocked: Collection[int],
                        files: Collection[str]) -> Admitted:
    """``data_batch`` without the samples whose dataset index is blocked or
    that load one of ``files`` (a composed sample: one of its parts).

    Args:
        data_batch: A batch from an mmengine dataloader.
        indices (list, optional): Each sample's dataset index.
        blocked (set[int]): The quarantined dataset indices.
        files (set[str]): The quarantined image files.

    Raises:
        UnknownBatchError: A sample is to be removed from a batch whose
            layout is not known.
    """
    n = batch_size(data_batch) or 0
    indices = list(indices) if indices is not None and len(indices) == n \
        else None
    paths = sample_files(data_batch) if files else None
    names = list(paths) if paths else [None] * n
    if paths:
        # A composed sample holding a quarantined part (Mosaic, MixUp).
        names = [quarantined_part(s, files) or p
                 for s, p in zip(data_batch['data_samples'], paths)]
    out = [i for i in range(n)
           if (names[i] is not None and names[i] in files) or (
               indices is not None and indices[i] is not None and
               indices[i] in blocked)]
    if not out:
        return Admitted(data_batch, indices, [])
    removed = [sample_name(names[i], indices[i] if indices else None)
               for i in out]
    if len(out) == n:
        return Admitted(None, [], removed)
    keep = [i for i in range(n) if i not in out]
    return Admitted(split_batch(data_batch, keep),
                    [indices[i] for i in keep] if indices else None, removed)


def replace_data(args: Sequence[Any], kwargs: Dict[str, Any],
                 data_batch: Any) -> Tuple[Sequence[Any], Dict[str, Any]]:
    """``train_step``'s arguments with ``data_batch`` as its batch."""
    if args:
        return (data_batch, ) + tuple(args[1:]), kwargs
    return args, dict(kwargs, data=data_batch)


def call_with(train_step: Callable[..., Any], args: Sequence[Any],
              kwargs: Dict[str, Any], data_batch: Any) -> Any:
    """``train_step`` called with ``args``/``kwargs``, ``data_batch`` as its
    batch."""
    args, kwargs = replace_data(args, kwargs, data_batch)
    return train_step(*args, **kwargs)
