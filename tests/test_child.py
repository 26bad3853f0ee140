"""A child process of mmnanhook is a stranger to the process that forks it
(:mod:`mmnanhook._child`): none of the parent's signal handlers, exit
functions or frames run in it, it leads its own process group, it cannot
outlive its parent, and no wait for it is unbounded. Forked from the pytest
process itself, as the index walk and the scan's workers are.
"""
import atexit
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mmnanhook._child import (REAP_WITHIN, Child, ChildFailed,
                              ordered_map)
from mmnan_testing.preempt import alive

# Signals a user's process may handle in Python: every one of them must be
# the default in the child.
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP,
           signal.SIGALRM)


@pytest.fixture
def handlers(tmp_path):
    """The pytest process with a handler for each of :data:`HANDLED`
    writing ``handler.<pid>`` (and an atexit function writing
    ``atexit.<pid>``), put back after."""

    def write(name):
        with open(str(tmp_path / ('%s.%d' % (name, os.getpid()))), 'w'):
            pass

    def handler(signum, frame):
        write('handler')

    before = dict((each, signal.signal(each, handler)) for each in HANDLED)
    at_exit = lambda: write('atexit')  # noqa: E731 - a one-line function
    atexit.register(at_exit)
    try:
        yield tmp_path
    finally:
        atexit.unregister(at_exit)
        for each, old in before.items():
            signal.signal(each, old)


def _report(path):
    # In the child: what it inherited, written for the parent to read.
    import json
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with open(path, 'w') as f:
        json.dump(dict(
            defaults=[signal.getsignal(each) == signal.SIG_DFL
                      for each in HANDLED],
            blocked=sorted(int(each) for each in blocked),
            group=os.getpgid(0) == os.getpid()), f)


def _sleep():
    time.sleep(60)


def _raise():
    raise KeyboardInterrupt


def test_a_child_inherits_no_handler_and_leads_its_own_group(handlers):
    import json
    path = str(handlers / 'report.json')
    child = Child(_report, (path, ))
    assert child.wait(10) == 0
    with open(path) as f:
        report = json.load(f)
    assert report == dict(defaults=[True] * len(HANDLED), blocked=[],
                          group=True)
    # The parent's handlers are its own still.
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)


@pytest.mark.parametrize('signum', HANDLED)
def test_a_signal_to_a_child_ends_it_and_runs_no_handler(handlers, signum):
    child = Child(_sleep)
    # At once: the signal may come before the child's first line.
    os.kill(child.pid, signum)
    assert child.wait(10) == -signum
    assert os.listdir(str(handlers)) == []


def test_a_child_leaves_by_os_exit_on_every_path(handlers):
    # Returning, and raising (KeyboardInterrupt too): no atexit function,
    # no pytest frame below the fork runs in the child.
    done, raised = Child(time.sleep, (0, )), Child(_raise)
    assert done.wait(10) == 0 and raised.wait(10) == 1
    assert os.listdir(str(handlers)) == []


def test_a_stopped_child_is_stopped_within_the_bound():
    child = Child(_sleep)
    os.kill(child.pid, signal.SIGSTOP)
    start = time.monotonic()
    assert child.stop()
    assert time.monotonic() - start < REAP_WITHIN
    assert child.exitcode == -signal.SIGKILL and not alive(child.pid)


def test_a_child_does_not_outlive_its_parent(tmp_path):
    # A parent killed (SIGKILL: nothing of it runs) takes its child along.
    script = textwrap.dedent('''
        import sys, time
        from mmnanhook._child import Child
        print(Child(time.sleep, (60, )).pid, flush=True)
        time.sleep(60)
    ''')
    parent = subprocess.Popen([sys.executable, '-c', script],
                              stdout=subprocess.PIPE)
    try:
        pid = int(parent.stdout.readline())
        assert alive(pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def _square(x):
    if x == 7:
        raise ValueError('seven')
    return x * x


def test_ordered_map_gives_results_in_order():
    assert list(ordered_map(_square, range(7), 2, stall=30)) == [
        x * x for x in range(7)]
    with pytest.raises(ValueError, match='seven'):
        list(ordered_map(_square, range(10), 2, stall=30))


def _kill_self(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def _stop_self(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    return x


@pytest.mark.parametrize('function, stall, message', [
    (_kill_self, 30, 'a worker died'), (_stop_self, 1, 'no worker finished')])
def test_ordered_map_fails_when_a_worker_dies_or_stops(function, stall,
                                                       message):
    start = time.monotonic()
    done = []
    with pytest.raises(ChildFailed, match=message):
        for each in ordered_map(function, range(8), 2, stall=stall):
            done.append(each)
    # In order, up to the task that never came back (a death may be seen
    # before the task before it is read).
    assert done == list(range(len(done))) and len(done) <= 3
    assert time.monotonic() - start < stall + REAP_WITHIN
