"""A training script that catches ``NonFiniteError``, keeps it, and exits.

What a sweep, a retry loop or a notebook does: the error (and through it
the report, the event, the hook) stays referenced until the interpreter
shuts down. If anything reachable from it still held an autograd graph
whose nodes carry Python hooks, torch 1.7 would hang in finalization.

Usage::

    python -m mmnan_testing.exit_check FAULT WORK_DIR EXIT_CODE

``FAULT`` is ``rng`` (a neck that makes NaN from ``torch.rand``, so only a
replay from the kept RNG state reproduces it), ``backward`` (a loss whose
backward alone makes Inf: ``sqrt`` at 0) or ``data`` (a zero-width GT box).
Prints one JSON line, then exits with ``EXIT_CODE``.
"""
import json
import sys

import torch
from mmengine.hooks import Hook
from mmengine.runner import Runner

from mmnanhook import NonFiniteError
from mmnan_testing import faults, testbed

FAULTS = ('rng', 'backward', 'data')


class _Reseed(Hook):
    """Seeds torch before iteration 1 so the planted drop fires there."""

    priority = 'VERY_HIGH'

    def __init__(self, seeds):
        self.seeds = seeds

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter in self.seeds:
            torch.manual_seed(self.seeds[runner.iter])


def build_runner(fault, work_dir, **hook_options):
    """A tiny RetinaNet with ``fault`` planted and NanDetectHook on.

    Args:
        fault (str): One of :data:`FAULTS`.
        work_dir (str): Where data, work dir and bundles go.
        **hook_options: More ``NanDetectHook`` options.
    """
    torch.set_num_threads(1)
    faults.register_mmdet_modules()
    # VOC: XMLDataset keeps the zero-width box that CocoDataset would drop.
    config = 'retinanet_voc' if fault == 'data' else 'retinanet'
    defects = {2: 'zero_size'} if fault == 'data' else {}
    data = testbed.make_dataset(config, work_dir + '/data', num_images=4,
                                defects=defects)
    overrides = {}
    if fault == 'backward':
        overrides['model.bbox_head.loss_bbox'] = dict(type='SqrtL1Loss')
    cfg = testbed.tiny_config(config, data, work_dir + '/work',
                              max_iters=2, log_level='WARNING', **overrides)
    if fault == 'rng':
        cfg.model.neck = dict(type='GalleryNeck', fpn=cfg.model.neck,
                              tail='drop')
    cfg.custom_imports = dict(imports=['mmnanhook'],
                              allow_failed_imports=False)
    cfg.custom_hooks = [dict(hook_options, type='NanDetectHook',
                             dump_dir=work_dir + '/dumps')]
    runner = Runner.from_cfg(cfg)
    if fault == 'rng':
        runner.register_hook(_Reseed({0: faults.seed_of(False),
                                      1: faults.seed_of(True, False)}))
    return runner


def main(argv=None):
    fault, work_dir, code = (argv or sys.argv[1:])[:3]
    if fault not in FAULTS:
        raise SystemExit('FAULT must be one of %s' % ', '.join(FAULTS))
    runner = build_runner(fault, work_dir)
    try:
        runner.train()
        kept = None
    except NonFiniteError as exc:
        kept = exc
    # Kept referenced until the interpreter exits, on purpose.
    globals()['_KEPT'] = kept
    print(json.dumps(dict(
        fault=fault, raised=kept is not None,
        trigger=getattr(kept, 'trigger', None),
        iter=getattr(kept, 'iter', None),
        kind=(getattr(kept, 'report', None) or {}).get('kind'))))
    sys.stdout.flush()
    sys.exit(int(code))


if __name__ == '__main__':
    main()
