"""Test-only AMP optim wrappers that run on a CPU.

``AmpOptimWrapper.__init__`` asserts a GPU; these replace only what must
change for a CPU (the constructor, and the autocast dtype), so every other
method under test is the real ``AmpOptimWrapper`` one. They are registered,
so a config can name them the way ``tools/train.py --amp`` names
``AmpOptimWrapper``.
"""
import contextlib

import torch
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS

from mmnanhook import compat


@OPTIM_WRAPPERS.register_module(force=True)
class CpuAmpOptimWrapper(AmpOptimWrapper):
    """``AmpOptimWrapper`` with bf16 autocast and a CPU GradScaler.

    Args:
        loss_scale (str | dict): ``'dynamic'`` or GradScaler kwargs.
        **kwargs: ``OptimWrapper`` arguments.
    """

    def __init__(self, loss_scale='dynamic', **kwargs):
        OptimWrapper.__init__(self, **kwargs)
        scaler_kwargs = {} if loss_scale == 'dynamic' else dict(loss_scale)
        self.loss_scaler = compat.cpu_grad_scaler(**scaler_kwargs)
        self.cast_dtype = torch.bfloat16
        self._scale_update_param = None


@OPTIM_WRAPPERS.register_module(force=True)
class CpuFp16AmpOptimWrapper(CpuAmpOptimWrapper):
    """``CpuAmpOptimWrapper`` with float16 autocast on CPU (torch >= 2.x
    autocasts float16 there; mmengine's ``autocast`` allows only bfloat16 on
    CPU, so the context is torch's own)."""

    def __init__(self, **kwargs):
        super(CpuFp16AmpOptimWrapper, self).__init__(**kwargs)
        self.cast_dtype = torch.float16

    @contextlib.contextmanager
    def optim_context(self, model):
        with OptimWrapper.optim_context(self, model), \
                compat.autocast('cpu', torch.float16):
            yield
