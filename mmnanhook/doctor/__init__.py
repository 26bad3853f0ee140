"""Catch it before the run: ``mmnan doctor`` and the hook's ``before_train``.

* :mod:`._rules`: config rules (data-free): an IoU-type box loss on encoded
  deltas, the LR not scaled to the real batch, a static AMP loss scale, an
  unclamped Gaussian-distance loss.
* :mod:`._dataset`: the pass over a config's train dataset (``mmnan scan``):
  workers, findings streamed, resumable (:mod:`._journal`).
* :mod:`._samples`: what each sample is checked for, as the loss will see
  it: GT boxes, declared sizes, labels, segmentation maps.
* :mod:`._headroom`: fp16 headroom of every module from a few fp32
  iterations.
* :mod:`._doctor`: the three in one report; the rules at a run's start.
"""
from ._dataset import (DatasetContext, DatasetError, load_config,
                       scan_config, try_build_dataset)
from ._doctor import DoctorReport, check_run_config, run_doctor
from ._headroom import (FP16_MAX, INIT_SCALE, NEAR, ModuleRange,
                        RangeRecorder, confirm_overflow, cpu_fp16_autocast,
                        measure)
from ._rules import RULES, RuleContext, config_dicts, config_findings

__all__ = [
    'DatasetContext', 'DatasetError', 'DoctorReport', 'FP16_MAX',
    'INIT_SCALE', 'ModuleRange', 'NEAR', 'RULES', 'RangeRecorder',
    'RuleContext', 'check_run_config', 'config_dicts', 'config_findings',
    'confirm_overflow', 'cpu_fp16_autocast', 'load_config', 'measure',
    'run_doctor', 'scan_config', 'try_build_dataset'
]
