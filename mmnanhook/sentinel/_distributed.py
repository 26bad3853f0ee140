"""One decision on every rank: the votes and exchanges of a DDP run.

Under DDP every rank must issue the same collectives in the same order, or a
rank waits alone (a hang) or its peers' next collectives do not match (a
crash). The update step's check already decides alike on every rank (its
flags are all-reduced); what it cannot see is a forward that raised, and what
each rank's own diagnosis found. :class:`Ranks` carries both:

* :meth:`Ranks.vote`, after every forward and before its backward: whether
  any rank's forward raised. A rank whose forward went fine learns it there
  (:class:`PeerForwardFailed`) instead of waiting in DDP's gradient
  all-reduce for a rank that never comes. :class:`ForwardGuard` votes so
  before every collective a train step calls from Python as well (mmdet's
  ``reduce_mean`` of a loss normalizer comes after its assigner, which may
  raise on one rank): a rank stops at the first collective the raising rank
  never reaches.
* :meth:`Ranks.exchange`, once per trigger every rank saw, after the ranks
  that triggered replayed their batch alone: each rank's
  :class:`~mmnanhook.records.RankFinding` gathered on every rank, from which
  each takes the same decision
  (:func:`~mmnanhook.recovery.drop_decision`), names the culprit in its
  bundle and quarantines the union.

Votes and exchanges travel in a gloo group of their own (under NCCL too, so
that a vote is a host round trip, not a device sync; never paired with a
collective of the model's), with a timeout long enough for a diagnosis.
"""
import datetime
import functools
import os
import sys

import torch
import torch.distributed as dist
from mmengine.dist import all_gather_object, get_dist_info

from ..errors import PeerForwardFailed
from ..records import RankFinding
from ..recovery import drop_decision

# torch.distributed functions that wait on other ranks.
COLLECTIVES = ('all_reduce', 'all_gather', 'all_gather_into_tensor',
               '_all_gather_base', 'reduce_scatter', 'reduce_scatter_tensor',
               '_reduce_scatter_base', 'broadcast', 'reduce', 'all_to_all',
               'all_to_all_single', 'barrier', 'monitored_barrier', 'gather',
               'scatter', 'all_gather_object', 'broadcast_object_list',
               'all_reduce_coalesced')
# The ranks wait this long in an exchange for the ranks that diagnose.
_TIMEOUT = datetime.timedelta(hours=2)
# mmnanhook itself, by the name it was imported under.
_PACKAGE = __name__.split('.')[0] + '.'
# Callers whose collectives need no vote: mmnanhook's own (the votes, the
# check, the exchange), and those inside batch norms that share their
# statistics (before the loss: a forward that raises among them is beyond
# any vote).
_EXEMPT = (_PACKAGE, 'torch.nn.modules._functions',
           'torch.nn.modules.batchnorm', 'mmcv.ops.sync_bn')


class Ranks(object):
    """The ranks of a distributed run, and the group they decide in.

    Args:
        rank (int): This rank.
        world_size (int): The ranks.
        group: The gloo process group (``dist.group.WORLD``: the default
            one; torch 1.7 refuses ``None``).
        own_group (bool): Whether :meth:`close` destroys ``group``.
    """

    def __init__(self, rank, world_size, group, own_group=False):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self._own_group = own_group

    @classmethod
    def start(cls):
        """The run's :class:`Ranks`, or ``None`` without other ranks.

        Called on every rank at the same point (``before_train``): creating
        a group is itself a collective.
        """
        rank, world_size = get_dist_info()
        if world_size < 2:
            return None
        return cls(rank, world_size,
                   dist.new_group(backend='gloo', timeout=_TIMEOUT), True)

    @property
    def writes(self):
        """Whether this rank writes the run's shared files: the first rank
        of each node, which may not share the work dir (torch's launchers
        and mmengine's slurm start set ``LOCAL_RANK``)."""
        local = os.environ.get('LOCAL_RANK')
        return int(local) == 0 if local is not None else self.rank == 0

    def reduce(self, value, op):
        """``value`` (a number) reduced over the ranks by ``op``
        (``'min'``/``'max'``): a decision every rank takes alike (failure
        path)."""
        tensor = torch.tensor([float(value)])
        dist.all_reduce(tensor, op=dict(min=dist.ReduceOp.MIN,
                                        max=dist.ReduceOp.MAX)[op],
                        group=self.group)
        return tensor.item()

    def vote(self, raised):
        """Every rank says whether its forward raised.

        Returns:
            list[int]: The ranks whose forward raised.
        """
        flags = torch.zeros(self.world_size)
        flags[self.rank] = float(bool(raised))
        dist.all_reduce(flags, group=self.group)
        return [r for r, flag in enumerate(flags.tolist()) if flag > 0]

    def before_backward(self):
        """Vote for a forward that went fine.

        Raises:
            PeerForwardFailed: Another rank's forward raised.
        """
        failed = self.vote(False)
        if failed:
            raise PeerForwardFailed(failed)

    def exchange(self, finding):
        """Gather every rank's finding.

        Args:
            finding (RankFinding): This rank's.

        Returns:
            list[RankFinding]: Every rank's, by rank.
        """
        return [RankFinding.from_dict(f) for f in all_gather_object(
            finding.to_dict(), group=self.group)]

    def close(self):
        """Give back the group of its own (local: no collective)."""
        if self._own_group:
            dist.destroy_process_group(self.group)
        self._own_group = False


