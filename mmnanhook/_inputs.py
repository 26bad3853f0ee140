"""Which samples of a preprocessed batch hold NaN/Inf in their inputs.

A floating-point input (an image loaded with ``to_float32``, a raster whose
nodata is NaN, mmagic's float frames) can carry NaN into the forward, where
some ops do not make NaN but crash the process (mmcv's deformable
convolution on the CPU). Integer inputs (``uint8`` images) cannot: they are
never looked at. The check is one sum per batch, synced once: a finite sum
means finite inputs; a non-finite one (or a sum that overflowed) is looked
at sample by sample, on the failure path only. Shared by tier 1 (before the
forward of a train step) and the replays of the diagnosis.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable, List, Optional

import torch

from ._batch import sample_files
from ._tensors import iter_tensors
from .errors import NonFiniteInputError


def floating(data_batch: Any) -> bool:
    """Whether the batch as the dataloader yields it has floating-point
    inputs (``data_batch['inputs']``: a tensor, or a list, tuple or dict of
    them).

    Args:
        data_batch: A batch from an mmengine dataloader.
    """
    inputs = data_batch.get('inputs') if isinstance(data_batch,
                                                    Mapping) else None
    return any(t.is_floating_point() for t in iter_tensors(inputs))


def per_sample(inputs: Any) -> list:
    """The tensors of each sample: ``inputs`` stacked (``(N, ...)``
    tensors, one per key of a dict) or one entry per sample.

    Args:
        inputs: A batch's ``inputs``.
    """
    if isinstance(inputs, torch.Tensor):
        return [[x] for x in inputs] if inputs.dim() > 0 else [[inputs]]
    if isinstance(inputs, Mapping):
        per = [per_sample(value) for value in inputs.values()]
        n = max([len(p) for p in per] or [0])
        return [[t for p in per if i < len(p) for t in p[i]]
                for i in range(n)]
    if isinstance(inputs, (list, tuple)):
        return [list(iter_tensors(x)) for x in inputs]
    return []


def nonfinite_samples(data: Any) -> list:
    """The positions of the samples whose inputs hold NaN/Inf.

    Args:
        data (dict): What the data preprocessor returned (``inputs``).

    Returns:
        list[int]: Empty when every input is finite (one host sync).
    """
    inputs = data.get('inputs') if isinstance(data, Mapping) else data
    tensors = [t for t in iter_tensors(inputs) if t.is_floating_point()]
    if not tensors:
        return []
    # A sum is one read of the inputs, no mask; NaN and Inf survive it.
    total = tensors[0].sum() if len(tensors) == 1 else torch.stack(
        [t.sum().float() for t in tensors]).sum()
    if bool(torch.isfinite(total)):
        return []
    return [i for i, sample in enumerate(per_sample(inputs))
            if any(t.is_floating_point() and not bool(torch.isfinite(t).all())
                   for t in sample)]


def sample_names(data: Any,
                 samples: Iterable[int]) -> Optional[List[Optional[str]]]:
    """The image file of each sample at ``samples`` (``None`` where
    unknown), or ``None`` when the batch has no list of data samples."""
    files = sample_files(data)
    if files is None:
        return None
    return [files[i] if i < len(files) else None for i in samples]


def check_inputs(data: Any) -> None:
    """Raise :class:`~mmnanhook.errors.NonFiniteInputError` naming the
    samples whose inputs hold NaN/Inf.

    Args:
        data (dict): What the data preprocessor returned.
    """
    samples = nonfinite_samples(data)
    if samples:
        raise NonFiniteInputError(samples, sample_names(data, samples))
