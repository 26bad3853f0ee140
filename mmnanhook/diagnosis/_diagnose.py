"""Tier 2: replay one failing iteration and say where the NaN/Inf came from.

:func:`diagnose` re-runs what ``BaseModel.train_step`` does for the failing
batch (data preprocessor, forward in ``'loss'`` mode, ``parse_losses``,
``backward``) from the same weights and RNG state, without an optimizer
step, under instrumentation too slow for every iteration:

1. parameters, buffers and optimizer state are scanned for NaN/Inf;
2. the batch is checked for non-finite inputs and bad GT boxes;
3. the main replay runs with anomaly mode on, every module's forward
   watched (the *producer* module) and every autograd node hooked (the
   first node making NaN **or Inf**, mapped to its module and source line);
4. under AMP the iteration is replayed in float32 as well: finite there
   means an fp16-range (or precision) problem, and the first module whose
   activations leave the AMP dtype's range is named;
5. the producer module's forward is replayed once more with a line tracer,
   for the exact source line;
6. each sample is replayed on its own, to name the ones that fail alone.

The model's parameters are never written; gradients, buffers and RNG states
are put back as they were.
"""
import contextlib
import copy
import math
import os
import time
import traceback
from collections.abc import Mapping

import torch
from mmengine.logging import print_log

from .. import compat
from .._anomaly import is_anomaly_nan_error
from ..report import finalize, new_report
from ..sentinel import GradNorms, describe_losses, loss_terms
from ..records import ReplayResult, SampleFinding
from ._data import batch_size, check_batch, split_batch
from ._instrument import (BackwardWatch, ForwardWatch, LineLocator,
                         PreservedModelState, anomaly_mode, first_nonfinite,
                         format_user_frames, node_traceback, parse_frames,
                         preserved_rng, user_location)

_THIS_FILE = os.path.normcase(os.path.abspath(__file__))

# Buffers a normalization layer updates in train-mode forward.
_RUNNING_STATS = ('running_mean', 'running_var', 'num_batches_tracked')


def _display_name(name):
    """Report name of a module: ``None`` for the model itself."""
    return name or None


def _dtype_name(dtype):
    return str(dtype).replace('torch.', '') if dtype is not None else None


def _device_type(model):
    for param in model.parameters():
        return param.device.type
    return 'cpu'


def _nonfinite_names(named_tensors):
    return [name for name, tensor in named_tensors
            if first_nonfinite([tensor]) is not None]


def _largest_param(model):
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
    }


class _Session(object):
    """Replays of one batch on one model, each from the same start state."""

    def __init__(self, model, data_batch, restore_rng, state, amp_dtype):
        # Built before any replay graph, to free what a raising backward of
        # one leaves queued.
        self.drain = compat.BackwardDrain()
        self.model = model
        self.data_batch = data_batch
        self.restore_rng = restore_rng
        self.state = state
        self.amp_dtype = amp_dtype
        self.device_type = _device_type(model)

    def _autocast(self, enabled):
        if not enabled or self.amp_dtype is None:
            return contextlib.nullcontext()
        return compat.autocast(self.device_type, self.amp_dtype)

    def run(self, batch=None, amp=True, forward_ctx=None,
            watch_backward=False, anomaly=False, backward=True):
        """Replay the iteration once, as ``BaseModel.train_step`` runs it.

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
                with forward_ctx, self._autocast(amp):
                    data = self.model.data_preprocessor(batch, True)
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
            result.backward = _backward_detail(watch.producer, owner)
        named = [(n, p.grad) for n, p in self.model.named_parameters()
                 if p.grad is not None]
        if named:
            norms = GradNorms([g for _, g in named])
            result.grad_norm = float(norms.total)
            bad = norms.nonfinite()
            result.nonfinite_grad_count = len(bad)
            result.nonfinite_grads = [named[i][0] for i in bad]


def _replay_frames(frames):
    """The frames of a stack below :meth:`_Session.run`.

    Frames above it are the caller of :func:`diagnose` (the hook, a test),
    which must not be taken for the place of a fault.
    """
    for index in range(len(frames) - 1, -1, -1):
        path, _, function, _ = frames[index]
        if function == 'run' and os.path.normcase(path) == _THIS_FILE:
            return frames[index + 1:]
    return frames


def _backward_detail(producer, owner):
    node = producer['node']
    frames = _replay_frames(parse_frames(node_traceback(node) or ''))
    location, code = user_location(frames)
    return {
        'op': producer['op'],
        'module': _display_name(owner(node)) if owner is not None else None,
        'location': location,
        'code': code,
        'nan': producer['nan'],
        'inf': producer['inf'],
        'stack': format_user_frames(frames),
    }


def _forward_detail(producer, found):
    """The forward producer, refined by the line tracer's finding."""
    frames = _replay_frames(producer['frames'])
    location, code = user_location(frames)
    op = producer['op']
    if found is not None:
        location, code, op = found['location'], found['code'], found['op']
    return {
        'module': _display_name(producer['module']),
        'call': producer['call'],
        'op': op,
        'location': location,
        'code': code,
        'nan': producer['nan'],
        'inf': producer['inf'],
        'stack': format_user_frames(frames),
    }


