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
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .._batch import batch_size, leave_out_refused, split_batch
from .._losses import loss_terms
from .._mmengine import unwrap_model
from .._patch import patched
from ..errors import PeerForwardFailed
from ..memory import restore_rng
from ..records import Culprit
from ..recovery import drop_unavailable, samples_to_drop


class Recomputation(object):
    """A step to recompute without some of its samples.

    Args:
        indices (list[int]): Positions, in the batch of the micro-step that
            failed, of the samples left out.
        forwards (list[callable]): One per micro-step since the last update
            step, in order (one without gradient accumulation): ``() ->
            loss``, that micro-step's forward (the failing one's on the
            reduced batch) from the RNG state before the original one, under
            the wrapper's ``optim_context``, through ``parse_losses``;
            returns the loss to give to ``backward`` and its terms
            (:func:`~._check.loss_terms`, or ``None``).
        undo (callable): Puts back what a forward wrote (BN running
            statistics): after the recompute when it is not applied either,
            and before a train step taken again (:meth:`Dropper.again`).
            The listener has put them back before its diagnosis, which the
            recompute follows.
        iter (int, optional): The iteration of the micro-step that failed.
        dropped (int, optional): Samples left out on every rank together
            (DDP); ``len(indices)`` by default.
        empty (bool): This rank leaves its whole batch out (DDP): it takes
            part with a zero loss.
        factor (float): What the failing micro-step's loss is multiplied by
            (:meth:`~mmnanhook.recovery.DropDecision.factor`).
        found (list[Culprit]): The samples left out, on every rank (what
            the quarantine lists once the step is applied).

    Attributes:
        outputs (dict): The recomputed last micro-step's ``log_vars``: what
            the train step returns instead of the failing forward's.
    """

    def __init__(self, indices: Iterable[int],
                 forwards: Iterable[Callable[[], Any]],
                 undo: Callable[[], Any], iter: Optional[int] = None,
                 dropped: Optional[int] = None, empty: bool = False,
                 factor: float = 1.0, found: Iterable[Culprit] = ()
                 ) -> None:
        self.indices = list(indices)
        self.forwards = list(forwards)
        self.undo = undo
        self.iter = iter
        self.dropped = len(self.indices) if dropped is None else dropped
        self.empty = empty
        self.factor = factor
        self.found = list(found)
        self.outputs = None

    def keep(self, log_vars: Dict[str, Any]) -> None:
        """Keep the recomputed train step's ``log_vars``."""
        self.outputs = log_vars

    def applied(self, sentinel: Any) -> None:
        """The step was applied without the samples: count them
        (``train/samples_dropped``)."""
        sentinel.samples_dropped += self.dropped
        sentinel.hub.update_scalar('train/samples_dropped',
                                   sentinel.samples_dropped)


def recompute(sentinel: Any, wrapper: Any,
              drop: Recomputation) -> Optional[str]:
    """Recompute the update step without ``drop.indices``; measure it and,
    when it passes, admit it to be applied.

    Same weights, optimizer state, LR and loss scale (nothing was applied);
    every micro-step since the last update step again, from the RNG state
    before its original forward, its loss divided for accumulation as the
    original was. The listener put the buffers back before its diagnosis
    replayed the step: the recompute starts from them too.

    Args:
        sentinel (WrapperSentinel): The wrapper's sentinel.
        wrapper (OptimWrapper): The wrapper stepped.
        drop (Recomputation): The drop.

    Returns:
        str | None: ``None`` when the recomputed step passed its check and
        is to be applied; else why not (it raised, or triggered the check
        too): the caller falls back, with ``drop.undo``.
    """
    wrapper.zero_grad()
    sentinel.check.forget()
    # backward() counts each micro-step again: the accumulation factor
    # (scale_loss) and should_update() must see the original counts.
    count = wrapper._inner_count
    try:
        for k, forward in enumerate(drop.forwards):
            wrapper._inner_count = count - len(drop.forwards) + k
            try:
                loss, terms = forward()
            except Exception:
                if sentinel.ranks is not None:
                    # The other ranks wait in this backward's vote.
                    sentinel.ranks.vote(True)
                raise
            sentinel.pending = (loss, terms)
            wrapper.backward(wrapper.scale_loss(loss))
    except Exception as error:  # noqa: BLE001 - the caller falls back
        sentinel.pending = None
        sentinel.check.forget()
        return 'recomputing the update step without sample(s) %s raised ' \
            '%s: %s' % (drop.indices, type(error).__name__, error)
    finally:
        wrapper._inner_count = count
    measured = sentinel.measure(wrapper, again=True)
    event = measured.outcome.event
    if event is not None:
        return 'the update step recomputed without sample(s) %s is not ' \
            'usable either (%s)' % (drop.indices,
                                    event.message.split('\n')[0])
    sentinel.admit(wrapper, measured)
    drop.applied(sentinel)
    return None


