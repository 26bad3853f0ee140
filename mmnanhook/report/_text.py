"""A report as text (``report.txt`` and the log)."""
from __future__ import annotations

from typing import Any, Dict, Set, Union

from .._format import format_value
from ..records import Report
from ._summary import _names, divergence_words, rise_words

# How each status of a fix is said.
_STATUS = {'verified': 'finite with it', 'refuted': 'refuted',
           'untested': 'not verified'}


def fix_line(fix: Any) -> str:
    """One line saying a fix and what replaying with it gave.

    Args:
        fix (Fix): The fix.
    """
    if fix.kind == 'none':
        return 'no fix can be applied mechanically: {}'.format(fix.detail)
    parts = [fix.detail] if fix.detail else []
    if fix.loss is not None:
        parts.insert(0, 'loss {}'.format(format_value(fix.loss)))
    return '{}: {}{}'.format(_STATUS[fix.status], fix.fix,
                             ' ({})'.format('; '.join(parts)) if parts else '')


def verified_hints(report: Report) -> Set[int]:
    """Indices of the hints a replayed fix verified."""
    return set(f.hint for f in report.fixes
               if f.status == 'verified' and f.hint is not None)


def _sample_line(sample):
    return '  [{}] {}: {}'.format(
        sample.index, sample.name if sample.img_path or
        sample.dataset_index is not None else '-',
        '; '.join(p.text for p in sample.problems) or
        'no data problem found')


def format_report(report: Union[Report, Dict[str, Any]]) -> str:
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
    divergence = report.divergence
    if divergence:
        name, over = divergence_words(divergence)
        rise = rise_words(divergence)
        lines.append('divergence: from iter {} ({} {}x {}){}'.format(
            divergence.began_at, name, format_value(divergence.factor),
            over,
            ': ' + rise if rise else ''))
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
        verified = verified_hints(report)
        lines.extend('  - ' + hint + (' [verified]' if i in verified else '')
                     for i, hint in enumerate(report.hints))
    if report.fixes:
        lines.append('verified (the failing iteration replayed with each '
                     'fix):')
        lines.extend('  - ' + fix_line(fix) for fix in report.fixes)
    if report.notes:
        lines.append('notes:')
        lines.extend('  - ' + note for note in report.notes)
    if report.config_findings:
        lines.append('config findings (mmnan doctor, at before_train):')
        lines.extend('  - ' + f.line() for f in report.config_findings)
    if report.traceback:
        lines.append('traceback:')
        lines.extend('  ' + line
                     for line in report.traceback.rstrip().split('\n'))
    return '\n'.join(lines)
