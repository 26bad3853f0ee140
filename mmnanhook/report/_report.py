"""The tier-2 diagnosis report: its fields, summary line, hints and text.

:func:`mmnanhook.diagnosis.diagnose` fills in the facts; this module turns
them into the one-line ``summary``, the concrete ``hints`` and the
human-readable text written to ``report.txt`` and the log.  Floats are kept
as Python floats (NaN/Inf included); the bundle writer makes them strict
JSON.
"""
import math

from .._format import format_names, format_value
from ..records import REPORT_FORMAT_VERSION, ProblemCategory, Report

FORMAT_VERSION = REPORT_FORMAT_VERSION

# Weights this large in a network that trained normally so far are the
# footprint of exploding updates (initialised weights are O(1)).
LARGE_WEIGHT = 1e3

# How many names a summary or the text lists before "and N more".
_SHOWN = 5

# Singular points of common ops, by the op's base name (grad_fn name without
# the ``Backward`` suffix); the advice says how to guard them.
_OP_ADVICE = (
    (('Sqrt', 'Rsqrt', 'Pow', 'Norm', 'LinalgVectorNorm', 'Cdist'),
     'its derivative is infinite at 0: keep its input away from 0, e.g. '
     '`x.clamp(min=1e-6).sqrt()` or `(x + eps).sqrt()`'),
    (('Log', 'Log2', 'Log10', 'Log1p', 'Digamma', 'Lgamma', 'Xlogy'),
     'log of 0 or of a negative number: clamp its input, e.g. '
     '`x.clamp(min=1e-6).log()`'),
    (('Div', 'Reciprocal'),
     'division by (almost) zero: add an eps to the denominator or clamp it'),
    (('Acos', 'Asin', 'Atanh'),
     'its derivative is infinite at +-1: clamp its input to '
     '[-1 + eps, 1 - eps]'),
    (('Atan2', ), 'atan2(0, 0) has no derivative: add an eps to its inputs'),
    (('Exp', 'Exp2', 'Expm1', 'Sinh', 'Cosh'),
     'it overflows for large inputs: clamp its input (e.g. '
     '`x.clamp(max=50)`) or use a log-sum-exp formulation'),
)


def new_report():
    """A report with every field present and nothing found yet."""
    return Report()


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


def _nonfinite_kind(detail):
    if not detail:
        return 'NaN/Inf'
    if detail.get('nan') and detail.get('inf'):
        return 'NaN and Inf'
    return 'NaN' if detail.get('nan') else 'Inf'


def _symptom(report):
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
            path = sample.img_path or 'no img_path'
            text = problems[0].text
            if (problems[0].category == ProblemCategory.SIZE_MISMATCH
                    and len(problems) > 1):
                # The root cause, then what it did to the boxes.
                text += '; so ' + problems[1].text
            return 'sample {} ({}): {}'.format(sample.index, path, text)
    return None


def summarize(report):
    """The one-line summary of a report's findings.

    Args:
        report (Report): A report, filled in.
    """
    kind = report.kind
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
                                        forward['module'],
                                        forward['location'], forward['op'])
        return text
    if kind == 'overflow':
        over = report.overflow or {}
        text = '{} only under autocast({}), finite in float32'.format(
            _symptom(report), report.amp_dtype)
        if over.get('max_abs') is not None:
            return text + ": '{}' outputs reach {} (the {} max is {})".format(
                over.get('module') or report.module,
                format_value(over['max_abs']), report.amp_dtype,
                format_value(over.get('limit')))
        return text + '; first non-finite value made ' + _where(report)
    if kind == 'data':
        implicated = [s for s in report.samples if s.problems]
        text = '{} caused by {}'.format(
            _symptom(report), _first_problem_text(implicated))
        if len(implicated) > 1:
            text += ' (and {} more sample(s))'.format(len(implicated) - 1)
        if report.module is None and report.location is None:
            return text
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


def _op_advice(op):
    if not op:
        return None
    base = op.split('::')[-1]
    index = base.find('Backward')
    base = base[:index] if index >= 0 else base
    for names, advice in _OP_ADVICE:
        if base in names:
            return advice
    return None


