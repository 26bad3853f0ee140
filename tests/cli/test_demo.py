"""Both demos end to end, as the README shows them: a fresh ``mmnan demo``
process, then ``mmnan replay`` of the bundle it printed; the README's demo
output is what the mmdet demo prints."""
import os.path as osp
import re

import pytest

from mmnanhook.demo import demo_dataset
from mmnan_testing.cli import (assert_same_report, mmnan, replay_json,
                                   run_report)


@pytest.mark.parametrize('dota', [
    pytest.param(False, marks=pytest.mark.mmdet, id='mmdet'),
    pytest.param(True, marks=pytest.mark.mmrotate, id='dota'),
])
def test_demo_finds_the_planted_defect_and_its_bundle_replays(tmp_path,
                                                               dota):
    work_dir = str(tmp_path / 'demo')
    flags = ['--dota'] if dota else []
    result = mmnan('demo', '--work-dir', work_dir, *flags)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    out = result.stdout

    # What the generator planted, written again from the same arguments.
    expected = demo_dataset(dota, str(tmp_path / 'expected'))
    (defect, ) = expected['defects']
    image = osp.join(
        work_dir, 'data',
        osp.relpath(expected['img_dir'], expected['data_root']),
        defect['image'])
    found = out.split('== NanDetectHook stopped training')[1]
    assert image in found
    assert 'gt box {} '.format(defect['index']) in found
    # No clean image is named anywhere.
    assert [name for name in expected['images'] if name in out] == [
        defect['image']]

    bundle = re.search(r'^ +replay: +mmnan replay (\S+)$', out,
                       re.MULTILINE).group(1)
    for label in ('plot', 'report', 'picture', 'full log'):
        path = re.search(r'^ +{}: +(\S+)$'.format(label), out,
                         re.MULTILINE).group(1)
        assert osp.isfile(path), label
    # A story, not MMEngine's config dump and hook table: those are in the
    # full log only.
    assert len(out.splitlines()) < 60, out
    assert 'Config:' not in out and 'Hooks will be executed' not in out
    with open(path) as f:
        full = f.read()
    assert 'Config:' in full and 'Hooks will be executed' in full
    code, report = replay_json(bundle)
    assert code == 0
    assert_same_report(report, run_report(bundle))
    assert [s['img_path'] for s in report['samples']] == [image]
    if not dota:
        _assert_readme_shows(out)


def _assert_readme_shows(out):
    """The README's demo output is this output, ``...`` standing for the
    paths of this machine: every line of it matches a line printed."""
    with open(osp.join(osp.dirname(osp.dirname(osp.dirname(
            osp.abspath(__file__)))), 'README.md')) as f:
        shown = re.search(r'```text\n(== NanDetectHook.*?)```', f.read(),
                          re.S).group(1).splitlines()
    printed = out.splitlines()
    for line in shown:
        pattern = '.*'.join(re.escape(part) for part in line.split('...'))
        assert any(re.fullmatch(pattern, p) for p in printed), line
