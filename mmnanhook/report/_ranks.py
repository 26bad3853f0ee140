"""What every rank found of one trigger, said in each rank's report (DDP).

Under SyncBN a rank whose own batch is clean sees NaN through the batch
statistics the ranks share in forward; without it, through the gradients
DDP averages. Each rank replays its own batch alone, the ranks exchange what
they found (:class:`~mmnanhook.records.RankFinding`), and every report names
the rank and sample that caused the failure.
"""
from __future__ import annotations

from typing import Any, Sequence


def _named(culprits):
    return '; '.join(
        'rank {} sample {} ({})'.format(f.rank, s.index, s.name)
        for f in culprits for s in f.samples)


def cross_rank(report: Any, findings: Sequence[Any], rank: int) -> None:
    """Say in ``report`` (this rank's, finalized) which rank's samples made
    the failure.

    Args:
        report (Report): This rank's diagnosis.
        findings (list[RankFinding]): Every rank's, by rank.
        rank (int): This rank.
    """
    report.ranks = list(findings)
    culprits = [f for f in findings if f.culprit]
    world = len(findings)
    if not culprits:
        report.notes.append(
            'no rank\'s samples fail on their own ({} ranks, each replaying '
            'its own batch alone)'.format(world))
        return
    named = _named(culprits)
    if any(f.rank == rank for f in culprits):
        others = [f for f in culprits if f.rank != rank]
        report.notes.append('rank {} of {}{}'.format(
            rank, world, '; samples of other ranks fail too: ' +
            _named(others) if others else ''))
        report.summary = 'rank {} of {}: {}'.format(rank, world,
                                                    report.summary)
        return
    via = ('the batch statistics its modules share in forward ({})'.format(
        report.local_modules[0].split(' (')[1].rstrip(')'))
           if report.local_modules else 'the gradients DDP averages')
    own = findings[rank] if rank < world else None
    clean = own is not None and own.reproduced is False
    text = ('the NaN/Inf came from another rank through {}, not from this '
            "rank's data: {}{}".format(
                via, named, "; this rank's own batch replays finite alone"
                if clean else ''))
    report.summary = '{}. Here: {}'.format(text, report.summary) \
        if report.summary else text
    report.hints.insert(0, 'look at {}: the failure is in its data; this '
                        'rank only received it'.format(named))