def _explain_exception(report, replay, watch):
    """Fill ``module``/``op``/``location``/``traceback`` for a replay error."""
    error = replay.error
    report.exception = {k: error[k] for k in ('phase', 'type', 'message')}
    text = error['traceback']
    record = replay.anomaly
    if error['phase'] == 'backward':
        # Anomaly mode names the node whose backward failed and the forward
        # line that created it (nothing when the error came from outside
        # the graph, e.g. a loss that does not require grad).
        if record is not None and record.messages:
            frames = _replay_frames(record.frames)
            report.op = record.node
            report.location, report.code = user_location(frames)
            if frames:
                text += '\nForward traceback of {} (anomaly mode):\n{}'.format(
                    report.op, format_user_frames(frames))
                report.module = _display_name(
                    watch.find_owner(report.op, report.location))
            else:
                report.notes.append(
                    '{} was not created by the replayed forward (anomaly '
                    'mode has no traceback for it): a tensor kept from an '
                    'earlier iteration is part of the graph'.format(
                        report.op))
    else:
        report.module = _display_name(watch.failed)
        report.location, report.code = user_location(error['frames'])
    report.traceback = text


def _locate(report, detail):
    for key in ('module', 'op', 'location', 'code'):
        setattr(report, key, detail[key])
    if detail.get('stack'):
        report.traceback = detail['stack']


def _replay_samples(session, report, backward, log):
    """Replay each sample alone; return the indices that fail alone.

    ``backward`` is needed only when the failure is in the gradients; a
    non-finite loss shows in the forward already.
    """
    n = batch_size(session.data_batch)
    if not n or n < 2:
        return None
    log('mmnanhook: replaying each of the {} samples alone'.format(n))
    replays = []
    for index in range(n):
        replay = session.run(
            split_batch(session.data_batch, [index]), backward=backward)
        if replay.error is not None:
            result = 'error'
        else:
            result = 'nonfinite' if replay.nonfinite else 'finite'
        entry = {'index': index, 'result': result,
                 'nonfinite_losses': replay.nonfinite_losses, 'error': None}
        if replay.error is not None:
            entry['error'] = '{}: {}'.format(
                replay.error['type'], replay.error['message'].split('\n')[0])
        replays.append(entry)
    report.sample_replays = replays
    implicated = [r['index'] for r in replays if r['result'] == 'nonfinite']
    if not implicated:
        report.notes.append('every sample is finite on its own: the '
                               'failure needs the whole batch')
    return implicated


def _scan_state(report, model, optimizer_state):
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
    report.largest_param = _largest_param(model)
    report.optimizer_state = _optimizer_state_problems(
        optimizer_state, model)


def _compare_fp32(session, report):
    """Replay in float32; record the range overflow if that is finite."""
    limit = float(torch.finfo(session.amp_dtype).max)
    watch = ForwardWatch(session.model, range_limit=limit)
    replay = session.run(amp=False, forward_ctx=watch)
    if replay.nonfinite or replay.error is not None:
        return
    over = watch.over_range or {}
    report.overflow = {
        'dtype': report.amp_dtype, 'limit': limit,
        'module': _display_name(over.get('module')),
        'max_abs': over.get('max_abs')}


def _locate_forward(session, report, producer):
    """Trace the producer's call line by line for the exact source line."""
    module = dict(session.model.named_modules())[producer['module']]
    locator = LineLocator(module, producer['call'])
    session.run(forward_ctx=locator, backward=False)
    report.forward = _forward_detail(producer, locator.found)


def _implicated_samples(session, report, main, check_samples, log):
    """Indices of the samples that fail alone (replayed or, else, checked)."""
    if check_samples and not report.params:
        replayed = _replay_samples(session, report,
                                   not main.nonfinite_losses, log)
        if replayed is not None:
            return replayed
    if batch_size(session.data_batch) == 1:
        return [0]
    # Not replayed one by one: the data checks alone name the suspects.
    return [s.index for s in report.batch_problems]


def _classify(report, main):
    if report.params:
        return 'params'
    if report.optimizer_state:
        return 'optimizer_state'
    if main.error is not None:
        return 'exception'
    if not main.nonfinite:
        return 'not_reproduced'
    if report.overflow is not None:
        return 'overflow'
    if any(p.category for s in report.samples for p in s.problems):
        return 'data'
    if report.forward is not None or report.nonfinite_losses:
        return 'forward'
    return 'backward'


