"""Time to diagnosis of NanDetectHook on the tiny real detectors (CPU).

A tiny detector trains ``--clean-iters`` clean iterations, then meets one
planted degenerate GT box (RetinaNet on VOC-style data: a zero-size box;
rotated RetinaNet on DOTA data: a collinear polygon) and NanDetectHook
(``policy='raise'``) replays, diagnoses and writes the bundle.

Measured per run, all in the same process and run:

* ``iter``: median wall time of the clean iterations after ``--warmup``,
  ``before_train_iter`` to ``after_train_iter`` (every hook plus
  ``train_step``);
* ``total``: wall time of the failing iteration, from its
  ``before_train_iter`` until the error reaches the caller, minus one
  ``iter`` (its own forward and backward): the cost of bundle + report;
* ``replay``: the diagnosis alone (``report['elapsed_s']``); ``total -
  replay`` is mostly the bundle's disk I/O (torch.save, fsync, plot);
* ``fixes``: of the replay, the fixes' replays (``report['fixes_s']``), and
  ``total - fixes`` in iterations: the diagnosis without them.

With ``--policy drop`` the failing iteration does not raise: ``total`` is its
span (diagnosis, bundle, the step recomputed without the bad sample and
applied, the quarantine written) minus one ``iter``: what one drop costs.

Reported: the median over ``--repeats`` fresh runs [min, max], and
``total`` and ``replay`` as multiples of ``iter``. The first run of a
process also pays one-time imports (e.g. matplotlib for ``history.png``).

To compare two versions of mmnanhook (e.g. before and after a change of the
failure path), run this script with ``PYTHONPATH`` pointing at a checkout of
the other one: the script only needs ``mmnan_testing``.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/diagnosis_time.py --threads 1
    python benchmarks/diagnosis_time.py --models rotated_retinanet
    python benchmarks/diagnosis_time.py --models zoo_retinanet_r50 --policy drop
    python benchmarks/diagnosis_time.py --models zoo_retinanet_r50_size
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import datetime
import json
import os
import os.path as osp
import platform
import statistics
import sys
import tempfile
import time

import _models  # benchmarks/_models.py, next to this script

# (key, title, planted defect, packages it needs, tiny config, name of the
# testbed overrides)
MODELS = [
    ('retinanet_voc', 'tiny RetinaNet (VOC, zero-size box)', 'zero_size',
     ('mmdet', ), 'retinanet_voc', None),
    ('retinanet_voc_r18', 'RetinaNet R18 widths, 256 px (VOC, zero-size box)',
     'zero_size', ('mmdet', ), 'retinanet_voc', 'R18_WIDTHS'),
    ('rotated_retinanet', 'tiny rotated RetinaNet (DOTA, collinear polygon)',
     'collinear', ('mmdet', 'mmrotate'), 'rotated_retinanet', None),
    # The zoo's loader shuffles: the last batch gets a GT box made zero-width
    # in place (as Resize's clipping of a box beyond a mis-declared border
    # makes it), not a planted file.
    ('zoo_retinanet_r50', 'zoo RetinaNet R50-FPN 1x, 320 px (COCO, '
     'zero-width box)', 'zero_width', ('mmdet', ), 'zoo:retinanet_r50', None),
    # A real file defect (the annotation declares twice the image's width),
    # so that the fixes that run the sample through the pipeline again have
    # a sample to run: the loader is unshuffled to put it in the last batch.
    ('zoo_retinanet_r50_size', 'zoo RetinaNet R50-FPN 1x, 320 px (COCO, '
     'declared twice as wide)', 'size_mismatch', ('mmdet', ),
     'zoo:retinanet_r50', None),
]


class _Span(object):
    """Hook pair timing each train iteration across all other hooks."""

    def __init__(self):
        from mmengine.hooks import Hook
        span = self
        self.start = None
        self.iters = []

        class Start(Hook):
            priority = 'HIGHEST'

            def before_train_iter(self, runner, batch_idx, data_batch=None):
                span.start = time.perf_counter()

        class End(Hook):
            priority = 'LOWEST'

            def after_train_iter(self, runner, batch_idx, data_batch=None,
                                 outputs=None):
                span.iters.append(time.perf_counter() - span.start)

        self.hooks = [Start(), End()]


def _loader_order(cfg):
    """Image file names in the order the train loader yields them (DOTA
    globs its annotation files, so the order is the file system's)."""
    from mmengine.registry import DATASETS, init_default_scope
    init_default_scope(cfg.default_scope)
    dataset = DATASETS.build(cfg.train_dataloader.dataset)
    return [osp.basename(dataset.get_data_info(i)['img_path'])
            for i in range(len(dataset))]


def _zoo_runner(name, clean_iters, work_dir, policy='raise',
                defect='zero_width'):
    """A Runner of the shipped config ``name`` whose batch ``clean_iters``
    gets a zero-width GT box, or (``defect='size_mismatch'``) holds an image
    whose annotation declares twice its width."""
    from mmengine.hooks import Hook
    from mmengine.runner import Runner

    from mmnan_testing import zoo
    planted = defect == 'size_mismatch'
    data = zoo.make_zoo_dataset(
        name, osp.join(work_dir, 'data'), num_images=2 * (clean_iters + 1),
        defects={2 * clean_iters: defect} if planted else None)
    cfg = zoo.child_config(name, data, osp.join(work_dir, 'run'), length=1,
                           hook='line', hook_options=dict(
                               policy=policy,
                               dump_dir=osp.join(work_dir, 'dumps')))
    cfg.log_level = 'WARNING'
    cfg.default_hooks.checkpoint = None
    if planted:
        # Batches in file order: the planted image comes last.
        cfg.train_dataloader.sampler.shuffle = False
        runner = Runner.from_cfg(cfg)
        return runner

    class ZeroWidth(Hook):
        priority = 'VERY_HIGH'

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            if runner.iter == clean_iters:
                boxes = data_batch['data_samples'][0].gt_instances.bboxes
                boxes.tensor[0, 2] = boxes.tensor[0, 0]

    runner = Runner.from_cfg(cfg)
    runner.register_hook(ZeroWidth())
    return runner


def _run(name, overrides, defect, clean_iters, warmup, work_dir,
         policy='raise'):
    """One run: clean iteration times, the failing iteration's span, its
    report and the bundle's size in bytes."""
    from mmengine.runner import Runner

    from mmnan_testing import testbed
    if name.startswith('zoo:'):
        return _measure(_zoo_runner(name[4:], clean_iters, work_dir, policy,
                                    defect),
                        clean_iters, warmup, osp.join(work_dir, 'dumps'))
    overrides = getattr(testbed, overrides) if overrides else {}
    batch = 2
    num_images = batch * (clean_iters + 1)
    root = osp.join(work_dir, 'data')
    data = testbed.make_dataset(name, root, num_images=num_images)
    hook = dict(type='NanDetectHook', policy=policy,
                dump_dir=osp.join(work_dir, 'dumps'))

    def config():
        cfg = testbed.tiny_config(name, data, osp.join(work_dir, 'run'),
                                  max_iters=clean_iters + 1,
                                  log_level='WARNING', **overrides)
        cfg.custom_hooks = [hook]
        return cfg

    # The defect goes into the image the loader yields last, so that every
    # iteration before it is clean. Rewriting the same files in place keeps
    # the directory order.
    last = _loader_order(config())[-1]
    index = data['images'].index(last)
    data = testbed.make_dataset(name, root, num_images=num_images,
                                defects={index: defect})
    return _measure(Runner.from_cfg(config()), clean_iters, warmup,
                    osp.join(work_dir, 'dumps'))


def _measure(runner, clean_iters, warmup, dumps):
    from mmnanhook import NonFiniteError
    span = _Span()
    for h in span.hooks:
        runner.register_hook(h)
    try:
        runner.train()
        dropped = runner.message_hub.log_scalars.get('train/samples_dropped')
        if dropped is not None and dropped.current() == 1:
            # policy='drop': the failing iteration went on.
            (bundle, ) = [osp.join(dumps, d) for d in os.listdir(dumps)]
            with open(osp.join(bundle, 'report.json')) as f:
                report = json.load(f)
            return (span.iters[warmup:clean_iters], span.iters[clean_iters],
                    report, _du(bundle))
    except NonFiniteError as error:
        failing = time.perf_counter() - span.start
        if error.iter != clean_iters or error.bundle is None:
            raise RuntimeError('unexpected trigger: %s' % error)
        return (span.iters[warmup:], failing, error.report,
                _du(error.bundle))
    raise RuntimeError('the planted defect did not trigger')


def _du(path):
    return sum(osp.getsize(osp.join(path, f)) for f in os.listdir(path))


def _fmt(values, digits=3):
    return '%.*f [%.*f, %.*f]' % (digits, statistics.median(values), digits,
                                  min(values), digits, max(values))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--clean-iters', type=int, default=20,
                        help='clean iterations before the trigger '
                        '(default 20)')
    parser.add_argument('--warmup', type=int, default=3,
                        help='clean iterations left out of the median '
                        '(default 3)')
    parser.add_argument('--repeats', type=int, default=3,
                        help='fresh runs per model (default 3)')
    _models.model_arguments(parser, MODELS)
    parser.add_argument('--policy', choices=('raise', 'drop'),
                        default='raise',
                        help="NanDetectHook's policy (default 'raise'; "
                        "'drop' measures one drop)")
    args = parser.parse_args(argv)
    if (args.clean_iters < 1 or args.repeats < 1 or args.warmup < 0
            or args.warmup >= args.clean_iters):
        parser.error('need --clean-iters >= 1, --repeats >= 1 and '
                     '0 <= --warmup < --clean-iters')
    import torch
    _models.set_threads(args)

    import mmnanhook  # noqa: F401 - registers NanDetectHook
    models = _models.select(MODELS, args.models, lambda m: m[3])
    work_root = args.work_dir or tempfile.mkdtemp(prefix='mmnan_diag_')
    # The hook logs its diagnosis on the console: the table comes last.
    lines = [
        '# mmnanhook time to diagnosis, %s' %
        datetime.date.today().isoformat(),
        '# machine: %s, %d CPUs, Python %s, torch %s (%d threads)' %
        (platform.node() or 'unknown host', os.cpu_count() or 0,
         platform.python_version(), torch.__version__,
         torch.get_num_threads()),
        '# %d fresh runs x %d clean iterations (%d warm-up) then one planted '
        'degenerate box, policy=%r; median [min, max] over runs' %
        (args.repeats, args.clean_iters, args.warmup, args.policy), '',
        '| model | torch | iter s | bundle + report s | of which replay s | '
        'of which fixes s | bundle + report / iter | without the fixes / '
        'iter | replay / iter | bundle MB |',
        '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |',
    ]
    for key, title, defect, _, name, overrides in models:
        iters, totals, replays, fixes, sizes = [], [], [], [], []
        for repeat in range(args.repeats):
            times, failing, report, size = _run(
                name, overrides, defect, args.clean_iters, args.warmup,
                osp.join(work_root, key, str(repeat)), args.policy)
            iter_s = statistics.median(times)
            iters.append(iter_s)
            totals.append(failing - iter_s)
            replays.append(report['elapsed_s'])
            # Reports of mmnanhook before the fixes have none.
            fixes.append(report.get('fixes_s') or 0.0)
            sizes.append(size / 1e6)
        lines.append('| %s | %s | %s | %s | %s | %s | %s | %s | %s | %.1f |'
                     % (title, torch.__version__, _fmt(iters), _fmt(totals),
                        _fmt(replays), _fmt(fixes),
                        _fmt([t / i for t, i in zip(totals, iters)], 1),
                        _fmt([(t - f) / i for t, f, i in zip(
                            totals, fixes, iters)], 1),
                        _fmt([r / i for r, i in zip(replays, iters)], 1),
                        statistics.median(sizes)))
    print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    sys.exit(main())
