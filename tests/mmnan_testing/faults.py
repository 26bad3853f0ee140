"""Faults planted in real detectors: small modules a config can name.

Each module stands for user code with one bug; a test (or a script run in a
subprocess) registers them in mmdet's ``MODELS`` with
:func:`register_mmdet_modules` and names them in a tiny config. Expected
source lines are found in this file by a marker comment (:func:`line_of`).
"""
import os.path as osp

import torch
import torch.nn as nn

# The first torch draw of a forward drops the feature map below this.
DROP_P = 0.05
# Multiplies a feature map: > 65504 (the float16 max) from O(1) features.
AMPLIFY = 1e5


def is_op(op, base):
    """Whether autograd node name ``op`` is ``base`` (torch >= 1.8 suffixes
    node names with a digit: ``SqrtBackward0``)."""
    return op is not None and op.rstrip('0123456789') == base


def line_of(marker):
    """``file:line`` of the line of this file ending in ``# MARK marker``."""
    path = osp.abspath(__file__)
    with open(path) as f:
        hits = [i + 1 for i, text in enumerate(f)
                if text.rstrip().endswith('# MARK ' + marker)]
    assert len(hits) == 1, marker
    return '{}:{}'.format(path, hits[0])


# -- planted modules ---------------------------------------------------------


class SqrtL1Loss(nn.Module):
    """A box loss written as ``sqrt(weight * err**2)``: finite forward, but
    the zero weight of every negative anchor puts ``sqrt`` at 0, whose
    derivative is infinite (and ``0 * inf`` behind it is NaN)."""

    def __init__(self, loss_weight=1.0):
        super(SqrtL1Loss, self).__init__()
        self.loss_weight = loss_weight

    def forward(self, pred, target, weight=None, avg_factor=None,
                reduction_override=None):
        err = (pred - target)**2
        if weight is not None:
            err = err * weight
        loss = torch.sqrt(err).sum()  # MARK sqrt
        return self.loss_weight * loss / max(float(avg_factor or 1), 1.0)


class _DivideByScale(nn.Module):
    """Divides by a scale buffer that nobody initialised (zeros)."""

    def __init__(self):
        super(_DivideByScale, self).__init__()
        self.register_buffer('scale', torch.zeros(1))

    def forward(self, x):
        return x / self.scale  # MARK divide


class _InplaceGate(nn.Module):
    """Gates a feature map, but rescales the gate in place."""

    def forward(self, x):
        gate = x.sigmoid()  # MARK sigmoid
        gate.mul_(2)  # sigmoid's backward needs its unmodified output
        return x * gate


class _RandomDrop(nn.Module):
    """Drops the whole map with probability DROP_P, rescaled by the kept
    fraction: ``0 / 0`` when dropped."""

    def forward(self, x):
        keep = (torch.rand(()) >= DROP_P).to(x.dtype)
        return x * keep / keep  # MARK drop


class _Amplify(nn.Module):
    """Finite in float32, beyond the float16 range under autocast."""

    def forward(self, x):
        return x * AMPLIFY  # MARK amplify


class NanGradient(torch.autograd.Function):
    """Identity whose gradient is NaN: a fault born in backward only."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float('nan')  # MARK nan gradient


class _SwitchedNanGradient(nn.Module):
    """Identity; its gradient is NaN while ``armed`` (set from outside, e.g.
    by a hook for chosen iterations)."""

    def __init__(self):
        super(_SwitchedNanGradient, self).__init__()
        self.armed = False

    def forward(self, x):
        return NanGradient.apply(x) if self.armed else x


TAILS = {
    'divide': _DivideByScale,
    'nan_gradient': _SwitchedNanGradient,
    'inplace': _InplaceGate,
    'drop': _RandomDrop,
    'amplify': _Amplify,
}


class GalleryNeck(nn.Module):
    """A neck that runs a stock FPN, then one planted module (``tail``) on
    its finest output: the parent of the fault, never its producer.

    Args:
        fpn (dict): The FPN config.
        tail (str): A key of ``TAILS``.
    """

    def __init__(self, fpn, tail):
        super(GalleryNeck, self).__init__()
        from mmdet.registry import MODELS
        self.fpn = MODELS.build(fpn)
        self.tail = TAILS[tail]()

    def forward(self, feats):
        outs = list(self.fpn(feats))
        outs[0] = self.tail(outs[0])
        return tuple(outs)


def seed_of(first_draw_drops, second_draw_drops=False):
    """A torch seed whose first two ``torch.rand(())`` draws fall below /
    above ``DROP_P`` as asked (for the ``drop`` tail)."""
    for seed in range(10000):
        gen = torch.Generator().manual_seed(seed)
        draws = [float(torch.rand((), generator=gen)) for _ in range(2)]
        if [d < DROP_P for d in draws] == [first_draw_drops,
                                            second_draw_drops]:
            return seed
    raise AssertionError('no such seed')


def register_mmdet_modules():
    """Register the planted modules in mmdet's ``MODELS``."""
    from mmdet.registry import MODELS
    MODELS.register_module(module=SqrtL1Loss, force=True)
    MODELS.register_module(module=GalleryNeck, force=True)
