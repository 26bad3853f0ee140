"""Scans of what the failing step started from: parameters, buffers and the
optimizer state."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Dict, Optional

import torch

from ._tensors import first_nonfinite

# Buffers a normalization layer updates in train-mode forward.
_RUNNING_STATS = ('running_mean', 'running_var', 'num_batches_tracked')


def _nonfinite_names(named_tensors):
    return [name for name, tensor in named_tensors
            if first_nonfinite([tensor]) is not None]


def largest_param(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """The finite parameter of largest magnitude: ``name``, ``max_abs``
    (a host sync per parameter: failure path, or once per run)."""
    best = None
    for name, param in model.named_parameters():
        if not param.is_floating_point() or param.numel() == 0:
            continue
        values = param.detach().abs()
        peak = float(values.max())
        if not math.isfinite(peak):  # rare: only then pay for the filter
            values = values[torch.isfinite(values)]
            peak = float(values.max()) if values.numel() else None
        if peak is not None and (best is None or peak > best['max_abs']):
            best = {'name': name, 'max_abs': peak}
    return best


def _walk_state(obj, path):
    """Yield ``(path, value)`` of the tensors and floats in a state dict."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            for item in _walk_state(value, path + [key]):
                yield item
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            for item in _walk_state(value, path + [index]):
                yield item
    elif isinstance(obj, (torch.Tensor, float)):
        yield path, obj


def _optimizer_state_problems(optimizer_state, model):
    """Dotted paths of the non-finite entries of an optimizer's state.

    Accepts an optimizer, an mmengine optim wrapper or a state dict.  When
    the optimizer object is given, ``state.<index>`` is named after the
    parameter (``state.<param name>.exp_avg``).
    """
    if optimizer_state is None:
        return []
    param_names = {}
    state = optimizer_state
    if hasattr(optimizer_state, 'state_dict'):
        optimizer = getattr(optimizer_state, 'optimizer', optimizer_state)
        if hasattr(optimizer, 'param_groups'):
            by_id = dict((id(p), n) for n, p in model.named_parameters())
            params = [p for group in optimizer.param_groups
                      for p in group['params']]
            # state_dict() numbers parameters in param_groups order.
            param_names = dict((i, by_id.get(id(p)))
                               for i, p in enumerate(params))
        state = optimizer_state.state_dict()
    bad = []
    for path, value in _walk_state(state, []):
        if isinstance(value, float):
            finite = math.isfinite(value)
        else:
            finite = first_nonfinite([value]) is None
        if finite:
            continue
        if len(path) > 1 and path[0] == 'state' and param_names.get(path[1]):
            path = ['state', param_names[path[1]]] + path[2:]
        bad.append('.'.join(str(p) for p in path))
    return bad


def scan_state(report: Any, model: torch.nn.Module,
               optimizer_state: Any) -> None:
    buffers = _nonfinite_names(model.named_buffers())
    # BN running statistics are written by the failing forward itself and
    # not read in train mode: non-finite ones are a symptom, not a cause.
    stats = [name for name in buffers
             if name.rsplit('.', 1)[-1] in _RUNNING_STATS]
    report.params = (_nonfinite_names(model.named_parameters())
                        + [name for name in buffers if name not in stats])
    if stats:
        report.notes.append(
            '{} normalization running statistics are non-finite ({}{}): the '
            'failing forward wrote them; train-mode forward does not read '
            'them'.format(len(stats), ', '.join(stats[:3]),
                          ', ...' if len(stats) > 3 else ''))
    report.largest_param = largest_param(model)
    report.optimizer_state = _optimizer_state_problems(
        optimizer_state, model)
