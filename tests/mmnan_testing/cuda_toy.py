"""A small residual conv net for the CUDA checks: torch + mmengine only (the
device machine has no compiled mmcv), trained by :func:`toy.make_runner`.

The toy dataset's 4-vectors are projected to a ``3 x 16 x 16`` image, then
two residual conv blocks, pooling and a linear head. Faults come with the
data, as in :class:`~mmnan_testing.toy.ToyModel`:

* ``fp16_range``: one activation multiplied by ``1e5`` after the first
  block: finite in fp32, beyond fp16's 65504 under fp16 autocast;
* ``nan``: ``sqrt(-1)`` added to that activation: NaN in any dtype.
"""
import torch
import torch.nn as nn
from mmengine.model import BaseModel

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


class SmallResNet(BaseModel):
    """Two residual blocks at ``width`` channels on 16 x 16 inputs."""

    def __init__(self, width=32):
        super().__init__()
        self.project = nn.Linear(4, 3 * 16 * 16)
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.block1 = _Block(width)
        self.block2 = _Block(width)
        self.head = nn.Linear(width, 1)

    def forward(self, inputs, fault=None, mode='tensor'):
        faults = set(f for f in (fault or []) if f)
        x = self.project(torch.stack(inputs)).view(-1, 3, 16, 16)
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