class ForwardGuard(object):
    """While a train step runs, every collective it calls from Python (but
    mmnanhook's own, and those of batch norms that share statistics) waits
    for the ranks' vote first: a rank whose forward raised before it votes so
    from its handler, and the others stop there (:class:`PeerForwardFailed`)
    instead of waiting for it in that collective.

    Args:
        ranks (Ranks): The run's ranks.
        exempt (iterable[str]): More modules whose collectives need no vote
            (those of the model's own communicating modules).

    Attributes:
        seen (int): Collectives the train steps called (and voted before):
            a rank without samples could not take part in them.
    """

    def __init__(self, ranks, exempt=()):
        self.ranks = ranks
        self.exempt = _EXEMPT + tuple(exempt)
        self.active = False
        self.seen = 0
        self._real = {}

    def install(self):
        """Put the guarded collectives in ``torch.distributed``."""
        for name in COLLECTIVES:
            real = getattr(dist, name, None)
            if real is not None:
                self._real[name] = real
                setattr(dist, name, self._guarded(real))

    def remove(self):
        """Put the real ones back."""
        for name, real in self._real.items():
            setattr(dist, name, real)
        self._real = {}

    def communicates(self, modules):
        """What communicates in the model's train step, for
        :func:`~mmnanhook.recovery.drop_decision`: ``modules`` (``(name,
        module)``) and the
        collectives the train steps called."""
        found = ['%s (%s)' % (n, type(m).__name__) for n, m in modules]
        if self.seen:
            found.append('%d collective(s) called in its train steps'
                         % self.seen)
        return found

    def _guarded(self, real):
        guard = self

        @functools.wraps(real)
        def guarded(*args, **kwargs):
            if guard.active and not guard._exempt(sys._getframe(1)):
                guard.seen += 1
                guard.ranks.before_backward()
            return real(*args, **kwargs)

        return guarded

    def _exempt(self, frame):
        # The first caller outside torch's and mmengine's wrappers decides.
        while frame is not None:
            name = frame.f_globals.get('__name__', '')
            if not name.startswith(('torch.distributed', 'mmengine.dist')):
                return name.startswith(self.exempt)
            frame = frame.f_back
        return False


def start_distributed(model, find_communicating):
    """The distributed side of a run, set up on every rank in
    ``before_train``: its :class:`Ranks`, the :class:`ForwardGuard` of its
    train steps (installed), and the model's modules that communicate in
    their forward.

    Args:
        model (nn.Module): The unwrapped model.
        find_communicating (callable): ``model -> [(name, module)]``.

    Returns:
        tuple: ``(ranks, guard, modules)``; ``(None, None, [])`` without
        other ranks.
    """
    ranks = Ranks.start()
    if ranks is None:
        return None, None, []
    modules = find_communicating(model)
    guard = ForwardGuard(ranks, set(type(m).__module__ for _, m in modules))
    guard.install()
    return ranks, guard, modules


class Exchange(object):
    """The exchange of one trigger: :meth:`Ranks.exchange` at most once,
    wherever this rank reaches it first (inside its diagnosis, or after it
    on a rank that did not diagnose).

    Args:
        ranks (Ranks): The run's ranks.
    """

    def __init__(self, ranks):
        self.ranks = ranks
        self.findings = None

    def __call__(self, finding):
        if self.findings is None:
            self.findings = self.ranks.exchange(finding)
        return self.findings


def plan_drop(dropper, event, steps, undo, findings, ranks, communicates,
              can_zero, logger):
    """This rank's part of the drop every rank takes
    (:func:`~mmnanhook.recovery.drop_decision`), once every rank could
    prepare its own (else every rank skips).

    Args:
        dropper (Dropper): Prepares this rank's part.
        event (NonFiniteEvent): The trigger.
        steps (list[tuple]): The micro-steps kept since the last update.
        undo (callable): Puts back what the failing forward wrote.
        findings (list[RankFinding]): Every rank's.
        ranks (Ranks): The run's ranks.
        communicates (list[str]): What communicates in the train step.
        can_zero (bool): Whether the model is wrapped in DDP.
        logger (logging.Logger): Where a failure to prepare is said.

    Returns:
        DropPlan | None: ``None``: every rank skips.
    """
    decision = drop_decision(findings, event.world_size, communicates,
                             can_zero)
    if decision.reason is not None:
        # None on every rank: it says why.
        return dropper.plan(event, None, steps, undo, decision)
    try:
        mine = dropper.plan(event, None, steps, undo, decision)
    except Exception:  # noqa: BLE001 - every rank must learn it
        logger.exception("mmnanhook: policy 'drop': this rank's part "
                         'could not be prepared')
        mine = None
    if not ranks.reduce(mine is not None, 'min'):
        logger.warning("mmnanhook: policy 'drop': a rank could not prepare "
                       'its part of the step: every rank skips it')
        return None
    return mine
