"""Child processes that are strangers to the process that starts them.

mmnanhook forks where a child saves the training process work of its own
threads: the walk of a large dataset for its sample index
(:mod:`.quarantine._index`) and the workers of ``mmnan scan`` / ``doctor``
(:func:`ordered_map`). A fork copies all of the process that forks: the
user's signal handlers (a cluster job's SIGTERM handler that checkpoints and
requeues), its ``atexit`` functions and finalizers, the frames below the
fork (pytest's, a launcher's). A child of mmnanhook runs none of them:

* every signal is blocked in the forking thread across the fork, so no
  handler of the parent runs in the child, not even before its first line;
  the child resets every handler to the default, leads a process group of
  its own (a Ctrl-C at the terminal, or a signal to the job's process group,
  is the parent's to handle: the child ends with the parent), and only then
  unblocks them;
* it cannot outlive its parent: Linux's ``PR_SET_PDEATHSIG`` kills it (SIGKILL)
  when the thread that forked it ends, and a parent already gone before that
  was set is noticed;
* it leaves by ``os._exit`` on every path, its own exceptions included.

The parent never waits for one without a bound: :meth:`Child.wait` takes a
timeout, :meth:`Child.stop` kills it (SIGKILL: a stopped process takes it
too) and reaps it within :data:`REAP_WITHIN` seconds, and
:func:`ordered_map` fails when no task is done for ``stall`` seconds.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import wait as wait_ready
from typing import Any, Callable, Iterable, Iterator, Optional

from .compat import valid_signals

# prctl's option that signals a child when its parent ends.
_PR_SET_PDEATHSIG = 1

# Seconds a killed child is given to be reaped: SIGKILL ends any process
# but one in uninterruptible sleep (a hung disk or NFS read).
REAP_WITHIN = 5.0

# Exit codes of a child: its work done, or failed (any exception).
_DONE, _FAILED = 0, 1

# How often a wait looks at a child again (seconds, at most).
_POLL = 0.05


def can_fork() -> bool:
    """Whether this platform forks (Linux, macOS)."""
    return 'fork' in multiprocessing.get_all_start_methods()


def _become_stranger(parent: int) -> None:
    """In a child just forked (every signal blocked): the defaults of every
    signal, a process group of its own, death with the parent; then
    signals unblocked."""
    for each in valid_signals():
        if each in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(each, signal.SIG_DFL)
        except (OSError, RuntimeError, ValueError):
            pass  # one the platform keeps for itself
    try:
        os.setpgid(0, 0)
    except OSError:
        pass  # already a group leader
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass  # not Linux: the parent's stop() is the only end
    if os.getppid() != parent:
        os._exit(_FAILED)  # the parent ended before prctl took
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def _run(parent: int, target: Callable, args: tuple) -> None:
    """A child's whole life: never returns into the frames it was forked
    from."""
    code = _FAILED
    try:
        _become_stranger(parent)
        target(*args)
        code = _DONE
    except BaseException:  # noqa: B902 - nothing of the parent's may run
        pass
    finally:
        os._exit(code)


def fork_stranger(target: Callable, args: tuple = ()) -> int:
    """Fork a child that runs ``target(*args)`` as a stranger (the
    module's docstring) and exits 0, or 1 when it raises.

    Returns:
        int: The child's pid.

    Raises:
        OSError: No fork (out of processes or memory).
    """
    parent = os.getpid()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, valid_signals())
    try:
        pid = os.fork()
        if pid == 0:
            _run(parent, target, args)
    finally:
        # The parent's signals arrive now, to its own handlers.
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return pid


class Child(object):
    """One forked stranger (:func:`fork_stranger`), waited for with bounds.

    Args:
        target (callable): What the child runs.
        args (tuple): Its arguments (the child's copies, by the fork).

    Attributes:
        pid (int): The child's.
        exitcode (int | None): ``None`` while it runs; 0 done, 1 failed,
            ``-N`` ended by signal ``N``, ``-1`` reaped by someone else.
    """

    def __init__(self, target: Callable, args: tuple = ()) -> None:
        self.pid = fork_stranger(target, args)
        self.exitcode: Optional[int] = None

    def poll(self) -> Optional[int]:
        """Its exit code once it ended (reaped now), else ``None``."""
        if self.exitcode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # Reaped elsewhere (SIGCHLD ignored, or a user's code that
                # reaps any child).
                self.exitcode = -1
            else:
                if pid:
                    self.exitcode = (-os.WTERMSIG(status)
                                     if os.WIFSIGNALED(status) else
                                     os.WEXITSTATUS(status))
        return self.exitcode

    def wait(self, timeout: float) -> Optional[int]:
        """Its exit code, waiting at most ``timeout`` seconds for it; else
        ``None``."""
        end = time.monotonic() + timeout
        while self.poll() is None:
            left = end - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(_POLL, left))
        return self.exitcode

    def stop(self) -> bool:
        """Kill it (if it runs) and reap it, within :data:`REAP_WITHIN`
        seconds.

        Returns:
            bool: Whether it is gone (``False``: it could not be reaped in
            time, stuck in the kernel; it dies when it comes back).
        """
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.wait(REAP_WITHIN) is not None


class ChildFailed(RuntimeError):
    """A worker of :func:`ordered_map` died or stopped answering."""


def _serve(function: Callable, connection: Any) -> None:
    # A worker: tasks in, (ok, result or error) out, until told to stop.
    # Ends at EOFError: the parent closed its end, or is gone.
    while True:
        task = connection.recv()
        try:
            answer = (True, function(task))
        except Exception as error:  # noqa: BLE001 - the parent raises it
            answer = (False, error)
        try:
            connection.send(answer)
        except Exception as error:  # noqa: BLE001 - e.g. not picklable
            connection.send((False, RuntimeError('%s: %s' % (
                type(error).__name__, error))))


def _died(child: Child) -> ChildFailed:
    """What a map raises when ``child`` is gone (its pipe closed, reset or
    broken)."""
    return ChildFailed('a worker died (exit code %s: killed by the OOM '
                       'killer?)' % child.wait(REAP_WITHIN))


def _give(worker: tuple, tasks: Iterator, number: int) -> bool:
    """Send ``worker`` the next task (the ``number``-th); ``False`` when
    there is none left."""
    child, connection, queue = worker
    for task in tasks:
        try:
            connection.send(task)
        except OSError:
            raise _died(child)
        queue.append(number)
        return True
    return False


def ordered_map(function: Callable, tasks: Iterable, workers: int,
                stall: float) -> Iterator:
    """``function(task)`` for each task, in the tasks' order, computed by
    ``workers`` forked strangers (:class:`Child`; they inherit ``function``
    and what it reads, copy-on-write), two tasks in flight each.

    Args:
        function (callable): Of one task; its result must pickle.
        tasks (iterable): Picklable tasks.
        workers (int): Child processes.
        stall (float): Seconds without any task done after which the map
            fails (a worker killed by the OOM killer, or stopped).

    Yields:
        Each task's result, in order. An exception of ``function`` is raised
        here as it was raised there.

    Raises:
        ChildFailed: A worker died, or none answered for ``stall`` s.

    Every worker is killed and reaped when the map ends, however it ends.
    """
    tasks = iter(tasks)
    children = []
    try:
        for _ in range(workers):
            ours, theirs = multiprocessing.Pipe()
            child = Child(_serve, (function, theirs))
            theirs.close()
            children.append((child, ours, []))
        sent = done = 0
        results = {}
        for entry in children * 2:
            if not _give(entry, tasks, sent):
                break
            sent += 1
        while done < sent:
            if done in results:
                ok, value = results.pop(done)
                if not ok:
                    raise value
                done += 1
                yield value
                continue
            busy = [entry for entry in children if entry[2]]
            ready = wait_ready([entry[1] for entry in busy], timeout=stall)
            if not ready:
                raise ChildFailed('no worker finished a task in %g s '
                                  '(stopped, or stuck)' % stall)
            for child, connection, queue in busy:
                if connection not in ready:
                    continue
                try:
                    results[queue.pop(0)] = connection.recv()
                except (EOFError, OSError):
                    # Closed, or reset: a worker that died with a task
                    # unread resets its socket.
                    raise _died(child)
                if _give((child, connection, queue), tasks, sent):
                    sent += 1
    finally:
        for child, connection, _ in children:
            connection.close()
            child.stop()
