"""What a wrapper's sentinel tells its listener, and what it asks."""


class Listener(object):
    """What a wrapper's sentinel tells its listener (``NanDetectHook``).

    Every method is optional to override; the defaults do nothing.
    """

    def loss_terms(self, loss):
        """The loss terms ``parse_losses`` produced for ``loss``, if known.

        Args:
            loss (torch.Tensor): The loss handed to ``update_params``.

        Returns:
            dict | None: name -> detached tensor.
        """
        return None

    def on_nonfinite(self, event):
        """Called on a trigger, inside the step, before the policy acts.

        Args:
            event (NonFiniteEvent): What was non-finite (or spiked).

        Returns:
            Answer | None: What the listener did and found (the diagnosis,
            the bundle, a drop plan, a reason to escalate), with which
            :class:`~mmnanhook.recovery.Policy` decides.
        """
        return None

    def on_spike(self, spikes):
        """Called for the spikes of an update step, whatever the policy.

        Args:
            spikes (list[Spike]): This step's spikes.
        """

    def on_resolved(self, applied):
        """Called after the policy acted on an update step.

        Args:
            applied (bool): Whether the step (or, under ``'drop'``, its
                recomputation) is applied.
        """

    def on_step(self, outcome):
        """Called after every checked update step, before the policy acts.

        Args:
            outcome (StepOutcome): What the check measured: the loss and
                gradient norm as every rank sees them.
        """
