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
6. each sample is replayed on its own, to name the ones that fail alone;
7. the iteration is replayed with each fix the findings suggest
   (:mod:`._fixes`); a replay that came out finite is tried once more.

The model's parameters are never written; gradients, buffers and RNG states
are put back as they were.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from .. import compat
from .._patch import patched
from .._log import log as _log
from ..records import DataProblem, ProblemCategory, SampleFinding
from ..report import finalize, new_report
from ._classify import classify, fill_location
from .._batch import leave_out_refused
from ._data import batch_size, check_batch, nonfinite_data, split_batch
from ._fixes import verify_fixes
from ._producer import ForwardWatch, LineLocator
from ._session import ReplaySession, device_type, display_name, \
    forward_detail
from ._state import PreservedModelState, preserved_rng
from ._state_scan import scan_state


def _dtype_name(dtype):
    return str(dtype).replace('torch.', '') if dtype is not None else None


def _nonfinite_inputs(samples, found, positions):
    """``found`` and every sample at ``positions``, whose input the check
    before the forward found not finite: said so where the batch as loaded
    was finite (the data preprocessor made the NaN/Inf)."""
    by_index = dict((s.index, s) for s in samples)
    named = set(s.index for s in found)
    found = list(found)
    for index in positions:
        if index in named:
            continue
        finding = by_index.get(index) or SampleFinding(index)
        finding.problems.append(DataProblem(
            ProblemCategory.NONFINITE_INPUT,
            'input is finite as loaded but not after the data '
            'preprocessor'))
        found.append(finding)
    return sorted(found, key=lambda s: s.index)


def _replay_samples(session, report, backward, log):
    """Replay each sample alone; return the indices that fail alone.

    ``backward`` is needed only when the failure is in the gradients; a
    non-finite loss shows in the forward already.
    """
    n = batch_size(session.data_batch)
    if not n or n < 2:
        return None
    layout = leave_out_refused(session.data_batch)
    if layout is not None:
        report.notes.append(
            'no sample was replayed alone: the batch\'s layout is not one '
            'mmnanhook knows how to take a sample out of ({})'.format(layout))
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


def _compare_fp32(session, report):
    """Replay in float32; record the range overflow if that is finite.

    Returns:
        ReplayResult: The float32 replay.
    """
    limit = float(torch.finfo(session.amp_dtype).max)
    watch = ForwardWatch(session.model, range_limit=limit)
    replay = session.run(amp=False, forward_ctx=watch)
    if replay.nonfinite or replay.error is not None:
        return replay
    over = watch.over_range or {}
    report.overflow = {
        'dtype': report.amp_dtype, 'limit': limit,
        'module': display_name(over.get('module')),
        'max_abs': over.get('max_abs')}
    return replay


def _failed(replay):
    """How a replay of an iteration that replayed finite once failed (it
    raised, or which losses were not finite), or ``None``: finite again."""
    if replay.error is not None:
        return 'it raised {}'.format(replay.error['type'])
    if replay.nonfinite:
        return ', '.join(replay.nonfinite_losses) or 'gradients'
    return None


def _replay_again(session, report, log):
    """A finite replay, tried once more: does the failure come and go?"""
    log('mmnanhook: the replay is finite; replaying once more')
    what = _failed(session.run())
    report.replays_agree = what is None
    if report.replays_agree:
        return
    report.notes.append(
        'the second replay of the same iteration was not finite ({}): a '
        'fault that comes and goes (nondeterministic kernels, a race, '
        'hardware)'.format(what))


def _replay_compiled(session, report, options, log):
    """A compiled run's failure that the eager replay did not make: the
    iteration replayed once more through the model's forward compiled with
    the run's options (its backward is the compiled one's too). Non-finite
    there: the fault is the compiled code's alone (a backend's kernels or
    fusions), which the eager replays cannot locate."""
    compiled = compat.compiled_forward(session.model, options)
    if compiled is None:
        return
    log('mmnanhook: the eager replay is finite; replaying through the '
        'compiled forward')
    with patched(session.model, 'forward', compiled):
        what = _failed(session.run())
    report.compiled_agrees = what is None
    if report.compiled_agrees:
        return
    report.notes.append(
        'replayed through the forward compiled as the run compiles it '
        '(torch.compile({})), the iteration is not finite ({}) where the '
        'eager replays are: the fault is made by the compiled code alone'
        .format(', '.join('{}={!r}'.format(k, v)
                          for k, v in sorted(options.items())), what))


def _locate_forward(session, report, producer, quiet):
    """Trace the producer's call line by line for the exact source line
    (not inside the ``quiet`` submodule calls, seen finite)."""
    module = dict(session.model.named_modules())[producer['module']]
    locator = LineLocator(module, producer['call'], producer['module'], quiet)
    session.run(forward_ctx=locator, backward=False)
    report.forward = forward_detail(producer, locator.found)


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


