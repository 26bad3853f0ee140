"""Snapshots of a good training state, and going back to one (``'rewind'``).

Every ``interval`` iterations, after an update step that neither triggered
nor spiked, the model's parameters and buffers, each optimizer's state and
each loss scaler's state are copied to ``device`` (the CPU by default); the
newest ``keep`` stay. A rewind copies one back in place: the model's own
tensors keep their identity, the optimizers keep their current param groups
(learning rates and momenta as the schedulers set them), so the schedules
run on as if nothing happened.

At scale a full copy per rank does not fit a node (a 220M-parameter model
with AdamW: 2.6 GB per rank, 8 ranks a node), and copying it stalls the
training thread. So:

* Under DDP every rank holds the same parameters and optimizer state: each
  rank copies only its share of them (:class:`_Partition`, by parameter,
  balanced by size), and a rewind broadcasts each share from its holder.
  Buffers (BN statistics need not agree across ranks) and loss scalers are
  small and copied whole on every rank.
* The parameters and the optimizer state change only at the next optimizer
  step: they are copied (and their norms taken) in a background thread while
  the next forward and backward run, and the copy is waited for before that
  step (:meth:`SnapshotStore.settle`). Buffers change in the next forward:
  they are copied at once.
"""
from __future__ import annotations

import collections
import copy
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist


# Seconds the training thread waits for a snapshot's copy before the next
# optimizer step: the copy of a 550 MB state takes 0.1-0.3 s here; one not
# done by then (a thread stuck, memory swapping) is given up on, and the
# step goes on.
SETTLE_WITHIN = 120.0


