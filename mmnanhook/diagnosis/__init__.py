"""Tier 2, once per trigger: replay the failing iteration and explain it.

* :mod:`._diagnose`: :func:`diagnose`, the order of the replays.
* :mod:`._session`: one replay of the failing iteration, and what it found.
* :mod:`._producer`, :mod:`._backward`: instrumentation as context managers
  that always remove what they installed (module forwards, the line
  tracer; anomaly mode, autograd-node hooks).
* :mod:`._classify`: the kind of the failure and its location.
* :mod:`._data`: checks of a batch's inputs and GT boxes (typed problems).
* :mod:`._state_scan`: non-finite parameters, buffers, optimizer state.
* :mod:`._state`, :mod:`._tensors`, :mod:`._frames`: what a replay puts back,
  finding tensors, reading stack frames.
* :mod:`._fixes`: the iteration replayed with each fix the findings suggest.
* :mod:`._pipeline`: a sample through the train pipeline again, with a fix.
* :mod:`._in_run`: a trigger in training diagnosed where it happened, asked
  with one :class:`DiagnosisRequest` of the run's :class:`Diagnostician`:
  :meth:`~Diagnostician.diagnose` (the replays), then, once the trigger
  procedure exchanged the ranks' findings, :meth:`~Diagnostician.write`
  (the bundle); :mod:`._incident`: the two steps' work.
* :mod:`._micro`: which micro-step of an accumulated step made a gradient
  fault.
* :mod:`._own_step`: a model with its own ``train_step`` (a GAN's two
  optim wrappers) replayed through it, up to the update step that failed.
* :mod:`._local`: under DDP, replays on one rank alone (SyncBN made local).
* :mod:`._composed`: a composed (Mosaic) sample's input traced to its part.
"""
from ._data import (angle_range_from_config, annotation_of, annotations,
                    batch_size, capped, check_batch, check_boxes,
                    declared_size, declared_size_problem, declared_sizes,
                    split_batch)
from ._diagnose import diagnose
from ._divergence import (apply_divergence, divergence_evidence,
                          evidence_before)
from ._in_run import Diagnostician, DiagnosisRequest
from ._incident import default_dump_dir
from ._local import communicating_modules, local_replays
from ._micro import locate_micro_step
from ._own_step import OwnTrainStep, overrides_train_step, own_train_step
from ._pipeline import TrainPipeline, filter_advice, train_pipeline
from ._state import preserved_run
from ._state_scan import largest_param

__all__ = [
    'angle_range_from_config', 'annotation_of', 'annotations',
    'apply_divergence', 'batch_size', 'capped', 'check_batch', 'check_boxes',
    'communicating_modules', 'divergence_evidence', 'declared_size',
    'declared_size_problem',
    'evidence_before', 'filter_advice',
    'declared_sizes', 'default_dump_dir', 'diagnose', 'Diagnostician',
    'DiagnosisRequest',
    'largest_param', 'local_replays', 'locate_micro_step', 'OwnTrainStep',
    'overrides_train_step', 'own_train_step', 'preserved_run',
    'split_batch',
    'TrainPipeline', 'train_pipeline'
]
