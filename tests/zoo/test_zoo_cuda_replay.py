"""The zoo R50's fp16-range bundle written on a GPU
(``tests/zoo/test_zoo_cuda.py``), replayed on the CPU by ``mmnan replay`` in
a fresh process.

The bundle is ``$MMNAN_ZOO_BUNDLE``; skipped without one. It cannot come
back from a device run whole: it holds the R50's weights (150 MB) and as
much optimizer state, and the device tool brings back 16 MiB a file, 64 MiB
in all. So ``scripts/device_check.sh`` runs this test on the device
machine's CPU right after the GPU tests, on the bundle they wrote, and
brings back that bundle without its state: its reports and pictures read as
they are (``mmnan inspect`` refuses a bundle whose listed files are missing).
The dry run (``MMNAN_DEVICE_DRYRUN=cpu``) replays the dry run's bundle.
"""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

from mmnanhook import compat
from mmnan_testing import cli

BUNDLE = os.environ.get('MMNAN_ZOO_BUNDLE')

pytestmark = [
    pytest.mark.zoo, pytest.mark.mmdet,
    pytest.mark.skipif(not BUNDLE or not osp.isdir(BUNDLE),
                       reason='no zoo AMP bundle to replay ($MMNAN_ZOO_BUNDLE,'
                       ' set by scripts/device_check.sh)'),
]


def _replay(bundle):
    # The machine's threads, not cli.mmnan's one: on the device machine a
    # float16 R50 replay on one core would take minutes.
    result = subprocess.run(
        [sys.executable, '-m', 'mmnanhook', 'replay', bundle, '--device',
         'cpu', '--json'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, timeout=600)
    assert result.returncode in (0, 3), result.stderr
    return result.returncode, json.loads(result.stdout)


def _file_line(location):
    # The run's tree may be elsewhere than this one.
    return osp.basename(location or '')


def test_zoo_amp_bundle_replays_on_cpu(record_property):
    original = cli.run_report(BUNDLE)
    with open(osp.join(BUNDLE, 'manifest.json')) as f:
        manifest = json.load(f)
    record_property('written_with', json.dumps(manifest.get('versions')))
    code, report = _replay(BUNDLE)
    record_property('summary', report['summary'])
    assert original['kind'] == 'overflow'
    if compat.autocast('cpu', torch.float16) is None:
        # No float16 autocast on this CPU: replayed in float32, where the
        # fault is finite, which is the diagnosis's own evidence.
        assert code == 3 and report['kind'] == 'not_reproduced'
        assert any('replayed in float32' in note
                   for note in report['notes']), report['notes']
        return
    assert code == 0
    assert report['kind'] == 'overflow', report['summary']
    assert report['amp_dtype'] == original['amp_dtype'] == 'float16'
    assert report['op'] == original['op']
    assert _file_line(report['location']) == \
        _file_line(original['location'])
    assert [osp.basename(s['img_path']) for s in report['samples']] == \
        [osp.basename(s['img_path']) for s in original['samples']]
    fixes = dict((f['kind'], f['status']) for f in report['fixes'])
    assert fixes['fp32'] == 'verified'
