"""Where a divergence began: the spikes or the blow-up before a trigger.

A learning rate too high or a warmup too short show as spikes of the loss or
the gradient norm, or as a steady blow-up, some iterations before the first
NaN; the replay of the failing iteration alone would only name the module
where the overflow finally happened. :func:`divergence_evidence` reads the
history for that story; :func:`apply_divergence` makes it the report's kind
(``'divergence'``), except for a data fault, whose cause is concrete.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Optional, Sequence

from ..records import Divergence
from ._fixes import lower_lr_fix

# A run of at least this many rising finite values, ending this many times
# above where it started, is a blow-up even without a spike (an LR far too
# high diverges within a few iterations, before any spike band exists).
_RISING = 3
_BLOWUP_FACTOR = 10.0
# How many grown parameters the report names.
_GROWN = 5
# An update that made the largest weight this many times what it was when
# training started is an exploding update, even with no rise of the loss
# before it: one step at a far too high LR goes from sane weights straight to
# an overflow, before any history exists.
_WEIGHT_FACTOR = 1e3


def _finite(value):
    return value is not None and isinstance(value, (int, float)) and \
        math.isfinite(value)


def _blowup(records, series):
    """The start of the rise of ``series`` that ends the history (the
    trigger's own record excluded), or ``None`` when it is no blow-up."""
    values = [(r['iter'], r.get(series)) for r in records[:-1]]
    values = [(i, v) for i, v in values if _finite(v) and v > 0]
    start = len(values) - 1
    while start > 0 and values[start - 1][1] < values[start][1]:
        start -= 1
    run = values[start:]
    if len(run) < _RISING or run[-1][1] < _BLOWUP_FACTOR * run[0][1]:
        return None
    return dict(series=series, iter=run[0][0], value=run[-1][1],
                median=run[0][1], factor=run[-1][1] / run[0][1])


def rising(records: Sequence[Dict[str, Any]]) -> bool:
    """Whether the loss or the gradient norm blew up before the trigger (the
    last record)."""
    return any(_blowup(records, s) is not None for s in ('loss', 'grad_norm'))


# The rise a report shows: its first values and the last ones before the
# trigger, ``...`` between.
_RISE_HEAD, _RISE_TAIL = 3, 4


def _rise(records, series, began):
    """The values of the rise from ``began`` to the trigger (the last
    record): ``{'series', 'values': [[iter, value], ...]}``. A blow-up of
    the weights shows as the loss it drove."""
    key = 'loss' if series == 'weights' else series
    values = [[r['iter'], r.get(key)] for r in records
              if r['iter'] >= began and r.get(key) is not None]
    if len(values) > _RISE_HEAD + _RISE_TAIL:
        values = values[:_RISE_HEAD] + [None] + values[-_RISE_TAIL:]
    return dict(series=key, values=values)


def _lr_at(records, iter):
    for record in records:
        if record['iter'] == iter:
            return record.get('lr')
    return None


def _grown(reference, current):
    grown = []
    for name, now in current.items():
        before = reference.get(name)
        if not _finite(before) or before <= 0:
            continue
        ratio = now / before if _finite(now) else math.inf
        grown.append(dict(name=name, before=before, after=now, ratio=ratio))
    grown.sort(key=lambda g: -g['ratio'])
    return grown[:_GROWN]


def divergence_evidence(records: Sequence[Dict[str, Any]],
                        spikes: Optional[Sequence[Dict[str, Any]]],
                        reference_norms: Optional[Dict[str, float]] = None,
                        current_norms: Optional[Dict[str, float]] = None,
                        grad_median: Optional[float] = None,
                        amp: bool = False) -> Optional[Divergence]:
    """What the history before a trigger says about a divergence.

    Args:
        records (list[dict]): History records, oldest first, the trigger's
            iteration last.
        spikes (list[dict]): Spikes (:meth:`Spike.to_dict`) seen before.
        reference_norms (dict, optional): Parameter norms at the last good
            snapshot (or at the first spike).
        current_norms (dict, optional): Parameter norms now.
        grad_median (float, optional): The median gradient norm of the
            clean band, for a ``clip_grad`` value.
        amp (bool): Whether the run used AMP.

    Returns:
        Divergence | None: ``None`` when nothing diverged before the
        trigger.
    """
    start = None
    if spikes:
        first = spikes[0]
        start = dict(series=first['series'], iter=first['iter'],
                     value=first['value'], median=first['median'],
                     factor=first['factor'])
    else:
        for series in ('loss', 'grad_norm'):
            found = _blowup(records, series)
            if found is not None and (start is None
                                      or found['iter'] < start['iter']):
                start = found
    if start is None:
        return None
    return Divergence(
        began_at=start['iter'], series=start['series'],
        factor=start['factor'], value=start['value'], median=start['median'],
        lr=_lr_at(records, start['iter']), spikes=len(spikes or []),
        rise=_rise(records, start['series'], start['iter']),
        grown=_grown(reference_norms or {}, current_norms or {}),
        clip_max_norm=(2.0 * grad_median if _finite(grad_median)
                       and grad_median > 0 else None),
        amp=bool(amp))


def weight_evidence(records: Sequence[Dict[str, Any]],
                    largest: Optional[Dict[str, Any]],
                    start: Optional[float],
                    amp: bool = False) -> Optional[Divergence]:
    """Divergence evidence from the growth of the largest weight.

    Args:
        records (list[dict]): History records, oldest first, the trigger's
            iteration last.
        largest (dict, optional): ``name`` and ``max_abs`` of the largest
            finite weight now (the report's ``largest_param``).
        start (float, optional): The largest ``|weight|`` when training
            started.
        amp (bool): Whether the run used AMP.

    Returns:
        Divergence | None: As :func:`divergence_evidence`, with ``series``
        ``'weights'`` and ``began_at`` the last update step applied before
        the trigger; ``None`` when the weights did not blow up.
    """
    now = (largest or {}).get('max_abs')
    if not (_finite(now) and _finite(start) and start > 0
            and now >= _WEIGHT_FACTOR * start):
        return None
    earlier = records[:-1]
    began = earlier[-1]['iter'] if earlier else records[-1]['iter']
    # The gradient norms from before the exploding update, for a clip value.
    norms = sorted(r['grad_norm'] for r in earlier
                   if r['iter'] < began and _finite(r.get('grad_norm')))
    median = norms[len(norms) // 2] if norms else None
    return Divergence(
        began_at=began, series='weights', factor=now / start, value=now,
        median=start, lr=_lr_at(records, began), spikes=0,
        rise=_rise(records, 'weights', began),
        grown=[dict(name=largest['name'], before=start, after=now,
                    ratio=now / start)],
        clip_max_norm=2.0 * median if median else None, amp=bool(amp))


def apply_divergence(report: Any, evidence: Optional[Divergence],
                     rewind: Optional[Dict[str, Any]] = None) -> bool:
    """Make ``evidence`` the report's finding unless the data is at fault.

    Its fix is then a lower learning rate (:func:`lower_lr_fix`), replacing
    the fixes of the symptom.

    Args:
        report (Report): The diagnosis of the trigger.
        evidence (Divergence, optional): :func:`divergence_evidence`'s
            answer.
        rewind (dict, optional): ``lr_factor`` and ``cooldown`` of the
            rewind about to be done.

    Returns:
        bool: Whether the report is now of kind ``'divergence'``.
    """
    if evidence is None or report.kind == 'data':
        return False
    report.divergence = dataclasses.replace(evidence, symptom_kind=(
        report.kind.value if report.kind is not None else None))
    report.kind = 'divergence'
    report.fixes = [lower_lr_fix(report.divergence, rewind)]
    return True


def evidence_before(event: Any, records: Sequence[Dict[str, Any]],
                    detector: Optional[Any], window: int,
                    reference: Optional[Dict[str, float]] = None,
                    snapshots: Optional[Any] = None,
                    norms: Optional[Callable[[], Dict[str, float]]] = None
                    ) -> Optional[Divergence]:
    """Evidence of a divergence before a trigger, or ``None``.

    Args:
        event (NonFiniteEvent): The trigger.
        records (list[dict]): History records, the trigger's last.
        detector (SpikeDetector, optional): The run's spikes and bands.
        window (int): Iterations back a spike still tells of a divergence.
        reference (dict, optional): Parameter norms when the current run of
            spikes began.
        snapshots (SnapshotStore, optional): Under ``'rewind'``: the norms
            of the last good snapshot before the divergence are the
            reference instead.
        norms (callable, optional): The parameter norms now (failure path
            only: called when there is evidence).
    """
    earlier = []
    if detector is not None:
        earlier = [s.to_dict() for s in detector.spikes
                   if event.iter - window <= s.iter < event.iter]
    if not earlier and not rising(records):
        return None
    if snapshots is not None:
        began = earlier[0]['iter'] if earlier else event.iter
        snapshot = snapshots.before(began)
        reference = snapshot.norms if snapshot is not None else reference
    return divergence_evidence(
        records, earlier, reference, norms() if norms else None,
        grad_median=detector.median('grad_norm')
        if detector is not None else None,
        amp=event.loss_scale is not None)