def _to(obj, device):
    """A deep copy of ``obj`` with every tensor detached and moved."""
    if torch.is_tensor(obj):
        return obj.detach().to(device, copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _to(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return copy.deepcopy(obj)


class _Held(object):
    """A tensor of a snapshot that another rank holds: what it is like."""

    __slots__ = ('owner', 'shape', 'dtype')

    def __init__(self, owner: int, tensor: torch.Tensor) -> None:
        self.owner = owner
        self.shape = tensor.shape
        self.dtype = tensor.dtype


class _Partition(object):
    """Which rank holds which parameter's copies (with its optimizer
    state): the same on every rank.

    Args:
        model (nn.Module): The model (unwrapped).
        rank (int): This rank.
        world_size (int): The ranks sharing the snapshots (1: no sharing).
    """

    def __init__(self, model: torch.nn.Module, rank: int = 0,
                 world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        loads = [0] * world_size
        self.by_name, self.by_param = {}, {}
        named = list(model.named_parameters())
        # Largest first, each to the least loaded rank: within one
        # parameter of an even split.
        for i in sorted(range(len(named)), key=lambda i: (
                -named[i][1].numel() * named[i][1].element_size(), i)):
            name, param = named[i]
            owner = loads.index(min(loads))
            loads[owner] += param.numel() * param.element_size()
            self.by_name[name] = owner
            self.by_param[id(param)] = owner

    @property
    def shared(self) -> bool:
        return self.world_size > 1

    def owner_of(self, name: str) -> Optional[int]:
        """The rank holding state dict entry ``name``; ``None``: every rank
        holds it (a buffer)."""
        return self.by_name.get(name) if self.shared else None

    def param_owners(self, optimizer: torch.optim.Optimizer
                     ) -> List[int]:
        """The rank holding each of ``optimizer``'s state entries, by its
        index in the optimizer's state dict."""
        params = [p for group in optimizer.param_groups
                  for p in group['params']]
        return [self.by_param.get(id(p), i % self.world_size)
                for i, p in enumerate(params)]


class Snapshot(object):
    """One saved training state.

    Attributes:
        iter (int): The iteration after whose update step it was taken.
        model (dict): The model's state dict (parameters and buffers);
            shared: this rank's parameters and every buffer.
        optimizers (list[dict]): Each optimizer's ``state`` (no groups);
            shared: entries another rank holds are :class:`_Held`.
        scalers (list[dict | None]): Each loss scaler's state dict.
        norms (dict): Parameter name -> its norm, for the divergence report.
    """

    def __init__(self, iter: int, model: Dict[str, Any],
                 optimizers: List[Dict[Any, Any]],
                 scalers: List[Optional[Dict[str, Any]]],
                 norms: Optional[Dict[str, float]]) -> None:
        self.iter = iter
        self.model = model
        self.optimizers = optimizers
        self.scalers = scalers
        self.norms = norms


def param_norms(model: torch.nn.Module) -> Dict[str, float]:
    """Parameter name -> float norm (a host sync per call: the failure path,
    and a snapshot's background copy)."""
    with torch.no_grad():
        named = [(n, p) for n, p in model.named_parameters()
                 if p.is_floating_point() and p.numel()]
        if not named:
            return {}
        values = torch.stack([p.detach().float().norm().to(named[0][1].device)
                              for _, p in named]).tolist()
    return dict((n, v) for (n, _), v in zip(named, values))


class SnapshotStore(object):
    """The last ``keep`` good snapshots, one every ``interval`` iterations.

    Args:
        interval (int): Iterations between snapshots.
        keep (int): How many to keep.
        device (str | torch.device): Where the copies live.
    """

    def __init__(self, interval: int = 50, keep: int = 2,
                 device: Union[str, torch.device] = 'cpu') -> None:
        self.interval = interval
        self.device = torch.device(device)
        self.partition = None
        self.group = None
        self._snapshots = collections.deque(maxlen=keep)
        self._copying = None
        # Why the last snapshot was not kept (until its owner says it).
        self.failed = None

    def __len__(self):
        return len(self._snapshots)

    def share(self, partition: _Partition, group: Any = None) -> None:
        """Hold only this rank's share of what every rank holds alike.

        Args:
            partition (_Partition): Who holds what.
            group: The process group a rewind broadcasts the shares in.
        """
        self.partition = partition
        self.group = group

    def due(self, iter: int) -> bool:
        """Whether the good update step of ``iter`` is to be saved."""
        return (iter + 1) % self.interval == 0 or not self._snapshots

    def take(self, iter: int, model: torch.nn.Module,
             wrappers: List[Any]) -> None:
        """Save the state after the update step of ``iter``; the parameters
        and optimizer states are copied in the background (until
        :meth:`settle`)."""
        self.settle()
        if len(self._snapshots) == self._snapshots.maxlen:
            # Before the new copy is made: one snapshot less at the peak.
            self._snapshots.popleft()
        partition = self.partition or _Partition(model)
        params = dict(model.named_parameters())
        state = model.state_dict()
        snapshot = Snapshot(iter, {}, [], [], None)
        later = []
        for name, tensor in state.items():
            owner = partition.owner_of(name)
            if owner is None and name not in params:
                snapshot.model[name] = _to(tensor, self.device)
            elif owner is None or owner == partition.rank:
                later.append((snapshot.model, name, tensor))
        for wrapper in wrappers:
            entries = wrapper.optimizer.state_dict()['state']
            owners = partition.param_owners(wrapper.optimizer) \
                if partition.shared else None
            kept = {}
            for index, entry in entries.items():
                owner = owners[index] if owners is not None else None
                if owner is None or owner == partition.rank:
                    later.append((kept, index, entry))
                else:
                    kept[index] = dict(
                        (k, _Held(owner, v) if torch.is_tensor(v) else
                         copy.deepcopy(v)) for k, v in entry.items())
            snapshot.optimizers.append(kept)
        snapshot.scalers = [_to(s, self.device) if s is not None else None
                            for s in map(_scaler_state, wrappers)]
        self._snapshots.append(snapshot)
        # What went wrong, said by the thread (a list: a thread that is
        # given up on writes to one nobody reads any more).
        errors = []
        thread = threading.Thread(
            target=self._copy, args=(snapshot, later, model, errors),
            name='mmnanhook-snapshot', daemon=True)
        thread.start()
        self._copying = thread, snapshot, errors

    def _copy(self, snapshot, later, model, errors):
        try:
            for target, key, value in later:
                target[key] = _to(value, self.device)
            snapshot.norms = param_norms(model)
        except Exception as error:  # noqa: BLE001 - said by settle()
            errors.append('%s: %s' % (type(error).__name__, error))
            snapshot.norms = None

    def settle(self) -> None:
        """Wait for the copy of the newest snapshot: before anything
        changes what it copies (the next optimizer step), or uses it; at
        most :data:`SETTLE_WITHIN` seconds. A copy that failed, or is not
        done by then, is forgotten (:attr:`failed` says why)."""
        if self._copying is None:
            return
        thread, snapshot, errors = self._copying
        self._copying = None
        thread.join(SETTLE_WITHIN)
        if thread.is_alive():
            # Left to end in the background, on a snapshot nothing holds.
            errors = ['its copy was not done after %g s' % SETTLE_WITHIN]
        if errors:
            self.failed = 'the snapshot after iter %d is not kept: %s' % (
                snapshot.iter, errors[0])
            self._snapshots.remove(snapshot)

    def before(self, iter: int) -> Optional[Snapshot]:
        """The newest snapshot taken before iteration ``iter``, or ``None``."""
        self.settle()
        for snapshot in reversed(self._snapshots):
            if snapshot.iter < iter:
                return snapshot
        return None

    def at(self, iter: int) -> Snapshot:
        """The snapshot of iteration ``iter``."""
        return next(s for s in self._snapshots if s.iter == iter)

    def drop_after(self, iter: int) -> None:
        """Forget the snapshots of iterations ``>= iter`` (they may hold the
        divergence)."""
        self.settle()
        while self._snapshots and self._snapshots[-1].iter >= iter:
            self._snapshots.pop()

    def restore(self, snapshot: Snapshot, model: torch.nn.Module,
                wrappers: List[Any]) -> None:
        """Copy ``snapshot`` back into ``model`` and the optimizers, in place
        (shared: on every rank at once, each share broadcast by its
        holder).

        Each optimizer keeps its current param groups: their learning rates
        are what the schedulers set for now.
        """
        self.settle()
        partition = self.partition
        if partition is None or not partition.shared:
            model.load_state_dict(snapshot.model)
        else:
            live = model.state_dict()
            with torch.no_grad():
                for name, tensor in live.items():
                    owner = partition.owner_of(name)
                    if owner is not None:
                        tensor.copy_(self._receive(
                            snapshot.model.get(name), owner, tensor))
            model.load_state_dict(dict(
                (k, v) for k, v in snapshot.model.items()
                if partition.owner_of(k) is None), strict=False)
        for wrapper, state, scaler in zip(wrappers, snapshot.optimizers,
                                          snapshot.scalers):
            current = wrapper.optimizer.state_dict()
            # In one order on every rank: the broadcasts pair up.
            current['state'] = dict(
                (index, dict((k, self._value(v))
                             for k, v in state[index].items()))
                for index in sorted(state))
            wrapper.optimizer.load_state_dict(current)
            if scaler is not None:
                wrapper.loss_scaler.load_state_dict(copy.deepcopy(scaler))

    def _value(self, value):
        """A snapshot's optimizer state value as it goes back."""
        if isinstance(value, _Held):
            return self._receive(None, value.owner, value)
        if torch.is_tensor(value) and self.partition is not None and \
                self.partition.shared:
            return self._receive(value, self.partition.rank, value)
        return copy.deepcopy(value)

    def _receive(self, held, owner, like):
        """``held`` from its holder ``owner``, broadcast to every rank."""
        if owner == self.partition.rank:
            buffer = held.to('cpu', copy=True)
        else:
            buffer = torch.empty(like.shape, dtype=like.dtype)
        dist.broadcast(buffer, owner, group=self.group)
        return buffer


def _scaler_state(wrapper):
    scaler = getattr(wrapper, 'loss_scaler', None)
    if scaler is None or not hasattr(scaler, 'state_dict'):
        return None
    return scaler.state_dict()


class Rewinder(object):
    """``policy='rewind'``: when to save, going back, the LR cooldown.

    The steps after a rewind, at the lowered LR, are the test of that fix:
    the log says whether the cooldown's steps stayed clean (verified) or a
    new rewind came first (refuted).

    Args:
        options (RewindOptions): Snapshot interval and device, how many,
            the LR factor, the cooldown, the consecutive-rewind limit.
        log (callable, optional): ``(level, message)``: where the outcome of
            each rewind goes.
    """

    def __init__(self, options: Any,
                 log: Optional[Callable[[int, str], Any]] = None) -> None:
        self.options = options
        self.log = log or (lambda level, message: None)
        self.store = SnapshotStore(options.snapshot_interval,
                                   options.max_snapshots,
                                   options.snapshot_device)
        self.rewinds = 0
        self.consecutive = 0
        self.cooldown_left = 0
        self.factor = 1.0

    def start(self, model: torch.nn.Module, wrappers: List[Any],
              ranks: Optional[Any] = None) -> None:
        """Save the state training starts from (iteration -1).

        Args:
            ranks (Ranks, optional): The ranks of a DDP run (every rank
                holds the same parameters): each holds its share of the
                snapshots.
        """
        if ranks is not None:
            self.store.share(_Partition(model, ranks.rank, ranks.world_size),
                             ranks.group)
        self.store.take(-1, model, wrappers)

    def after_update(self, iter: int, clean: bool, model: torch.nn.Module,
                     wrappers: List[Any], sentinels: List[Any]) -> None:
        """After the update step of ``iter``: count the cooldown down and
        save a snapshot when one is due.

        Args:
            clean (bool): The step neither triggered nor spiked.
        """
        # The copy was waited for before this step (HookRun.on_step).
        if self.store.failed is not None:
            self.log(logging.WARNING, 'mmnanhook: ' + self.store.failed)
            self.store.failed = None
        if not clean:
            return
        if self.cooldown_left:
            self.cooldown_left -= 1
            if not self.cooldown_left:
                self.log(logging.INFO, (
                    'mmnanhook: verified: the LR x %g after the last rewind '
                    'held for %d clean update steps (up to iter %d); back '
                    'to the scheduled LR' % (self.factor,
                                             self.options.cooldown, iter)))
                # Cooled down: the scheduled LR again, a fresh budget.
                self.consecutive = 0
                self.factor = 1.0
                for sentinel in sentinels:
                    sentinel.lr_factor = None
        if self.store.due(iter):
            self.store.take(iter, model, wrappers)

    def target(self, since: int, ranks: Optional[Any] = None
               ) -> Tuple[Optional[Snapshot], Optional[str]]:
        """The snapshot a rewind from a divergence that began at ``since``
        would go back to: the newest taken before it.

        Args:
            since (int): The first iteration of the divergence.
            ranks (Ranks, optional): Under DDP: every rank goes back before
                the earliest ``since`` of all, to the same snapshot.

        Returns:
            tuple: ``(snapshot, None)``, or ``(None, reason)`` when there is
            none to go back to.
        """
        if ranks is not None:
            since = int(ranks.reduce(since, 'min'))
        snapshot = self.store.before(since)
        if ranks is not None:
            # A copy that failed on one rank only: its shares are missing.
            held = snapshot.iter if snapshot is not None else -2
            if ranks.reduce(held, 'min') != ranks.reduce(held, 'max'):
                return None, ('the ranks do not hold the same snapshot '
                              'before iteration %s (a copy failed on one; '
                              'see its log)' % (since, ))
        if snapshot is None:
            return None, ('no snapshot older than iteration %s to rewind to'
                          % (since, ))
        return snapshot, None

    def go_back(self, iter: int, model: torch.nn.Module,
                wrappers: List[Any], sentinels: List[Any]) -> int:
        """Go back to the snapshot of iteration ``iter`` (:meth:`target`'s)
        and lower the LR (``train/rewinds`` counted, the log told).

        Args:
            iter (int): The snapshot's iteration.
            model (nn.Module): The model.
            wrappers (list[OptimWrapper]): Its optim wrappers.
            sentinels (list): Their sentinels (the LR factor they apply).

        Returns:
            int: ``iter``.
        """
        snapshot = self.store.at(iter)
        if self.cooldown_left:
            self.log(logging.WARNING, (
                'mmnanhook: refuted: the LR x %g after the last rewind did '
                'not hold (%d of its %d update steps left); going back again'
                % (self.factor, self.cooldown_left, self.options.cooldown)))
        self.store.restore(snapshot, model, wrappers)
        self.store.drop_after(snapshot.iter + 1)
        self.consecutive += 1
        self.rewinds += 1
        self.factor *= self.options.lr_factor
        self.cooldown_left = self.options.cooldown
        for sentinel in sentinels:
            sentinel.lr_factor = self.factor if self.cooldown_left else None
        sentinels[0].hub.update_scalar('train/rewinds', self.rewinds)
        self.log(logging.WARNING, (
            'mmnanhook: rewound to the state %s; LR x %g for %d update '
            'steps' % ('after iter %d' % snapshot.iter if snapshot.iter >= 0
                       else 'training started from', self.factor,
                       self.options.cooldown)))
        return snapshot.iter
