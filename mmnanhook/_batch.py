"""What a batch from an MMEngine dataloader holds per sample: how many
samples, and the sub-batch of some of them (the diagnosis replays samples
alone; ``policy='drop'`` recomputes a step without some)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence

import torch


def batch_size(data_batch: Any) -> Optional[int]:
    """Number of samples in a batch, or ``None`` when it cannot be told.

    ``inputs`` decides for mmengine batches (a list with one entry per
    sample, or a stacked tensor); otherwise the first list or tensor found.

    Args:
        data_batch: A batch from an mmengine dataloader.
    """
    if isinstance(data_batch, Mapping):
        order = ['inputs'] if 'inputs' in data_batch else []
        order += [k for k in data_batch if k != 'inputs']
        for key in order:
            n = _length(data_batch[key])
            if n:
                return n
        return None
    return _length(data_batch)


def _length(value):
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() > 0 else None
    if isinstance(value, (list, tuple)):
        return len(value) or None
    if isinstance(value, Mapping):
        return batch_size(value)
    return None


def split_batch(data_batch: Any, indices: Sequence[int]) -> Any:
    """The sub-batch holding only the samples at ``indices``.

    Every list, tuple or tensor whose length is the batch size is indexed;
    everything else is shared.

    Args:
        data_batch: A batch from an mmengine dataloader.
        indices (list[int]): Samples to keep, in order.
    """
    n = batch_size(data_batch)
    index = torch.as_tensor(list(indices), dtype=torch.long)

    def take(value):
        if (isinstance(value, torch.Tensor) and value.dim() > 0
                and value.shape[0] == n):
            return value[index.to(value.device)]
        if isinstance(value, list) and len(value) == n:
            return [value[i] for i in indices]
        if isinstance(value, tuple) and len(value) == n:
            return tuple(value[i] for i in indices)
        if isinstance(value, Mapping):
            return type(value)((k, take(v)) for k, v in value.items())
        return value

    return take(data_batch)


def replace_samples(data_batch: Any,
                    packed: Dict[int, Optional[Dict[str, Any]]]) -> Any:
    """The batch with some samples replaced by what a pipeline packed anew.

    Args:
        data_batch (dict): A batch of ``pseudo_collate`` (a list per key, one
            entry per sample) or ``default_collate`` (stacked tensors).
        packed (dict): Position -> the pipeline's output for that sample
            (``{'inputs': ..., 'data_samples': ...}``), or ``None`` to leave
            the sample out (a pipeline that dropped it).
    """
    n = batch_size(data_batch)
    keep = [i for i in range(n) if i not in packed or packed[i] is not None]

    def entry(key, value, i):
        return packed[i][key] if i in packed else value[i]

    batch = type(data_batch)()
    for key, value in data_batch.items():
        if isinstance(value, (list, tuple)) and len(value) == n:
            batch[key] = type(value)(entry(key, value, i) for i in keep)
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and \
                value.shape[0] == n:
            batch[key] = torch.stack([entry(key, value, i) for i in keep])
        else:
            batch[key] = value
    return batch


def sample_files(data_batch: Any) -> Optional[List[Optional[str]]]:
    """``img_path`` of each sample of an mmengine batch (``None`` where its
    metainfo has none); ``None`` for a batch without data samples."""
    samples = data_batch.get('data_samples') if isinstance(
        data_batch, Mapping) else None
    if not isinstance(samples, (list, tuple)):
        return None
    # An attribute of the sample (BaseDataElement keeps each metainfo key
    # as one): no copy of its metainfo dict per sample.
    return [getattr(s, 'img_path', None) for s in samples]
