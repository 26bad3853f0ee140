"""The one-line summary of a report."""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

from .._format import format_names, format_value
from ..records import ProblemCategory

# How many names a summary or the text lists before "and N more".
_SHOWN = 5


def _names(names, total=None):
    names = list(names)
    total = len(names) if total is None else total
    return format_names(names[:_SHOWN], total)


def _losses_text(report):
    bad = report.nonfinite_losses
    if not bad:
        return None
    return ', '.join('{}={}'.format(k, format_value(report.losses.get(k)))
                     for k in bad)


def _where(report, with_op=True):
    """``in module 'm' at file:line (OP)``, as far as known."""
    parts = []
    if report.module is not None:
        parts.append("in module '{}'".format(report.module))
    if report.location:
        parts.append('at ' + report.location)
    if not parts:
        parts.append('in the model, outside any submodule')
    if with_op and report.op:
        parts.append('({})'.format(report.op))
    return ' '.join(parts)


def _first_line(message, limit=200):
    line = (message or '').strip().split('\n')[0]
    return line if len(line) <= limit else line[:limit - 3] + '...'


def _nonfinite_kind(origin):
    if origin is None:
        return 'NaN/Inf'
    if origin.nan and origin.inf:
        return 'NaN and Inf'
    return 'NaN' if origin.nan else 'Inf'


def _symptom(report):
    if report.exception:
        # The forward raised on a sample's non-finite data (kind 'data').
        return '{} raised in {}'.format(report.exception['type'],
                                        report.exception['phase'])
    losses = _losses_text(report)
    if losses:
        return losses
    norm = report.grad_norm
    if report.nonfinite_grad_count:
        return 'non-finite gradients in {}'.format(
            _names(report.nonfinite_grads, report.nonfinite_grad_count))
    if norm is not None and not math.isfinite(norm):
        return 'gradient norm {} from finite gradients'.format(
            format_value(norm))
    return 'non-finite gradients'


def _first_problem_text(samples):
    for sample in samples:
        problems = sample.problems
        if problems:
            path = sample.name
            text = problems[0].text
            if (problems[0].category == ProblemCategory.SIZE_MISMATCH
                    and len(problems) > 1):
                # The root cause, then what it did to the boxes.
                text += '; so ' + problems[1].text
            return 'sample {} ({}): {}'.format(sample.index, path, text)
    return None


