"""Per-iteration overhead of NanDetectHook when MMEngine compiles the train
step (``compile`` in the config: ``torch.compile`` of the bound
``train_step``), on CPU; the sibling of ``overhead.py``.

Variants, every one compiled with the same backend: plain MMEngine (twice:
the second copy measures the noise floor) and ``NanDetectHook()`` (tier 1).
As in ``overhead.py`` each variant trains its own real Runner on the same
config, data and seed; the runners take turns, one train iteration at a
time in a random order drawn afresh every round, and the ratio is the
median over iterations of ``t_variant / t_plain`` for the same iteration,
reported as its median over ``--repeats`` fresh sets, with the range. The
first ``--warmup`` iterations (where the compiles and recompiles happen)
are not timed.

Also counted per variant: the compiled graphs each iteration runs (a backend
that hands every graph to ``--backend`` and counts its calls), whose
difference to plain is the number of graph breaks mmnanhook adds per
iteration (negative: fewer graphs; the update step runs eagerly under the
hook, see docs/performance.md).

Usage::

    python benchmarks/overhead_compile.py --threads 1 --models retinanet
    python benchmarks/overhead_compile.py --iters 3 --repeats 1 --warmup 4
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import collections
import datetime
import logging
import statistics
import sys
import tempfile

import _models  # benchmarks/_models.py, next to this script
import overhead  # benchmarks/overhead.py: the turns, the models

_THREAD = 'mmnan-bench-variant-'


class _Recompiles(logging.Handler):
    """Dynamo's recompilations (``TORCH_LOGS=recompiles``), by variant."""

    def __init__(self):
        super(_Recompiles, self).__init__(logging.DEBUG)
        self.counts = collections.Counter()

    def emit(self, record):
        if (record.getMessage().startswith('Recompiling function')
                and record.threadName.startswith(_THREAD)):
            self.counts[int(record.threadName[len(_THREAD):])] += 1


VARIANTS = [
    ('plain, compiled', []),
    ('plain again, compiled (noise floor)', []),
    ('NanDetectHook(), compiled', [dict(type='NanDetectHook')]),
]
MODELS = [m for m in overhead.MODELS if m[0] != 'rotated_retinanet']


def _compiled(build, backend):
    """``build`` of ``overhead.MODELS`` with ``compile`` set."""

    def compiled(work_dir, data_dir, iters):
        cfg = build(work_dir, data_dir, iters)
        cfg.compile = dict(backend=backend)
        return cfg

    return compiled


def _run_model(name, build, iters, warmup, work_root, repeat):
    """``overhead._run_model``, with the graphs of each iteration counted.

    Returns:
        tuple: The timed iterations' seconds and graph counts, per variant.
    """
    from mmnan_testing.compiled import GraphsPerIter

    counters = [GraphsPerIter() for _ in VARIANTS]
    times = overhead._run_model(name, build, iters, warmup, work_root, repeat,
                                VARIANTS, probe=counters.__getitem__,
                                thread_name=_THREAD)
    return times, [c.counts[warmup:] for c in counters]


def _recompile_logger():
    import torch
    from mmnan_testing.compiled import RECOMPILES_LOGGER
    torch._logging.set_logs(recompiles=True)
    logger = logging.getLogger(RECOMPILES_LOGGER)
    # Counted here, not printed.
    logger.propagate = False
    return logger


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iters', type=int, default=40,
                        help='timed iterations per variant (default 40)')
    parser.add_argument('--repeats', type=int, default=3,
                        help='fresh sets of runners (default 3)')
    parser.add_argument('--warmup', type=int, default=8,
                        help='untimed first iterations, the compiles '
                        '(default 8)')
    parser.add_argument('--backend', default='inductor',
                        help="torch.compile backend (default 'inductor'; "
                        "'aot_eager' compiles in seconds)")
    _models.model_arguments(parser, MODELS)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error('--iters and --repeats must be >= 1, --warmup >= 0')
    import torch._dynamo
    _models.set_threads(args)
    # Three runners compile the same code objects (one entry per model
    # instance, and a few recompiles each on the detectors' dynamic shapes):
    # dynamo's default limit of 8 would leave the last ones eager.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096

    import mmnanhook  # noqa: F401 - registers NanDetectHook
    from mmnan_testing.compiled import counting_backend
    backend = counting_backend(args.backend)
    logger = _recompile_logger()
    models = _models.select(MODELS, args.models, lambda m: m[2])
    work_root = args.work_dir or tempfile.mkdtemp(prefix='mmnan_bench_')
    print('# mmnanhook overhead under torch.compile (backend %r), %s' %
          (args.backend, datetime.date.today().isoformat()))
    print('# machine: %s' % overhead._machine())
    print('# %d repeats (fresh runners) x %d timed iterations per variant '
          'after %d warm-up, paired per iteration.' %
          (args.repeats, args.iters, args.warmup))
    print('# ratio: median over repeats of the median over iterations of '
          't_variant / t_plain [min, max over repeats]; graphs: compiled '
          'graphs run per timed iteration [min, max]; recompilations: '
          'dynamo\'s, over each repeat\'s whole run (warm-up included; a '
          'later repeat reuses what dynamo learnt of the shapes)\n')
    print('| model | variant | median s/iter | ratio to plain | graphs/iter '
          '| recompilations (each repeat) |')
    print('| --- | --- | --- | --- | --- | --- |')
    for name, title, _, build in models:
        runs, recompiles = [], []
        for repeat in range(args.repeats):
            watch = _Recompiles()
            logger.addHandler(watch)
            runs.append(_run_model(name, _compiled(build, backend),
                                   args.iters, args.warmup, work_root,
                                   repeat))
            logger.removeHandler(watch)
            recompiles.append(watch.counts)
        for index, (label, _) in enumerate(VARIANTS):
            ratios = [
                statistics.median(a / b for a, b in zip(t[index], t[0]))
                for t, _ in runs
            ]
            ratio = '1 (reference)' if index == 0 else \
                '%.3fx [%.3f, %.3f]' % (statistics.median(ratios),
                                        min(ratios), max(ratios))
            seconds = statistics.median(x for t, _ in runs for x in t[index])
            counts = [c for _, g in runs for c in g[index]]
            print('| %s | %s | %.4f | %s | %d [%d, %d] | %s |' % (
                title, label, seconds, ratio, statistics.median(counts),
                min(counts), max(counts),
                ', '.join(str(r[index]) for r in recompiles)))
        sys.stdout.flush()
    return 0


if __name__ == '__main__':
    sys.exit(main())
