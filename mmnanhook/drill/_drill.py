"""``mmnan drill CONFIG``: the runs in a child process, watched with bounds,
and their verdicts.

The runs train in a process of their own (:mod:`._runs`), a stranger to
this one's signal handlers (:class:`mmnanhook._child.Child`, then an exec
of a fresh interpreter): a fault the protection does not hold against may
kill it (an op's SIGSEGV), and the drill says so instead of dying. A run
that dies is recorded as such and the remaining runs go on in a new process
(one process: under a launcher, the ranks' process group cannot be made
again); a run that takes longer than ``timeout`` seconds is killed.
"""
from __future__ import annotations

import json
import os
import os.path as osp
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from .._child import Child
from ..errors import DatasetError
from ..options import POLICIES
from ._faults import FAULTS
from ._runs import (CLEAN, CLEAN_WITHOUT, read_results, results_path,
                    write_results)
from ._verdict import judge_clean, judge_fault

# Iterations trained after the fault's.
AFTER = 1
# How often the results file is looked at (seconds).
_POLL = 0.5
# Lines of a dead process's log said.
_TAIL = 3


class Drill(object):
    """What a drill found on this rank.

    Args:
        verdicts (list[Verdict]): The clean run's, then one per fault.
        work_dir (str): Where its runs, bundles and logs are.
        changes (list[str]): What the drill changed of the config.
    """

    def __init__(self, verdicts: List[Any], work_dir: str,
                 changes: List[str]) -> None:
        self.verdicts = verdicts
        self.work_dir = work_dir
        self.changes = changes

    @property
    def ok(self) -> bool:
        """Whether every verdict holds."""
        return all(v.ok for v in self.verdicts)

    def to_dict(self) -> Dict[str, Any]:
        return dict(ok=self.ok, work_dir=self.work_dir, changes=self.changes,
                    verdicts=[v.to_dict() for v in self.verdicts])


