"""What a micro-step leaves in the windows LogProcessor smooths.

Under gradient accumulation the update step that a non-finite loss spoils
comes iterations later; its earlier micro-steps' values are already logged
by then. RuntimeInfoHook has turned them into host floats when the hook's
``after_train_iter`` runs (before LoggerHook), so reading them costs no sync.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional


def forget_nonfinite(message_hub: Any,
                     outputs: Optional[Dict[str, Any]]) -> bool:
    """Take this iteration's values back out of the ``train/`` windows when
    its loss is not finite.

    Args:
        message_hub (MessageHub): The runner's.
        outputs (dict, optional): What the train step returned (the keys
            RuntimeInfoHook logged).

    Returns:
        bool: Whether they were taken out.
    """
    loss = message_hub.log_scalars.get('train/loss')
    if not outputs or 'loss' not in outputs or loss is None or \
            math.isfinite(loss.current()):
        return False
    for key in outputs:
        _forget_last_scalar(message_hub, 'train/' + key)
    return True


def _forget_last_scalar(message_hub, key):
    """Take the last value of ``key`` back out of ``message_hub``.

    ``HistoryBuffer`` (mmengine 0.10.x) has no public way to: its two numpy
    arrays are shortened; a buffer left empty is removed, as LogProcessor
    cannot smooth an empty window.
    """
    buffer = message_hub.log_scalars.get(key)
    if buffer is None:
        return
    if len(buffer._log_history) <= 1:
        del message_hub.log_scalars[key]
        return
    buffer._log_history = buffer._log_history[:-1]
    buffer._count_history = buffer._count_history[:-1]
