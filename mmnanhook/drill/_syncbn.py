"""A CPU stand-in of ``SyncBatchNorm``, for a drill (and tests) of DDP over
gloo.

torch's ``SyncBatchNorm`` refuses CPU modules, and mmdet's ``RTMDet``
(``use_syncbn=True``) converts every BatchNorm to it once the world is larger
than one. :class:`CpuSyncBatchNorm` does on a CPU what torch's does on GPUs:
in every training forward the batch statistics of all ranks are all-reduced
(sum, sum of squares and count per channel), and in backward their
gradients are, so every rank normalizes with the statistics of the global
batch. A forward run on one rank alone waits for the others: what a replay
must never do.

Registered as ``CpuSyncBN`` in mmengine's root ``MODELS``, beside mmcv's
``BN`` / ``SyncBN`` / ``MMSyncBN``: ``norm_cfg=dict(type='CpuSyncBN')``.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.distributed as dist
from mmengine.registry import MODELS
from torch.nn.modules.batchnorm import _BatchNorm

from ..doctor import config_dicts


class _AllReduceSum(torch.autograd.Function):
    """A sum over the ranks whose gradient is the ranks' summed gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _synced():
    return dist.is_available() and dist.is_initialized() and \
        dist.get_world_size() > 1


@MODELS.register_module('CpuSyncBN')
class CpuSyncBatchNorm(_BatchNorm):
    """A batch norm whose training statistics are those of every rank's
    batch together (see the module docstring); any input of at least two
    dimensions, channels second, as torch's ``SyncBatchNorm``.

    Args: as ``torch.nn.BatchNorm2d``.
    """

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError('expected at least 2D input (got {}D input)'
                             .format(input.dim()))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and _synced()):
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.shape[1]
        flat = input.transpose(0, 1).reshape(channels, -1)
        count = torch.full((1, ), float(flat.shape[1]), dtype=input.dtype)
        stats = _AllReduceSum.apply(torch.cat(
            [flat.sum(1), flat.pow(2).sum(1), count]))
        total = stats[-1]
        mean = stats[:channels] / total
        var = stats[channels:2 * channels] / total - mean.pow(2)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else \
                    1.0 / float(self.num_batches_tracked)
                unbiased = var.detach() * total / (total - 1).clamp(min=1)
                self.running_mean.mul_(1 - momentum).add_(
                    momentum * mean.detach())
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased)
        shape = (1, channels) + (1, ) * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(
            var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


# Models that make their BatchNorm torch's SyncBatchNorm themselves once the
# world is larger than one (``use_syncbn``), with its default.
_CONVERTING = {'RTMDet': True}


def use_cpu_syncbn(cfg: Any,
                   types: Tuple[str, ...] = ('SyncBN', 'MMSyncBN')) -> int:
    """Every ``norm_cfg`` of ``types`` in a config's model set to
    ``CpuSyncBN``, and a model's own conversion to torch's
    ``SyncBatchNorm`` (RTMDet's ``use_syncbn``) turned off: its ``BN``
    converted here instead; in place.

    Args:
        cfg (mmengine.Config): The config.
        types (tuple[str]): The norm types converted (and ``'BN'`` where the
            model converts its own).

    Returns:
        int: The ``norm_cfg`` entries changed, and conversions turned off.
    """
    changed = 0
    model = cfg.model
    kind = str(model.get('type', '')).split('.')[-1]
    if model.get('use_syncbn', _CONVERTING.get(kind, False)):
        model['use_syncbn'] = False
        types = tuple(types) + ('BN', )
        changed += 1

    for _, node in config_dicts(model):
        norm = node.get('norm_cfg')
        if isinstance(norm, dict) and norm.get('type') in types:
            node['norm_cfg'] = dict(norm, type='CpuSyncBN')
            changed += 1
    return changed
