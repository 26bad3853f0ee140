"""The test legs keep their word: a leg's own stack imports or the run fails,
and CI cannot pass with a leg missing.

``scripts/leg.sh`` names what each leg installs by design;
``scripts/test_leg.sh`` hands it to ``tests/conftest.py``
(``MMNANHOOK_LEG_REQUIRES``), where an import failure of one of those is a
usage error, not a skip.
"""
import os
import os.path as osp
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def _collect(requires, only='', paths=('test_compat.py', ), leg=''):
    env = dict(os.environ, MMNANHOOK_LEG_REQUIRES=requires,
               MMNANHOOK_LEG_ONLY=only, MMNANHOOK_LEG=leg)
    return subprocess.run(
        [sys.executable, '-m', 'pytest', '--collect-only', '-q',
         '-p', 'no:cacheprovider'] + [osp.join('tests', p) for p in paths],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        universal_newlines=True, timeout=600)


def test_a_required_package_that_does_not_import_fails_the_run():
    # mmpretrain is the codebases leg's (see tests/conftest.py), not this
    # leg's; this leg's own requirements pass (the suite itself runs with
    # them).
    result = _collect('mmpretrain,no_such_marker')
    assert result.returncode == 4, result.stdout[-3000:]
    assert 'this leg installs mmpretrain, no_such_marker by design, but it ' \
        'does not import' in result.stdout
    shown = result.stdout.split('does not import', 1)[1]
    # The real import error is shown, not a made-up reason.
    assert 'mmpretrain: Traceback' in shown and 'Error' in shown
    assert 'no_such_marker: not a marker of tests/conftest.py' in shown


def _missing_leg(require_all):
    env = dict(os.environ, MMNANHOOK_REQUIRE_ALL_LEGS=require_all)
    return subprocess.run(
        ['bash', '-c', '. scripts/leg.sh && missing_leg "test dota" '
         '"no Python 3.8"; echo not reached'],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, timeout=60)


def test_a_missing_leg_is_loud_and_fatal_where_every_leg_is_required():
    laptop = _missing_leg('0')
    assert laptop.returncode == 0
    assert 'SKIPPED: no Python 3.8' in laptop.stdout
    assert 'does NOT run here' in laptop.stdout
    assert 'not reached' not in laptop.stdout
    ci = _missing_leg('1')
    assert ci.returncode == 1
    assert 'MMNANHOOK_REQUIRE_ALL_LEGS=1 requires every leg' in ci.stderr
    with open(osp.join(ROOT, '.ci', 'run')) as f:
        assert 'export MMNANHOOK_REQUIRE_ALL_LEGS=1' in f.read()


def test_a_leg_that_says_its_share_collects_its_packages_tests_alone():
    # The codebases leg (MMNANHOOK_LEG_ONLY, scripts/leg.sh): mmpretrain's
    # zoo tests, none of mmnanhook's own (another leg's to run).
    pretrain = osp.join('zoo', 'test_zoo_pretrain.py')
    result = _collect('', 'mmpretrain,mmpose', ('test_compat.py', pretrain))
    assert result.returncode == 0, result.stdout[-3000:]
    ids = [line for line in result.stdout.splitlines() if '::' in line]
    assert ids and all(i.startswith('tests/' + pretrain) for i in ids), ids
    # test_compat.py's tests were collected, then left to the other legs.
    assert ' deselected' in result.stdout


def test_a_test_placed_on_a_leg_runs_there_alone():
    # The inductor run (on_legs('codebases')): in that leg's share though
    # not marked with its packages, left out of the modern leg.
    compiled = osp.join('zoo', 'test_zoo_compile.py')
    inductor = 'test_inductor_on_the_tiny_retinanet'
    there = _collect('', 'mmpretrain,mmpose', (compiled, ), 'codebases')
    assert there.returncode == 0, there.stdout[-3000:]
    ids = [line for line in there.stdout.splitlines() if '::' in line]
    assert len(ids) == 1 and inductor in ids[0], ids
    modern = _collect('', '', (compiled, ), 'modern')
    ids = [line for line in modern.stdout.splitlines() if '::' in line]
    assert ids and not [i for i in ids if inductor in i], ids
    # A plain pytest (no leg) runs it.
    plain = _collect('', '', (compiled, ))
    assert inductor in plain.stdout
