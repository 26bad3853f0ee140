"""A replay session: the failing iteration re-run, each time from the same
start state, as ``BaseModel.train_step`` runs it (without the step)."""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import compat
from .._anomaly import is_anomaly_nan_error
from .._inputs import check_inputs, floating
from ..errors import NonFiniteInputError
from ..records import Origin, ReplayResult
from .._losses import describe_losses, loss_terms
from .._norms import GradNorms
from ._backward import BackwardWatch, anomaly_mode
from ._frames import (format_user_frames, node_traceback, parse_frames,
                      user_location)
from ._local import replay_begins

_THIS_FILE = os.path.normcase(os.path.abspath(__file__))



def device_type(model: torch.nn.Module) -> str:
    for param in model.parameters():
        return param.device.type
    return 'cpu'


def _error_info(phase, error):
    trace = error.__traceback__
    return {
        'phase': phase,
        'type': type(error).__name__,
        'message': str(error),
        'traceback': ''.join(
            traceback.format_exception(type(error), error, trace)),
        'frames': [(f.filename, f.lineno, f.name, (f.line or '').strip())
                   for f in traceback.extract_tb(trace)],
        # The batch positions of the inputs found not finite before the
        # forward (NonFiniteInputError): no op of the model ran.
        'inputs': error.samples if isinstance(
            error, NonFiniteInputError) else None,
    }


class ReplaySession(object):
    """Replays of one batch on one model, each from the same start state."""

    def __init__(self, model: Any, data_batch: Any,
                 restore_rng: Optional[Callable[[], Any]], state: Any,
                 amp_dtype: Optional[torch.dtype],
                 train_step: Optional[Any] = None) -> None:
        # Built before any replay graph, to free what a raising backward of
        # one leaves queued.
        self.drain = compat.BackwardDrain()
        self.model = model
        self.data_batch = data_batch
        self.restore_rng = restore_rng
        self.state = state
        self.amp_dtype = amp_dtype
        self.device_type = device_type(model)
        # A model with its own train_step (OwnTrainStep) is replayed
        # through it, up to the update step that failed.
        self.train_step = train_step

    def _autocast(self, enabled):
        if not enabled or self.amp_dtype is None:
            return contextlib.nullcontext()
        return compat.autocast(self.device_type, self.amp_dtype)

    def run(self, batch: Any = None, amp: bool = True,
            forward_ctx: Optional[Any] = None, watch_backward: bool = False,
            anomaly: bool = False, backward: bool = True) -> ReplayResult:
        """Replay the iteration once, as ``BaseModel.train_step`` runs it
        (or the model's own ``train_step``, up to its failing update step).

        Args:
            batch: The (sub-)batch; the whole batch by default.
            amp (bool): Autocast the forward to the AMP dtype, if any.
            forward_ctx: Context manager active during the forward
                (:class:`ForwardWatch`, :class:`LineLocator`).
            watch_backward (bool): Hook every autograd node.
            anomaly (bool): Anomaly mode on for forward and backward.
            backward (bool): Run backward at all.
        """
        self.state.reset()
        if self.restore_rng is not None:
            self.restore_rng()
        replay_begins()
        # The model may change its inputs in place; every replay needs the
        # batch as the dataloader produced it.
        batch = copy.deepcopy(self.data_batch if batch is None else batch)
        result = ReplayResult()
        record = None
        with contextlib.ExitStack() as stack:
            if anomaly:
                record = stack.enter_context(anomaly_mode())
            try:
                forward_ctx = forward_ctx or contextlib.nullcontext()
                checked = floating(batch)
                if self.train_step is not None:
                    # Its backward runs inside too: what the train step set
                    # for the update step holds for it.
                    step = stack.enter_context(self.train_step.replaying(
                        self.model, functools.partial(self._autocast, amp),
                        checked))
                    with forward_ctx:
                        loss, log_vars = step(batch)
                else:
                    with forward_ctx, self._autocast(amp):
                        data = self.model.data_preprocessor(batch, True)
                        if checked:
                            # As in the run: a NaN input never reaches an
                            # op that may crash on it.
                            check_inputs(data)
                        losses = self.model._run_forward(data, mode='loss')
                    loss, log_vars = self.model.parse_losses(losses)
            except Exception as error:  # noqa: BLE001 - a finding
                result.error = _error_info('forward', error)
            else:
                result.losses, result.nonfinite_losses = describe_losses(
                    loss_terms(log_vars))
                if backward:
                    owner = getattr(forward_ctx, 'owner', None)
                    self._backward(loss, result, watch_backward, owner)
        result.anomaly = record
        return result

    def _backward(self, loss, result, watch_backward, owner):
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            return
        if watch_backward:
            watch = BackwardWatch([loss])
        else:
            watch = contextlib.nullcontext()
        try:
            with watch:
                loss.backward()
        except Exception as error:  # noqa: BLE001 - a finding
            self.drain()
            if is_anomaly_nan_error(error):
                result.nan_check_stopped = True
            else:
                result.error = _error_info('backward', error)
        if watch_backward and watch.producer is not None:
            result.backward = backward_detail(watch.producer, owner)
        named = [(n, p.grad) for n, p in self.model.named_parameters()
                 if p.grad is not None]
        if named:
            norms = GradNorms([g for _, g in named])
            result.grad_norm = float(norms.total)
            bad = norms.nonfinite()
            result.nonfinite_grad_count = len(bad)
            result.nonfinite_grads = [named[i][0] for i in bad]


def replay_frames(frames: List[Tuple[str, int, str, str]]
                  ) -> List[Tuple[str, int, str, str]]:
    """The frames of a stack below :meth:`_Session.run`.

    Frames above it are the caller of :func:`diagnose` (the hook, a test),
    which must not be taken for the place of a fault.
    """
    for index in range(len(frames) - 1, -1, -1):
        path, _, function, _ = frames[index]
        if function == 'run' and os.path.normcase(path) == _THIS_FILE:
            return frames[index + 1:]
    return frames


def display_name(name: Optional[str]) -> Optional[str]:
    """Report name of a module: ``None`` for the model itself."""
    return name or None


def backward_detail(producer: Dict[str, Any],
                    owner: Optional[Callable[[Any], Optional[str]]]
                    ) -> Origin:
    node = producer['node']
    frames = replay_frames(parse_frames(node_traceback(node) or ''))
    location, code = user_location(frames)
    return Origin(
        op=producer['op'],
        module=display_name(owner(node)) if owner is not None else None,
        location=location, code=code, nan=producer['nan'],
        inf=producer['inf'], stack=format_user_frames(frames))


def forward_detail(producer: Dict[str, Any],
                   found: Optional[Dict[str, Any]]) -> Origin:
    """The forward producer, refined by the line tracer's finding."""
    frames = replay_frames(producer['frames'])
    location, code = user_location(frames)
    op = producer['op']
    if found is not None:
        location, code, op = found['location'], found['code'], found['op']
    return Origin(
        module=display_name(producer['module']), call=producer['call'],
        op=op, location=location, code=code, nan=producer['nan'],
        inf=producer['inf'], stack=format_user_frames(frames))
