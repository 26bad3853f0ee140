"""Tier 1, every iteration: the per-step check, and its decision carried out.

* :mod:`._check`: :class:`StepCheck`, the measure of one update step on
  plain torch.
* :mod:`._shards`: which gradients are FSDP shards, so that the norm is the
  global one.
* :mod:`._sentinel`: :class:`WrapperSentinel`, the check of one
  ``OptimWrapper``, and :class:`UpdateStep`, its update step as the
  decision of :mod:`mmnanhook.recovery` acts on it; :mod:`._listener`: what
  it tells its listener.
* :mod:`._install`: the sentinel bound onto an ``OptimWrapper`` instance,
  :func:`install_nan_detect`, the registered ``NanDetect*OptimWrapper``
  classes.
* :mod:`._supported`: which optim wrappers can be checked.
* :mod:`._guard`: the bypass guard.
* :mod:`._inputs`: floating-point inputs checked before the forward.
* :mod:`._spikes`: robust spike bands of the loss and the gradient norm.
* :mod:`._rewind`: snapshots of good states and going back to one.
* :mod:`._drop`: ``policy='drop'``: the step recomputed without samples.
* :mod:`._raised`: the event of a train step whose forward raised.

What a replay needs of each step is kept in :mod:`mmnanhook.memory`; the
ranks of a DDP run vote and exchange in :mod:`mmnanhook.distributed`; the
gradient norms (:mod:`mmnanhook._norms`) and loss terms
(:mod:`mmnanhook._losses`) tier 2 measures alike are on the floor below.
"""
from ._check import MicroStep, StepCheck, StepContext, StepOutcome
from ._drop import Dropper, Recomputation, recompute
from ._raised import forward_event, is_out_of_memory
from ._guard import BypassGuard
from ._inputs import InputCheck
from ._install import (ATTRIBUTE, NanDetectAmpOptimWrapper, NanDetectHandle,
                       NanDetectOptimWrapper, install_nan_detect, sentinel_of)
from ._listener import Listener
from ._rewind import Rewinder, Snapshot, SnapshotStore, param_norms
from ._sentinel import Measured, UpdateStep, WrapperSentinel
from ._spikes import SeriesBand, Spike, SpikeDetector

__all__ = [
    'ATTRIBUTE', 'BypassGuard', 'Dropper', 'forward_event',
    'InputCheck', 'install_nan_detect', 'is_out_of_memory', 'Listener',
    'Measured', 'MicroStep', 'NanDetectAmpOptimWrapper',
    'NanDetectHandle', 'NanDetectOptimWrapper', 'param_norms', 'recompute',
    'Recomputation',
    'Rewinder', 'sentinel_of', 'SeriesBand', 'Snapshot', 'SnapshotStore',
    'Spike', 'SpikeDetector', 'StepCheck', 'StepContext', 'StepOutcome',
    'UpdateStep', 'WrapperSentinel'
]
