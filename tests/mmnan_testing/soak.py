"""A long ``policy='skip'`` run through random faults, for leaks and counts.

A tiny RetinaNet trains on a VOC-style dataset in which a random tenth of
the batches are bad: half of them carry a zero-width GT box (a data fault),
half arm a neck module whose gradient is NaN (a backward-only fault). Every
bad step must be skipped, ``train/nan_skipped`` must equal their count, the
weights must stay finite, at most ``max_dumps`` bundles may stay on disk,
and the resident memory must not grow.
"""
import ctypes
import glob
import math
import os
import os.path as osp
import random

import torch
from mmengine.hooks import Hook
from mmengine.runner import Runner

from mmnanhook._mmengine import unwrap_model
from mmnan_testing import faults, testbed

BATCH = 2


def rss_bytes():
    """The process's resident set size (Linux), or ``None``."""
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, ValueError):
        return None


def trimmed_rss_bytes():
    """RSS after glibc's ``malloc_trim(0)`` hands free heap pages back.

    Memory that was freed but stays in the allocator's arenas counts in RSS;
    trimmed, a steady RSS means nothing is held. ``None`` without glibc.
    """
    try:
        libc = ctypes.CDLL('libc.so.6')
    except OSError:
        return None
    libc.malloc_trim(0)
    return rss_bytes()


def plan(iters, bad_fraction=0.1, seed=0):
    """``{iteration: 'data' | 'backward'}`` for the bad iterations."""
    rng = random.Random(seed)
    bad = sorted(rng.sample(range(iters), int(round(iters * bad_fraction))))
    return {it: ('data' if k % 2 == 0 else 'backward')
            for k, it in enumerate(bad)}


class _Soak(Hook):
    """Arms the backward fault where planned; records weights' finiteness
    and the resident memory after every iteration."""

    priority = 'VERY_HIGH'

    def __init__(self, planned):
        self.planned = planned
        self.rss = []
        self.trimmed = []
        self.finite = True

    def _tail(self, runner):
        return unwrap_model(runner.model).neck.tail

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self._tail(runner).armed = self.planned.get(runner.iter) == 'backward'

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        self._tail(runner).armed = False
        self.rss.append(rss_bytes())
        self.trimmed.append(trimmed_rss_bytes())
        self.finite = self.finite and all(
            bool(torch.isfinite(p).all()) for p in runner.model.parameters())


def slope(values):
    """Least-squares slope of ``values`` per step."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2.0, sum(values) / float(n)
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def run_soak(work_dir, iters=500, bad_fraction=0.1, seed=0, max_dumps=5,
             tail=400, hook=True, **hook_options):
    """Train ``iters`` iterations under ``policy='skip'``; see the module.

    With ``hook=False`` the same run without mmnanhook and without faults:
    the memory baseline. ``hook_options`` go to ``NanDetectHook``.

    Returns:
        dict: ``planned`` (bad iterations), ``skipped``, ``finite``,
        ``bundles``, ``rss_mb`` (per iteration), ``slope_kb_per_iter`` over
        the last ``tail`` iterations, the same after ``malloc_trim``
        (``trimmed_mb``, ``trimmed_slope_kb_per_iter``), ``iters`` run.
    """
    torch.set_num_threads(1)
    faults.register_mmdet_modules()
    planned = plan(iters, bad_fraction, seed) if hook else {}
    data_iters = [it for it, kind in planned.items() if kind == 'data']
    # Image k lands in iteration k // BATCH (no shuffling).
    defects = {BATCH * it: 'zero_size' for it in data_iters}
    data = testbed.make_dataset('retinanet_voc', osp.join(work_dir, 'data'),
                                num_images=BATCH * iters, defects=defects)
    # At the configs' lr the tiny detectors diverge after a few dozen
    # iterations by themselves: a real divergence is not the point here.
    cfg = testbed.tiny_config('retinanet_voc', data,
                              osp.join(work_dir, 'work'), max_iters=iters,
                              log_level='WARNING',
                              **{'optim_wrapper.optimizer.lr': 1e-4})
    cfg.model.neck = dict(type='GalleryNeck', fpn=cfg.model.neck,
                          tail='nan_gradient')
    dump_dir = osp.join(work_dir, 'dumps')
    cfg.custom_hooks = [dict(hook_options, type='mmnanhook.NanDetectHook',
                             policy='skip', max_dumps=max_dumps,
                             dump_dir=dump_dir)] if hook else []
    cfg.default_hooks.logger = dict(type='LoggerHook', interval=50)
    runner = Runner.from_cfg(cfg)
    soak = _Soak(planned)
    runner.register_hook(soak)
    runner.train()
    skipped = runner.message_hub.get_scalar('train/nan_skipped').current() \
        if hook else 0
    rss = [v / 2.0**20 for v in soak.rss if v is not None]
    trimmed = [v / 2.0**20 for v in soak.trimmed if v is not None]
    window, trimmed_window = rss[-tail:], trimmed[-tail:]
    return dict(planned=planned, skipped=int(skipped), finite=soak.finite,
                trimmed_mb=trimmed,
                trimmed_slope_kb_per_iter=slope(trimmed_window) * 1024
                if trimmed_window else math.nan,
                bundles=len(glob.glob(osp.join(dump_dir, '*',
                                               'manifest.json'))),
                rss_mb=rss, iters=runner.iter,
                slope_kb_per_iter=slope(window) * 1024 if window else math.nan)
