"""A small residual conv net for the CUDA checks: torch + mmengine only (the
device machine has no compiled mmcv), trained by :func:`toy.make_runner`.

The toy dataset's 4-vectors are projected to a ``3 x 16 x 16`` image (or
``size``), then
two residual conv blocks, pooling and a linear head. Faults come with the
data, as in :class:`~mmnan_testing.toy.ToyModel`:

* ``fp16_range``: one activation multiplied by ``1e5`` after the first
  block: finite in fp32, beyond fp16's 65504 under fp16 autocast;
* ``nan``: ``sqrt(-1)`` added to that activation: NaN in any dtype.

:func:`cuda_config` trains it from a config (registered names, imported by
``custom_imports``), so that its bundles rebuild the model in ``mmnan
replay`` on another machine.
"""
import uuid

import torch
import torch.nn as nn
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS

from .toy import BATCH, ToyDataset

FP16_FACTOR = 1e5


class _Block(nn.Module):

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = self.bn1(self.conv1(x)).relu()
        return (x + self.bn2(self.conv2(y))).relu()


@MODELS.register_module()
class SmallResNet(BaseModel):
    """Two residual blocks at ``width`` channels on ``size`` squared
    inputs (larger ones make a GPU iteration compute-bound)."""

    def __init__(self, width=32, size=16):
        super().__init__()
        self.size = size
        self.project = nn.Linear(4, 3 * size * size)
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.block1 = _Block(width)
        self.block2 = _Block(width)
        self.head = nn.Linear(width, 1)

    def forward(self, inputs, fault=None, mode='tensor'):
        faults = set(f for f in (fault or []) if f)
        x = self.project(torch.stack(inputs)).view(-1, 3, self.size,
                                                   self.size)
        h = self.block1(self.stem(x))
        if 'fp16_range' in faults:
            h = h * FP16_FACTOR  # MARK fp16_range
        if 'nan' in faults:
            h = h + torch.sqrt(-torch.ones((), device=h.device))  # MARK nan
        h = self.block2(h)
        y = self.head(h.float().mean((2, 3)))
        if mode != 'loss':
            return y
        return dict(loss=(y - 1.0).pow(2).mean())


DATASETS.register_module(name='CudaToyDataset', module=ToyDataset)


def cuda_config(work_dir, faults, hook, optim_wrapper, max_iters=4):
    """A config training :class:`SmallResNet` on the toy data (``faults``
    as :class:`~mmnan_testing.toy.ToyDataset` takes them)."""
    return Config(dict(
        custom_imports=dict(imports=['mmnan_testing.cuda_toy', 'mmnanhook'],
                            allow_failed_imports=False),
        default_scope='mmengine', model=dict(type='SmallResNet'),
        work_dir=str(work_dir),
        experiment_name='cuda_toy_' + uuid.uuid4().hex,
        train_dataloader=dict(
            dataset=dict(type='CudaToyDataset', n=16, faults=faults),
            sampler=dict(type='DefaultSampler', shuffle=False),
            batch_size=BATCH, num_workers=0,
            collate_fn=dict(type='pseudo_collate')),
        train_cfg=dict(by_epoch=False, max_iters=max_iters),
        optim_wrapper=optim_wrapper, custom_hooks=[hook],
        default_hooks=dict(checkpoint=None), randomness=dict(seed=0),
        log_level='WARNING'))