def model_forward(model: Any, wrapper: Any, batch: Any,
                  restore_rng: Callable[[], Any],
                  keep_outputs: Callable[[Dict[str, Any]], Any],
                  factor: float = 1.0) -> Callable[[], Tuple[Any, Any]]:
    """A :class:`Recomputation` forward for an MMEngine model: what
    ``BaseModel.train_step`` does before ``update_params``.

    Args:
        model: ``runner.model`` (a DDP wrapper included).
        wrapper (OptimWrapper): The optim wrapper of the step.
        batch: The reduced batch, as the dataloader gives batches.
        restore_rng (callable): Puts the RNG states back to those before
            the original forward.
        keep_outputs (callable): Given the recomputed ``log_vars``: what
            the train step returns instead of the failing forward's.
        factor (float): The loss given to backward is multiplied by it
            (:class:`~mmnanhook.recovery.DropDecision`'s ``factor``).
    """
    module = unwrap_model(model)

    def forward():
        restore_rng()
        with wrapper.optim_context(model):
            data = module.data_preprocessor(batch, True)
            losses = model._run_forward(data, mode='loss')
        loss, log_vars = module.parse_losses(losses)
        keep_outputs(log_vars)
        return (loss * factor if factor != 1.0 else loss,
                loss_terms(log_vars))

    return forward


def zero_forward(model: Any,
                 wrapper: Any) -> Callable[[], Tuple[Any, Any]]:
    """A :class:`Recomputation` forward for a DDP rank whose whole batch is
    left out: a zero loss that touches every trained parameter, through
    DDP's own forward, so this rank takes part in its buffer broadcast and
    gradient all-reduce with zero gradients (``find_unused_parameters``
    finds them all used).

    Args:
        model (DistributedDataParallel): ``runner.model``.
        wrapper (OptimWrapper): The optim wrapper of the step.
    """
    module = unwrap_model(model)

    def zero(*args, **kwargs):
        return sum((p * 0).sum() for p in module.parameters()
                   if p.requires_grad)

    def forward():
        with patched(module, 'forward', zero), wrapper.optim_context(model):
            # One input: DDP with device_ids scatters its inputs and takes
            # the first.
            return model(torch.zeros(())), None

    return forward


@contextlib.contextmanager
def _scaled_losses(module, factor):
    """``module.parse_losses`` giving its loss times ``factor`` while the
    block runs (the logged terms unchanged)."""
    if factor == 1.0:
        yield
        return
    parse = module.parse_losses

    def scaled(*args, **kwargs):
        loss, log_vars = parse(*args, **kwargs)
        return loss * factor, log_vars

    with patched(module, 'parse_losses', scaled):
        yield


def _ignore(log_vars):
    return None


