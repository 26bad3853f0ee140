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

One module (over 500 lines) because it is one concern: what keeps the ranks'
collectives paired. The guard's record and the votes it saves are only sound
with the group, its timeout and its failure line beside them; apart, each
half would have to know the other's order of calls.
"""
import collections
import datetime
import functools
import os
import re
import sys
import time

import torch
import torch.distributed as dist
from mmengine.dist import all_gather_object, get_dist_info
from mmengine.logging import MMLogger
from torch.distributed.constants import default_pg_timeout

from .. import compat
from ..errors import PeerForwardFailed, RankTimeoutError
from ..records import RankFinding

# torch.distributed functions that wait on other ranks.
COLLECTIVES = ('all_reduce', 'all_gather', 'all_gather_into_tensor',
               '_all_gather_base', 'reduce_scatter', 'reduce_scatter_tensor',
               '_reduce_scatter_base', 'broadcast', 'reduce', 'all_to_all',
               'all_to_all_single', 'barrier', 'monitored_barrier', 'gather',
               'scatter', 'all_gather_object', 'broadcast_object_list',
               'all_reduce_coalesced')
# The ranks wait at least this long in an exchange for the ranks that
# diagnose: a diagnosis has no time limit of its own, and the replays of a
# large detector under anomaly mode (each fix verified) take minutes.
_DIAGNOSIS_WAIT = datetime.timedelta(hours=2)
# After a collective of ours failed, how long each rank still there waits
# for the others' word before naming those that never gave it. Every rank
# that answered in time fails within one timeout of the first (it entered
# before that one gave up): the wait is that, at most a few seconds.
_ANSWER_WAIT = datetime.timedelta(seconds=10)
# mmnanhook itself, by the name it was imported under.
_PACKAGE = __name__.split('.')[0] + '.'
# Callers whose collectives need no vote: mmnanhook's own (the votes, the
# check, the exchange), and those inside batch norms that share their
# statistics (before the loss: a forward that raises among them is beyond
# any vote).
_EXEMPT = (_PACKAGE, 'torch.nn.modules._functions',
           'torch.nn.modules.batchnorm', 'mmcv.ops.sync_bn')


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

    def __init__(self, rank, world_size, group, own_group=False,
                 timeout=None, exchange_group=None, exchange_timeout=None):
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
    def start(cls, timeout=None):
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
        self._collective('a decision of the ranks', lambda: dist.all_reduce(
            tensor, op=dict(min=dist.ReduceOp.MIN,
                            max=dist.ReduceOp.MAX)[op], group=self.group))
        return tensor.item()

    def vote(self, raised):
        """Every rank says whether its forward raised.

        Returns:
            list[int]: The ranks whose forward raised.
        """
        flags = torch.zeros(self.world_size)
        flags[self.rank] = float(bool(raised))
        self._collective('the vote before backward', lambda: dist.all_reduce(
            flags, group=self.group))
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
        return [RankFinding.from_dict(f) for f in self._collective(
            'the exchange of findings', lambda: all_gather_object(
                finding.to_dict(), group=self.exchange_group), True)]

    def close(self):
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


def run_timeout(cfg):
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


# Collectives a rank can call again from their record, with zeros of their
# tensors' shapes (ForwardGuard): all that mmdet's reduce_mean and
# all_reduce_dict and mmengine.dist's tensor helpers call.
REPLAYABLE = frozenset(('all_reduce', 'all_gather', 'all_gather_into_tensor',
                        '_all_gather_base', 'broadcast', 'barrier'))

# A tensor argument of a recorded collective: called again as zeros.
_Zeros = collections.namedtuple('_Zeros', 'shape dtype device')


def collective_signature(name, args, kwargs):
    """What calls the collective ``name`` again with zeros for its tensors
    (no tensor kept); ``None`` for one not :data:`REPLAYABLE`."""
    if name not in REPLAYABLE:
        return None
    return name, tuple(_spec(a) for a in args), dict(
        (k, _spec(v)) for k, v in kwargs.items())


def _spec(value):
    if isinstance(value, torch.Tensor):
        return _Zeros(tuple(value.shape), value.dtype, value.device)
    if isinstance(value, list):
        # all_gather's tensors.
        return [_spec(v) for v in value]
    return value


# The argument a collective writes its result into: position, keyword.
_OUTPUT = dict(all_reduce=(0, 'tensor'), broadcast=(0, 'tensor'),
               all_gather=(0, 'tensor_list'),
               all_gather_into_tensor=(0, 'output_tensor'),
               _all_gather_base=(0, 'output_tensor'))


def collective_outputs(name, args, kwargs):
    """What a collective wrote: ``[(tensor, its version)]``, by reference (a
    version that moved on means the caller wrote it since: no longer the
    answer; no copy, no kernel), or ``[(copy, None)]`` for a broadcast.

    A broadcast is kept as a copy: its value is rank ``src``'s alone (no
    rank can make it up), it is rare (a preprocessor's every tenth
    iteration), and its callers copy the result over itself (mmengine's
    ``broadcast`` on the tensor's own device), which moves the version on.
    """
    where = _OUTPUT.get(name)
    if where is None:
        return []
    position, keyword = where
    value = args[position] if len(args) > position else kwargs.get(keyword)
    tensors = value if isinstance(value, list) else [value]
    if name == 'broadcast':
        return [(t.detach().clone(), None) for t in tensors
                if isinstance(t, torch.Tensor)]
    return [(t, t._version) for t in tensors
            if isinstance(t, torch.Tensor)]


def _zeros(spec):
    if isinstance(spec, _Zeros):
        return torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
    if isinstance(spec, list):
        return [_zeros(s) for s in spec]
    return spec


class ForwardGuard(object):
    """While a train step runs, no rank waits in a collective it calls from
    Python (but mmnanhook's own, and those of batch norms that share
    statistics) for a rank whose forward raised: that rank votes so from
    its handler, and the others stop at a vote (:class:`PeerForwardFailed`).

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
    the recorded one at its position or not :data:`REPLAYABLE`, after the
    step's first backward (a second optimizer's forward, an update step
    recomputed: the record is of the first forward), and once a forward
    raised in the step.

    Collectives that no Python call shows are counted alike: the start of
    the DDP wrapper's forward is one entry of the record, every step
    (:meth:`watch`, a forward pre-hook), which may broadcast the module's
    buffers (``broadcast_buffers=True``) and, once, the rebuilt gradient
    buckets (the first forward after the first backward). A rank that
    abandons the step before it makes the same calls; the first entry of a
    step that waits on the other ranks is voted before, whether a Python
    collective or DDP's forward. A rank whose data preprocessor raised thus
    never leaves its peers waiting in DDP's broadcasts.

    Args:
        ranks (Ranks): The run's ranks.
        exempt (iterable[str]): More modules whose collectives need no vote
            (those of the model's own communicating modules).

    Attributes:
        seen (int): Collectives the train steps called: a rank without
            samples could not take part in them.
    """

    def __init__(self, ranks, exempt=()):
        self.ranks = ranks
        self.exempt = _EXEMPT + tuple(exempt)
        self.active = False
        self.seen = 0
        self._real = {}
        # The signatures of the collectives of the last step whose forward
        # raised on no rank, before its first backward.
        self._record = None
        # This step's so far, how many of them returned, and what each
        # returned (collective_outputs): a replay of the step is answered
        # with it.
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

    def install(self):
        """Put the guarded collectives in ``torch.distributed``."""
        for name in COLLECTIVES:
            real = getattr(dist, name, None)
            if real is not None:
                self._real[name] = real
                setattr(dist, name, self._guarded(name, real))

    def watch(self, ddp):
        """Count the collectives ``ddp`` (a ``DistributedDataParallel``)
        makes from C++ at the start of its forward.

        Args:
            ddp (DistributedDataParallel): The run's model wrapper.
        """
        self._hidden['ddp_forward'] = functools.partial(
            compat.ddp_forward_collectives, ddp)

        @compat.not_traced  # a compiled train_step traces DDP's forward
        def hook(module, inputs):
            self._ddp_forward(ddp)

        self._hooks.append(ddp.register_forward_pre_hook(hook))

    def remove(self):
        """Put the real ones back."""
        for name, real in self._real.items():
            setattr(dist, name, real)
        self._real = {}
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hidden = [], {}

    def begin(self, backwards):
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

    def end(self):
        """The train step ended: what it called is the record, unless a
        forward raised in it."""
        self.active = False
        if not self._raised:
            self._record = self._calls

    def abandon(self, own):
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
            work = call(*[_zeros(a) for a in args], **dict(
                (k, _zeros(v)) for k, v in kwargs.items()))
            if work is not None:
                # Recorded with async_op=True. Bounded as the call itself:
                # a work of the model's group fails at that group's timeout
                # (docs/how-it-works.md, the waits).
                work.wait()

    def step_collectives(self):
        """The collectives this train step's first forward called so far,
        each with what it returned: ``[(signature, outputs)]``
        (:func:`collective_signature`; :func:`collective_outputs`), for
        replays of the step (:func:`~mmnanhook.diagnosis.local_replays`)."""
        return list(zip(self._calls, self._results))

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

    def _guarded(self, name, real):
        guard = self

        @compat.not_traced  # called from a compiled forward's losses
        @functools.wraps(real)
        def guarded(*args, **kwargs):
            if not guard.active or guard._exempt(sys._getframe(1)):
                return real(*args, **kwargs)
            guard.seen += 1
            if guard._backwards() != guard._first:
                guard.ranks.before_backward()
                return real(*args, **kwargs)
            guard._before(collective_signature(name, args, kwargs))
            result = real(*args, **kwargs)
            guard._done += 1
            guard._results.append(collective_outputs(name, args, kwargs))
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

    def _exempt(self, frame):
        # The first caller outside torch's and mmengine's wrappers decides
        # (and outside the not_traced wrapper of guarded itself).
        while frame is not None:
            name = frame.f_globals.get('__name__', '')
            if not name.startswith(('torch.distributed', 'mmengine.dist',
                                    'torch._dynamo')):
                return name.startswith(self.exempt)
            frame = frame.f_back
        return False


def start_distributed(model, find_communicating, cfg):
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
