"""The event of a train step whose forward raised, before any backward.

A forward that raises *because* it made non-finite values (a DETR matcher
handed a NaN cost matrix, SimOTA's cross-entropy of NaN scores, an assertion
on box coordinates) is a trigger like a non-finite loss, and the policy
applies (:meth:`~mmnanhook.recovery.Policy.plan`). Under DDP the
rank whose forward raised votes so (:class:`~._ranks.Ranks`); every
other rank learns it in its own vote, before its backward
(:class:`~mmnanhook.errors.PeerForwardFailed`), and all of them handle the
same event. Inputs found not finite before the forward
(:class:`~mmnanhook.errors.NonFiniteInputError`, :mod:`._inputs`) take the
same path, before any op ran.
"""
from __future__ import annotations

from typing import List, Optional

from mmengine.dist import get_dist_info

from ..errors import NonFiniteInputError, PeerForwardFailed
from ..records import NonFiniteEvent, Trigger
from ._check import StepContext


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` ran out of memory: replaying that forward only runs
    out of memory again."""
    return 'out of memory' in str(exc).lower()


def forward_event(iter: int, epoch: int, exc: Exception,
                  failed: Optional[List[int]],
                  shared: bool) -> NonFiniteEvent:
    """The :class:`~mmnanhook.records.NonFiniteEvent` of a forward that
    raised.

    Args:
        iter (int): The train iteration.
        epoch (int): Its epoch.
        exc (Exception): What the forward raised (``PeerForwardFailed`` on
            a rank whose own forward went fine).
        failed (list[int], optional): The ranks whose forward raised.
        shared (bool): Whether every rank of a distributed run has it.
    """
    rank, world_size = get_dist_info()
    where = StepContext(iter, epoch).where(rank, world_size)
    if isinstance(exc, NonFiniteInputError):
        message = 'input check at %s: %s' % (where, exc)
    elif isinstance(exc, PeerForwardFailed):
        message = 'forward of rank(s) %s raised at %s: this rank takes ' \
            'the same path' % (', '.join(map(str, failed)), where)
    else:
        message = '%s raised in forward at %s: %s' % (type(exc).__name__,
                                                      where, exc)
    return NonFiniteEvent(
        Trigger.EXCEPTION, message, iter=iter, epoch=epoch, rank=rank,
        world_size=world_size, bad_ranks=failed,
        exception='%s: %s' % (type(exc).__name__, exc), shared=shared)
