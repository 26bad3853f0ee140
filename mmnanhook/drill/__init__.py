"""``mmnan drill CONFIG``: prove the protection on the user's own config.

* :mod:`._config`: the user's config, a few iterations long, on their data
  or a synthetic stand-in; with and without NanDetectHook.
* :mod:`._data`: that stand-in, in the config's classes, format and image
  sizes, one for every rank; why a train dataset is empty.
* :mod:`._sampler`: ``DrillSampler``, the first samples of the user's
  sampler.
* :mod:`._faults`: the planted faults (``data``, ``loss``, ``grad``).
* :mod:`._runs`: the runs, in a process of their own.
* :mod:`._verdict`: what they mean.
* :mod:`._drill`: the process started, watched with bounds, judged.
* :mod:`._syncbn`: a CPU ``SyncBatchNorm`` for drills of DDP over gloo.
"""
from ._drill import Drill, run_drill
from ._faults import FAULTS, FaultInjector, Planted
from ._syncbn import CpuSyncBatchNorm, use_cpu_syncbn
from ._verdict import Check, Verdict

__all__ = [
    'Check', 'CpuSyncBatchNorm', 'Drill', 'FAULTS', 'FaultInjector',
    'Planted', 'Verdict', 'run_drill', 'use_cpu_syncbn'
]