def _fill_location(report, main, watch):
    kind = report.kind
    if kind == 'exception':
        _explain_exception(report, main, watch)
    elif kind != 'not_reproduced':
        detail = report.forward
        if detail is None and not report.nonfinite_losses:
            # A finite forward: the first bad gradient is the place.  With
            # a non-finite loss but no producer, the values came in with
            # the batch, and backward only shows where they spread.
            detail = report.backward
        if detail is not None:
            _locate(report, detail)
        if kind == 'overflow' and report.overflow['module'] is not None:
            report.module = report.overflow['module']
    for key in ('forward', 'backward'):
        if getattr(report, key) is not None:
            getattr(report, key).pop('stack', None)


def diagnose(model, data_batch, restore_rng=None, amp_dtype=None,
             angle_range=None, check_samples=True, optimizer_state=None,
             logger=None, anomaly=True, declared=None):
    """Replay a failing training iteration and explain its NaN/Inf.

    Args:
        model (mmengine.model.BaseModel): The unwrapped model, in train mode,
            with the weights it had before the failing step.
        data_batch: The raw batch as the hook saw it (e.g. ``{'inputs':
            [uint8 CHW tensors], 'data_samples': [DetDataSample]}``).
        restore_rng (callable, optional): Puts every RNG back to its state
            before the failing iteration's forward; called before each
            replay so that RNG-dependent faults reproduce.
        amp_dtype (torch.dtype, optional): Autocast dtype of the failing run
            (``None``: float32).
        angle_range (tuple[float, float], optional): Allowed rotated-box
            angles in radians (see
            :func:`mmnanhook.data_checks.angle_range_from_config`).
        check_samples (bool): Replay each sample alone to name the ones
            that fail by themselves.
        optimizer_state (optional): Optimizer, optim wrapper or their state
            dict, scanned for non-finite entries.
        logger (logging.Logger, optional): Where progress goes; the current
            MMLogger by default.
        anomaly (bool): Run the main replay under anomaly mode, for the
            forward traceback of the failing backward node (the hook's
            ``anomaly='never'`` turns it off).
        declared (list, optional): Per sample, the ``(width, height)`` its
            annotation declares (see
            :func:`mmnanhook.data_checks.declared_sizes`).

    Returns:
        dict: The report (see :func:`mmnanhook.report.new_report`), with
        ``kind`` one of ``data``, ``forward``, ``backward``, ``params``,
        ``optimizer_state``, ``overflow``, ``exception``, ``not_reproduced``.
    """
    start = time.time()

    def log(message):
        print_log(message, logger=logger or 'current')

    report = new_report()
    report.amp_dtype = _dtype_name(amp_dtype)
    device_type = _device_type(model)
    replay_dtype = amp_dtype
    if amp_dtype is not None and compat.autocast(device_type,
                                                 amp_dtype) is None:
        replay_dtype = None
        report.notes.append(
            'autocast({}) is not available on {} with torch {}: replayed in '
            'float32 only'.format(report.amp_dtype, device_type,
                                  torch.__version__))
    samples = check_batch(data_batch, angle_range, declared=declared)
    report.batch_problems = [s for s in samples if s.problems]
    _scan_state(report, model, optimizer_state)
    with preserved_rng(), torch.enable_grad(), \
            PreservedModelState(model) as state:
        session = _Session(model, data_batch, restore_rng, state,
                           replay_dtype)
        log('mmnanhook: replaying the failing iteration with {}module and '
            'autograd-node instrumentation'.format(
                'anomaly mode, ' if anomaly else ''))
        watch = ForwardWatch(model, claim_nodes=True)
        main = session.run(forward_ctx=watch, watch_backward=True,
                           anomaly=anomaly)
        for key in ('losses', 'nonfinite_losses', 'grad_norm',
                    'nonfinite_grads', 'nonfinite_grad_count'):
            setattr(report, key, getattr(main, key))
        report.backward = main.backward
        if main.nan_check_stopped:
            report.notes.append(
                "torch {} cannot turn off anomaly mode's NaN check: backward "
                'stopped at the first NaN, so the gradients are '
                'incomplete'.format(torch.__version__))
        if (main.error is not None and main.error['phase'] == 'forward'
                and watch.producer is not None):
            # A forward that raised after making non-finite values: those
            # are the likely cause (e.g. a matcher given a NaN cost matrix).
            report.forward = _forward_detail(watch.producer, None)
        if main.error is None and main.nonfinite:
            if replay_dtype is not None:
                log('mmnanhook: replaying in float32 to compare')
                _compare_fp32(session, report)
            if watch.producer is not None:
                _locate_forward(session, report, watch.producer)
            by_index = dict((s.index, s) for s in samples)
            report.samples = [
                by_index.get(i, SampleFinding(i))
                for i in _implicated_samples(session, report, main,
                                             check_samples, log)]
    report.kind = _classify(report, main)
    _fill_location(report, main, watch)
    report.elapsed_s = time.time() - start
    return finalize(report)