def _data_hints(report):
    hints = []
    if report.kind == 'data':
        samples = report.samples
    else:
        samples = report.batch_problems
    categories = set()
    for sample in samples:
        categories.update(sample.categories)
    paths = [s.img_path for s in samples if s.problems and s.img_path]
    where = ' (images: {})'.format(_names(paths)) if paths else ''
    if ProblemCategory.SIZE_MISMATCH in categories:
        hints.append(
            'The annotation declares other image sizes than the files have, '
            'so boxes beyond the real border survive the dataset filter and '
            "are clipped by the pipeline: fix the sizes (or the boxes) in the "
            'annotation file' + where + '. If the annotations were made on '
            'the raw pixels of images with an EXIF orientation, load them '
            "unrotated: `dict(type='LoadImageFromFile', "
            "color_type='color_ignore_orientation')`.")
    if ProblemCategory.DEGENERATE in categories:
        hints.append(
            'Drop degenerate GT boxes before they reach the box coder '
            '(log(w) of a zero width is -inf): add '
            "`dict(type='FilterAnnotations', min_gt_bbox_wh=(1e-2, 1e-2))` "
            'to the train pipeline after the resize (mmrotate: '
            "`type='mmdet.FilterAnnotations'`), or fix the annotations"
            + where + '.')
    if ProblemCategory.NONFINITE_BOX in categories:
        hints.append('Some GT boxes hold NaN/Inf coordinates: fix or remove '
                     'those annotations' + where + '.')
    if ProblemCategory.OUTSIDE in categories:
        hints.append(
            'Some GT boxes lie outside their image: check the annotation '
            'coordinates (order x1, y1, x2, y2; units) and filter such '
            'boxes' + where + '.')
    if ProblemCategory.ANGLE in categories:
        hints.append(
            'Some rotated GT boxes have angles outside the configured '
            "range: make the dataset's and the model's `angle_version` "
            'agree' + where + '.')
    if ProblemCategory.NONFINITE_INPUT in categories:
        hints.append(
            'The input images hold NaN/Inf: check image decoding and the '
            'normalisation (e.g. a zero std in `data_preprocessor`)' + where
            + '.')
    return hints


def _exploding(report):
    """Whether the findings look like an exploding update."""
    largest = report.largest_param or {}
    norm = report.grad_norm
    return (report.kind == 'params'
            or (largest.get('max_abs') or 0.0) >= LARGE_WEIGHT
            or (norm is not None and not math.isfinite(norm)
                and not report.nonfinite_grad_count))


def _overflow_hint(report):
    # module is None when the model's own forward (no submodule) made it.
    where = "'{}'".format(report.module) if report.module else (
        'the op at {}'.format(report.location or 'the reported line'))
    if report.amp_dtype == 'float16':
        return (
            'Keep {} (or the loss it feeds) in float32: run it under '
            '`torch.autocast(device_type, enabled=False)` with `.float()` '
            "inputs, switch AMP to bfloat16 (`AmpOptimWrapper(dtype="
            "'bfloat16')`), or scale its activations down.".format(where))
    return ("The failure needs autocast({}): a precision loss, not a range "
            "overflow. Run {} in float32 (`torch.autocast(device_type, "
            'enabled=False)`).'.format(report.amp_dtype, where))


def _exception_hint(report):
    message = (report.exception or {}).get('message') or ''
    if 'inplace operation' in message:
        return ('An in-place operation changed a tensor that backward needs: '
                'make the in-place op at or after {} out-of-place '
                '(`x = x + y` instead of `x += y`, `inplace=False`).'.format(
                    report.location or 'the reported op'))
    if 'second time' in message:
        return ('A graph is backpropagated twice: detach tensors kept across '
                'iterations, or pass `retain_graph=True` where intended.')
    return None


