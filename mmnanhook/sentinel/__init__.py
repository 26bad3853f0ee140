"""Tier 1, every iteration: the per-step check and what it keeps.

* :mod:`._check`: :class:`StepCheck`, the decision of one update step on
  plain torch.
* :mod:`._norms`: gradient norms computed once; clipping that reuses them.
* :mod:`._shards`: which gradients are FSDP shards, so that the norm is the
  global one.
* :mod:`._wrapper`: the MMEngine adapter bound onto an ``OptimWrapper``
  instance, the registered ``NanDetect*OptimWrapper`` classes,
  :func:`install_nan_detect`.
* :mod:`._supported`: which optim wrappers can be checked.
* :mod:`._guard`: the bypass guard.
* :mod:`._spikes`: robust spike bands of the loss and the gradient norm.
* :mod:`._rewind`: snapshots of good states and going back to one.
* :mod:`._drop`: ``policy='drop'``: which samples, and the step recomputed
  without them.
* :mod:`._distributed`: under DDP, the vote after every forward and the
  exchange of findings after a trigger: every rank takes the same path.
* :mod:`._forward`: a train step whose forward raised.
* :mod:`._steps`, :mod:`._rng`: the batch, RNG states and buffers kept per
  step for a replay.
* :mod:`._history`: the per-iteration scalars kept for a bundle.
"""
from ._check import (MicroStep, StepCheck, StepContext, StepOutcome,
                     answer_text, describe_losses, loss_terms)
from ._distributed import (COLLECTIVES, DropDecision, Exchange, ForwardGuard,
                           PeerForwardFailed, Ranks, data_culprits,
                           drop_decision, plan_drop, rank_finding,
                           received, start_distributed)
from ._drop import DropPlan, Dropper, drop_unavailable, samples_to_drop
from ._forward import forward_failed, raised_by_nonfinite
from ._guard import BypassGuard
from ._history import FIELDS, History, step_record
from ._norms import GradNorms, clip_grads_with_norm_
from ._rewind import Rewinder, Snapshot, SnapshotStore, param_norms
from ._rng import capture_rng, restore_rng
from ._spikes import SeriesBand, Spike, SpikeDetector
from ._steps import BufferSnapshot, StepMemory
from ._wrapper import (ATTRIBUTE, Listener, NanDetectAmpOptimWrapper,
                       NanDetectHandle, NanDetectOptimWrapper, WrapperSentinel,
                       install_nan_detect, members, sentinel_of)

__all__ = [
    'answer_text', 'ATTRIBUTE', 'BufferSnapshot', 'BypassGuard', 'capture_rng',
    'clip_grads_with_norm_', 'COLLECTIVES', 'data_culprits', 'describe_losses',
    'drop_decision', 'drop_unavailable', 'DropDecision', 'Dropper', 'DropPlan',
    'Exchange', 'FIELDS', 'forward_failed', 'ForwardGuard', 'GradNorms',
    'History', 'install_nan_detect', 'Listener', 'loss_terms', 'members',
    'MicroStep', 'NanDetectAmpOptimWrapper', 'NanDetectHandle',
    'NanDetectOptimWrapper', 'param_norms', 'PeerForwardFailed', 'plan_drop',
    'raised_by_nonfinite', 'rank_finding', 'Ranks', 'received', 'restore_rng',
    'Rewinder', 'samples_to_drop', 'sentinel_of', 'SeriesBand', 'Snapshot',
    'SnapshotStore', 'Spike', 'SpikeDetector', 'start_distributed',
    'step_record', 'StepCheck', 'StepContext', 'StepMemory', 'StepOutcome',
    'WrapperSentinel'
]
