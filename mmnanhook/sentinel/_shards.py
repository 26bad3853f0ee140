"""Gradients split across ranks (FSDP): which are shards, as local tensors.

Under FSDP a rank holds only a shard of a sharded parameter's gradient, so a
norm of the local gradients is a per-rank partial norm. MMEngine's
``FSDPStrategy`` clips (and logs) exactly that: its ``_clip_grad`` calls
``clip_grad_norm_`` on the local shards. torch's own
``FullyShardedDataParallel.clip_grad_norm_`` (and ``clip_grad_norm_`` on
FSDP2's DTensor gradients) sums the p-th powers of the shards' norms over
the ranks and adds the gradients that are whole on every rank once. The
check does the same inside the all-reduce it makes anyway
(:func:`._check._sync`); this module says which local tensors are shards.
"""
from __future__ import annotations

from typing import List, Optional, Set, Tuple

import torch
from mmengine.dist import get_world_size

from .. import compat

# The type of every gradient outside FSDP (one lookup each, in C).
_PLAIN = frozenset((torch.Tensor, ))


def local_grads(params: List[torch.Tensor], grads: List[torch.Tensor],
                sharded_ids: Optional[Set[int]] = None,
                norm_type: float = 2.0
                ) -> Tuple[List[torch.Tensor], Optional[List[bool]]]:
    """The gradients as local tensors, and which of them are shards.

    Args:
        params (list[torch.Tensor]): Parameters with a gradient.
        grads (list[torch.Tensor]): Their gradients; DTensors allowed.
        sharded_ids (set[int], optional): ids of the parameters FSDP1 shards
            (:func:`mmnanhook.compat.fsdp_sharded_params`).

    Returns:
        tuple[list[torch.Tensor], list[bool] | None]: The local tensors and,
        per tensor, whether it is a shard (its norm's p-th power is summed
        over the ranks); ``None`` when nothing is sharded in this model, the
        plain single-process or DDP case. Every rank of one model answers
        ``None`` alike, so every rank makes the same all-reduce.
    """
    if sharded_ids is None and set(map(type, grads)) <= _PLAIN:
        return grads, None
    dtensor = compat.dtensor_type()
    world_size = get_world_size()
    local, sharded = [], []
    for param, grad in zip(params, grads):
        if dtensor is not None and isinstance(grad, dtensor):
            layout = _layout(grad, world_size)
            if layout is None:
                # HSDP, tensor parallel, a mesh of part of the world: DTensor
                # reduces the norm itself (a collective of its own); the
                # one-element result has that norm and is counted once.
                local.append(torch.linalg.vector_norm(
                    grad.detach(), float(norm_type)).full_tensor().reshape(1))
                sharded.append(False)
            else:
                local.append(grad.to_local())
                sharded.append(layout)
        else:
            local.append(grad)
            sharded.append(sharded_ids is not None
                           and id(param) in sharded_ids)
    return local, sharded


def _layout(grad, world_size):
    """True for a shard of a 1-D mesh over the world, False for a tensor
    replicated on it, ``None`` for any other layout."""
    mesh = grad.device_mesh
    if mesh.ndim != 1 or mesh.size() != world_size:
        return None
    (placement, ) = grad.placements
    if placement.is_shard():
        return True
    if placement.is_replicate():
        return False
    return None
