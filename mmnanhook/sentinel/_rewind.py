"""Snapshots of a good training state, and going back to one (``'rewind'``).

Every ``interval`` iterations, after an update step that neither triggered
nor spiked, the model's parameters and buffers, each optimizer's state and
each loss scaler's state are copied to ``device`` (the CPU by default); the
newest ``keep`` stay. A rewind copies one back in place: the model's own
tensors keep their identity, the optimizers keep their current param groups
(learning rates and momenta as the schedulers set them), so the schedules
run on as if nothing happened.
"""
import collections
import copy
import logging

import torch


def _to(obj, device):
    """A deep copy of ``obj`` with every tensor detached and moved."""
    if torch.is_tensor(obj):
        return obj.detach().to(device, copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _to(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return copy.deepcopy(obj)


class Snapshot(object):
    """One saved training state.

    Attributes:
        iter (int): The iteration after whose update step it was taken.
        model (dict): The model's state dict (parameters and buffers).
        optimizers (list[dict]): Each optimizer's ``state`` (no groups).
        scalers (list[dict | None]): Each loss scaler's state dict.
        norms (dict): Parameter name -> its norm, for the divergence report.
    """

    def __init__(self, iter, model, optimizers, scalers, norms):
        self.iter = iter
        self.model = model
        self.optimizers = optimizers
        self.scalers = scalers
        self.norms = norms


def param_norms(model):
    """Parameter name -> float norm (a host sync per call: rare paths only)."""
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

    def __init__(self, interval=50, keep=2, device='cpu'):
        self.interval = interval
        self.device = torch.device(device)
        self._snapshots = collections.deque(maxlen=keep)

    def __len__(self):
        return len(self._snapshots)

    def due(self, iter):
        """Whether the good update step of ``iter`` is to be saved."""
        return (iter + 1) % self.interval == 0 or not self._snapshots

    def take(self, iter, model, wrappers):
        """Save the state after the update step of ``iter``."""
        optimizers = [_to(w.optimizer.state_dict()['state'], self.device)
                      for w in wrappers]
        scalers = [_scaler_state(w) for w in wrappers]
        self._snapshots.append(Snapshot(
            iter, _to(model.state_dict(), self.device), optimizers,
            [_to(s, self.device) if s is not None else None
             for s in scalers], param_norms(model)))

    def before(self, iter):
        """The newest snapshot taken before iteration ``iter``, or ``None``."""
        for snapshot in reversed(self._snapshots):
            if snapshot.iter < iter:
                return snapshot
        return None

    def drop_after(self, iter):
        """Forget the snapshots of iterations ``>= iter`` (they may hold the
        divergence)."""
        while self._snapshots and self._snapshots[-1].iter >= iter:
            self._snapshots.pop()

    @staticmethod
    def restore(snapshot, model, wrappers):
        """Copy ``snapshot`` back into ``model`` and the optimizers, in place.

        Each optimizer keeps its current param groups: their learning rates
        are what the schedulers set for now.
        """
        model.load_state_dict(snapshot.model)
        for wrapper, state, scaler in zip(wrappers, snapshot.optimizers,
                                          snapshot.scalers):
            current = wrapper.optimizer.state_dict()
            current['state'] = copy.deepcopy(state)
            wrapper.optimizer.load_state_dict(current)
            if scaler is not None:
                wrapper.loss_scaler.load_state_dict(copy.deepcopy(scaler))


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

    def __init__(self, options, log=None):
        self.options = options
        self.log = log or (lambda level, message: None)
        self.store = SnapshotStore(options.snapshot_interval,
                                   options.max_snapshots,
                                   options.snapshot_device)
        self.rewinds = 0
        self.consecutive = 0
        self.cooldown_left = 0
        self.factor = 1.0

    def start(self, model, wrappers):
        """Save the state training starts from (iteration -1)."""
        self.store.take(-1, model, wrappers)

    def after_update(self, iter, clean, model, wrappers, sentinels):
        """After the update step of ``iter``: count the cooldown down and
        save a snapshot when one is due.

        Args:
            clean (bool): The step neither triggered nor spiked.
        """
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

    def rewind(self, since, model, wrappers, sentinels, ranks=None):
        """Go back to the newest snapshot taken before iteration ``since``
        (``train/rewinds`` counted, the log told).

        Args:
            since (int): The first iteration of the divergence.
            model (nn.Module): The model.
            wrappers (list[OptimWrapper]): Its optim wrappers.
            sentinels (list): Their sentinels (the LR factor they apply).
            ranks (Ranks, optional): Under DDP: every rank goes back before
                the earliest ``since`` of all, to the same snapshot.

        Returns:
            tuple: ``(snapshot, None)`` after going back; ``(None, reason)``
            when there is nothing to go back to or when ``max_rewinds``
            consecutive rewinds are exceeded (the caller escalates).
        """
        if ranks is not None:
            since = int(ranks.reduce(since, 'min'))
        snapshot = self.store.before(since)
        if snapshot is None:
            return None, ('no snapshot older than iteration %s to rewind to'
                          % (since, ))
        if self.consecutive >= self.options.max_rewinds:
            return None, ("policy 'rewind' already went back %d consecutive "
                          'times without %d clean update steps in between '
                          '(max_rewinds=%d)' % (
                              self.consecutive, self.options.cooldown,
                              self.options.max_rewinds))
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
        return snapshot, None
