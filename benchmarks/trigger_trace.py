"""Which of mmnanhook's modules one ``'drop'`` trigger runs in, in order.

The tiny RetinaNet of ``mmnan demo`` (one zero-width box in image 5) trains
under ``NanDetectHook(policy='drop')``. From the moment tier 1's check
returns the trigger's event until the update step's ``check_step`` returns
(the step's fate settled: recomputed without the bad sample and applied),
every call that a module of the package makes straight into a function of
the package is recorded with both modules. A call that torch, mmengine or
the model makes (a hook of ours that a replayed forward calls back) is not
one module calling another and is left out.

Counted, a **crossing**: such a call between two modules where either side
is a room that settles the step's fate (``hook``, ``run/``, ``recovery/``,
``sentinel/``): every call of the trigger's path between two of its
modules, and every call from the rooms that work for it (``diagnosis/``,
``report/``, ``bundle/``, ``quarantine/``, ``memory/``, ``distributed/``,
``doctor/``) back into those rooms. Calls among the working rooms (a
diagnosis formatting its report, writing its bundle) are their own
business, and the bottom floor of docs/how-it-works.md, every room's tools
(``records/``, ``errors``, ``options``, ``compat`` and every ``_*.py`` of
the package's top level), is not counted as a callee. ``--path-only``
counts as the trace did before issue 56: no call made inside the working
rooms counted, every other call counted (``memory/`` and ``distributed/``
were in ``sentinel/`` then).

Usage::

    python benchmarks/trigger_trace.py              # the count and the trace
    python benchmarks/trigger_trace.py --all        # every call recorded
    python benchmarks/trigger_trace.py --path-only  # the count of issue 45
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import os.path as osp
import sys
import tempfile

import mmnanhook

PACKAGE = osp.dirname(osp.abspath(mmnanhook.__file__)) + osp.sep
ROOMS_OF_THEIR_OWN = ('diagnosis', 'report', 'bundle', 'quarantine',
                      'doctor', 'demo', 'cli')
DECIDING = ('hook', 'run', 'recovery', 'sentinel')
LEAVES = ('records', 'errors', 'options', 'compat', 'version', 'registry')


def module_of(code):
    """``sentinel._drop`` for a code object of the package, else ``None``."""
    filename = osp.abspath(code.co_filename)
    if not filename.startswith(PACKAGE):
        return None
    return filename[len(PACKAGE):-3].replace(osp.sep, '.')


def _caller(frame):
    frame = frame.f_back
    while frame is not None:
        module = module_of(frame.f_code)
        if module is not None:
            return module
        frame = frame.f_back
    return None


def _check_step(frame):
    """The frame of ``WrapperSentinel.check_step`` below ``frame``: it
    returns once the step's fate is settled."""
    while frame.f_code.co_name != 'check_step':
        frame = frame.f_back
    return frame


class Trace(object):
    """The calls of one trigger, from its event to its step's fate."""

    def __init__(self):
        # The frame of the update step's check_step that found the trigger.
        self.outer = None
        self.calls = []

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if self.outer is None:
            if (event == 'return' and code.co_name == 'check'
                    and module_of(code) == 'sentinel._check'
                    and getattr(arg, 'event', None) is not None):
                self.outer = _check_step(frame)
            return
        if event == 'return' and frame is self.outer:
            sys.setprofile(None)
            return
        if event != 'call':
            return
        callee = module_of(code)
        if callee is not None and module_of(frame.f_back.f_code) is not None:
            # Called by a module of the package itself: what torch, mmengine
            # or the model calls back (a hook of ours in a replayed
            # forward) is not one room calling another.
            self.calls.append((_caller(frame), callee, code.co_name))


def crossings(calls, path_only=False):
    """The calls that cross between modules: to or from a room that
    settles the step's fate (of the trigger's path alone: ``path_only``)."""
    counted = []
    for caller, callee, name in calls:
        if caller is None or caller == callee:
            continue
        room, into = caller.split('.')[0], callee.split('.')[0]
        if into in LEAVES or into.startswith('_'):
            # The bottom floor (docs/how-it-works.md): every room's tools.
            continue
        if path_only:
            if room in ROOMS_OF_THEIR_OWN:
                continue
        elif room not in DECIDING and into not in DECIDING:
            continue
        counted.append((caller, callee, name))
    return counted


def run(work_dir):
    from mmengine.runner import Runner

    from mmnanhook.demo import demo_dataset, tiny_config
    data = demo_dataset(False, osp.join(work_dir, 'data'))
    cfg = tiny_config(
        'retinanet_voc', data, osp.join(work_dir, 'run'), max_iters=4,
        custom_hooks=[dict(type='NanDetectHook', policy='drop',
                           dump_dir=osp.join(work_dir, 'dumps'))])
    runner = Runner.from_cfg(cfg)
    trace = Trace()
    sys.setprofile(trace)
    try:
        runner.train()
    finally:
        sys.setprofile(None)
    return trace.calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--all', action='store_true',
                        help='print every call recorded, not only those '
                        'that cross')
    parser.add_argument('--path-only', action='store_true',
                        help='leave the calls out of the rooms that work on '
                        'their own uncounted (the count before issue 56)')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work_dir:
        calls = run(work_dir)
    if not calls:
        print('no trigger happened')
        return 1
    counted = crossings(calls, args.path_only)
    for caller, callee, name in (calls if args.all else counted):
        print('%-28s -> %-28s %s' % (caller, callee, name))
    rooms = [c for c in counted
             if c[0].split('.')[0] != c[1].split('.')[0]]
    print('%d crossings between modules%s, %d of them between rooms (%d '
          'calls into the package recorded)' % (
              len(counted), " of the trigger's path" if args.path_only
              else ', from every room, to or from the deciding rooms',
              len(rooms), len(calls)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
