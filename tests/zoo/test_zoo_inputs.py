"""A NaN never reaches a compiled op: the zoo's VFNet and RepPoints (mmcv's
deformable convolution, which crashes the process on a NaN input on the
CPU) with one image that loads as float pixels, all NaN (a nodata tile, as
a remote-sensing loader yields it), in a one-epoch run of four images.

Each run is its own process (:mod:`mmnan_testing.crash`): without the input
check the process dies of SIGSEGV inside the forward, which must fail the
test, not end the session. The default policy stops the step before the
forward with the sample named; ``'drop'`` completes the epoch with that
sample alone left out and quarantined.
"""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest

from mmnanhook.quarantine import read_quarantine
from mmnan_testing import zoo
from mmnan_testing.crash import IMAGES

pytestmark = [pytest.mark.zoo, pytest.mark.mmdet, pytest.mark.zoo_full]

NAMES = ['vfnet_r50', 'reppoints_r50']


def _tile_run(tmp_path, name, policy):
    if not zoo.available(name):
        pytest.skip('%s is not installed here' % zoo.ZOO[name].package)
    env = dict(os.environ, OMP_NUM_THREADS='1')
    process = subprocess.run(
        [sys.executable, '-m', 'mmnan_testing.crash', 'tile', name,
         str(tmp_path), policy], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, universal_newlines=True, env=env,
        timeout=900)
    assert process.returncode == 0, (process.returncode,
                                     process.stderr[-4000:])
    (result, ) = [json.loads(line) for line in process.stdout.splitlines()
                  if line.startswith('{')]
    return result


def _iteration_of(result):
    (at, ) = [i for i, files in enumerate(result['files'])
              if result['bad'] in map(osp.basename, files)]
    return at


@pytest.mark.parametrize('name', NAMES)
def test_the_default_policy_stops_before_the_forward(tmp_path, name):
    result = _tile_run(tmp_path, name, 'default')
    error = result['error']
    assert error is not None, result
    assert error['iter'] == _iteration_of(result)
    assert error['trigger'] == 'exception'
    assert 'input check at iter' in error['message']
    assert '%s) is not finite' % result['bad'] in error['message']
    report = error['report']
    assert report['kind'] == 'data'
    (sample, ) = report['samples']
    assert osp.basename(sample['img_path']) == result['bad']
    assert any('NaN' in p for p in sample['problems'])
    assert report['summary'].startswith('the input is not finite')
    assert error['bundle'] is not None and osp.isdir(error['bundle'])
    assert result['finite']


@pytest.mark.parametrize('name', NAMES)
def test_drop_completes_the_epoch_with_the_tile_alone_quarantined(
        tmp_path, name):
    result = _tile_run(tmp_path, name, 'drop')
    assert result['error'] is None, result['error']
    assert result['done'] == IMAGES // 2
    assert result['scalars'].get('samples_dropped') == 1
    assert result['scalars'].get('nan_skipped', 0) == 0
    (sample, ) = read_quarantine(
        osp.join(str(tmp_path), 'work', 'nan_quarantine.json'), IMAGES)
    assert osp.basename(sample.file) == result['bad']
    assert sample.source == 'drop'
    assert result['finite']
