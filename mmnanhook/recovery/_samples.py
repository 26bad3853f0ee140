"""Which samples a ``'drop'`` leaves out, decided alike on every rank.

On one rank, the samples the diagnosis singles out (:func:`samples_to_drop`).
Under DDP each rank sums up its own diagnosis in a
:class:`~mmnanhook.records.RankFinding` (:func:`rank_finding`), the ranks
exchange them, and each takes the same :class:`DropDecision` from all of
them (:func:`drop_decision`): the step is recomputed without the culprits'
samples on their ranks, or skipped on every rank, saying why.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple

from .._batch import batch_size, leave_out_refused
from ..records import NONFINITE_DATA, Culprit, Kind, RankFinding

# Kinds whose implicated samples are the cause: the data itself, or a forward
# or backward failure that some samples (not all) reproduce alone. Weights,
# optimizer state, AMP ranges, exceptions and divergences are not about data.
_DATA_KINDS = (Kind.DATA, Kind.FORWARD, Kind.BACKWARD)


def drop_unavailable(wrappers: int) -> Optional[str]:
    """Why ``'drop'`` can only do what ``'skip'`` does in this run, or
    ``None``.

    Args:
        wrappers (int): Optim wrappers stepped (an ``OptimWrapperDict``'s
            members).
    """
    if wrappers != 1:
        return 'an OptimWrapperDict steps several optimizers'
    return None


def samples_to_drop(report: Optional[Any], batch_size: Optional[int],
                    whole: bool = False, refused: Optional[str] = None
                    ) -> Tuple[Optional[List[int]], Optional[str]]:
    """The batch positions a drop leaves out, or why none can be.

    Args:
        report (Report, optional): The trigger's diagnosis.
        batch_size (int, optional): Samples in the failing batch.
        whole (bool): Whether the whole batch may be left out (under DDP
            the rank then takes part with a zero loss).
        refused (str, optional): Why no sample can be left out of the
            failing batch (:func:`~mmnanhook._batch.leave_out_refused`: a
            layout that is not known is never guessed at).

    Returns:
        tuple: ``(indices, None)``, or ``(None, reason)`` when ``'drop'``
        must do what ``'skip'`` does.
    """
    if report is None:
        return None, 'no replay diagnosed the batch (replay=False)'
    if not batch_size or (batch_size < 2 and not whole):
        return None, 'the batch holds a single sample'
    if report.kind not in _DATA_KINDS:
        return None, 'the failure (kind %r) is not about samples' % (
            report.kind.value if report.kind is not None else None, )
    indices = sorted(set(s.index for s in report.samples
                         if s.index is not None))
    if not indices:
        return None, 'no sample of the batch fails on its own'
    if len(indices) >= batch_size and not whole:
        return None, 'every sample of the batch fails on its own'
    if refused is not None and len(indices) < batch_size:
        return None, ('sample(s) %s cannot be left out of the batch: its '
                      'layout is not one mmnanhook knows (%s)' % (
                          ', '.join(map(str, indices)), refused))
    return indices, None


def raised_by_nonfinite(report: Optional[Any]) -> bool:
    """Whether a forward that raised did so because of non-finite values
    (its diagnosis found where the forward made them, or a sample whose
    data is not finite): the policy applies, instead of re-raising.

    Args:
        report (Report, optional): The diagnosis.
    """
    return report is not None and (report.forward is not None or
                                   report.kind == Kind.DATA)


def rank_finding(rank: int, report: Optional[Any] = None,
                 data_batch: Any = None, iter: Optional[int] = None,
                 raises: bool = False,
                 error: Optional[str] = None) -> RankFinding:
    """This rank's :class:`~mmnanhook.records.RankFinding` of a trigger.

    Args:
        rank (int): This rank.
        report (Report, optional): Its diagnosis; ``None`` when it did not
            diagnose.
        data_batch (optional): The batch it replayed.
        iter (int, optional): That batch's iteration.
        raises (bool): Its forward raised an exception no policy handles.
        error (str, optional): That exception, ``Type: message``.
    """
    if report is None or report.kind is None:
        return RankFinding(rank, iter=iter, raises=raises, error=error)
    n = batch_size(data_batch) if data_batch is not None else None
    drop, reason = samples_to_drop(
        report, n, whole=True, refused=leave_out_refused(data_batch)
        if data_batch is not None else None)
    nonfinite = any(s.categories.intersection(NONFINITE_DATA)
                    for s in report.batch_problems)
    return RankFinding(
        rank, report.kind.value, report.samples, iter, n, drop, reason,
        nonfinite, report.kind != Kind.NOT_REPRODUCED, raises, error)


def received(finding: RankFinding,
             findings: Iterable[RankFinding]) -> bool:
    """Whether ``finding``'s rank only received the failure: its own batch
    replays finite alone while samples of another rank fail (through SyncBN
    statistics, or its forward raised on them)."""
    return finding.reproduced is False and any(
        f.culprit for f in findings if f.rank != finding.rank)


def data_culprits(event: Any, findings: Sequence[RankFinding]
                  ) -> Tuple[bool, List[Culprit]]:
    """Whether every rank's findings put the failure on data, and the
    findings of the samples that made it, on all ranks.

    A forward that raised must have raised on every rank it raised on
    because of data (a rank that only received it aside).

    Returns:
        tuple: ``(data, culprits)``: a bool, and the :class:`Culprit` s.
    """
    culprits = [f for f in findings if f.kind == Kind.DATA]
    data = bool(culprits) and all(
        f.kind == Kind.DATA or received(f, findings) for f in findings
        if f.rank in event.bad_ranks)
    return data, [Culprit(s, f.rank) for f in culprits for s in f.samples]


class DropDecision(object):
    """What ``'drop'`` does on every rank, the same on all.

    Args:
        culprits (list[RankFinding]): The ranks that leave samples out,
            each with its ``drop`` and ``iter``.
        world_size (int): The ranks.
        reason (str, optional): Why every rank skips instead.
    """

    def __init__(self, culprits: Iterable[RankFinding] = (),
                 world_size: int = 1, reason: Optional[str] = None) -> None:
        self.culprits = dict((f.rank, f) for f in culprits)
        self.world_size = world_size
        self.reason = reason

    def indices(self, rank: int) -> List[int]:
        """Batch positions ``rank`` leaves out (of its batch at
        :meth:`iter`)."""
        finding = self.culprits.get(rank)
        return list(finding.drop) if finding is not None else []

    def iter(self, rank: int,
             default: Optional[int]) -> Optional[int]:
        """The iteration whose batch ``rank`` leaves samples out of."""
        finding = self.culprits.get(rank)
        return finding.iter if finding is not None else default

    def empty(self, rank: int) -> bool:
        """Whether ``rank`` leaves its whole batch out: it takes part with
        a zero loss that touches every parameter."""
        finding = self.culprits.get(rank)
        return finding is not None and len(finding.drop) >= (
            finding.batch_size or 0)

    def factor(self, iter: Optional[int]) -> float:
        """What the losses of iteration ``iter`` are multiplied by on the
        ranks that have samples in it, so that DDP's mean over the ranks is
        the mean over those: ``world_size / (world_size - empty ranks)``."""
        empty = sum(1 for rank, f in self.culprits.items()
                    if f.iter == iter and self.empty(rank))
        return float(self.world_size) / (self.world_size - empty)

    @property
    def dropped(self) -> int:
        """Samples left out on all ranks together."""
        return sum(len(f.drop) for f in self.culprits.values())

    @property
    def found(self) -> List[Culprit]:
        """Every sample left out, on all ranks (what the quarantine lists):
        :class:`~mmnanhook.records.Culprit` s."""
        return [Culprit(s, f.rank) for f in self.culprits.values()
                for s in f.samples if s.index in f.drop]


def drop_decision(findings: Sequence[RankFinding], world_size: int,
                  communicates: Sequence[str],
                  can_zero: bool = True) -> DropDecision:
    """The one drop every rank takes, from every rank's finding.

    Args:
        findings (list[RankFinding]): Every rank's.
        world_size (int): The ranks.
        communicates (list[str]): Modules that communicate in their forward
            (SyncBN): a rank without samples could not take part in their
            collectives.
        can_zero (bool): Whether a rank without samples can take part in
            the gradient all-reduce with a zero loss (a DDP model).

    Returns:
        DropDecision: With ``reason`` set when every rank skips.
    """
    culprits = [f for f in findings if f.culprit]
    if not culprits:
        return DropDecision(reason='no rank\'s samples fail on their own')
    for finding in culprits:
        if finding.drop is None:
            return DropDecision(reason='rank %d: %s' % (
                finding.rank, finding.reason))
    decision = DropDecision(culprits, world_size)
    empty = [f.rank for f in culprits if decision.empty(f.rank)]
    if not empty:
        return decision
    if communicates or not can_zero:
        why = ('%d module(s) communicate in their forward (%s)' % (
            len(communicates), communicates[0]) if communicates else
            'the model is not wrapped in DistributedDataParallel')
        return DropDecision(reason=(
            'every sample of rank(s) %s fails, and %s: a rank without '
            'samples cannot take part in the step' % (
                ', '.join(map(str, empty)), why)))
    if len(empty) >= world_size:
        return DropDecision(reason='every sample of every rank fails')
    return decision
