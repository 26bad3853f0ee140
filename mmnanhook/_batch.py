"""What a batch from an MMEngine dataloader holds per sample: how many
samples, and the sub-batch of some of them (the diagnosis replays samples
alone; ``policy='drop'`` recomputes a step without some).

Two layouts are known, and samples are left out of no other (a batch whose
shape is not known is never guessed at: :func:`leave_out_refused` says why):

* one entry per sample: ``pseudo_collate`` (mmdet, mmseg, mmpose,
  mmpretrain: a list of inputs and a list of data samples), or tensors
  stacked along their first dimension (``default_collate``); every value of
  the batch is such an entry, or a scalar shared by all;
* mmyolo's ``yolov5_collate``: stacked inputs and ``data_samples`` one dict
  of the batch's boxes, ``bboxes_labels`` an ``(M, 6)`` tensor whose first
  column is each box's place in the batch (its other entries, ``masks``,
  ``keypoints``, one row per box too): a sample's rows go with it, and the
  places of the others are numbered anew.
"""
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


# The key of ``yolov5_collate``'s box rows, and the column of each row's
# place in the batch.
ROWS = 'bboxes_labels'


class UnknownBatchError(ValueError):
    """A batch whose per-sample layout is not one this module knows: no
    sample is left out of it (the message says what was not known)."""


def _rows(data_batch):
    """``yolov5_collate``'s ``data_samples`` (a dict whose ``bboxes_labels``
    is a 2-d tensor), or ``None``."""
    samples = data_batch.get('data_samples') if isinstance(
        data_batch, Mapping) else None
    rows = samples.get(ROWS) if isinstance(samples, Mapping) else None
    if isinstance(rows, torch.Tensor) and rows.dim() == 2 and \
            rows.shape[1] >= 2:
        return samples
    return None


def _scalar(value):
    return value is None or isinstance(value, (str, bytes, int, float)) or (
        isinstance(value, torch.Tensor) and value.dim() == 0)


def _not_per_sample(value, n, where):
    """Why ``value`` is neither one entry per sample of ``n`` nor a scalar
    shared by all, or ``None``."""
    if _scalar(value):
        return None
    if isinstance(value, torch.Tensor):
        return None if value.shape[0] == n else \
            '{} is a tensor of {} rows in a batch of {}'.format(
                where, value.shape[0], n)
    if isinstance(value, (list, tuple)):
        return None if len(value) == n else \
            '{} holds {} entries in a batch of {}'.format(where, len(value), n)
    if isinstance(value, Mapping):
        for key, each in value.items():
            why = _not_per_sample(each, n, '{}[{!r}]'.format(where, key))
            if why is not None:
                return why
        return None
    return '{} is a {}'.format(where, type(value).__name__)


def leave_out_refused(data_batch: Any) -> Optional[str]:
    """Why samples cannot be left out of ``data_batch`` (its layout is not
    one this module knows), or ``None``.

    Args:
        data_batch: A batch from an mmengine dataloader.
    """
    if isinstance(data_batch, torch.Tensor):
        return None if data_batch.dim() > 0 else 'the batch is a 0-d tensor'
    if not isinstance(data_batch, Mapping):
        return 'the batch is a {}, not a dict'.format(
            type(data_batch).__name__)
    n = batch_size(data_batch)
    if not n:
        return 'the batch size cannot be told'
    samples = _rows(data_batch)
    if samples is not None:
        count = samples[ROWS].shape[0]
        for key, value in samples.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or \
                    value.shape[0] != count:
                return ("data_samples[{!r}] is not one row per box of "
                        "data_samples[{!r}]".format(key, ROWS))
        rest = dict((k, v) for k, v in data_batch.items()
                    if k != 'data_samples')
        return _not_per_sample(rest, n, 'the batch')
    return _not_per_sample(data_batch, n, 'the batch')