def make_hints(report):
    """Concrete fixes suggested by a report's findings.

    Args:
        report (Report): A report, filled in.

    Returns:
        list[str]: Hints, most specific first.
    """
    kind = report.kind
    hints = []
    if kind in ('data', 'not_reproduced'):
        hints.extend(_data_hints(report))
    if kind in ('data', 'forward', 'backward', 'overflow'):
        advice = _op_advice(report.op)
        if advice:
            hints.append('{} at {}: {}.'.format(
                report.op, report.location or 'the reported op', advice))
    if kind == 'overflow':
        hints.append(_overflow_hint(report))
    if kind == 'optimizer_state':
        hints.append(
            'Resume from the last good checkpoint; a non-finite optimizer '
            "state stays non-finite. Lower the learning rate, raise Adam's "
            '`eps`, or set `clip_grad`.')
    if _exploding(report):
        largest = report.largest_param or {}
        detail = ''
        if (largest.get('max_abs') or 0.0) >= LARGE_WEIGHT:
            detail = ' (largest |weight| {} in {})'.format(
                format_value(largest.get('max_abs')), largest['name'])
        hints.append(
            'This looks like an exploding update{}: lower the learning '
            'rate, lengthen the warmup (`param_scheduler` LinearLR), set '
            '`optim_wrapper.clip_grad=dict(max_norm=35, norm_type=2)`, and '
            'resume from the last good checkpoint.'.format(detail))
    if kind == 'exception' and _exception_hint(report):
        hints.append(_exception_hint(report))
    replays = report.sample_replays
    if (kind not in ('not_reproduced', 'params', 'optimizer_state',
                     'exception') and replays
            and not any(r['result'] == 'nonfinite' for r in replays)):
        hints.append(
            'No sample fails on its own: the failure depends on the batch as '
            'a whole (batch statistics, padding, cross-image assignment).')
    if kind == 'not_reproduced':
        hints.append(
            'The replay restores the batch, weights and RNG but not GPU '
            'non-determinism, other ranks or state changed by other hooks; '
            'keep the bundle and replay it on the same kind of machine.')
    return hints


def finalize(report):
    """Fill ``summary`` and ``hints`` from the findings; return the report.

    Args:
        report (Report): A report, filled in.
    """
    report.summary = summarize(report)
    report.hints = make_hints(report)
    return report


def _sample_line(sample):
    return '  [{}] {}: {}'.format(
        sample.index, sample.img_path or '-',
        '; '.join(p.text for p in sample.problems) or
        'no data problem found')


def format_report(report):
    """The human-readable text of a report (``report.txt`` and the log).

    Args:
        report (Report | dict): A finished report, or ``report.json``'s
            content (missing fields count as empty).

    Returns:
        str: Several lines, no trailing newline.
    """
    if isinstance(report, dict):
        report = Report.from_dict(report)
    lines = [
        'mmnanhook diagnosis: {}'.format(report.kind),
        'summary: {}'.format(report.summary)
    ]
    for key in ('module', 'op', 'location'):
        if getattr(report, key) is not None:
            lines.append('{}: {}'.format(key, getattr(report, key)))
    if report.code:
        lines.append('code: {}'.format(report.code))
    if report.losses:
        lines.append('losses: ' +
                     ', '.join('{}={}'.format(k, format_value(v))
                               for k, v in report.losses.items()))
    if report.grad_norm is not None:
        lines.append('grad_norm: {}'.format(format_value(report.grad_norm)))
    if report.nonfinite_grad_count:
        lines.append(
            'non-finite gradients: ' +
            _names(report.nonfinite_grads, report.nonfinite_grad_count))
    if report.params:
        lines.append('non-finite parameters/buffers: ' +
                     _names(report.params))
    if report.optimizer_state:
        lines.append('non-finite optimizer state: ' +
                     _names(report.optimizer_state))
    if report.samples:
        lines.append('implicated samples:')
        lines.extend(_sample_line(s) for s in report.samples)
    implicated = set(s.index for s in report.samples)
    others = [
        s for s in report.batch_problems if s.index not in implicated
    ]
    if others:
        lines.append(
            'other samples with data problems (finite on their own):'
            if report.sample_replays else 'samples with data problems:')
        lines.extend(_sample_line(s) for s in others)
    if report.sample_replays:
        lines.append('one-sample replays: ' +
                     ', '.join('{}={}'.format(r['index'], r['result'])
                               for r in report.sample_replays))
    if report.hints:
        lines.append('hints:')
        lines.extend('  - ' + hint for hint in report.hints)
    if report.notes:
        lines.append('notes:')
        lines.extend('  - ' + note for note in report.notes)
    if report.traceback:
        lines.append('traceback:')
        lines.extend('  ' + line
                     for line in report.traceback.rstrip().split('\n'))
    return '\n'.join(lines)
