"""The concrete fixes a report suggests."""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

from .._format import format_value
from ..records import FixKind, ProblemCategory
from ._summary import _names, divergence_words

# Weights this large in a network that trained normally so far are the
# footprint of exploding updates (initialised weights are O(1)).
LARGE_WEIGHT = 1e3

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
    """``(fix kind, hint)`` pairs for the data problems found."""
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
        hints.append((FixKind.DECLARED_SIZE,
            'The annotation declares other image sizes than the files have, '
            'so boxes beyond the real border survive the dataset filter and '
            "are clipped by the pipeline: fix the sizes (or the boxes) in the "
            'annotation file' + where + '. If the annotations were made on '
            'the raw pixels of images with an EXIF orientation, load them '
            "unrotated: `dict(type='LoadImageFromFile', "
            "color_type='color_ignore_orientation')`."))
    if ProblemCategory.DEGENERATE in categories:
        hints.append((FixKind.FILTER,
            'Drop degenerate GT boxes before they reach the box coder '
            '(log(w) of a zero width is -inf): add '
            "`dict(type='FilterAnnotations', min_gt_bbox_wh=(0.01, 0.01))` "
            'to the train pipeline before its `Pack*Inputs` step, after '
            "every resize (mmrotate: `type='mmdet.FilterAnnotations'`), or "
            'fix the annotations' + where + '.'))
    if ProblemCategory.NONFINITE_BOX in categories:
        hints.append((None, 'Some GT boxes hold NaN/Inf coordinates: fix or '
                      'remove those annotations' + where + '.'))
    if ProblemCategory.NONFINITE_TARGET in categories:
        # Keypoints and other targets come from the annotations as the
        # boxes do (a NaN an export wrote into a keypoint's x or y).
        hints.append((None, 'Some ground-truth targets (keypoints, labels '
                      'or maps the pipeline made of them) hold NaN/Inf: '
                      'fix or remove those annotations' + where + '.'))
    if ProblemCategory.OUTSIDE in categories:
        hints.append((None,
            'Some GT boxes lie outside their image: check the annotation '
            'coordinates (order x1, y1, x2, y2; units) and filter such '
            'boxes' + where + '.'))
    if ProblemCategory.ANGLE in categories:
        hints.append((None,
            'Some rotated GT boxes have angles outside the configured '
            "range: make the dataset's and the model's `angle_version` "
            'agree' + where + '.'))
    if ProblemCategory.NONFINITE_INPUT in categories:
        hints.append((None,
            'The input images hold NaN/Inf: check image decoding and the '
            'normalisation (e.g. a zero std in `data_preprocessor`)' + where
            + '.'))
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


def keyed_hints(report: Any) -> List[Tuple[Optional[FixKind], str]]:
    """The hints of a report, each with the kind of fix that checks it.

    A hint whose fix was replayed and came out non-finite is left out: it
    is shown as refuted with the fixes, never as advice.

    Args:
        report (Report): A report, filled in (its ``fixes`` included).

    Returns:
        list[tuple]: ``(FixKind | None, hint)``, most specific first.
    """
    refuted = set(f.kind for f in report.fixes if f.status == 'refuted')
    return [(key, text) for key, text in _keyed_hints(report)
            if key is None or key not in refuted]


def _keyed_hints(report):
    kind = report.kind
    hints = []
    if kind == 'divergence':
        return _divergence_hints(report)
    if kind in ('data', 'not_reproduced'):
        hints.extend(_data_hints(report))
    if kind in ('data', 'forward', 'backward', 'overflow'):
        advice = _op_advice(report.op)
        if advice:
            hints.append((None, '{} at {}: {}.'.format(
                report.op, report.location or 'the reported op', advice)))
    if kind == 'overflow':
        hints.append((FixKind.FP32, _overflow_hint(report)))
    if kind == 'optimizer_state':
        hints.append((None,
            'Resume from the last good checkpoint; a non-finite optimizer '
            "state stays non-finite. Lower the learning rate, raise Adam's "
            '`eps`, or set `clip_grad`.'))
    if _exploding(report):
        largest = report.largest_param or {}
        detail = ''
        if (largest.get('max_abs') or 0.0) >= LARGE_WEIGHT:
            detail = ' (largest |weight| {} in {})'.format(
                format_value(largest.get('max_abs')), largest['name'])
        hints.append((None,
            'This looks like an exploding update{}: lower the learning '
            'rate, lengthen the warmup (`param_scheduler` LinearLR), set '
            '`optim_wrapper.clip_grad=dict(max_norm=35, norm_type=2)`, and '
            'resume from the last good checkpoint.'.format(detail)))
    if kind == 'exception' and _exception_hint(report):
        hints.append((None, _exception_hint(report)))
    replays = report.sample_replays
    if (kind not in ('not_reproduced', 'params', 'optimizer_state',
                     'exception') and replays
            and not any(r['result'] == 'nonfinite' for r in replays)):
        hints.append((None,
            'No sample fails on its own: the failure depends on the batch as '
            'a whole (batch statistics, padding, cross-image assignment).'))
    if kind == 'not_reproduced':
        hints.append((None,
            'The replay restores the batch, weights and RNG but not GPU '
            'non-determinism, other ranks or state changed by other hooks; '
            'keep the bundle and replay it on the same kind of machine.'))
    return hints


def _divergence_hints(report):
    d = report.divergence
    if d is None:
        return []
    lr = d.lr
    hints = [(FixKind.LOWER_LR,
        'The {} blew up from iter {} on{}: lower the learning rate{} or '
        'lengthen the warmup (`param_scheduler` LinearLR with a larger '
        '`end`, e.g. 1000 iterations).'.format(
            divergence_words(d)[0], d.began_at,
            ' (lr {} there)'.format(format_value(lr)) if lr is not None
            else '',
            ' (e.g. optim_wrapper.optimizer.lr={})'.format(
                format_value(lr / 10.0)) if lr else ''))]
    clip = d.clip_max_norm
    if clip:
        hints.append((None,
            'Clip the gradient norm: `optim_wrapper.clip_grad=dict('
            'max_norm={}, norm_type=2)` (twice the median gradient norm of '
            'the iterations before).'.format(format_value(clip))))
    grown = d.grown
    if grown:
        weights = d.series == 'weights'
        hints.append((None, 'The {} that grew most since {}: {}.'.format(
            'weights' if weights else 'parameter norms',
            'training started' if weights else 'the last good state',
            ', '.join('{} ({} -> {})'.format(g['name'],
                                             format_value(g['before']),
                                             format_value(g['after']))
                      for g in grown))))
    if d.amp:
        hints.append((None, 'Under AMP a diverging run also drives the loss '
                      "scale down: keep `loss_scale='dynamic'` and check "
                      '`train/loss_scale`.'))
    hints.append((None, "`NanDetectHook(policy='rewind', "
                  "spike_policy='rewind')` goes back to the last good "
                  'snapshot automatically and lowers the LR for a while.'))
    return hints