def _exec(spec_path, log_path, package_root):
    """In the forked stranger: its output into the log, then a fresh
    interpreter running the runs."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    path = os.environ.get('PYTHONPATH')
    os.environ['PYTHONPATH'] = package_root + (os.pathsep + path
                                               if path else '')
    os.execv(sys.executable,
             [sys.executable, '-m', 'mmnanhook.drill', spec_path])


def _death(code, log_path):
    """How a process of runs ended, in words (with its log's last lines)."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = 'signal {}'.format(-code)
        return 'the process died of {}'.format(name)
    try:
        with open(log_path) as f:
            tail = [line.strip() for line in f if line.strip()][-_TAIL:]
    except OSError:
        tail = []
    return 'the process exited with code {}{}'.format(
        code, (': ' + ' | '.join(tail)) if tail else '')


def _validate(config, faults, iter, rank, world, policy, timeout):
    if not osp.isfile(config):
        raise DatasetError('no config file {}'.format(config))
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        raise ValueError('--faults: {!r} is not a list of {}'.format(
            ','.join(faults), ', '.join(FAULTS)))
    if iter < 0:
        raise ValueError('--iter: {} is not an iteration (>= 0)'.format(iter))
    if not 0 <= rank < world:
        raise ValueError('--rank: {} is not a rank of {}'.format(rank, world))
    if policy is not None and policy not in POLICIES:
        raise ValueError('--policy: {!r} is not one of {}'.format(
            policy, ', '.join(POLICIES)))
    if timeout <= 0:
        raise ValueError('--timeout: {} is not a number of seconds > 0'
                         .format(timeout))


def _shared_dir():
    """A new work dir every local rank of a launcher's group names alike:
    by the launcher's process (their parent) and its port."""
    return osp.join(tempfile.gettempdir(), 'mmnan_drill_{}_{}'.format(
        os.getppid(), os.environ.get('MASTER_PORT', '')))


def run_drill(config: str, faults: Sequence[str] = FAULTS, iter: int = 1,
              rank: int = 0, policy: Optional[str] = None,
              launcher: str = 'none', work_dir: Optional[str] = None,
              image_size: int = 320, synthetic: bool = False,
              timeout: float = 900.0,
              say: Optional[Callable[[str], None]] = None) -> 'Drill':
    """Drill NanDetectHook on a config: a clean run with and without it,
    and one run per fault planted in iteration ``iter`` on rank ``rank``.

    Args:
        config (str): The user's config file.
        faults (sequence[str]): Of :data:`FAULTS`.
        iter (int): The iteration the faults are planted in.
        rank (int): The rank they are planted on.
        policy (str, optional): NanDetectHook's policy; else the config's.
        launcher (str): ``'none'`` or ``'pytorch'`` (this process is one
            rank of ``torchrun``'s).
        work_dir (str, optional): Where runs, bundles and logs go (not one
            an earlier drill wrote to); else a new temporary directory
            (under a launcher, one every local rank names alike).
        image_size (int): The short side images are scaled to (0: as the
            config says).
        synthetic (bool): A synthetic dataset even where the config's own
            data is at hand.
        timeout (float): Seconds a run may take before it is killed.
        say (callable, optional): Called with each progress line.

    Returns:
        Drill: The verdicts.

    Raises:
        ValueError: A bad argument (naming the option).
        DatasetError: The config cannot be loaded, or no data had.
    """
    say = say or (lambda line: None)
    distributed = launcher != 'none'
    this = int(os.environ.get('RANK', 0)) if distributed else 0
    world = int(os.environ.get('WORLD_SIZE', 1)) if distributed else 1
    faults = list(faults)
    _validate(config, faults, iter, rank, world, policy, timeout)
    if work_dir is None:
        work_dir = _shared_dir() if distributed else tempfile.mkdtemp(
            prefix='mmnan_drill_')
    if osp.exists(results_path(work_dir, this)):
        # Its runs' bundles and outcomes would be taken for this drill's.
        raise ValueError('--work-dir: {} holds an earlier drill; give a new '
                         'directory'.format(work_dir))
    os.makedirs(work_dir, exist_ok=True)
    spec = dict(config=osp.abspath(config), work_dir=osp.abspath(work_dir),
                faults=faults, iter=iter, rank=rank, policy=policy,
                length=iter + 1 + AFTER, image_size=image_size,
                synthetic=synthetic, launcher=launcher, timeout=timeout)
    results = _run_children(spec, this, distributed, timeout, say)
    if 'prepared' not in results:
        raise DatasetError(results.get('failed', 'the drill could not start'))
    runs = results['runs']
    verdicts = [judge_clean(runs.get(CLEAN_WITHOUT), runs.get(CLEAN),
                            spec['length'], this)]
    policy = results['prepared']['policy']
    verdicts.extend(judge_fault(f, runs.get(f), spec, policy, this)
                    for f in faults)
    return Drill(verdicts, work_dir, results['prepared']['changes'])


def _run_children(spec, this, distributed, timeout, say):
    """Run the drill's runs, a new process after one that died, until each
    has an outcome; the results."""
    work_dir = spec['work_dir']
    spec_path = osp.join(work_dir, 'spec.rank{}.json'.format(this))
    with open(spec_path, 'w') as f:
        json.dump(spec, f)
    path = results_path(work_dir, this)
    log_path = osp.join(work_dir, 'drill.rank{}.log'.format(this))
    root = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
    names = [CLEAN_WITHOUT, CLEAN] + spec['faults']
    said = set()
    while True:
        child = Child(_exec, (spec_path, log_path, root))
        try:
            code, hung = _watch(child, path, timeout, said, say)
        finally:
            child.stop()
        results = read_results(path)
        runs = results.setdefault('runs', {})
        if all(n in runs for n in names):
            return results
        started = results.get('started')
        if started is None:  # it ended before any run: nothing to go on with
            results.setdefault('failed', 'its start took longer than {:g} s '
                               '(killed)'.format(timeout) if hung else
                               _death(code, log_path))
            return results
        runs[started] = dict(died='killed after {:g} s'.format(timeout)
                             if hung else _death(code, log_path))
        results['started'] = None
        write_results(path, results)
        if distributed:
            return results


def _watch(child, path, timeout, said, say):
    """Wait for ``child``, saying each run that ends, killing it when its
    start or a run takes longer than ``timeout``; ``(exit code, hung)``."""
    current, since = None, time.monotonic()
    while child.wait(_POLL) is None:
        results = _say_ended(path, said, say)
        if results.get('started') != current:
            current, since = results.get('started'), time.monotonic()
            if current is not None:
                say('running {}'.format(current))
        if time.monotonic() - since > timeout:
            return None, True
    _say_ended(path, said, say)
    return child.exitcode, False


def _say_ended(path, said, say):
    """Say the runs that ended since the last look; the results."""
    results = read_results(path)
    for name, outcome in sorted(results.get('runs', {}).items()):
        if name not in said:
            said.add(name)
            say('{}: {}'.format(name, outcome.get('error') or
                                outcome.get('died') or
                                '{} iterations'.format(outcome['iters'])))
    return results
