"""What a failure is (its :class:`~mmnanhook.records.Kind`) and where:
module, op, ``file:line`` and source line, from what the replays found."""
from __future__ import annotations

from typing import Any

from ._frames import format_user_frames, user_location
from ._session import display_name, replay_frames

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
            frames = replay_frames(record.frames)
            report.op = record.node
            report.location, report.code = user_location(frames)
            if frames:
                text += '\nForward traceback of {} (anomaly mode):\n{}'.format(
                    report.op, format_user_frames(frames))
                report.module = display_name(
                    watch.find_owner(report.op, report.location))
            else:
                report.notes.append(
                    '{} was not created by the replayed forward (anomaly '
                    'mode has no traceback for it): a tensor kept from an '
                    'earlier iteration is part of the graph'.format(
                        report.op))
    elif error.get('inputs'):
        # Raised by mmnanhook's input check: no op of the model ran, so
        # there is no place in it to name.
        report.notes.append(
            'the forward was not run: the input of sample(s) {} is not '
            'finite after the data preprocessor, and mmnanhook stops a step '
            'before an op can crash or compute on it'.format(
                ', '.join(str(i) for i in error['inputs'])))
        return
    else:
        report.module = display_name(watch.failed)
        report.location, report.code = user_location(error['frames'])
    report.traceback = text


def _locate(report, origin):
    for key in ('module', 'op', 'location', 'code'):
        setattr(report, key, getattr(origin, key))
    if origin.stack:
        report.traceback = origin.stack


def classify(report: Any, main: Any) -> str:
    if report.params:
        return 'params'
    if report.optimizer_state:
        return 'optimizer_state'
    if main.error is not None:
        # A forward that raised on a sample with non-finite inputs or
        # targets (SimOTA's binary_cross_entropy on NaN scores): the sample
        # is the cause, the exception its symptom.
        return 'data' if report.samples else 'exception'
    if not main.nonfinite:
        return 'not_reproduced'
    if report.overflow is not None:
        return 'overflow'
    if any(p.category for s in report.samples for p in s.problems):
        return 'data'
    if report.forward is not None or report.nonfinite_losses:
        return 'forward'
    return 'backward'


def fill_location(report: Any, main: Any, watch: Any) -> None:
    kind = report.kind
    if kind == 'exception' or (kind == 'data' and main.error is not None):
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
            # The report's traceback holds the one shown.
            getattr(report, key).stack = None
