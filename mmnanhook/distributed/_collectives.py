"""A collective call as a record: what calls it again with zeros of its
tensors' shapes, and what it wrote (:class:`~._forward_guard.ForwardGuard`
records every collective of a train step with them)."""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# torch.distributed functions that wait on other ranks.
COLLECTIVES = ('all_reduce', 'all_gather', 'all_gather_into_tensor',
               '_all_gather_base', 'reduce_scatter', 'reduce_scatter_tensor',
               '_reduce_scatter_base', 'broadcast', 'reduce', 'all_to_all',
               'all_to_all_single', 'barrier', 'monitored_barrier', 'gather',
               'scatter', 'all_gather_object', 'broadcast_object_list',
               'all_reduce_coalesced')

# tensors' shapes (ForwardGuard): all that mmdet's reduce_mean and
# all_reduce_dict and mmengine.dist's tensor helpers call.
REPLAYABLE = frozenset(('all_reduce', 'all_gather', 'all_gather_into_tensor',
                        '_all_gather_base', 'broadcast', 'barrier'))

# A tensor argument of a recorded collective: called again as zeros.
_Zeros = collections.namedtuple('_Zeros', 'shape dtype device')


def collective_signature(
        name: str, args: Sequence[Any], kwargs: Dict[str, Any]
) -> Optional[Tuple[str, Tuple[Any, ...], Dict[str, Any]]]:
    """What calls the collective ``name`` again with zeros for its tensors
    (no tensor kept); ``None`` for one not :data:`REPLAYABLE`."""
    if name not in REPLAYABLE:
        return None
    # Comprehensions, not generators: a batch norm's every collective of a
    # DDP step is signed (about 1 us each, half what generators cost).
    return name, tuple([_spec(a) for a in args]), {
        k: _spec(v) for k, v in kwargs.items()}


def _spec(value):
    if isinstance(value, torch.Tensor):
        return _Zeros(value.shape, value.dtype, value.device)
    if isinstance(value, list):
        # all_gather's tensors.
        return [_spec(v) for v in value]
    return value


# The argument a collective writes its result into: position, keyword.
_OUTPUT = dict(all_reduce=(0, 'tensor'), broadcast=(0, 'tensor'),
               all_gather=(0, 'tensor_list'),
               all_gather_into_tensor=(0, 'output_tensor'),
               _all_gather_base=(0, 'output_tensor'))


def collective_outputs(
        name: str, args: Sequence[Any], kwargs: Dict[str, Any]
) -> List[Tuple[torch.Tensor, Optional[int]]]:
    """What a collective wrote: ``[(tensor, its version)]``, by reference (a
    version that moved on means the caller wrote it since: no longer the
    answer; no copy, no kernel), or ``[(copy, None)]`` for a broadcast.

    A broadcast is kept as a copy: its value is rank ``src``'s alone (no
    rank can make it up), it is rare (a preprocessor's every tenth
    iteration), and its callers copy the result over itself (mmengine's
    ``broadcast`` on the tensor's own device), which moves the version on.
    """
    where = _OUTPUT.get(name)
    if where is None:
        return []
    position, keyword = where
    value = args[position] if len(args) > position else kwargs.get(keyword)
    tensors = value if isinstance(value, list) else [value]
    if name == 'broadcast':
        return [(t.detach().clone(), None) for t in tensors
                if isinstance(t, torch.Tensor)]
    return [(t, t._version) for t in tensors
            if isinstance(t, torch.Tensor)]


def zeros(spec: Any) -> Any:
    if isinstance(spec, _Zeros):
        return torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
    if isinstance(spec, list):
        return [zeros(s) for s in spec]
    return spec
