"""Gradient norms computed once per update step, and clipping that reuses them.

Pure torch. The hot path builds tensors only; values reach the host in the
one sync the caller chooses, and per-gradient values are read on the failure
path only.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Union

import torch

from . import compat

# Gradients whose 2-norm the fast path takes from a dot product.
_DOT_DTYPES = (torch.float32, torch.float64)


class GradNorms(object):
    """Per-tensor and total p-norms of gradients, computed once.

    With ``exact=True`` the total is computed the way
    ``torch.nn.utils.clip_grad_norm_`` computes it (bitwise equal on the
    torch versions whose clip :mod:`mmnanhook.compat` mirrors), so clipping
    can reuse it. Without, the norm only has to be right to a few ulps: torch
    before 2.0, whose per-tensor norm kernels are slow on CPU, then gets the
    2-norm from dot products, about 4x faster; newer torch uses the fused
    ``_foreach_norm`` either way.

    Args:
        grads (list[torch.Tensor]): Gradient tensors.
        norm_type (float | str): The ``p`` of the norm; ``'inf'`` allowed.
        exact (bool): Compute the total exactly as the clip does.
        sharded (list[bool], optional): Per gradient, whether it is this
            rank's shard of a tensor split across ranks (FSDP, see
            :mod:`._shards`). Then :attr:`total` is only this rank's part
            until :meth:`finish` is given :attr:`power` summed over the ranks
            (its maximum for the inf-norm).
    """

    def __init__(self, grads: Iterable[torch.Tensor],
                 norm_type: Union[float, str] = 2.0, exact: bool = True,
                 sharded: Optional[List[bool]] = None) -> None:
        self.grads = list(grads)
        self.norm_type = float(norm_type)
        self.sharded = sharded
        self.order = []
        # Per gradient, a value that is non-finite iff its norm is.
        self._partials = []
        squares = (not exact and self.norm_type == 2.0 and sharded is None
                   and not compat.FOREACH_NORM_IN_CLIP
                   and all(g.dtype in _DOT_DTYPES for g in self.grads))
        with torch.no_grad():
            groups = compat.clip_norm_groups(self.grads)
            # Grouped and summed in the order torch's clip uses.
            for group in groups:
                tensors = [self.grads[i] for i in group]
                if squares:
                    flat = [t.reshape(-1) for t in tensors]
                    self._partials.extend(torch.dot(f, f) for f in flat)
                elif compat.foreach_norm_supported(tensors,
                                                   tensors[0].device):
                    self._partials.extend(
                        torch._foreach_norm(tensors, self.norm_type))
                else:
                    self._partials.extend(
                        compat.clip_vector_norm(t, self.norm_type)
                        for t in tensors)
                self.order.extend(group)
            if sharded is not None:
                self._split_powers()
                return
            if not self._partials:
                self.total = torch.tensor(0.0)
                return
            partials = self._partials
            if len(groups) > 1:
                device = self.grads[0].device
                partials = [t.to(device) for t in partials]
            stacked = torch.stack(partials)
            if squares:
                self.total = stacked.sum().sqrt()
            else:
                self.total = compat.clip_vector_norm(stacked, self.norm_type)

    def _split_powers(self):
        # As torch's FSDP clip: the shards' norms to the p-th power (their
        # maximum for inf), to be summed over the ranks; the gradients whole
        # on every rank added once, after.
        device = self.grads[0].device if self.grads else torch.device('cpu')
        shards, whole = [], []
        for k, i in enumerate(self.order):
            part = self._partials[k].to(device)
            (shards if self.sharded[i] else whole).append(part)
        self.power = self._power(shards, device)
        self._whole = self._power(whole, device)
        self.total = self.finish(self.power)

    def _power(self, norms, device):
        if not norms:
            return torch.zeros((), device=device)
        stacked = torch.stack(norms).float()
        if math.isinf(self.norm_type):
            return stacked.max()
        return (stacked**self.norm_type).sum()

    def finish(self, power: torch.Tensor) -> torch.Tensor:
        """The total norm, given :attr:`power` reduced over the ranks.

        Args:
            power (torch.Tensor): The sum over the ranks of :attr:`power`
                (the maximum for the inf-norm).

        Returns:
            torch.Tensor: The global norm, also kept as :attr:`total`.
        """
        power = power.to(self._whole.device)
        if math.isinf(self.norm_type):
            self.total = torch.max(power, self._whole)
        else:
            self.total = (power + self._whole)**(1.0 / self.norm_type)
        return self.total

    def nonfinite(self) -> List[int]:
        """Indices (into ``grads``) of gradients holding NaN or Inf.

        Failure path only (host syncs). Only gradients whose own norm is not
        finite are inspected element-wise.
        """
        if not self._partials:
            return []
        device = self.total.device
        values = torch.stack([t.to(device).float()
                              for t in self._partials]).tolist()
        suspects = [self.order[k] for k, v in enumerate(values)
                    if not math.isfinite(v)]
        if not suspects:
            return []
        finite = torch.stack([
            torch.isfinite(self.grads[i]).all().to(device) for i in suspects
        ]).tolist()
        return sorted(i for i, ok in zip(suspects, finite) if not ok)

    def largest_abs(self) -> float:
        """The largest gradient magnitude, as a float (failure path)."""
        if not self.grads:
            return 0.0
        device = self.total.device
        return float(
            torch.stack([
                g.detach().abs().max().float().to(device) for g in self.grads
            ]).max())


def clip_grads_with_norm_(params: List[torch.Tensor], max_norm: float,
                          total_norm: torch.Tensor) -> None:
    """Scale gradients in place by ``min(max_norm / (total + 1e-6), 1)``.

    The second half of ``clip_grad_norm_``, given the norm it would have
    computed, so clipping costs no second pass over the gradients' norms.

    Args:
        params (list[torch.Tensor]): Parameters whose ``.grad`` is scaled.
        max_norm (float): Maximum norm.
        total_norm (torch.Tensor): Total norm, e.g. :attr:`GradNorms.total`.
    """
    if compat.clip_grads_with_norm_ is not None:
        compat.clip_grads_with_norm_(params, max_norm, total_norm)
        return
    # torch < 2.6: the same arithmetic as its clip_grad_norm_.
    clip_coef = float(max_norm) / (total_norm + 1e-6)
    if compat.CLIP_ALWAYS_MULTIPLIES:
        clip_coef = torch.clamp(clip_coef, max=1.0)
    elif not clip_coef < 1:
        return
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(clip_coef.to(p.grad.device))
