"""Batches in flight: sampled before a quarantine, loaded after it.

With worker processes, up to ``num_workers * prefetch_factor`` index batches
were handed out before the decision; a quarantined sample in one of them
reaches the train step once more. It is left out there, before the forward,
by its file (``img_path`` of its metainfo): a set lookup per sample, on the
host.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Dict, List, Sequence, Tuple

from .._batch import sample_files, split_batch
from ._composed import quarantined_part


def without_files(data_batch: Any,
                  files: Collection[str]) -> Tuple[Any, List[str]]:
    """``data_batch`` without the samples that load one of ``files``.

    Args:
        data_batch: A batch from an mmengine dataloader.
        files (set[str]): The quarantined image files.

    Returns:
        tuple: ``(batch, removed)``: the batch itself when nothing is
        removed (``None`` when every sample is), and the removed samples'
        files.
    """
    paths = sample_files(data_batch) if files else None
    if not paths:
        return data_batch, []
    # A composed sample holding a quarantined part (Mosaic, MixUp).
    paths = [quarantined_part(s, files) or p
             for s, p in zip(data_batch['data_samples'], paths)]
    removed = [p for p in paths if p in files]
    if not removed:
        return data_batch, []
    if len(removed) == len(paths):
        return None, removed
    return split_batch(data_batch, [
        i for i, p in enumerate(paths) if p not in files]), removed


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