class Dropper(object):
    """``policy='drop'`` for one run: the recomputations, and what they
    leave behind.

    Args:
        model: ``runner.model``.
        wrappers (list[OptimWrapper]): The optim wrappers checked.
        log (callable): ``(level, message)``: where the reasons go.
    """

    def __init__(self, model: Any, wrappers: List[Any],
                 log: Callable[[int, str], Any]) -> None:
        self.model = model
        self.wrappers = wrappers
        self.log = log
        # Why no step of this run can be recomputed without samples.
        self.unavailable = drop_unavailable(len(wrappers))

    def prepare(self, event: Any, report: Optional[Any], memory: Any,
                undo: Callable[[], Any], decision: Optional[Any] = None
                ) -> Optional[Recomputation]:
        """The :class:`Recomputation` of a trigger, or ``None`` (the step is
        then skipped; the log says why).

        Args:
            event (NonFiniteEvent): The trigger.
            report (Report, optional): Its diagnosis.
            memory (StepMemory): Every micro-step since the last update
                step.
            undo (callable): Puts back what the failing forward wrote.
            decision (DropDecision, optional): Under DDP, the drop every
                rank takes (:func:`~mmnanhook.recovery.drop_decision`):
                this rank's part of it, whatever its own report.
        """
        reason = self.unavailable
        steps = memory.steps()
        if decision is None and reason is None:
            fail = event.fail_iter
            batch = dict((i, b) for i, b, _ in steps).get(fail)
            indices, reason = samples_to_drop(
                report, batch_size(batch) if batch is not None else None,
                refused=leave_out_refused(batch) if batch is not None
                else None)
        elif reason is None:
            reason = decision.reason
        if reason is not None:
            self.log(logging.WARNING, "mmnanhook: policy 'drop': %s: the "
                     'step is skipped%s' % (reason, '' if decision is None
                                             else ' on every rank'))
            return None
        if decision is None:
            return self._prepare(event, steps, undo, indices, fail, found=[
                Culprit(s) for s in report.samples if s.index in indices])
        rank = event.rank
        return self._prepare(event, steps, undo, decision.indices(rank),
                             decision.iter(rank, event.fail_iter),
                             decision, decision.empty(rank), decision.found)

    def _prepare(self, event, steps, undo, indices, fail, decision=None,
                 empty=False, found=()):
        wrapper = self.wrappers[0]
        if empty:
            what = 'with a zero loss: every sample of its batch of iter %s ' \
                'fails' % fail
        elif indices:
            what = 'without sample(s) %s of the batch of iter %s' % (
                indices, fail)
        else:
            what = 'on its batch unchanged, as the other ranks drop theirs'
        self.log(logging.WARNING,
                 "mmnanhook: policy 'drop': recomputing the update step of "
                 'iter %s %s' % (event.iter, what))
        if decision is None:
            drop = Recomputation(indices, [], undo, fail, found=found)
        else:
            drop = Recomputation(indices, [], undo, fail, decision.dropped,
                                 empty, decision.factor(fail), found)
        last = steps[-1][0]
        for i, batch, rng in steps:
            # What train_step returns is its own micro-step's log_vars.
            keep = drop.keep if i == last else _ignore
            if empty and i == fail:
                keep({})
                drop.forwards.append(zero_forward(self.model, wrapper))
                continue
            if i == fail and indices:
                batch = split_batch(batch, [
                    k for k in range(batch_size(batch)) if k not in indices])
            drop.forwards.append(model_forward(
                self.model, wrapper, batch,
                functools.partial(restore_rng, rng), keep,
                decision.factor(i) if decision is not None else 1.0))
        return drop

    def again(self, drop: Recomputation, steps: List[Tuple[Any, ...]],
              train_step: Callable[[Any], Any], sentinel: Any,
              undo: Optional[Callable[[], Any]] = None
              ) -> Optional[Tuple[Any, bool]]:
        """The train step of a forward that raised on its samples' data,
        taken again without them (``policy='drop'``).

        Nothing reached ``backward``, so no gradient of the failing
        micro-step is to be taken back: the train step itself runs on the
        reduced batch, from the RNG state before the failing forward, and
        its update step is checked, applied and resolved as any other.
        Under DDP every rank takes it again (its batch unchanged when it
        drops nothing; a zero loss when it drops everything); a forward that
        raises again on one rank makes every rank skip it.

        Args:
            drop (Recomputation): The drop.
            steps (list[tuple]): ``(iter, data_batch, rng_state)`` of every
                micro-step since the last update step.
            train_step (callable): ``batch -> outputs``: the model's own
                ``train_step`` with the loop's other arguments.
            sentinel (WrapperSentinel): The optim wrapper's sentinel
                (``train/samples_dropped``, the ranks' vote).
            undo (callable, optional): Puts the buffers back as they were
                before the failing micro-step; ``drop.undo`` by default.

        Returns:
            tuple | None: What the reduced train step returned, and whether
            its update step was applied; ``None`` when it raised on a rank
            (every rank then falls back as the drop says).
        """
        batch, rng = dict((i, (b, r)) for i, b, r in steps)[drop.iter]
        (undo or drop.undo)()
        restore_rng(rng)
        check = sentinel.check
        skipped, records = check.skipped, check.records
        wrapper = self.wrappers[0]
        try:
            if drop.empty:
                outputs = {}
                wrapper.update_params(zero_forward(self.model, wrapper)()[0])
            else:
                if drop.indices:
                    batch = split_batch(batch, [i for i in range(
                        batch_size(batch)) if i not in drop.indices])
                with _scaled_losses(unwrap_model(self.model), drop.factor):
                    outputs = train_step(batch)
        except Exception as error:
            if sentinel.ranks is None or check.records != records:
                raise
            if not isinstance(error, PeerForwardFailed):
                # The other ranks wait in their next vote.
                sentinel.ranks.vote(True)
            self.log(logging.WARNING, 'mmnanhook: the train step taken again '
                     'without sample(s) %s raised %s: %s; every rank skips '
                     'it' % (drop.indices, type(error).__name__, error))
            return None
        applied = check.skipped == skipped
        if applied:
            drop.applied(sentinel)
        return outputs, applied
