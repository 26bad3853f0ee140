"""Replays on one rank alone: what communicates in its forward made local.

Under DDP the replays of a trigger (the diagnosis, the one-sample replays,
the fixes, the search for a micro-step) run on the ranks that triggered, on
the unwrapped model. A module whose training forward issues a collective
(torch's ``SyncBatchNorm``, mmcv's ``SyncBatchNorm``, a registered stand-in
of either), or a loss that averages a normalizer over the ranks (mmdet's
``reduce_mean`` of ``avg_factor``), would then wait for ranks that are not
replaying (a hang, or a crash when the peers' next collectives do not
match), or mix another rank's replay into this one. :func:`local_replays`
keeps every replay on this rank:

* each module that communicates in its forward gets a batch-norm forward
  over this rank's batch alone; its forward and its buffers (running
  statistics included) are put back bitwise afterwards. Modules are found
  by type, and by a dry check for any other module with running
  statistics: its training forward on a small input with every collective
  of ``torch.distributed`` made to raise instead of waiting;
* every other collective of ``torch.distributed`` called while the replays
  run is answered on this rank, never waiting for another: with what the
  failing iteration's own call got, where the replay's call is the one the
  train step made at the same position (same collective, same shapes and
  arguments; :meth:`~mmnanhook.distributed.ForwardGuard.step_collectives`): a
  preprocessor's ``broadcast`` of the next input size, a loss's
  ``reduce_mean`` of its normalizer over the ranks' real values. Any other
  (a sub-batch's normalizer, a call the failing forward never reached) as
  if every rank held this rank's values (a sum is this value times the
  world size, a gather this value on every rank): a mean over the ranks is
  this rank's own value. A ``broadcast`` to this rank without a recorded
  answer is refused (the replay raises): its value exists on another rank
  only, and an uninitialised tensor would be taken for it. The report
  counts each kind.
"""
from __future__ import annotations

import contextlib
import functools
from typing import (Any, Dict, Iterable, Iterator, List, Optional, Sequence,
                    Tuple)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .._patch import set_attribute
from ..distributed import COLLECTIVES, collective_outputs, collective_signature
from ..memory import BufferSnapshot

# Norm layers that never communicate (no dry check needed).
_LOCAL = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d,
          torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d,
          torch.nn.InstanceNorm3d)


class _Communicated(Exception):
    """A collective was called during a dry check."""


def _refuse(*args, **kwargs):
    raise _Communicated()


@contextlib.contextmanager
def _no_collectives():
    saved = [(name, getattr(dist, name)) for name in COLLECTIVES
             if hasattr(dist, name)]
    for name, _ in saved:
        setattr(dist, name, _refuse)
    try:
        yield
    finally:
        for name, func in saved:
            setattr(dist, name, func)


def _known_sync_types():
    types = [torch.nn.SyncBatchNorm]
    try:
        from mmcv.ops import SyncBatchNorm
        types.append(SyncBatchNorm)
    except Exception:  # noqa: BLE001 - mmcv without ops: nothing of it here
        pass
    return tuple(types)


def _communicates(module):
    """The dry check: whether ``module``'s training forward calls a
    collective (its buffers and mode are put back)."""
    channels = getattr(module, 'num_features', None)
    if not isinstance(channels, int) or channels < 1:
        return False
    param = next(iter(module.parameters(recurse=False)), None)
    buffer = getattr(module, 'running_mean', None)
    like = param if param is not None else buffer
    if like is None:
        return False
    saved = BufferSnapshot(module)
    training = module.training
    module.train()
    try:
        with _no_collectives(), torch.no_grad():
            for shape in ((2, channels, 2, 2), (2, channels, 2),
                          (2, channels)):
                # No random numbers: the replays' RNG states stay as kept.
                size = 1
                for n in shape:
                    size *= n
                probe = torch.arange(size, dtype=like.dtype,
                                     device=like.device).reshape(shape)
                try:
                    module(probe)
                    return False
                except _Communicated:
                    return True
                except Exception:  # noqa: BLE001 - another input rank
                    continue
        return False
    finally:
        module.train(training)
        saved.restore()


