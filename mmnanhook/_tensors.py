"""The tensors inside a value a module takes or returns: shared by the
input check (:mod:`._inputs`) and the diagnosis."""
from collections.abc import Mapping

import torch

# Nesting that real model outputs reach (data sample -> instances -> boxes
# -> tensor is 4); the limit only guards against self-referencing objects.
_MAX_DEPTH = 8


def iter_tensors(obj, _depth=0):
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
    # Attributes are looked up on the class or in __dict__ only: objects
    # found among a frame's locals may have a __getattr__ that raises.
    attrs = getattr(obj, '__dict__', None)
    if isinstance(obj, Mapping):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif callable(getattr(type(obj), 'all_values', None)):
        children = obj.values()  # an mmengine data element's data fields
    elif (isinstance(attrs, dict)
          and isinstance(attrs.get('tensor'), torch.Tensor)):
        children = (attrs['tensor'], )  # an mmdet/mmrotate box structure
    else:
        return
    for child in children:
        for tensor in iter_tensors(child, _depth + 1):
            yield tensor
