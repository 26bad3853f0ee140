"""Tier 1, every iteration: the per-step check, and its decision carried out.

* :mod:`._check`: :class:`StepCheck`, the measure of one update step on
  plain torch.
* :mod:`._norms`: gradient norms computed once; clipping that reuses them.
* :mod:`._shards`: which gradients are FSDP shards, so that the norm is the
  global one.
* :mod:`._sentinel`: :class:`WrapperSentinel`, the check of one
  ``OptimWrapper`` and the decision of :mod:`mmnanhook.recovery` carried
  out; :mod:`._listener`: what it tells its listener.
* :mod:`._install`: the sentinel bound onto an ``OptimWrapper`` instance,
  :func:`install_nan_detect`, the registered ``NanDetect*OptimWrapper``
  classes.
* :mod:`._supported`: which optim wrappers can be checked.
* :mod:`._guard`: the bypass guard.
* :mod:`._inputs`: floating-point inputs checked before the forward.
* :mod:`._spikes`: robust spike bands of the loss and the gradient norm.
* :mod:`._rewind`: snapshots of good states and going back to one.
* :mod:`._drop`: ``policy='drop'``: the step recomputed without samples.
* :mod:`._distributed`: under DDP, the vote after every forward and the
  exchange of findings after a trigger: every rank takes the same path.
* :mod:`._raised`: the event of a train step whose forward raised.
* :mod:`._steps`, :mod:`._rng`, :mod:`._attributes`: the batch, RNG states,
  buffers and the preprocessor's attributes kept per step for a replay.
* :mod:`._history`: the per-iteration scalars kept for a bundle.
"""
from ._attributes import Attributes, module_attributes
from ._check import (MicroStep, StepCheck, StepContext, StepOutcome,
                     describe_losses, loss_terms)
from ._distributed import (COLLECTIVES, Exchange, ForwardGuard, Ranks,
                           collective_outputs, collective_signature,
                           start_distributed)
from ._drop import DropPlan, Dropper, recompute
from ._raised import forward_event, is_out_of_memory
from ._guard import BypassGuard
from ._inputs import InputCheck
from ._history import History, StepState, step_record
from ._install import (ATTRIBUTE, NanDetectAmpOptimWrapper, NanDetectHandle,
                       NanDetectOptimWrapper, install_nan_detect, members,
                       sentinel_of)
from ._listener import Listener
from ._norms import GradNorms, clip_grads_with_norm_
from ._rewind import Rewinder, Snapshot, SnapshotStore, param_norms
from ._rng import capture_rng, restore_rng
from ._sentinel import WrapperSentinel
from ._spikes import SeriesBand, Spike, SpikeDetector
from ._steps import BufferSnapshot, ForwardStart, StepMemory

__all__ = [
    'ATTRIBUTE', 'Attributes', 'BufferSnapshot', 'BypassGuard', 'capture_rng',
    'clip_grads_with_norm_', 'collective_outputs', 'collective_signature',
    'COLLECTIVES', 'describe_losses', 'Dropper',
    'DropPlan', 'Exchange', 'forward_event', 'ForwardGuard', 'ForwardStart',
    'GradNorms', 'History', 'InputCheck', 'install_nan_detect', 'is_out_of_memory',
    'Listener', 'loss_terms', 'members', 'MicroStep', 'module_attributes',
    'NanDetectAmpOptimWrapper', 'NanDetectHandle', 'NanDetectOptimWrapper',
    'param_norms', 'Ranks', 'recompute', 'restore_rng',
    'Rewinder', 'sentinel_of', 'SeriesBand', 'Snapshot', 'SnapshotStore',
    'Spike', 'SpikeDetector', 'start_distributed', 'step_record',
    'StepCheck', 'StepContext', 'StepMemory', 'StepOutcome', 'StepState',
    'WrapperSentinel'
]
