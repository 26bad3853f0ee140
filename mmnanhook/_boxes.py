"""Box structures as mmdet and mmrotate hand them over: what kind they are
and their corners. Shared by the GT checks and the pictures."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch

_KIND_BY_CLASS = {
    'HorizontalBoxes': 'hbox',
    'RotatedBoxes': 'rbox',
    'QuadriBoxes': 'qbox',
}
_KIND_BY_WIDTH = {4: 'hbox', 5: 'rbox', 8: 'qbox'}


def as_box_tensor(boxes: Any
                  ) -> Tuple[Optional[str], Optional[torch.Tensor]]:
    """(kind, float tensor N x D) of boxes, or (None, None)."""
    tensor = getattr(boxes, 'tensor', boxes)
    if isinstance(tensor, np.ndarray):
        tensor = torch.from_numpy(tensor)
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        return None, None
    kind = _KIND_BY_CLASS.get(type(boxes).__name__)
    if kind is None:
        kind = _KIND_BY_WIDTH.get(int(tensor.shape[-1]))
    if kind is None:
        return None, None
    return kind, tensor.detach().to('cpu', torch.float64)


def rbox_corners(t: torch.Tensor) -> torch.Tensor:
    """Corners (N, 4, 2) of (cx, cy, w, h, angle) boxes."""
    cx, cy, w, h, a = t.unbind(-1)
    cos, sin = torch.cos(a), torch.sin(a)
    dx = torch.stack([w, -w, -w, w], -1) / 2
    dy = torch.stack([h, h, -h, -h], -1) / 2
    xs = cx[:, None] + dx * cos[:, None] - dy * sin[:, None]
    ys = cy[:, None] + dx * sin[:, None] + dy * cos[:, None]
    return torch.stack([xs, ys], -1)
