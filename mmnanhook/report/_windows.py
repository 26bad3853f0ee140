"""What a micro-step leaves in the windows LogProcessor smooths.

Under gradient accumulation the update step that a non-finite loss spoils
comes iterations later; its earlier micro-steps' values are already logged
by then. RuntimeInfoHook has turned them into host floats when the hook's
``after_train_iter`` runs (before LoggerHook), so reading them costs no sync.
"""
import math

from .. import compat


def forget_nonfinite(message_hub, outputs):
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
        compat.forget_last_scalar(message_hub, 'train/' + key)
    return True
