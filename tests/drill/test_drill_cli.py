"""``mmnan drill`` in a fresh process, as a user runs it, on the tiny
RetinaNet config of ``configs/`` (its data synthetic: the config's files
are not there): every fault held under the default policy, and under
'drop' on a child of it with its own classes; a copy of mmnanhook whose
gradient check is blind fails the drill (exit 1, naming the fault); a
config whose classes leave its own data empty is said so (exit 1); bad
options are bad input (exit 2).

The zoo's configs are drilled in tests/zoo/test_zoo_drill.py.
"""
import json
import os
import os.path as osp

import pytest

from mmnanhook.demo import synthetic
from mmnan_testing import families, testbed
from mmnan_testing.cli import assert_bad_input, mmnan, mmnan_patched

# Fresh processes training four times each: in make test on the DOTA leg,
# whose share of the everyday tier has room; on the modern leg in make
# test-zoo.
pytestmark = [pytest.mark.everyday_leg('dota'), pytest.mark.mmdet]

TINY = osp.join(testbed.config_dir(), 'tiny_retinanet.py')
# The line of tier 1's update-step check that sees a non-finite gradient.
GRAD_CHECK = 'grads_bad = bool(grad_ranks) or not math.isfinite(grad_norm)'


def _verdicts(stdout):
    drill = json.loads(stdout)
    return drill, {v['run']: v for v in drill['verdicts']}


def _checks(verdict):
    return {c['name']: c for c in verdict['checks']}


def test_every_fault_holds_under_raise(tmp_path):
    result = mmnan('drill', TINY, '--work-dir', tmp_path, '--json')
    assert result.returncode == 0, result.stdout + result.stderr
    drill, verdicts = _verdicts(result.stdout)
    assert drill['ok']
    assert sorted(verdicts) == ['clean', 'data', 'grad', 'loss']
    clean = verdicts['clean']['checks']
    assert [c['name'] for c in clean] == ['trains', 'trains', 'quiet',
                                          'unchanged']
    for fault in ('data', 'loss', 'grad'):
        checks = _checks(verdicts[fault])
        assert sorted(checks) == ['caught', 'finite', 'named', 'policy']
        assert all(c['ok'] for c in checks.values()), checks
        assert 'at iteration 1' in checks['caught']['detail']
        assert "'raise': NonFiniteError raised in iteration 1" == \
            checks['policy']['detail']
    # Named as planted: the sample's file, the first loss term, the first
    # parameter backward reached.
    assert _checks(verdicts['loss'])['named']['detail'].startswith(
        'loss term loss_cls planted; named: loss_cls')
    named = _checks(verdicts['data'])['named']['detail']
    planted = named.split(' planted')[0][len('sample '):]
    assert osp.isfile(planted) and named.endswith(planted)
    assert any('a synthetic coco dataset' in c for c in drill['changes'])
    # Each run in its own work dir, a bundle for each fault.
    for fault in ('data', 'loss', 'grad'):
        assert os.listdir(osp.join(str(tmp_path), fault, 'nan_dumps'))
    assert not osp.isdir(osp.join(str(tmp_path), 'clean', 'nan_dumps'))


def test_drop_quarantines_the_planted_sample(tmp_path):
    """On the commonest config there is: a child with its own classes (as
    many in the head), its data not here and ``'drop'`` in its
    ``default_hooks``. Before issue 64 its stand-in was in other classes,
    which its metainfo filtered out: every run failed (``ValueError: need
    at least one array to concatenate``)."""
    child = families.own_classes_child(tmp_path, TINY)
    result = mmnan('drill', child, '--work-dir', tmp_path / 'drill')
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.rstrip().endswith('all hold')
    assert 'in its 3 classes (balloon, kangaroo, fish)' in out
    policy = [line for line in out.splitlines()
              if line.strip().startswith('ok  policy')]
    assert len(policy) == 3, out
    # The data fault's sample dropped and listed; the others cannot be
    # singled out to a sample: the step left out.
    assert "'drop': 1 sample(s) dropped, quarantined: " in policy[0]
    assert policy[0].split('quarantined: ')[1].endswith('.png')
    assert "'drop': 1 step(s) skipped" in policy[1]
    assert "'drop': 1 step(s) skipped" in policy[2]


def test_a_blind_gradient_check_fails_the_drill(tmp_path):
    """A regression planted in a scratch copy of mmnanhook: the drill runs
    that copy (in its own process too) and exits 1 naming the fault."""
    result = mmnan_patched(tmp_path, 'sentinel/_check.py', GRAD_CHECK,
                           'grads_bad = False', 'drill', TINY, '--work-dir',
                           tmp_path / 'drill')
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.rstrip().splitlines()[-1]
    assert last == 'FAILS: grad caught: no trigger in iteration 1; weights ' \
        'NOT finite after iteration 1', result.stdout
    assert 'data   holds' in result.stdout
    assert 'loss   holds' in result.stdout


def test_a_dataset_its_classes_leave_empty_is_said(tmp_path):
    """Its own data is here, in other classes than its ``metainfo``'s: the
    clean runs say which dataset and which filter left it empty (numpy's
    ``need at least one array to concatenate`` before)."""
    own = str(tmp_path / 'own')
    synthetic.make_coco_dataset(own, num_images=4)  # cat and dog
    child = families.own_classes_child(tmp_path, TINY, data_root=own + '/')
    result = mmnan('drill', child, '--work-dir', tmp_path / 'drill')
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.rstrip().splitlines()[-1]
    assert last == (
        'FAILS: clean trains: without mmnanhook: the train dataset is empty: '
        'CocoDataset of {}/annotations/train.json: none of its classes '
        '(balloon, kangaroo, fish) is a category of its annotation file, and '
        'filter_cfg=dict(filter_empty_gt=True, min_size=32) left none of its '
        '4 images'.format(own)), result.stdout
    assert 'need at least one array' not in result.stdout
    # Its own data, not a stand-in it would not train on either.
    assert 'synthetic' not in result.stdout


@pytest.mark.parametrize('args, expected', [
    (['--faults', 'data,bogus'], "--faults: 'data,bogus' is not a list"),
    (['--rank', '1'], '--rank: 1 is not a rank of 1'),
    (['--policy', 'ignore'], "--policy: 'ignore' is not one of"),
    (['--iter', '-1'], '--iter: -1 is not an iteration'),
])
def test_bad_options_are_bad_input(tmp_path, args, expected):
    assert_bad_input(mmnan('drill', TINY, '--work-dir', tmp_path, *args),
                     'drill', expected)


def test_an_earlier_drills_work_dir_is_bad_input(tmp_path):
    (tmp_path / 'results.rank0.json').write_text('{}')
    assert_bad_input(mmnan('drill', TINY, '--work-dir', tmp_path), 'drill',
                     '--work-dir: {} holds an earlier drill'.format(tmp_path))


def test_a_start_past_the_timeout_is_killed_and_said(tmp_path):
    # Importing torch and the codebase alone takes longer than a second.
    assert_bad_input(mmnan('drill', TINY, '--work-dir', tmp_path,
                           '--timeout', '1'), 'drill',
                     'its start took longer than 1 s (killed)')


def test_a_missing_config_is_bad_input(tmp_path):
    missing = str(tmp_path / 'missing.py')
    assert_bad_input(mmnan('drill', missing), 'drill',
                     'no config file ' + missing)
