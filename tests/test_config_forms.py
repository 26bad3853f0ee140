"""The config forms a user writes, each run in a fresh process the way
``tools/train.py`` runs a config, on the leg's mmengine (or the older one
``make test-mmengine`` lays over the leg).

* ``dotted``: ``type='mmnanhook.NanDetectHook'`` in ``default_hooks``, nothing
  imports mmnanhook beforehand;
* ``custom_imports``: ``custom_imports = dict(imports=['mmnanhook'])`` and the
  plain ``type='NanDetectHook'``;
* ``base``: ``configs/_base_/nan_detect.py`` as a ``_base_`` file
  (``runner_type = 'mmnanhook.NanDetectRunner'``, options in ``nan_detect``).
"""
import json
import os
import os.path as osp
import subprocess
import sys

import mmengine
import pytest

from mmnan_testing.cli import PROJECT_DIR
from mmnan_testing.testbed import config_dir

# The toy project (replay_toys on PYTHONPATH) and a loss that is NaN at the
# first iteration.
_COMMON = """
custom_imports = dict(imports=%(imports)r)
model = dict(type='RandomSubsetRegressor', keep_prob=0.0)
default_scope = 'mmengine'
log_level = 'WARNING'
env_cfg = dict(dist_cfg=dict(backend='gloo'))
train_dataloader = dict(
    dataset=dict(type='ToyRegressionDataset'), batch_size=2,
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='pseudo_collate'), num_workers=0)
train_cfg = dict(by_epoch=False, max_iters=2)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))
"""
_OPTIONS = dict(replay=False, max_dumps=0)
FORMS = {
    'dotted': (['replay_toys'], 'default_hooks = dict(checkpoint=None, '
               'nan_detect=dict(type=%r, **%r))' % (
                   'mmnanhook.NanDetectHook', _OPTIONS)),
    'custom_imports': (['replay_toys', 'mmnanhook'],
                       'default_hooks = dict(checkpoint=None, '
                       'nan_detect=dict(type=%r, **%r))' % (
                           'NanDetectHook', _OPTIONS)),
    'base': (['replay_toys'], '_base_ = [%r]\nnan_detect = %r\n'
             'default_hooks = dict(checkpoint=None)' % (
                 osp.join(config_dir(), '_base_', 'nan_detect.py'),
                 _OPTIONS)),
}

# tools/train.py of mmdet / mmrotate, less its arguments.
_TRAIN = r"""
import json, os, sys
import mmengine
from mmengine.config import Config
from mmengine.registry import RUNNERS
from mmengine.runner import Runner
cfg = Config.fromfile(sys.argv[1])
cfg.work_dir = sys.argv[2]
imported = 'mmnanhook' in sys.modules
if 'runner_type' not in cfg:
    runner = Runner.from_cfg(cfg)
else:
    runner = RUNNERS.build(cfg)
hooks = [type(h).__module__ + '.' + type(h).__name__ for h in runner.hooks]
error = trigger = None
try:
    runner.train()
except Exception as exc:
    error = type(exc).__module__ + '.' + type(exc).__name__
    trigger = getattr(exc, 'trigger', None)
print(json.dumps(dict(mmengine=mmengine.__version__, imported=imported,
                      hooks=hooks, error=error, trigger=trigger)))
# Without the exit handlers: torch 1.7's autograd engine can hang in them
# after a backward (pytorch#47886), whatever ran the backward.
sys.stdout.flush()
os._exit(0)
"""


def _env():
    env = dict(os.environ, OMP_NUM_THREADS='1')
    paths = [p for p in env.pop('PYTHONPATH', '').split(os.pathsep) if p]
    env['PYTHONPATH'] = os.pathsep.join([PROJECT_DIR] + paths)
    return env


@pytest.mark.parametrize('form', sorted(FORMS))
def test_config_forms_work_in_a_fresh_process(tmp_path, form):
    imports, text = FORMS[form]
    config = tmp_path / 'config.py'
    config.write_text(_COMMON % dict(imports=imports) + text + '\n')
    out = subprocess.run(
        [sys.executable, '-c', _TRAIN, str(config), str(tmp_path / 'work')],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The fresh process ran this process's mmengine (an overlay included).
    assert result['mmengine'] == mmengine.__version__
    # Only custom_imports imports mmnanhook before the runner is built.
    assert result['imported'] == (form == 'custom_imports')
    assert result['hooks'].count('mmnanhook.hook.NanDetectHook') == 1
    assert result['error'] == 'mmnanhook.errors.NonFiniteError'
    assert result['trigger'] == 'loss'
