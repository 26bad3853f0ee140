"""The config's findings (``mmnan doctor``'s rules, run at ``before_train``)
in a trigger's report: all of them kept, a hint for each that explains the
trigger."""
from __future__ import annotations

from typing import Any, Iterable

from ..records import Kind


def _loss_key(where):
    """``'model.bbox_head.loss_bbox'`` -> ``'loss_bbox'`` (``None`` when the
    path names no loss)."""
    for part in reversed(where.split('.')):
        if part.startswith('loss'):
            return part
    return None


def explains(finding: Any, report: Any) -> bool:
    """Whether a config finding may explain the trigger of ``report``.

    Args:
        finding (ConfigFinding): The finding.
        report (Report): The trigger's diagnosis.
    """
    if finding.rule == 'static_loss_scale':
        return report.amp_dtype is not None
    if finding.rule == 'lr_not_scaled':
        return report.kind == Kind.DIVERGENCE
    key = _loss_key(finding.where)
    if key is None:
        return False
    if report.nonfinite_losses:
        return any(name == key or name.endswith('.' + key)
                   for name in report.nonfinite_losses)
    # A loss that is finite with a non-finite gradient (a sqrt at 0).
    return report.kind == Kind.BACKWARD


def explain_by_config(report: Any, findings: Iterable[Any]) -> None:
    """Keep ``findings`` in ``report`` and add a hint for each that explains
    its trigger.

    Args:
        report (Report): The trigger's diagnosis (changed in place).
        findings (list[ConfigFinding]): What the config rules found.
    """
    report.config_findings = list(findings)
    for finding in findings:
        if explains(finding, report):
            report.hints.append(
                'The config may explain it (mmnan doctor, at before_train): '
                '{} at {} (seen in {}); fix: {}'.format(
                    finding.what, finding.where, finding.why, finding.fix))
