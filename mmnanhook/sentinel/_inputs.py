"""Tier 1 before the forward: floating-point inputs checked once the data
preprocessor made them, before any op of the model runs.

A forward hook on the model's data preprocessor, armed for its next call
by each train step whose batch has floating-point inputs
(:func:`~mmnanhook._inputs.floating`); a batch of integer images arms
nothing and costs a dtype look per sample. Armed, the hook sums the
preprocessed inputs (one host sync); a sample whose inputs are not finite
makes the model's own forward raise :class:`~mmnanhook.errors.
NonFiniteInputError` on entry (a forward pre-hook), before any op of it ran,
and the step goes the way of any forward that raised (the policy;
``'drop'`` recomputes the step without them). Under DDP the other ranks
learn it at their next vote, and the rank stopped there answers their
forward's collectives up to it (:class:`~mmnanhook.distributed.
ForwardGuard`: DDP's buffer broadcast, SyncBN's statistics). The
hook sees only the train step's call (the ``training`` flag is a keyword
under DDP, which torch < 2.0 does not hand to hooks): the replays of a
diagnosis check their inputs themselves.
"""
from __future__ import annotations

from typing import Any

from .. import compat
from .._inputs import floating, nonfinite_samples, sample_names
from ..errors import NonFiniteInputError


class InputCheck(object):
    """The input check of one model's train steps; :meth:`remove` undoes it.

    Args:
        model (BaseModel, optional): The (unwrapped) model; nothing is
            checked when ``None`` or it has no data preprocessor.
    """

    def __init__(self, model: Any) -> None:
        self._armed = False
        self._found = None
        self._handles = []
        preprocessor = getattr(model, 'data_preprocessor', None)
        if preprocessor is not None:
            self._handles = [
                preprocessor.register_forward_hook(
                    compat.not_traced(self._preprocessed())),
                model.register_forward_pre_hook(
                    compat.not_traced(self._entered()))]

    def arm(self, data_batch: Any) -> None:
        """Check the next call's output when ``data_batch``, the train
        step's batch, has floating-point inputs."""
        self._armed = bool(self._handles) and floating(data_batch)
        self._found = None

    def _preprocessed(self):

        def after_preprocessor(module, args, output):
            if self._armed:
                self._armed = False
                samples = nonfinite_samples(output)
                if samples:
                    self._found = NonFiniteInputError(
                        samples, sample_names(output, samples))

        return after_preprocessor

    def _entered(self):

        def before_forward(module, args):
            found, self._found = self._found, None
            if found is not None:
                raise found

        return before_forward

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        self._armed, self._found = False, None
        for handle in handles:
            handle.remove()