def diagnose(model: Any, data_batch: Any,
             restore_rng: Optional[Callable[[], Any]] = None,
             amp_dtype: Optional[torch.dtype] = None,
             angle_range: Optional[Tuple[float, float]] = None,
             check_samples: bool = True, optimizer_state: Any = None,
             logger: Optional[logging.Logger] = None, anomaly: bool = True,
             declared: Optional[Sequence[Optional[Tuple[int, int]]]] = None,
             pipeline: Optional[Any] = None,
             sources: Optional[Dict[int, Any]] = None, retry: bool = True,
             drop_refused: Optional[str] = None,
             composed: Optional[Callable[[Any, Any], Any]] = None,
             start_attributes: Optional[Any] = None,
             compiled: Optional[Dict[str, Any]] = None,
             identities: Optional[Sequence[Any]] = None,
             train_step: Optional[Any] = None) -> Any:
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
            :func:`mmnanhook.diagnosis.angle_range_from_config`).
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
            :func:`mmnanhook.diagnosis.declared_sizes`).
        pipeline (TrainPipeline, optional): The run's train pipeline, for
            the fixes that run a sample through it again.
        sources (dict, optional): Batch position -> that sample's data info
            as the dataset gives it (its ``img_path`` readable here).
        retry (bool): Replay a finite replay once more (not for a finite
            spike, which no replay turns non-finite).
        drop_refused (str, optional): Why ``policy='drop'`` only skips in
            the run (:func:`~mmnanhook.recovery.drop_unavailable`): the
            fixes then do not advise it.
        composed (callable, optional): ``(findings, data_batch)``: traces
            composed samples' findings to their parts
            (:func:`._composed.trace_parts`).
        start_attributes (Attributes, optional): Python attributes of the
            model's modules as they were before the failing forward (the
            data preprocessor's: ``BatchSyncRandomResize`` resizes by the
            size it kept): put back before every replay, as the RNG states.
        compiled (dict, optional): The ``torch.compile`` options of a run
            that compiles its train step: a failure the eager replays do
            not make is replayed once more through the compiled forward
            (``report.compiled_agrees``).
        identities (list[SampleId], optional): Per sample, its dataset
            index and file (:func:`~mmnanhook.quarantine.name_samples`):
            what the findings name and a drop quarantines.
        train_step (OwnTrainStep, optional): The model's own
            ``train_step`` (:func:`~._own_step.own_train_step`): every replay
            runs it up to the update step that failed, instead of what
            ``BaseModel.train_step`` does.

    Returns:
        Report: The diagnosis, its ``kind`` a
        :class:`~mmnanhook.records.Kind` (``data``, ``forward``,
        ``backward``, ``params``, ``optimizer_state``, ``overflow``,
        ``exception``, ``not_reproduced``, ``divergence``).
    """
    start = time.time()

    def log(message):
        _log(message, logging.INFO, logger)

    report = new_report()
    report.amp_dtype = _dtype_name(amp_dtype)
    device = device_type(model)
    replay_dtype = amp_dtype
    if amp_dtype is not None and compat.autocast(device,
                                                 amp_dtype) is None:
        replay_dtype = None
        report.notes.append(
            'autocast({}) is not available on {} with torch {}: replayed in '
            'float32 only'.format(report.amp_dtype, device,
                                  torch.__version__))
    samples = check_batch(data_batch, angle_range, declared=declared,
                          identities=identities)
    if composed is not None:
        composed(samples, data_batch)
    report.batch_problems = [s for s in samples if s.problems]
    scan_state(report, model, optimizer_state)
    with preserved_rng(), torch.enable_grad(), \
            PreservedModelState(model, start_attributes) as state:
        session = ReplaySession(model, data_batch, restore_rng, state,
                                replay_dtype, train_step)
        if train_step is not None:
            report.notes.append(train_step.describe(model))
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
            report.forward = forward_detail(watch.producer, None)
        fp32 = None
        if main.error is None and main.nonfinite:
            if replay_dtype is not None:
                log('mmnanhook: replaying in float32 to compare')
                fp32 = _compare_fp32(session, report)
            if watch.producer is not None:
                _locate_forward(session, report, watch.producer,
                                watch.finite_calls)
            by_index = dict((s.index, s) for s in samples)
            report.samples = [
                by_index.get(i, SampleFinding(i))
                for i in _implicated_samples(session, report, main,
                                             check_samples, log)]
        elif main.error is None and retry:
            _replay_again(session, report, log)
        if compiled is not None and main.error is None and \
                not main.nonfinite:
            _replay_compiled(session, report, compiled, log)
        elif main.error is not None and main.error['phase'] == 'forward':
            report.samples = nonfinite_data(samples)
            if main.error.get('inputs'):
                report.samples = _nonfinite_inputs(
                    samples, report.samples, main.error['inputs'])
        report.kind = classify(report, main)
        fill_location(report, main, watch)
        log('mmnanhook: replaying the failing iteration with each fix')
        fixes_start = time.time()
        report.fixes = verify_fixes(
            report, session, pipeline, sources, declared, angle_range, fp32,
            drop_refused)
        report.fixes_s = time.time() - fixes_start
    report.elapsed_s = time.time() - start
    return finalize(report)