def communicating_modules(model: torch.nn.Module
                          ) -> List[Tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module of ``model`` whose training
    forward communicates with other ranks."""
    known = _known_sync_types()
    found, checked = [], {}
    for name, module in model.named_modules():
        if isinstance(module, known):
            found.append((name, module))
            continue
        if type(module) in _LOCAL or not isinstance(
                getattr(module, 'running_mean', None), torch.Tensor):
            continue
        cls = type(module)
        if cls not in checked:
            checked[cls] = _communicates(module)
        if checked[cls]:
            found.append((name, module))
    return found


def _local_forward(module):
    if isinstance(module, _BatchNorm):
        # torch's own batch norm over the input given: this rank's batch.
        return functools.partial(_BatchNorm.forward, module)

    def forward(input):
        momentum = module.momentum if module.momentum is not None else 0.0
        return F.batch_norm(input, module.running_mean, module.running_var,
                            module.weight, module.bias, module.training,
                            momentum, module.eps)

    return forward


class _Done(object):
    """The work handle of a collective answered locally (``async_op``)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _size(group):
    return dist.get_world_size(group) if group is not None else \
        dist.get_world_size()


def _rank(group):
    return dist.get_rank(group) if group is not None else dist.get_rank()


def _times(tensor, op, n):
    """``tensor`` reduced by ``op`` over ``n`` ranks that all hold it."""
    if op is None or op == dist.ReduceOp.SUM:
        tensor.mul_(n)
    elif op == dist.ReduceOp.PRODUCT:
        tensor.pow_(n)
    # AVG, MIN, MAX and the bitwise ones: the value itself.


class _Unanswerable(RuntimeError):
    """A collective whose answer exists on another rank only."""


def _local_collectives(scope):
    """Collective name -> its local answer; each call counted in
    ``scope``."""
    calls = scope.calls

    def counted(name, answer):
        def local(*args, **kwargs):
            with torch.no_grad():
                if scope.answer_recorded(name, args, kwargs):
                    return _Done()
                calls[name] = calls.get(name, 0) + 1
                answer(*args, **kwargs)
            # A work handle whether async_op was given or not.
            return _Done()
        return local

    def broadcast(tensor, src=0, group=None, async_op=False):
        if src != _rank(group):
            raise _Unanswerable(
                'mmnanhook: a broadcast from rank %s in a replay on rank %s '
                'that the failing iteration did not make at this point: '
                'its value exists on rank %s only' % (src, _rank(group),
                                                       src))

    def all_reduce(tensor, op=None, group=None, async_op=False):
        _times(tensor, op, _size(group))

    def reduce(tensor, dst=0, op=None, group=None, async_op=False):
        _times(tensor, op, _size(group))

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        for out in tensor_list:
            out.copy_(tensor)

    def gather_into(output, input, group=None, async_op=False):
        output.copy_(torch.cat([input] * _size(group)).view_as(output))

    def reduce_scatter(output, input_list, op=None, group=None,
                       async_op=False):
        output.copy_(input_list[_rank(group)])
        _times(output, op, _size(group))

    def reduce_scatter_tensor(output, input, op=None, group=None,
                              async_op=False):
        output.copy_(input.chunk(_size(group))[_rank(group)].view_as(output))
        _times(output, op, _size(group))

    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
        for out in gather_list or ():
            out.copy_(tensor)

    def scatter(tensor, scatter_list=None, src=0, group=None,
                async_op=False):
        if scatter_list:
            tensor.copy_(scatter_list[_rank(group)])

    def all_to_all(output_list, input_list, group=None, async_op=False):
        for out in output_list:
            out.copy_(input_list[_rank(group)])

    def all_to_all_single(output, input, *args, **kwargs):
        # Every rank sends this rank its chunk: this rank's own, n times.
        group = kwargs.get('group')
        chunk = input.chunk(_size(group))[_rank(group)]
        output.copy_(torch.cat([chunk] * _size(group)).view_as(output))

    def all_reduce_coalesced(tensors, op=None, group=None, async_op=False):
        for tensor in tensors:
            _times(tensor, op, _size(group))

    def unchanged(*args, **kwargs):
        pass

    answers = dict(all_reduce=all_reduce, reduce=reduce,
                   all_gather=all_gather, all_gather_into_tensor=gather_into,
                   _all_gather_base=gather_into,
                   reduce_scatter=reduce_scatter,
                   reduce_scatter_tensor=reduce_scatter_tensor,
                   _reduce_scatter_base=reduce_scatter_tensor,
                   all_gather_object=all_gather_object, gather=gather,
                   scatter=scatter, all_to_all=all_to_all,
                   all_to_all_single=all_to_all_single,
                   all_reduce_coalesced=all_reduce_coalesced,
                   broadcast=broadcast, broadcast_object_list=unchanged,
                   barrier=unchanged, monitored_barrier=unchanged)
    return dict((name, counted(name, answer))
                for name, answer in answers.items() if hasattr(dist, name))


class LocalReplays(object):
    """What :func:`local_replays` kept on this rank.

    Attributes:
        modules (list[str]): ``name (type)`` of each module made local.
        calls (dict): Collective -> how many calls the replays made,
            answered on this rank.
    """

    def __init__(self, modules: List[str],
                 recorded: Iterable[Tuple[Any, Any]] = ()) -> None:
        self.modules = modules
        self.calls = {}
        self.recorded = list(recorded)
        self.replayed = 0
        self._position = 0

    def begin(self) -> None:
        """A replay of the iteration starts: its collectives are matched
        with the train step's from the first on."""
        self._position = 0

    def answer_recorded(self, name: str, args: Sequence[Any],
                        kwargs: Dict[str, Any]) -> bool:
        """Answer the collective ``name`` with what the failing train step's
        call at this position got, if it is that call and its result is
        still as the collective left it.

        Returns:
            bool: Whether it was answered.
        """
        position, self._position = self._position, self._position + 1
        if position >= len(self.recorded):
            return False
        signature, outputs = self.recorded[position]
        if (signature is None or signature != collective_signature(
                name, args, kwargs) or any(
                    version is not None and t._version != version
                    for t, version in outputs)):
            return False
        for (out, _), (got, _) in zip(
                collective_outputs(name, args, kwargs), outputs):
            out.copy_(got)
        self.replayed += 1
        return True

    def describe(self) -> Optional[str]:
        """One sentence for the report, or ``None`` when nothing was made
        local."""
        parts = []
        if self.modules:
            types = sorted(set(m.split(' (')[1].rstrip(')')
                               for m in self.modules))
            parts.append(
                '{} module(s) that communicate in their forward ({}) '
                "normalized with this rank's batch statistics, their forward "
                'and running statistics put back afterwards'.format(
                    len(self.modules), ', '.join(types)))
        if self.replayed:
            parts.append(
                '{} collective(s) answered with what the failing iteration '
                'got'.format(self.replayed))
        if self.calls:
            parts.append(
                '{} answered on this rank as if every rank held its values'
                .format(', '.join('{} x{}'.format(name, n) for name, n in
                                  sorted(self.calls.items()))))
        if not parts:
            return None
        return 'replayed on this rank alone: ' + '; '.join(parts)


# The scope of the replays running now (one at a time: on the training
# thread, inside a trigger), for :func:`replay_begins`.
_active = []


def replay_begins() -> None:
    """A replay of the failing iteration starts (its collectives are
    matched with the step's from the first on); nothing outside
    :func:`local_replays`."""
    for scope in _active:
        scope.begin()


@contextlib.contextmanager
def local_replays(modules: Iterable[Tuple[str, torch.nn.Module]],
                  recorded: Iterable[Tuple[Any, Any]] = ()
                  ) -> Iterator[LocalReplays]:
    """Replays on this rank alone while the block runs (under DDP).

    Args:
        modules (list[tuple]): ``(name, module)`` of the modules that
            communicate in their forward (:func:`communicating_modules`).
        recorded (list[tuple]): ``(signature, outputs)`` of the collectives
            the failing train step called, in order
            (:meth:`~mmnanhook.distributed.ForwardGuard.step_collectives`).

    Yields:
        LocalReplays: What was made local; its ``calls`` fill while the
        block runs.
    """
    scope = LocalReplays(['%s (%s)' % (name or '<model>',
                                       type(module).__name__)
                          for name, module in modules], recorded)
    saved, real = [], {}
    try:
        for name, module in modules:
            buffers = BufferSnapshot(module)
            saved.append((set_attribute(module, 'forward',
                                        _local_forward(module)), buffers))
        for name, answer in _local_collectives(scope).items():
            real[name] = getattr(dist, name)
            setattr(dist, name, answer)
        _active.append(scope)
        yield scope
    finally:
        if scope in _active:
            _active.remove(scope)
        for name, func in real.items():
            setattr(dist, name, func)
        for undo, buffers in saved:
            undo()
            buffers.restore()
