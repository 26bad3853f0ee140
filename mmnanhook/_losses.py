"""The loss terms of a parsed loss dict, and which of them are not finite:
what tier 1 records of every loss and what a replay reads of its own."""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Tuple

import torch


def loss_terms(log_vars: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """The entries of a parsed loss dict that ``parse_losses`` sums.

    Args:
        log_vars (Mapping[str, torch.Tensor]): ``parse_losses``' second
            output (including the total under ``'loss'``).

    Returns:
        OrderedDict: name -> detached tensor, for the keys containing
        ``'loss'`` (the sum's terms and the total); other entries, such as an
        accuracy, are not losses.
    """
    return OrderedDict((k, v.detach()) for k, v in log_vars.items()
                       if 'loss' in k and torch.is_tensor(v))


def describe_losses(terms: Mapping[str, torch.Tensor]
                    ) -> Tuple[Dict[str, float], List[str]]:
    """Turn loss terms into floats and name the non-finite ones.

    Failure path only: every term costs a host sync.

    Args:
        terms (Mapping[str, torch.Tensor]): From :func:`loss_terms`.

    Returns:
        tuple[dict, list[str]]: name -> float, and the non-finite names. The
        total ``'loss'`` is named only when no term explains it.
    """
    values = OrderedDict((k, float(v.float().mean()))
                         for k, v in terms.items())
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if len(bad) > 1 and 'loss' in bad:
        bad.remove('loss')
    return values, bad
