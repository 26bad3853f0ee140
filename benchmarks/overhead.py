"""Per-iteration overhead of NanDetectHook on real detectors (CPU).

Models: the tiny test-bed detectors, and mmdet's own RetinaNet R50 config as
shipped in the installed package (its LinearLR + MultiStepLR schedule, its
pipeline and sampler, at 320 px; see :mod:`mmnan_testing.zoo`), also with
its images loaded as float32 (tier 1's input check then runs). Each variant
trains its own real Runner on the same config, data and seed; the runners run in threads that take turns, one train iteration at a
time, in a random order drawn afresh every round, so iteration k of every
variant runs under the same machine conditions. Only one runner computes at a
time (data loading included), and the timed span is ``before_train_iter`` to
``after_train_iter`` (every hook of the iteration plus ``train_step``).
Per set of runners, the median over iterations of ``t_variant / t_plain``
for the same iteration; reported is its median over ``--repeats`` fresh
sets, with the range.

Variants: plain MMEngine (twice: the second copy measures the noise floor),
mmdet's ``CheckInvalidLossHook(interval=1)``, ``NanDetectHook()`` (default)
and ``NanDetectHook(anomaly='always')``.

Usage::

    python benchmarks/overhead.py --threads 1           # every model available
    python benchmarks/overhead.py --iters 3 --repeats 1 --warmup 1  # smoke
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import datetime
import os
import os.path as osp
import platform
import random
import statistics
import sys
import tempfile
import threading
import time

import _models  # benchmarks/_models.py, next to this script

# Longest wait for a turn, in seconds: a stuck runner ends the run.
_TURN_TIMEOUT_S = 600

VARIANTS = [
    ('plain', []),
    # Identical to plain: its ratio shows the measurement's own error.
    ('plain again (noise floor)', []),
    ('CheckInvalidLossHook(interval=1)',
     [dict(type='mmdet.CheckInvalidLossHook', interval=1)]),
    ('NanDetectHook()', [dict(type='NanDetectHook')]),
    ("NanDetectHook(anomaly='always')",
     [dict(type='NanDetectHook', anomaly='always')]),
    # Snapshots every 10 iterations (5x the default rate of one per 50), so
    # that a short run holds several: the cost at the default interval is a
    # fifth of its excess over NanDetectHook().
    ("NanDetectHook(policy='rewind', snapshot_interval=10)",
     [dict(type='NanDetectHook', policy='rewind', snapshot_interval=10)]),
]

def _tiny(config, overrides=None):
    """A tiny test-bed detector config, for ``iters`` iterations."""

    def build(work_dir, data_dir, iters):
        from mmnan_testing import testbed
        data = testbed.make_dataset(config, data_dir, num_images=16)
        extra = getattr(testbed, overrides) if overrides else {}
        # At the configs' lr the tiny detectors diverge after a few dozen
        # iterations; an iteration costs the same at any lr.
        cfg = testbed.tiny_config(
            config, data, work_dir, max_iters=iters, log_level='WARNING',
            **dict(extra, **{
                'optim_wrapper.optimizer.lr': 1e-4,
                'train_dataloader.sampler.type': 'InfiniteSampler'}))
        return cfg

    return build


def _zoo(name, float_inputs=False):
    """A config shipped in the model zoo, with enough epochs for ``iters``;
    ``float_inputs``: its images loaded as float32 (``to_float32=True``), as
    a raster loader gives them: tier 1 then checks them before the forward."""

    def build(work_dir, data_dir, iters):
        from mmnan_testing import zoo
        data = zoo.make_zoo_dataset(name, data_dir, num_images=16)
        per_epoch = 16 // 2
        cfg = zoo.child_config(name, data, work_dir,
                               length=-(-iters // per_epoch))
        cfg.log_level = 'WARNING'
        # No checkpoint per epoch (outside the timed span, but slow).
        cfg.default_hooks.checkpoint = None
        if float_inputs:
            for step in cfg.train_dataloader.dataset.pipeline:
                if step['type'] == 'LoadImageFromFile':
                    step['to_float32'] = True
        return cfg

    return build


# (key, title, packages needed, config builder)
MODELS = [
    ('retinanet', 'tiny RetinaNet', ('mmdet', ), _tiny('retinanet')),
    # The same detector at ResNet-18 widths: how the fixed per-iteration
    # cost shrinks relative to a model dominated by compute.
    ('retinanet_r18', 'RetinaNet R18 widths, 256 px', ('mmdet', ),
     _tiny('retinanet', 'R18_WIDTHS')),
    ('rotated_retinanet', 'tiny rotated RetinaNet', ('mmdet', 'mmrotate'),
     _tiny('rotated_retinanet')),
    ('zoo_retinanet_r50', 'zoo RetinaNet R50-FPN 1x (its schedule), 320 px',
     ('mmdet', ), _zoo('retinanet_r50')),
    ('zoo_retinanet_r50_float', 'the same, images loaded as float32',
     ('mmdet', ), _zoo('retinanet_r50', float_inputs=True)),
]


class _Turns(object):
    """Lets ``n`` threads run one iteration each per round, in turn."""

    def __init__(self, n):
        self.n = n
        self.round = 0
        self.pos = 0
        self.holder = None
        self.failed = False
        self.orders = {}
        self.cond = threading.Condition()
        self.ready = threading.Barrier(n, timeout=_TURN_TIMEOUT_S)

    def _order(self):
        # A fresh random order every round: no variant always runs first, or
        # right after the same other one.
        if self.round not in self.orders:
            order = list(range(self.n))
            random.Random(self.round).shuffle(order)
            self.orders = {self.round: order}
        return self.orders[self.round]

    def acquire(self, index):
        with self.cond:
            if self.holder == index:
                self._advance()
            ok = self.cond.wait_for(
                lambda: self.failed or self._order()[self.pos] == index,
                timeout=_TURN_TIMEOUT_S)
            if self.failed or not ok:
                raise RuntimeError('another benchmark runner failed')
            self.holder = index

    def release(self, index):
        with self.cond:
            if self.holder == index:
                self._advance()

    def fail(self):
        with self.cond:
            self.failed = True
            self.cond.notify_all()
        self.ready.abort()

    def _advance(self):
        self.holder = None
        self.pos += 1
        if self.pos == self.n:
            self.pos = 0
            self.round += 1
        self.cond.notify_all()


def _timing_hooks(turns, index, times):
    from mmengine.hooks import Hook

    class Start(Hook):
        priority = 'HIGHEST'

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            if runner.iter == 0:
                # Every runner has finished building before any is timed.
                turns.ready.wait()
            turns.acquire(index)
            self.t0 = time.perf_counter()

    start = Start()

    class End(Hook):
        # The turn is kept until the next iteration starts, so loading the
        # next batch does not overlap another runner's timed iteration.
        priority = 'LOWEST'

        def after_train_iter(self, runner, batch_idx, data_batch=None,
                             outputs=None):
            times.append(time.perf_counter() - start.t0)

        def after_train(self, runner):
            turns.release(index)

    return [start, End()]


def _run_model(name, build, iters, warmup, work_root, repeat, variants,
               probe=None, thread_name='runner'):
    """Train one runner per variant, in turns, one iteration each.

    Args:
        probe (callable, optional): ``index -> Hook`` (or a list of
            hooks): what else each
            runner's iterations are measured by, registered after its timing
            hooks (it counts while the runner holds its turn).
        thread_name (str): Each runner's thread is this and its variant's
            index (dynamo names the compiling thread in what it logs).

    Returns:
        list[list[float]]: The timed iterations' seconds, per variant.
    """
    from mmengine.runner import Runner

    turns = _Turns(len(variants))
    times = [[] for _ in variants]
    runners = [None] * len(variants)
    # Built in a different order each repeat: where a runner's memory lands
    # shifts its speed by a percent or two, whatever variant it runs.
    build_order = list(range(len(variants)))
    random.Random(repeat).shuffle(build_order)
    for index in build_order:
        cfg = build(osp.join(work_root, name, str(repeat), str(index)),
                    osp.join(work_root, name, 'data'), warmup + iters)
        cfg.default_hooks.logger = dict(type='LoggerHook', interval=50)
        cfg.custom_hooks = list(cfg.get('custom_hooks') or []) + list(
            variants[index][1])
        runner = Runner.from_cfg(cfg)
        for hook in _timing_hooks(turns, index, times[index]):
            runner.register_hook(hook)
        probes = probe(index) if probe is not None else []
        for hook in probes if isinstance(probes, list) else [probes]:
            runner.register_hook(hook)
        runners[index] = runner
    errors = []

    def train(runner):
        try:
            runner.train()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            turns.fail()

    threads = [threading.Thread(target=train, args=(r, ),
                                name='%s%d' % (thread_name, i))
               for i, r in enumerate(runners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [t[warmup:] for t in times]


def _machine():
    import torch
    return '%s, %s, %d CPUs, Python %s, torch %s (%d threads)' % (
        platform.node() or 'unknown host', platform.processor()
        or platform.machine(), os.cpu_count() or 0,
        platform.python_version(), torch.__version__,
        torch.get_num_threads())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iters', type=int, default=100,
                        help='timed iterations per variant (default 100)')
    parser.add_argument('--repeats', type=int, default=3,
                        help='fresh sets of runners (default 3)')
    parser.add_argument('--warmup', type=int, default=5,
                        help='untimed first iterations (default 5)')
    parser.add_argument('--variants', nargs='+', type=int,
                        help='indices into the variant list (default all; '
                        'plain and its copy always run)')
    _models.model_arguments(parser, MODELS)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error('--iters and --repeats must be >= 1, --warmup >= 0')
    _models.set_threads(args)

    import mmnanhook  # noqa: F401 - registers NanDetectHook
    models = _models.select(MODELS, args.models, lambda m: m[2])
    variants = VARIANTS if not args.variants else VARIANTS[:2] + [
        VARIANTS[i] for i in args.variants if i >= 2]
    work_root = args.work_dir or tempfile.mkdtemp(prefix='mmnan_bench_')
    print('# mmnanhook overhead, %s' %
          datetime.date.today().isoformat())
    print('# machine: %s' % _machine())
    print('# %d repeats (fresh runners) x %d timed iterations per variant '
          'after %d warm-up, paired per iteration.' %
          (args.repeats, args.iters, args.warmup))
    print('# ratio: median over repeats of the median over iterations of '
          't_variant / t_plain [min, max over repeats]\n')
    print('| model | variant | median s/iter | ratio to plain |')
    print('| --- | --- | --- | --- |')
    for name, title, _, build in models:
        runs = [
            _run_model(name, build, args.iters, args.warmup, work_root,
                       repeat, variants)
            for repeat in range(args.repeats)
        ]
        for index, (label, _) in enumerate(variants):
            ratios = [
                statistics.median(a / b for a, b in zip(run[index], run[0]))
                for run in runs
            ]
            ratio = '1 (reference)' if index == 0 else \
                '%.3fx [%.3f, %.3f]' % (statistics.median(ratios),
                                        min(ratios), max(ratios))
            seconds = statistics.median(t for run in runs for t in run[index])
            print('| %s | %s | %.4f | %s |' % (title, label, seconds, ratio))
        sys.stdout.flush()
    return 0


if __name__ == '__main__':
    sys.exit(main())
