"""No rank waits in a collective of a train step whose forward raised on
another rank: :class:`ForwardGuard`, and the distributed side of a run set
up (:func:`start_distributed`).

With :class:`~._ranks.Ranks` beside it: the guard's record and the votes it
saves are only sound with the group, its timeout and its failure line; the
guard asks the ranks for each vote and knows nothing of their groups.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch.distributed as dist

from .. import compat
from ._collectives import (COLLECTIVES, collective_outputs,
                           collective_signature, zeros)
from ._ranks import Ranks, run_timeout

# mmnanhook itself, by the name it was imported under: its collectives (the
# votes, the check, the exchange) are neither voted on nor recorded.
_PACKAGE = __name__.split('.')[0] + '.'
# Batch norms that share their statistics: their forward's collectives are
# recorded (a rank that abandons the step answers them) and voted on like
# any other, but are not the train step's own (not counted in ``seen``, not
# answered to a replay, which makes these modules local); their backward's
# need no vote (every rank voted before its backward).
_NORMS = ('torch.nn.modules._functions', 'torch.nn.modules.batchnorm',
          'mmcv.ops.sync_bn')
# Who calls a collective (ForwardGuard._caller).
_OWN, _NORM, _MODEL = 'own', 'norm', 'model'


class ForwardGuard(object):
    """While a train step runs, no rank waits in a collective it calls from
    Python (but mmnanhook's own) for a rank whose forward raised: that rank
    votes so from its handler, and the others stop at a vote
    (:class:`PeerForwardFailed`).

    A vote is a host round trip: one before every collective would cost
    mmdet's DINO 26 a step (a ``reduce_mean`` per loss term and decoder
    layer). The guard votes before the first collective of a step, and
    records each collective the step calls (:func:`collective_signature`, a
    list append): the same model in the same mode calls the same ones every
    step. A rank whose forward raises after that vote first calls the
    others' remaining collectives, up to their next vote, as the last step
    recorded them, with zeros (:meth:`abandon`): they go on with garbage to
    their vote before backward, and stop there. Where that cannot be done,
    the step votes before every collective, as every rank alike: in the
    first step (nothing recorded), from the first collective that is not
    the recorded one at its position or not
    :data:`~._collectives.REPLAYABLE`, after the step's first backward (a
    second optimizer's forward, an update step recomputed: the record is of
    the first forward), and once a forward raised in the step.

    Collectives that no Python call shows are counted alike: the start of
    the DDP wrapper's forward is one entry of the record, every step
    (:meth:`watch`, a forward pre-hook), which may broadcast the module's
    buffers (``broadcast_buffers=True``) and, once, the rebuilt gradient
    buckets (the first forward after the first backward). A rank that
    abandons the step before it makes the same calls; the first entry of a
    step that waits on the other ranks is voted before, whether a Python
    collective or DDP's forward. A rank whose data preprocessor raised thus
    never leaves its peers waiting in DDP's broadcasts.

    The forward's batch norms that share their statistics (torch's and
    mmcv's ``SyncBatchNorm``, the model's own communicating modules) are
    entries of the record as any collective, and the first entry of a step
    may be one of them: a rank stopped on entry to its forward (the input
    check) or anywhere in it answers the others' statistics with zeros up to
    their next vote, and in the first step they vote before each (issue 65:
    before, their collectives were exempt, and the others waited in the
    first for a rank that had stopped). Their backward's collectives are not
    voted on: every rank voted before its backward.

    Args:
        ranks (Ranks): The run's ranks.
        norms (iterable[str]): More modules whose collectives share batch
            statistics (those of the model's own communicating modules).

    Attributes:
        seen (int): Collectives the train steps called: a rank without
            samples could not take part in them.
    """

    def __init__(self, ranks: Ranks, norms: Iterable[str] = ()) -> None:
        self.ranks = ranks
        self.norms = _NORMS + tuple(norms)
        self.active = False
        self.seen = 0
        self._real = {}
        # The signatures of the collectives of the last step whose forward
        # raised on no rank, before its first backward.
        self._record = None
        # This step's so far, how many of them returned, and what each
        # returned (collective_outputs; None for a norm's): a replay of the
        # step is answered with it.
        self._calls = []
        self._done = 0
        self._results = []
        # Whether one of them waited on the other ranks (voted before).
        self._waited = False
        # This step's collectives from this position on are voted before.
        self._voted_from = 0
        # () -> the backwards so far; their count when the step began.
        self._backwards = None
        self._first = 0
        self._raised = False
        # DDP's collectives from C++ (:meth:`watch`): the forward hooks, and
        # how to call the buffers' broadcast again.
        self._hooks = []
        self._hidden = {}
        self._rebuilt = False

    def install(self) -> None:
        """Put the guarded collectives in ``torch.distributed``."""
        for name in COLLECTIVES:
            real = getattr(dist, name, None)
            if real is not None:
                self._real[name] = real
                setattr(dist, name, self._guarded(name, real))

    def watch(self, ddp: Any) -> None:
        """Count the collectives ``ddp`` (a ``DistributedDataParallel``)
        makes from C++ at the start of its forward.

        Args:
            ddp (DistributedDataParallel): The run's model wrapper.
        """
        self._hidden['ddp_forward'] = functools.partial(
            compat.ddp_forward_collectives, ddp)

        @compat.not_traced  # a compiled train_step traces DDP's forward
        def hook(module: Any, inputs: Any) -> None:
            self._ddp_forward(ddp)

        self._hooks.append(ddp.register_forward_pre_hook(hook))

    def remove(self) -> None:
        """Put the real ones back."""
        for name, real in self._real.items():
            setattr(dist, name, real)
        self._real = {}
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hidden = [], {}

    def begin(self, backwards: Callable[[], int]) -> None:
        """A train step starts.

        Args:
            backwards (callable): ``() -> int``: the backwards so far (the
                collectives after the step's first are not recorded).
        """
        self.active = True
        self._backwards, self._first = backwards, backwards()
        self._calls, self._done, self._raised = [], 0, False
        self._results, self._waited = [], False
        record = self._record or []
        self._voted_from = record.index(None) if None in record \
            else len(record)

    def end(self) -> None:
        """The train step ended: what it called is the record, unless a
        forward raised in it."""
        self.active = False
        if not self._raised:
            self._record = self._calls

    def abandon(self, own: bool) -> None:
        """The train step's forward raised, on this rank (``own``: called
        before its vote) or on another. From now on the step votes before
        every collective, and is not recorded. A rank whose own forward
        raised after the step's first vote first calls, with zeros, the
        other ranks' collectives up to their next vote, as the last step
        recorded them.

        Args:
            own (bool): Whether this rank's forward raised.
        """
        remaining = []
        if (own and self._calls and self._done < self._voted_from
                and self._backwards() == self._first):
            end = self._voted_from
            if not self._waited:
                # The others vote before the step's first entry that waits
                # (the entries so far were DDP's forward, which did not):
                # this rank votes with them from its handler.
                end = next((i for i in range(self._done, end)
                            if self._waits(self._record[i])), end)
            remaining = self._record[self._done:end]
        self._raised, self._voted_from = True, 0
        for name, args, kwargs in remaining:
            call = self._real.get(name) or self._hidden[name]
            work = call(*[zeros(a) for a in args], **dict(
                (k, zeros(v)) for k, v in kwargs.items()))
            if work is not None:
                # Recorded with async_op=True: waited for no longer than the
                # run's timeout (env_cfg.dist_cfg.timeout), after which
                # torch raises, as a failed collective of the model would.
                work.wait(timeout=self.ranks.timeout)

    def step_collectives(self) -> List[Tuple[Any, List[Any]]]:
        """The collectives this train step's first forward called so far,
        each with what it returned: ``[(signature, outputs)]``
        (:func:`collective_signature`; :func:`collective_outputs`), for
        replays of the step (:func:`~mmnanhook.diagnosis.local_replays`)."""
        return [(call, outputs) for call, outputs in
                zip(self._calls, self._results) if outputs is not None]

    def communicates(self,
                     modules: Iterable[Tuple[str, Any]]) -> List[str]:
        """What communicates in the model's train step, for
        :func:`~mmnanhook.recovery.drop_decision`: ``modules`` (``(name,
        module)``) and the
        collectives the train steps called."""
        found = ['%s (%s)' % (n, type(m).__name__) for n, m in modules]
        if self.seen:
            found.append('%d collective(s) called in its train steps'
                         % self.seen)
        return found

    def _guarded(self, name, real):
        guard = self

        @compat.not_traced  # called from a compiled forward's losses
        @functools.wraps(real)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if not guard.active:
                return real(*args, **kwargs)
            caller = guard._caller(sys._getframe(1))
            if caller is _OWN:
                return real(*args, **kwargs)
            norm = caller is _NORM
            if not norm:
                guard.seen += 1
            if guard._backwards() != guard._first:
                if not norm:
                    guard.ranks.before_backward()
                return real(*args, **kwargs)
            guard._before(collective_signature(name, args, kwargs))
            result = real(*args, **kwargs)
            guard._done += 1
            guard._results.append(
                None if norm else collective_outputs(name, args, kwargs))
            return result

        return guarded

    def _waits(self, signature):
        """Whether the recorded entry ``signature`` waits on the other ranks
        in this step: every collective, and DDP's forward where it
        broadcasts the buffers or may rebuild its buckets."""
        name, args, _ = signature
        return name != 'ddp_forward' or args[0] or (
            not self._rebuilt and self._backwards() > 0)

    def _ddp_forward(self, ddp):
        """DDP's forward starts: recorded as one collective, every step, so
        that a rank that abandons the step before it makes the same calls
        (:func:`~mmnanhook.compat.ddp_forward_collectives`); voted before
        where one of them waits on the other ranks. Not counted in
        :attr:`seen`: a rank without samples takes part in DDP's forward
        too."""
        if not self.active:
            return
        # The buckets are rebuilt once, by the first forward after a
        # backward (not at all with find_unused_parameters: one vote too
        # many then, once in a run).
        rebuild = not self._rebuilt and self._backwards() > 0
        self._rebuilt = self._rebuilt or rebuild
        buffers = compat.ddp_syncs_buffers(ddp)
        waits = rebuild or buffers
        if self._backwards() != self._first:
            if waits:
                self.ranks.before_backward()
            return
        self._before(('ddp_forward', (buffers, ), {}), waits)
        # Nothing of Python runs between this hook and DDP's broadcasts.
        self._done += 1
        self._results.append([])

    def _before(self, signature, waits=True):
        """Record a collective of the step's first forward; vote before it
        where the ranks must (see the class): ``waits``, whether it waits
        for the other ranks at all (DDP's forward may make none)."""
        position = len(self._calls)
        self._calls.append(signature)
        if (position < self._voted_from
                and signature != self._record[position]):
            # Every rank leaves the record here: they called the collectives
            # before this one together, and recorded the same step.
            self._voted_from = position
        if waits and (not self._waited or position >= self._voted_from):
            self.ranks.before_backward()
        self._waited = self._waited or waits

    def _caller(self, frame):
        """Whose collective it is: :data:`_NORM` (a batch norm's; mmnanhook's
        own stand-in included), :data:`_OWN` (mmnanhook's) or
        :data:`_MODEL`. The first caller outside torch's and mmengine's
        wrappers decides (and outside the not_traced wrapper of guarded
        itself)."""
        while frame is not None:
            name = frame.f_globals.get('__name__', '')
            if not name.startswith(('torch.distributed', 'mmengine.dist',
                                    'torch._dynamo')):
                if name.startswith(self.norms):
                    return _NORM
                return _OWN if name.startswith(_PACKAGE) else _MODEL
            frame = frame.f_back
        return _MODEL


def start_distributed(
    model: Any, find_communicating: Callable[[Any], List[Tuple[str, Any]]],
    cfg: Any
) -> Tuple[Optional[Ranks], Optional[ForwardGuard], List[Tuple[str, Any]]]:
    """The distributed side of a run, set up on every rank in
    ``before_train``: its :class:`Ranks`, the :class:`ForwardGuard` of its
    train steps (installed), and the model's modules that communicate in
    their forward.

    Args:
        model (nn.Module): The unwrapped model.
        find_communicating (callable): ``model -> [(name, module)]``.
        cfg (Config): The runner's: its timeout (:func:`run_timeout`).

    Returns:
        tuple: ``(ranks, guard, modules)``; ``(None, None, [])`` without
        other ranks.
    """
    ranks = Ranks.start(run_timeout(cfg))
    if ranks is None:
        return None, None, []
    modules = find_communicating(model)
    guard = ForwardGuard(ranks, set(type(m).__module__ for _, m in modules))
    guard.install()
    return ranks, guard, modules
