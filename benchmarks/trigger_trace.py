"""Which of mmnanhook's modules one ``'drop'`` trigger runs in, in order.

The tiny RetinaNet of ``mmnan demo`` (one zero-width box in image 5) trains
under ``NanDetectHook(policy='drop')``. From the moment tier 1's check
returns the trigger's event until the update step's check that found it returns
its decision (the step's fate settled: recomputed without the bad sample and
applied), every call into a function of the package is recorded with the module it runs in and
the package module it was called from (the nearest package frame below it:
mmengine's and torch's frames in between are not modules of ours).

Counted, a **crossing**: a call from one module of the trigger's path into
another module of the package. The path is every module but those that
work for one room (a diagnosis's replays, the report, the bundle, the
quarantine's file: calls made *inside* ``diagnosis/``, ``report/``,
``bundle/``, ``quarantine/`` and ``doctor/`` are that room's own business)
and the leaf modules every room uses as values (``records/``, ``errors``,
``options``, ``compat``, ``_log``, ``_batch``, ``_patch``, ``_mmengine``,
``_anomaly``), which are not counted as callees either.

Usage::

    python benchmarks/trigger_trace.py            # the count and the trace
    python benchmarks/trigger_trace.py --all      # every call recorded
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
LEAVES = ('records', 'errors', 'options', 'compat', '_log', '_batch',
          '_patch', '_mmengine', '_anomaly')


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


class Trace(object):
    """The calls of one trigger, from its event to its step's fate."""

    def __init__(self):
        # The frame of the update step's check that found the trigger.
        self.outer = None
        self.calls = []

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if self.outer is None:
            if (event == 'return' and code.co_name == 'check'
                    and module_of(code) == 'sentinel._check'
                    and getattr(arg, 'event', None) is not None):
                self.outer = frame.f_back
            return
        if event == 'return' and frame is self.outer:
            sys.setprofile(None)
            return
        if event != 'call':
            return
        callee = module_of(code)
        if callee is not None:
            self.calls.append((_caller(frame), callee, code.co_name))


def crossings(calls):
    """The calls that cross between modules of the trigger's path."""
    counted = []
    for caller, callee, name in calls:
        if caller is None or caller == callee:
            continue
        if caller.split('.')[0] in ROOMS_OF_THEIR_OWN:
            continue
        if callee.split('.')[0] in LEAVES:
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work_dir:
        calls = run(work_dir)
    if not calls:
        print('no trigger happened')
        return 1
    counted = crossings(calls)
    for caller, callee, name in (calls if args.all else counted):
        print('%-28s -> %-28s %s' % (caller, callee, name))
    rooms = [c for c in counted
             if c[0].split('.')[0] != c[1].split('.')[0]]
    print('%d crossings between modules of the trigger\'s path, %d of them '
          'between rooms (%d calls into the package recorded)' % (
              len(counted), len(rooms), len(calls)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
