"""Running ``mmnan`` in a fresh process and reading what it answered."""
import json
import os
import os.path as osp
import re
import subprocess
import sys
import uuid

from mmengine.config import Config

from mmnanhook.bundle import ALLOWLIST_FALLBACK

# A user's project, outside every package: its modules (``replay_toys``) are
# importable only where this directory is on the path, as a project's are.
PROJECT_DIR = osp.join(osp.dirname(osp.abspath(__file__)), 'project')

BATCH = 2

# What ``mmnan replay`` says first where torch cannot load with an allowlist.
FALLBACK_WARNING = 'mmnan replay: warning: {}'.format(
    ALLOWLIST_FALLBACK)


def toy_config(work_dir, model, **overrides):
    """A config that trains the toy ``model`` of ``replay_toys`` with
    NanDetectHook until its fault (``overrides`` replace top-level keys)."""
    cfg = dict(
        custom_imports=dict(imports=['replay_toys', 'mmnanhook'],
                            allow_failed_imports=False),
        default_scope='mmengine',
        model=dict(type=model),
        work_dir=work_dir,
        experiment_name='{}_{}'.format(model, uuid.uuid4().hex),
        train_dataloader=dict(
            dataset=dict(type='ToyRegressionDataset', n=32),
            sampler=dict(type='DefaultSampler', shuffle=False),
            batch_size=BATCH, num_workers=0),
        train_cfg=dict(by_epoch=False, max_iters=16),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        custom_hooks=[dict(type='NanDetectHook')],
        default_hooks=dict(checkpoint=None),
        randomness=dict(seed=0),
        log_level='WARNING')
    cfg.update(overrides)
    return Config(cfg)


def train_to_bundle(cfg):
    """Train ``cfg`` until NanDetectHook raises; that error, whose bundle
    was written."""
    from mmengine.runner import Runner

    from mmnanhook import NonFiniteError
    try:
        Runner.from_cfg(cfg).train()
    except NonFiniteError as error:
        assert error.bundle is not None
        return error
    raise AssertionError('the run ended without a NonFiniteError')


def mmnan(*args, **kwargs):
    """Run ``python -m mmnanhook ARGS`` in a fresh process.

    Args:
        *args: Command-line arguments.
        importable (bool): Whether the project modules of
            :data:`PROJECT_DIR` are importable there. Defaults to True.
        timeout (float): Seconds it may take. Defaults to 600.

    Returns:
        subprocess.CompletedProcess: With ``stdout`` and ``stderr`` as text.
    """
    env = dict(os.environ, OMP_NUM_THREADS='1')
    paths = [p for p in env.pop('PYTHONPATH', '').split(os.pathsep) if p]
    if kwargs.pop('importable', True):
        paths.insert(0, PROJECT_DIR)
    if paths:
        env['PYTHONPATH'] = os.pathsep.join(paths)
    timeout = kwargs.pop('timeout', 600)
    assert not kwargs, kwargs
    return subprocess.run(
        [sys.executable, '-m', 'mmnanhook'] + [str(a) for a in args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, env=env, timeout=timeout)


def mmnan_patched(tmp_path, path, old, new, *args):
    """Run ``python -m mmnanhook ARGS`` from a scratch copy of the package
    whose file ``path`` (relative to the package) has its one ``old`` line
    replaced by ``new``: a regression planted where nothing else sees it.

    Returns:
        subprocess.CompletedProcess: As :func:`mmnan`.
    """
    import shutil

    import mmnanhook
    scratch = tmp_path / 'scratch'
    shutil.copytree(osp.dirname(osp.abspath(mmnanhook.__file__)),
                    str(scratch / 'mmnanhook'),
                    ignore=shutil.ignore_patterns('__pycache__'))
    source = scratch / 'mmnanhook' / path
    text = source.read_text()
    assert text.count(old) == 1, '{} changed: update the test'.format(path)
    source.write_text(text.replace(old, new))
    env = dict(os.environ, OMP_NUM_THREADS='1')
    env.pop('PYTHONPATH', None)
    # The scratch copy first on the path: ``-m`` puts the cwd there.
    return subprocess.run(
        [sys.executable, '-m', 'mmnanhook'] + [str(a) for a in args],
        cwd=str(scratch), env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, universal_newlines=True, timeout=1500)


def run_report(bundle):
    """The ``report.json`` the run wrote into ``bundle``."""
    with open(osp.join(bundle, 'report.json')) as f:
        return json.load(f)


def assert_same_report(replayed, original):
    """Everything but the times it took is the same."""
    replayed, original = dict(replayed), dict(original)
    for report in (replayed, original):
        report.pop('elapsed_s')
        report.pop('fixes_s')
    assert replayed == original


def replay_json(bundle, *flags):
    """``mmnan replay BUNDLE --device cpu --json FLAGS``: (exit code,
    report)."""
    result = mmnan('replay', bundle, '--device', 'cpu', '--json', *flags)
    assert result.returncode in (0, 3), result.stderr
    # stdout holds the report alone (logs go to stderr).
    return result.returncode, json.loads(result.stdout)


# A Python warning on stderr: its 'file:line: XWarning: message' line, then
# the indented source line.
_PY_WARNING = re.compile(r'^\S.*:\d+: \w*Warning: ')


def message_lines(stderr):
    """The lines of ``stderr`` that are not Python warnings.

    torch 1.7 without a GPU and mmengine on torch < 1.8 warn while being
    imported, before the CLI runs; that is no part of its answer.
    """
    lines, after_warning = [], False
    for line in stderr.splitlines():
        if _PY_WARNING.match(line):
            after_warning = True
        elif after_warning and line.startswith(' '):
            after_warning = False
        else:
            after_warning = False
            lines.append(line)
    return lines


def assert_bad_input(result, command, expected):
    """Exit 2, nothing on stdout, one line on stderr that names ``expected``
    (after the warning line of a replay on torch < 2.5, which says how the
    bundle is loaded there)."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert 'Traceback' not in result.stderr
    assert result.stdout == ''
    lines = message_lines(result.stderr)
    if command == 'replay' and ALLOWLIST_FALLBACK:
        assert lines[:1] == [FALLBACK_WARNING], result.stderr
        lines = lines[1:]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith('mmnan {}: error: '.format(command))
    assert expected in lines[0]
