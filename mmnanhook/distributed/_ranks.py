"""One decision on every rank: the votes and exchanges of a DDP run.

Under DDP every rank must issue the same collectives in the same order, or a
rank waits alone (a hang) or its peers' next collectives do not match (a
crash). The update step's check already decides alike on every rank (its
flags are all-reduced); what it cannot see is a forward that raised, and what
each rank's own diagnosis found. :class:`Ranks` carries both:

* :meth:`Ranks.vote`, after every forward and before its backward: whether
  any rank's forward raised. A rank whose forward went fine learns it there
  (:class:`PeerForwardFailed`) instead of waiting in DDP's gradient
  all-reduce for a rank that never comes. :class:`~._forward_guard.
  ForwardGuard` votes so
  before the first collective a train step calls from Python as well
  (mmdet's ``reduce_mean`` of a loss normalizer comes after its assigner,
  which may raise on one rank), and a rank whose forward raises after it
  calls the others' remaining collectives of the step with zeros: no rank
  waits in a collective the raising rank never reaches.
* :meth:`Ranks.exchange`, once per trigger every rank saw, after the ranks
  that triggered replayed their batch alone: each rank's
  :class:`~mmnanhook.records.RankFinding` gathered on every rank, from which
  each takes the same decision
  (:func:`~mmnanhook.recovery.drop_decision`), names the culprit in its
  bundle and quarantines the union.

Votes and exchanges travel in gloo groups of their own (under NCCL too, so
that a vote is a host round trip, not a device sync; never paired with a
collective of the model's): the votes and decisions with the run's timeout
(``env_cfg.dist_cfg.timeout``), the exchange with one long enough for a
diagnosis. A rank that does not answer in time stops the others with one
line that names it (:class:`~mmnanhook.errors.RankTimeoutError`).


The DDP side of tier 1 is three modules, one concern each: this one (the
ranks, their votes and exchanges, the timeouts and the one line of a rank
that did not answer), :mod:`._collectives` (what a collective call is, as a
record that can be called again with zeros) and :mod:`._forward_guard` (no
rank left waiting in a collective of a step whose forward raised elsewhere).
"""
from __future__ import annotations

import datetime
import os
import re
import time
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from mmengine.dist import all_gather_object, get_dist_info
from mmengine.logging import MMLogger
from torch.distributed.constants import default_pg_timeout

from .. import compat
from ..errors import PeerForwardFailed, RankTimeoutError
from ..records import RankFinding

# diagnose: a diagnosis has no time limit of its own, and the replays of a
# large detector under anomaly mode (each fix verified) take minutes.
_DIAGNOSIS_WAIT = datetime.timedelta(hours=2)
# After a collective of ours failed, how long each rank still there waits
# for the others' word before naming those that never gave it. Every rank
# that answered in time fails within one timeout of the first (it entered
# before that one gave up): the wait is that, at most a few seconds.
_ANSWER_WAIT = datetime.timedelta(seconds=10)


