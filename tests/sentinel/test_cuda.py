"""The CUDA path: the real ``AmpOptimWrapper`` (fp16, dynamic loss scale)
on a GPU. Needs torch + mmengine only; run by ``make device-check`` on a
device machine (``scripts/device_check.sh``), skipped elsewhere.

When ``MMNAN_DEVICE_OUT`` is set, the bundle of the fp16-range test is
copied there: the CPU test ``tests/cli/test_cuda_bundle.py`` replays it.
"""
import inspect
import os
import shutil

import pytest
import torch
from mmengine.runner import Runner

from mmnan_testing import cuda_toy
from mmnan_testing.cuda_toy import SmallResNet, cuda_config
from mmnan_testing.toy import (Probe, assert_same, assert_state_same,
                                   make_runner, train_error)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason='no CUDA device: AmpOptimWrapper with fp16 '
                       'runs on a GPU only (make device-check)'),
]


def amp(**kwargs):
    cfg = dict(type='AmpOptimWrapper', dtype='float16', loss_scale='dynamic',
               optimizer=dict(type='SGD', lr=0.01, momentum=0.9))
    cfg.update(kwargs)
    return cfg


def _runner(tmp_path, faults=None, hook=None, **kwargs):
    return make_runner(tmp_path, faults=faults, model=SmallResNet(),
                       hook=dict(hook or {}, type='NanDetectHook',
                                 dump_dir=str(tmp_path / 'dumps')),
                       **kwargs)


def _line_of(marker):
    """``file:line`` of the line of cuda_toy ending in ``# MARK marker``."""
    lines, _ = inspect.findsource(cuda_toy)
    (hit, ) = [i + 1 for i, text in enumerate(lines)
               if text.rstrip().endswith('# MARK ' + marker)]
    return '{}:{}'.format(inspect.getsourcefile(cuda_toy), hit)


def _scales(runner):
    return list(runner.message_hub.get_scalar('train/loss_scale').data[0])


@pytest.mark.parametrize('anomaly', ['on_trigger', 'always'])
def test_ordinary_overflows_are_skipped_without_a_trigger(tmp_path, anomaly):
    # A scale of 2**40 overflows fp16 gradients: GradScaler skips and halves
    # it until it fits; anomaly='always' must not turn that into a crash.
    # train/loss_scale is the scale each step's gradients were taken at.
    runner = _runner(tmp_path, hook=dict(anomaly=anomaly),
                     optim_wrapper=amp(loss_scale=dict(init_scale=2.0**40)),
                     max_iters=8)
    runner.train()
    scales = _scales(runner)
    assert scales[0] == 2.0**40 and scales[-1] < 2.0**40
    assert scales == sorted(scales, reverse=True)
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 0
    assert not os.path.isdir(str(tmp_path / 'dumps'))


def test_fp16_range_overflow_is_diagnosed_as_overflow(tmp_path):
    # From a config: its bundle is replayed on CPU (test_cuda_bundle.py).
    cfg = cuda_config(tmp_path, {2: 'fp16_range'},
                      dict(type='NanDetectHook',
                           dump_dir=str(tmp_path / 'dumps')), amp())
    error = train_error(Runner.from_cfg(cfg))
    assert error.iter == 1 and error.bundle is not None
    assert error.report['kind'] == 'overflow', error.report['summary']
    out = os.environ.get('MMNAN_DEVICE_OUT')
    if out:
        shutil.copytree(error.bundle, os.path.join(out, 'cuda_bundle'))


def test_nan_that_stays_in_fp32_is_not_an_overflow(tmp_path):
    runner = _runner(tmp_path, faults={2: 'nan'}, optim_wrapper=amp())
    error = train_error(runner)
    assert error.report['kind'] == 'forward', error.report['summary']
    assert error.report['location'] == _line_of('nan')


def test_skip_keeps_weights_and_scaler_state_bitwise(tmp_path):
    probe = Probe()
    runner = make_runner(tmp_path, faults={2: 'nan'}, model=SmallResNet(),
                         probe=probe, optim_wrapper=amp(),
                         hook=dict(type='NanDetectHook', policy='skip',
                                   dump_dir=str(tmp_path / 'dumps')))
    runner.train()
    assert_same(probe.after[1][0], probe.before[1][0])
    assert_state_same(probe.after[1][1], probe.before[1][1])
    assert 'loss_scaler' in probe.after[1][1]
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 1
