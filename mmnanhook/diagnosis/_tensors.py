"""Finding tensors in model outputs and telling which hold NaN or Inf."""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, Optional

import torch


def _is_float(tensor):
    return (tensor.is_floating_point() and not tensor.is_sparse
            and tensor.numel() > 0)


def first_nonfinite(tensors: Iterable[Optional[torch.Tensor]]
                    ) -> Optional[torch.Tensor]:
    """The first floating-point tensor holding NaN or Inf, else ``None``.

    Args:
        tensors (Iterable[Tensor | None]): Tensors to check.
    """
    for tensor in tensors:
        if (tensor is not None and _is_float(tensor)
                and not bool(torch.isfinite(tensor.detach()).all())):
            return tensor
    return None


class FiniteMemo(object):
    """Tensors seen finite, not checked again while unchanged.

    A module's output is its parent's output and the next module's input:
    remembered (by identity and version, an in-place change being a new
    version), each activation is read once per replay instead of three
    times or more.
    """

    def __init__(self) -> None:
        self._seen = {}

    def first_nonfinite(self, tensors: Iterable[Optional[torch.Tensor]]
                        ) -> Optional[torch.Tensor]:
        """As :func:`first_nonfinite`, skipping tensors seen finite."""
        for tensor in tensors:
            if tensor is None or not _is_float(tensor):
                continue
            seen = self._seen.get(id(tensor))
            if (seen is not None and seen[0]() is tensor
                    and seen[1] == tensor._version):
                continue
            if not bool(torch.isfinite(tensor.detach()).all()):
                return tensor
            self._seen[id(tensor)] = (weakref.ref(tensor), tensor._version)
        return None


def max_abs(tensors: Iterable[torch.Tensor]) -> float:
    """Largest absolute value over floating-point ``tensors`` (0.0 if none).

    Args:
        tensors (Iterable[Tensor]): Tensors to check.
    """
    best = 0.0
    for tensor in tensors:
        if _is_float(tensor):
            best = max(best, float(tensor.detach().abs().max()))
    return best


def count_nonfinite(tensor: torch.Tensor) -> Dict[str, int]:
    """``{'nan': n, 'inf': m}`` counts of a tensor.

    Args:
        tensor (Tensor): A floating-point tensor.
    """
    tensor = tensor.detach()
    return {'nan': int(torch.isnan(tensor).sum()),
            'inf': int(torch.isinf(tensor).sum())}


def _grad_fn_name(tensor):
    fn = getattr(tensor, 'grad_fn', None)
    return fn.name() if fn is not None else None