class Ranks(object):
    """The ranks of a distributed run, and the groups they decide in.

    Args:
        rank (int): This rank.
        world_size (int): The ranks.
        group: The gloo process group of the votes and decisions
            (``dist.group.WORLD``: the default one; torch 1.7 refuses
            ``None``).
        own_group (bool): Whether :meth:`close` destroys ``group`` and
            ``exchange_group``.
        timeout (datetime.timedelta, optional): ``group``'s, said when a
            rank does not answer in time; torch's default by default.
        exchange_group (optional): The gloo group of :meth:`exchange`;
            ``group`` by default.
        exchange_timeout (datetime.timedelta, optional): Its timeout;
            ``timeout`` by default.
    """

    # Ranks made in this process: the same count on every rank, which
    # starts the same runs in the same order. It keeps a failure's store
    # keys apart from an earlier run's.
    _made = 0

    def __init__(self, rank: int, world_size: int, group: Any,
                 own_group: bool = False,
                 timeout: Optional[datetime.timedelta] = None,
                 exchange_group: Any = None,
                 exchange_timeout: Optional[datetime.timedelta] = None
                 ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self._own_group = own_group
        self.timeout = timeout or default_pg_timeout
        self.exchange_group = exchange_group or group
        self.exchange_timeout = exchange_timeout or self.timeout
        Ranks._made += 1
        self._id = Ranks._made
        # Collectives of ours so far, alike on every rank: a failure's keys.
        self._calls = 0
        # The RankTimeoutError of a failed collective: the groups are broken.
        self._failed = None

    @classmethod
    def start(cls, timeout: Optional[datetime.timedelta] = None
              ) -> Optional[Ranks]:
        """The run's :class:`Ranks`, or ``None`` without other ranks.

        Called on every rank at the same point (``before_train``): creating
        a group is itself a collective.

        Args:
            timeout (datetime.timedelta, optional): The run's
                (:func:`run_timeout`): the votes' and decisions'. The
                exchange waits at least two hours, for a diagnosis.
        """
        rank, world_size = get_dist_info()
        if world_size < 2:
            return None
        timeout = timeout or default_pg_timeout
        exchange_timeout = max(timeout, _DIAGNOSIS_WAIT)
        return cls(rank, world_size,
                   dist.new_group(backend='gloo', timeout=timeout), True,
                   timeout,
                   dist.new_group(backend='gloo', timeout=exchange_timeout),
                   exchange_timeout)

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run's shared files: the first rank
        of each node, which may not share the work dir (torch's launchers
        and mmengine's slurm start set ``LOCAL_RANK``)."""
        local = os.environ.get('LOCAL_RANK')
        return int(local) == 0 if local is not None else self.rank == 0

    def reduce(self, value: float, op: str) -> float:
        """``value`` (a number) reduced over the ranks by ``op``
        (``'min'``/``'max'``): a decision every rank takes alike (failure
        path)."""
        tensor = torch.tensor([float(value)])
        self._collective('a decision of the ranks', lambda: dist.all_reduce(
            tensor, op=dict(min=dist.ReduceOp.MIN,
                            max=dist.ReduceOp.MAX)[op], group=self.group))
        return tensor.item()

    def vote(self, raised: bool) -> List[int]:
        """Every rank says whether its forward raised.

        Returns:
            list[int]: The ranks whose forward raised.
        """
        flags = torch.zeros(self.world_size)
        flags[self.rank] = float(bool(raised))
        self._collective('the vote before backward', lambda: dist.all_reduce(
            flags, group=self.group))
        return [r for r, flag in enumerate(flags.tolist()) if flag > 0]

    def before_backward(self) -> None:
        """Vote for a forward that went fine.

        Raises:
            PeerForwardFailed: Another rank's forward raised.
        """
        failed = self.vote(False)
        if failed:
            raise PeerForwardFailed(failed)

    def exchange(self, finding: RankFinding) -> List[RankFinding]:
        """Gather every rank's finding.

        Args:
            finding (RankFinding): This rank's.

        Returns:
            list[RankFinding]: Every rank's, by rank.
        """
        return [RankFinding.from_dict(f) for f in self._collective(
            'the exchange of findings', lambda: all_gather_object(
                finding.to_dict(), group=self.exchange_group), True)]

    def close(self) -> None:
        """Give back the groups of its own (local: no collective)."""
        if self._own_group:
            for group in {self.group, self.exchange_group}:
                dist.destroy_process_group(group)
            # destroy_process_group leaves a group's gloo threads running
            # while a reference to it remains (torch 1.7.1 and 2.13): the
            # last one goes here, so that they end with the run, not when
            # (or whether) this object is collected.
            self.group = self.exchange_group = None
        self._own_group = False

    def _collective(self, what, call, exchange=False):
        """``call()``, a collective of ours (``what``, in the exchange's
        group if ``exchange``); when it fails (gloo's timeout, or a peer
        gone), the line that names the ranks that did not answer is logged
        and raised.

        Raises:
            RankTimeoutError: This collective failed, or an earlier one did
                (the groups are broken: this one would fail too).
        """
        if self._failed is not None:
            raise self._failed
        self._calls += 1
        try:
            return call()
        except RuntimeError as exc:
            timeout = self.exchange_timeout if exchange else self.timeout
            absent = self._absent(min(timeout, _ANSWER_WAIT))
            line = _not_answered(absent, what, timeout, exchange, exc)
            MMLogger.get_current_instance().error(line)
            self._failed = RankTimeoutError(line, absent or [])
            raise self._failed from exc

    def _absent(self, wait):
        """After a failed collective: this rank says it is here, and waits
        up to ``wait`` for the others to say so (in the default group's
        store, which outlives our groups; nothing is paid before a
        failure).

        Returns:
            list[int] | None: The ranks that did not; ``None``: the store
            is gone (its host with it).
        """
        prefix = 'mmnan/alive/%d.%d/' % (self._id, self._calls)
        others = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.time() + wait.total_seconds()
        try:
            store = compat.default_store()
            store.add(prefix + str(self.rank), 1)
            while True:
                # add(key, 0) tells whether a key was set without waiting
                # (torch 1.7's store has no check()).
                others = [r for r in others
                          if not store.add(prefix + str(r), 0)]
                if not others or time.time() >= deadline:
                    return others
                time.sleep(0.05)
        except RuntimeError:
            return None


def _not_answered(absent, what, timeout, exchange, exc):
    """The one line of a failed collective of ours (see
    :meth:`Ranks._collective`)."""
    if absent:
        return 'mmnanhook: rank%s %s did not answer %s within %s (%s): ' \
            'stopping' % ('s' if len(absent) > 1 else '',
                          ', '.join(map(str, absent)), what, timeout,
                          'the wait for a diagnosis' if exchange else
                          'env_cfg.dist_cfg.timeout')
    # gloo's first line, without the source location it starts with.
    cause = re.sub(r'^\[[^]]*\]\s*', '', (str(exc).strip().splitlines()
                                          or [type(exc).__name__])[0])
    return 'mmnanhook: %s failed (%s); %s: stopping' % (
        what, cause[:200], 'which rank did not answer is unknown (the '
        'store is gone too)' if absent is None else 'every rank answered '
        'after it')


def run_timeout(cfg: Any) -> datetime.timedelta:
    """The timeout of a run's collectives: ``env_cfg.dist_cfg.timeout`` of
    its config (seconds, which MMEngine's ``init_dist`` gives the default
    group; a ``timedelta`` is taken as is), torch's default (30 min) where
    unset.

    Args:
        cfg (Config): The runner's (``runner.cfg``).

    Returns:
        datetime.timedelta
    """
    timeout = (cfg.get('env_cfg') or {}).get('dist_cfg', {}).get('timeout')
    if timeout is None:
        return default_pg_timeout
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=timeout)
