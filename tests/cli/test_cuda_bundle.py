"""A bundle written on CUDA replays on CPU.

``make device-check`` writes it (``tests/sentinel/test_cuda.py``, fp16-range
overflow) into the device run's ``$OUT/cuda_bundle.tar.gz``; it is kept in
``tests/data/cuda_bundle`` once a device run brought it back. Its config
imports ``mmnan_testing.cuda_toy`` (the model), so ``tests/`` is put on the
replay's path, as a user's project is on theirs.
"""
import os
import os.path as osp

import pytest

from mmnan_testing.cli import mmnan, replay_json

TESTS_DIR = osp.dirname(osp.dirname(osp.abspath(__file__)))
BUNDLE = osp.join(TESTS_DIR, 'data', 'cuda_bundle')

pytestmark = pytest.mark.skipif(
    not osp.isdir(BUNDLE), reason='no CUDA bundle has come back from a '
    'device run yet (tests/data/cuda_bundle; make device-check)')


def test_cuda_bundle_loads_and_replays_on_cpu(monkeypatch):
    monkeypatch.setenv('PYTHONPATH', os.pathsep.join(
        p for p in (TESTS_DIR, os.environ.get('PYTHONPATH')) if p))
    result = mmnan('inspect', BUNDLE)
    assert result.returncode == 0, result.stderr
    code, report = replay_json(BUNDLE)
    # On CPU the replay runs in fp32 (no fp16 autocast there): an fp16-range
    # overflow comes out finite, which is the diagnosis's own evidence.
    assert code in (0, 3), report
    assert report['kind'] in ('overflow', 'not_reproduced'), report['summary']