def summarize(report: Any) -> str:
    """The one-line summary of a report's findings.

    Args:
        report (Report): A report, filled in.
    """
    kind = report.kind
    if kind == 'divergence':
        return _divergence_summary(report)
    if kind == 'not_reproduced':
        text = 'the replay of the failing iteration is finite: not reproduced'
        if report.amp_dtype:
            text += ' (replayed under autocast({}))'.format(
                report.amp_dtype)
        return text
    if kind == 'params':
        return ('{} parameter(s)/buffer(s) were already non-finite before '
                'the step: {}'.format(
                    len(report.params), _names(report.params)))
    if kind == 'optimizer_state':
        return ('the optimizer state was already non-finite before the '
                'step: {}'.format(_names(report.optimizer_state)))
    if kind == 'exception':
        exc = report.exception or {}
        if exc.get('phase') == 'backward' and report.op:
            where = 'the backward of ' + report.op
            if report.location or report.module is not None:
                where += ' created ' + _where(report, with_op=False)
        else:
            where = '{} {}'.format(exc.get('phase'), _where(report))
        text = '{} in {}: {}'.format(exc.get('type'), where,
                                     _first_line(exc.get('message')))
        forward = report.forward
        if forward is not None:
            text += '; before it, the forward made {} first in module ' \
                "'{}' at {} ({})".format(_nonfinite_kind(forward),
                                        forward.module, forward.location,
                                        forward.op)
        return text
    if kind == 'overflow':
        over = report.overflow or {}
        text = '{} only under autocast({}), finite in float32'.format(
            _symptom(report), report.amp_dtype)
        if over.get('max_abs') is not None:
            # No name: the root module, whose forward made them itself.
            module = over.get('module') or report.module
            outputs = ("'{}' outputs".format(module) if module else
                       "the model's own outputs (outside any submodule)")
            return text + ': {} reach {} (the {} max is {})'.format(
                outputs, format_value(over['max_abs']), report.amp_dtype,
                format_value(over.get('limit')))
        return text + '; first non-finite value made ' + _where(report)
    if kind == 'data':
        implicated = [s for s in report.samples if s.problems]
        more = ' (and {} more sample(s))'.format(len(implicated) - 1) \
            if len(implicated) > 1 else ''
        if (report.exception or {}).get('type') == 'NonFiniteInputError':
            return ('the input is not finite: {}{}; stopped before the '
                    'forward, no op of the model ran'.format(
                        _first_problem_text(implicated), more))
        text = '{} caused by {}{}'.format(
            _symptom(report), _first_problem_text(implicated), more)
        if report.module is None and report.location is None:
            return text
        if report.exception:
            # Where the forward raised: the symptom's place, not where the
            # non-finite values were made (they came with the sample).
            return text + '; it raised ' + _where(report)
        return text + '; first non-finite value made ' + _where(report)
    if kind == 'backward':
        detail = report.backward
        if detail:
            return ('backward of {} made {} from finite gradients {}; '
                    '{}'.format(report.op, _nonfinite_kind(detail),
                                _where(report, with_op=False),
                                _symptom(report)))
        return 'backward: {}'.format(_symptom(report))
    if report.forward is None:
        return ('{}, but no module made it from finite inputs: it came in '
                'with the batch'.format(_symptom(report)))
    return 'the forward pass made {} first {}; {}'.format(
        _nonfinite_kind(report.forward), _where(report), _symptom(report))


# What each series of a divergence is called, and what its factor is over.
_SERIES = {'loss': 'loss', 'grad_norm': 'gradient norm',
           'weights': 'largest weight'}


def divergence_words(divergence: Any) -> Tuple[str, str]:
    """``(series name, what the factor is over)`` of a
    :class:`~mmnanhook.records.Divergence`, e.g. ``('gradient norm', 'its
    median 1.3')``."""
    series = divergence.series
    median = format_value(divergence.median)
    if series == 'weights':
        return (_SERIES[series],
                'the largest when training started, {}'.format(median))
    return _SERIES.get(series, series), 'its median {}'.format(median)


def rise_words(divergence: Any) -> Optional[str]:
    """The rise itself, e.g. ``'loss 1.81 -> 5.6 -> 7.8e+06 -> nan at
    iterations 0-3, lr 20'``, or ``None`` when the record has none."""
    rise = divergence.rise or {}
    values = rise.get('values') or []
    shown = [v for v in values if v is not None]
    if not shown:
        return None
    text = '{} {} at iterations {}-{}'.format(
        _SERIES.get(rise.get('series'), rise.get('series')),
        ' -> '.join('...' if v is None else format_value(v[1])
                    for v in values), shown[0][0], shown[-1][0])
    if divergence.lr is not None:
        text += ', lr {}'.format(format_value(divergence.lr))
    return text


def _divergence_summary(report):
    d = report.divergence
    if d is None:
        return 'training diverged'
    name, over = divergence_words(d)
    text = 'training diverged from iter {}: the {} reached {}, {}x {}'.format(
        d.began_at, name, format_value(d.value), format_value(d.factor),
        over)
    rise = rise_words(d)
    if rise:
        text += ': ' + rise
    elif d.lr is not None:
        text += ' (lr {})'.format(format_value(d.lr))
    if d.spikes:
        text += '; {} spike(s) before the trigger'.format(d.spikes)
    if d.grown:
        text += "; '{}' grew most, {}x".format(
            d.grown[0]['name'], format_value(d.grown[0]['ratio']))
    symptom = d.symptom_kind
    if symptom not in (None, 'not_reproduced'):
        text += '; it ended in {} ({})'.format(_symptom(report), symptom)
    return text
