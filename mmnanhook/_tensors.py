"""The tensors inside a value a module takes or returns: shared by the
input check (:mod:`._inputs`) and the diagnosis."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

import torch

# Nesting that real model outputs reach (data sample -> instances -> boxes
# -> tensor is 4); the limit only guards against self-referencing objects.
_MAX_DEPTH = 8


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Yield the tensors inside ``obj``.

    Looks into mappings, lists, tuples, mmengine data elements (their data
    fields) and box structures (their ``tensor``).

    Args:
        obj: Anything a module takes or returns.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if _depth >= _MAX_DEPTH:
        return
    # The containers first: every train step's input check walks one.
    if isinstance(obj, (list, tuple)):
        children = obj
    elif isinstance(obj, Mapping):
        children = obj.values()
    elif callable(getattr(type(obj), 'all_values', None)):
        children = obj.values()  # an mmengine data element's data fields
    else:
        # Attributes are looked up on the class or in __dict__ only: objects
        # found among a frame's locals may have a __getattr__ that raises.
        attrs = getattr(obj, '__dict__', None)
        if not (isinstance(attrs, dict)
                and isinstance(attrs.get('tensor'), torch.Tensor)):
            return
        children = (attrs['tensor'], )  # an mmdet/mmrotate box structure
    for child in children:
        yield from iter_tensors(child, _depth + 1)
