"""What a wrapper's sentinel tells its listener, and what it asks."""
from __future__ import annotations

from typing import Any, Dict, List, Optional


class Listener(object):
    """What a wrapper's sentinel tells its listener (``NanDetectHook``).

    Every method is optional to override; the defaults do nothing.
    """

    def loss_terms(self, loss: Any) -> Optional[Dict[str, Any]]:
        """The loss terms ``parse_losses`` produced for ``loss``, if known.

        Args:
            loss (torch.Tensor): The loss handed to ``update_params``.

        Returns:
            dict | None: name -> detached tensor.
        """
        return None

    def on_trigger(self, event: Any, step: Any) -> None:
        """Carry out a trigger of the update step: called inside the step,
        before anything of the step is decided.

        Args:
            event (NonFiniteEvent): What was non-finite (or spiked).
            step (UpdateStep): The step, for
                :func:`~mmnanhook.recovery.carry_out` to act on. The
                default carries out the policy's plan on it without a
                diagnosis.
        """
        step.sentinel.carry_out_alone(event, step)

    def on_backward_raised(self, event: Any) -> Optional[str]:
        """Called when backward raised (the exception goes on whatever the
        policy).

        Args:
            event (NonFiniteEvent): The exception's event.

        Returns:
            str | None: What to add to the exception as a note.
        """
        return None

    def on_spike(self, spikes: List[Any]) -> None:
        """Called for the spikes of an update step, whatever the policy.

        Args:
            spikes (list[Spike]): This step's spikes.
        """

    def on_resolved(self, applied: bool) -> None:
        """Called after the policy acted on an update step (every one).

        Args:
            applied (bool): Whether the step (or, under ``'drop'``, its
                recomputation) is applied.
        """