def split_batch(data_batch: Any, indices: Sequence[int]) -> Any:
    """The sub-batch holding only the samples at ``indices``.

    Every list, tuple or tensor whose length is the batch size is indexed,
    scalars are shared; ``yolov5_collate``'s box rows go with their samples,
    renumbered.

    Args:
        data_batch: A batch from an mmengine dataloader.
        indices (list[int]): Samples to keep, in order.

    Raises:
        UnknownBatchError: The batch's layout is not known
            (:func:`leave_out_refused`).
    """
    why = leave_out_refused(data_batch)
    if why is not None:
        raise UnknownBatchError(why)
    n = batch_size(data_batch)
    index = torch.as_tensor(list(indices), dtype=torch.long)
    samples = _rows(data_batch)

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

    if samples is None:
        return take(data_batch)
    return type(data_batch)(
        (key, _take_rows(value, indices, n) if key == 'data_samples' else
         take(value)) for key, value in data_batch.items())


def _take_rows(samples, indices, n):
    """``yolov5_collate``'s ``data_samples`` of the samples at ``indices``:
    their rows, each row's place renumbered to its sample's new one."""
    rows = samples[ROWS]
    place = torch.full((n, ), -1, dtype=torch.long)
    place[torch.as_tensor(list(indices), dtype=torch.long)] = torch.arange(
        len(indices))
    owner = rows[:, 0].detach().long().cpu()
    # A row of no sample of the batch (a place outside it) goes.
    inside = (owner >= 0) & (owner < n)
    kept = torch.zeros_like(inside)
    kept[inside] = place[owner[inside]] >= 0
    taken = type(samples)((key, value[kept.to(value.device)])
                          for key, value in samples.items())
    renumbered = taken[ROWS].clone()
    renumbered[:, 0] = place[owner[kept]].to(renumbered)
    taken[ROWS] = renumbered
    return taken


def replace_samples(data_batch: Any,
                    packed: Dict[int, Optional[Dict[str, Any]]]) -> Any:
    """The batch with some samples replaced by what a pipeline packed anew.

    Args:
        data_batch (dict): A batch of ``pseudo_collate`` (a list per key, one
            entry per sample) or ``default_collate`` (stacked tensors).
        packed (dict): Position -> the pipeline's output for that sample
            (``{'inputs': ..., 'data_samples': ...}``), or ``None`` to leave
            the sample out (a pipeline that dropped it).

    Raises:
        UnknownBatchError: Not one entry per sample (``yolov5_collate``'s
            boxes would have to be collated again).
    """
    if _rows(data_batch) is not None or leave_out_refused(data_batch):
        raise UnknownBatchError(
            'the batch cannot take a sample packed anew: {}'.format(
                leave_out_refused(data_batch) or
                "its boxes are collated into data_samples[{!r}]".format(ROWS)))
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


# The metainfo (and data info) keys that name a sample's file, the first
# found: its image; else, for a sample without an input image, its target
# image (mmagic's unconditional GANs train on real images alone, loaded
# under the key 'gt': ``gt_img`` from ``gt_path``).
FILE_KEYS = ('img_path', 'gt_path')


def file_of(item: Any) -> Optional[Any]:
    """The file that names a sample (:data:`FILE_KEYS`), or ``None``.

    Args:
        item: A data info or metainfo (a mapping), or a data sample (an
            mmengine ``BaseDataElement``: each metainfo key is an attribute,
            read without a copy of its metainfo dict).
    """
    for key in FILE_KEYS:
        value = item.get(key) if isinstance(item, Mapping) else \
            getattr(item, key, None)
        if value is not None:
            return value
    return None


def sample_files(data_batch: Any) -> Optional[List[Optional[str]]]:
    """The file of each sample of an mmengine batch (:func:`file_of`;
    ``None`` where its metainfo names none); ``None`` for a batch without
    data samples."""
    samples = data_batch.get('data_samples') if isinstance(
        data_batch, Mapping) else None
    if not isinstance(samples, (list, tuple)):
        return None
    return [file_of(s) for s in samples]
