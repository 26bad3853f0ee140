"""``policy='drop'``: the update step again, without the samples that broke it.

On a trigger whose diagnosis singles out offending samples, the sentinel
recomputes the step from the same weights, optimizer state, learning rate,
loss scale and RNG state on the batch without them (what the failing forward
wrote, BN running statistics, put back first), checks it like any step and
applies it. The listener (``NanDetectHook``) decides which samples and gives
the forward of the reduced batch; the sentinel runs the backward, the check
and the step, so the recomputed step is checked and clipped exactly as the
original would have been. When no sample can be singled out, ``'drop'`` does
what ``'skip'`` does and says why.
"""

import functools
import logging

from .._batch import batch_size, split_batch
from .._mmengine import unwrap_model
from ._rng import restore_rng

# Kinds whose implicated samples are the cause: the data itself, or a forward
# or backward failure that some samples (not all) reproduce alone. Weights,
# optimizer state, AMP ranges, exceptions and divergences are not about data.
_DATA_KINDS = ('data', 'forward', 'backward')


class DropPlan(object):
    """A step to recompute without some of its samples.

    Args:
        indices (list[int]): Positions, in the batch of the micro-step that
            failed, of the samples left out.
        forwards (list[callable]): One per micro-step since the last update
            step, in order (one without gradient accumulation): ``() ->
            loss``, that micro-step's forward (the failing one's on the
            reduced batch) from the RNG state before the original one, under
            the wrapper's ``optim_context``, through ``parse_losses``;
            returns the loss to give to ``backward``.
        undo (callable): Puts back what a forward wrote (BN running
            statistics); called before the recompute, and after it when the
            recomputed step is not applied either.
    """

    def __init__(self, indices, forwards, undo):
        self.indices = list(indices)
        self.forwards = list(forwards)
        self.undo = undo


def samples_to_drop(report, batch_size):
    """The batch positions a drop leaves out, or why none can be.

    Args:
        report (dict): The trigger's ``report.json`` content.
        batch_size (int, optional): Samples in the failing batch.

    Returns:
        tuple: ``(indices, None)``, or ``(None, reason)`` when ``'drop'``
        must do what ``'skip'`` does.
    """
    if not report:
        return None, 'no replay diagnosed the batch (replay=False)'
    if not batch_size or batch_size < 2:
        return None, 'the batch holds a single sample'
    kind = (report or {}).get('kind')
    if kind not in _DATA_KINDS:
        return None, 'the failure (kind %r) is not about samples' % (kind, )
    indices = sorted(set(s['index'] for s in report.get('samples') or []
                         if s.get('index') is not None))
    if not indices:
        return None, 'no sample of the batch fails on its own'
    if len(indices) >= batch_size:
        return None, 'every sample of the batch fails on its own'
    return indices, None


def model_forward(model, wrapper, batch, restore_rng, keep_outputs):
    """A :class:`DropPlan` forward for an MMEngine model: what
    ``BaseModel.train_step`` does before ``update_params``.

    Args:
        model: ``runner.model`` (a DDP wrapper included).
        wrapper (OptimWrapper): The optim wrapper of the step.
        batch: The reduced batch, as the dataloader gives batches.
        restore_rng (callable): Puts the RNG states back to those before
            the original forward.
        keep_outputs (callable): Given the recomputed ``log_vars``: what
            the train step returns instead of the failing forward's.
    """
    module = unwrap_model(model)

    def forward():
        restore_rng()
        with wrapper.optim_context(model):
            data = module.data_preprocessor(batch, True)
            losses = model._run_forward(data, mode='loss')
        loss, log_vars = module.parse_losses(losses)
        keep_outputs(log_vars)
        return loss

    return forward


def _ignore(log_vars):
    return None


class Dropper(object):
    """``policy='drop'`` for one run: the plans, and what they leave behind.

    Args:
        model: ``runner.model``.
        wrappers (list[OptimWrapper]): The optim wrappers checked.
        log (callable): ``(level, message)``: where the reasons go.
    """

    def __init__(self, model, wrappers, log):
        self.model = model
        self.wrappers = wrappers
        self.log = log
        self._outputs = None
        self._found = None

    def plan(self, event, report, steps, undo):
        """The :class:`DropPlan` of a trigger, or ``None`` (the step is then
        skipped; the log says why).

        Args:
            event (NonFiniteEvent): The trigger.
            report (dict, optional): Its diagnosis.
            steps (list[tuple]): ``(iter, data_batch, rng_state)`` of every
                micro-step since the last update step (``StepMemory``).
            undo (callable): Puts back what the failing forward wrote.
        """
        kept = dict((i, (b, r)) for i, b, r in steps)
        data_batch = kept.get(event.fail_iter, (None, None))[0]
        n = batch_size(data_batch) if data_batch is not None else None
        indices = None
        if event.world_size > 1:
            # Every rank decides alike, so none waits in a collective.
            reason = 'not implemented under distributed training yet'
        elif len(self.wrappers) != 1:
            reason = 'an OptimWrapperDict steps several optimizers'
        else:
            indices, reason = samples_to_drop(report, n)
        if reason is not None:
            self.log(logging.WARNING, "mmnanhook: policy 'drop': %s: the "
                     'step is skipped' % reason)
            return None
        keep = [i for i in range(n) if i not in indices]
        self.log(logging.WARNING,
                 "mmnanhook: policy 'drop': recomputing the update step of "
                 'iter %s without sample(s) %s of the batch of iter %s' %
                 (event.iter, indices, event.fail_iter))
        self._found = [f for f in report['samples'] if f['index'] in indices]
        last = steps[-1][0]
        forwards = [model_forward(
            self.model, self.wrappers[0],
            split_batch(batch, keep) if i == event.fail_iter else batch,
            functools.partial(restore_rng, rng),
            # What train_step returns is its own micro-step's log_vars.
            self._keep if i == last else _ignore)
            for i, batch, rng in steps]
        return DropPlan(indices, forwards, undo)

    def _keep(self, log_vars):
        self._outputs = log_vars

    def take_outputs(self):
        """The recomputed step's ``log_vars`` (once), or ``None``."""
        outputs, self._outputs = self._outputs, None
        return outputs

    def take_found(self):
        """The report's findings of the samples last dropped (once)."""
        found, self._found = self._found, None
        return found
