"""A long run's incidents in a short one, for ``mmnan inspect WORK_DIR``:
the tiny RetinaNet (VOC) under ``NanDetectHook(policy='drop')``, trained in
two processes that share one work dir (a crash must take down the script,
never the test session).

Usage::

    python -m mmnan_testing.story first WORK_DIR
    python -m mmnan_testing.story second WORK_DIR

``first``: :data:`ITERS` iterations planned, a checkpoint after each; image
``k`` is in iteration ``k // 2`` (no shuffling). Iteration :data:`DROP_AT`
holds a zero-width box (dropped, quarantined), :data:`SPIKE_AT` a finite
loss spike (its box loss x :data:`SPIKE`; ``spike_policy='warn'``),
:data:`SKIP_AT` a NaN gradient every sample makes (nothing to drop: the
step is skipped); in :data:`DIES_AT` the backbone's forward kills the
process (SIGKILL, as the OOM killer). ``second``: the same config,
``resume=True``, trained to its end: it quarantines the died step's
samples, and iteration :data:`DROP_AGAIN_AT` holds a second zero-width box.
Each prints one JSON line: the images of its iterations' batches (``first``
up to the one it dies in).
"""
import json
import os
import os.path as osp
import signal
import sys

import torch
from mmengine.hooks import Hook
from mmengine.runner import Runner

from mmnanhook._mmengine import unwrap_model
from mmnan_testing import faults, testbed

ITERS = 10
BATCH = 2
DROP_AT, SPIKE_AT, SKIP_AT, DIES_AT, DROP_AGAIN_AT = 3, 4, 5, 6, 8
# The zero-width boxes: the second sample of each of those iterations.
BAD = (BATCH * DROP_AT + 1, BATCH * DROP_AGAIN_AT + 1)
SPIKE = 20.0
# Small bands, so that a short run is judged: from its fourth iteration.
SPIKES = dict(spike_window=10, spike_warmup=3)


def _print(**values):
    print(json.dumps(values))
    sys.stdout.flush()


class _Incidents(Hook):
    """Plants what each iteration of the plan holds; notes the images of
    every batch."""

    priority = 'VERY_HIGH'

    def __init__(self, dies):
        self.dies = dies
        self.files = []
        self.armed = False

    def before_train(self, runner):
        model = unwrap_model(runner.model)
        model.backbone.register_forward_pre_hook(self._in_forward)

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        model = unwrap_model(runner.model)
        model.neck.tail.armed = runner.iter == SKIP_AT
        model.bbox_head.loss_bbox.loss_weight = \
            SPIKE if runner.iter == SPIKE_AT else 1.0
        self.files.append([s.metainfo['img_path']
                           for s in data_batch['data_samples']])
        self.armed = self.dies and runner.iter == DIES_AT
        if self.armed:
            _print(iter=runner.iter, files=self.files)

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        model = unwrap_model(runner.model)
        model.neck.tail.armed = False
        model.bbox_head.loss_bbox.loss_weight = 1.0

    def _in_forward(self, module, args):
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)


def config(work_dir, resume):
    """The tiny RetinaNet's config of both runs, and its data."""
    faults.register_mmdet_modules()
    data = testbed.make_dataset(
        'retinanet_voc', osp.join(work_dir, 'data'),
        num_images=BATCH * ITERS, defects=dict((k, 'zero_size') for k in BAD))
    cfg = testbed.tiny_config('retinanet_voc', data,
                              osp.join(work_dir, 'work'), max_iters=ITERS,
                              log_level='WARNING')
    cfg.model.neck = dict(type='GalleryNeck', fpn=cfg.model.neck,
                          tail='nan_gradient')
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=1,
                                        by_epoch=False)
    cfg.resume = resume
    cfg.custom_imports = dict(imports=['mmnanhook'],
                              allow_failed_imports=False)
    cfg.custom_hooks = [dict(type='NanDetectHook', policy='drop', **SPIKES)]
    return cfg, data


def run(work_dir, second):
    torch.set_num_threads(1)
    cfg, _ = config(work_dir, second)
    runner = Runner.from_cfg(cfg)
    incidents = _Incidents(dies=not second)
    runner.register_hook(incidents)
    runner.train()
    _print(files=incidents.files, iter=runner.iter)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    command, work_dir = argv
    run(work_dir, {'first': False, 'second': True}[command])


if __name__ == '__main__':
    main()
