"""Tier 1's overhead on mmdet's zoo RetinaNet R50 on a GPU, and the input
check's cost on a float batch there.

The model is the shipped config's child of the device checks
(:mod:`mmnan_testing.cuda_zoo`: synthetic COCO data, ``init_cfg=None``, 320
px, the zoo's SGD and schedule; float32 as shipped, or ``--amp`` as
``tools/train.py --amp`` sets it), with mmdet's ``py_sigmoid_focal_loss``
standing in for mmcv's CUDA ``sigmoid_focal_loss`` where that kernel is
missing (the device machine's mmcv has its CPU ops only): every figure says
which loss ran.

Paired per iteration and interleaved, as ``benchmarks/overhead.py`` (whose
turns this reuses): three runners, plain, plain again (the noise floor) and
``NanDetectHook()``, in threads that take turns one train iteration at a
time, in a fresh random order each round. The timed span is
``before_train_iter`` to ``after_train_iter``, closed by a
``torch.cuda.synchronize()`` after every other hook, so that it holds the
GPU's work. Per set of runners, the medians over iterations of ``t_hooked /
t_plain`` (the ratio) and of ``t_hooked - t_plain`` (host µs: what tier 1's
host work and its one sync add to an iteration); reported, their median over
the sets, [min, max].

The runs, one set of each per repeat (so that a budget that runs out leaves
every run measured at least once): batch 2 and 8 (``--batches``) of ``uint8``
images as the zoo loads them; batch 2 with the images loaded as float32,
where tier 1's input check runs every iteration (``--float-batch``, 0: not
run). Then the input check alone (``_inputs.nonfinite_samples``: one sum
and its read) on float batches on the GPU: the median of ``--check-calls``
calls, each after a ``synchronize()``.

Usage (on a device machine, by ``scripts/device_check.sh``)::

    python benchmarks/cuda_zoo_overhead.py --json zoo_overhead.json

Dry run on the CPU (``MMNAN_DEVICE_DRYRUN=cpu``, 64 px, no sync)::

    MMNAN_DEVICE_DRYRUN=cpu python benchmarks/cuda_zoo_overhead.py \\
        --iters 2 --warmup 1 --repeats 1 --check-calls 5
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time

import overhead  # benchmarks/overhead.py: the turns, the runners

VARIANTS = [
    ('plain', []),
    ('plain again (noise floor)', []),
    ('NanDetectHook()', [dict(type='NanDetectHook')]),
]
# The input check alone: the CPU figure's batch (docs/performance.md,
# issue 54), batch 8 of it, and the zoo's own scale at batch 2.
CHECK_SHAPES = [(2, 3, 320, 544), (8, 3, 320, 544), (2, 3, 800, 1344)]


def _build(device, batch, float_inputs, amp):
    """A config builder for ``overhead._run_model``."""

    def build(work_dir, data_dir, iters):
        from mmnan_testing import cuda_zoo, zoo
        images = 4 * batch
        data = zoo.make_zoo_dataset(cuda_zoo.NAME, data_dir,
                                    num_images=images)
        return cuda_zoo.config(data, work_dir, device,
                               length=-(-iters // (images // batch)),
                               amp=amp, batch=batch,
                               float_inputs=float_inputs)

    return build


def _synchronize(index):
    import torch
    from mmengine.hooks import Hook

    class Synchronize(Hook):
        # After every other hook, before the timer's end (LOWEST, 100).
        priority = 99

        def after_train_iter(self, runner, batch_idx, data_batch=None,
                             outputs=None):
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    return Synchronize()


def _median_range(values, scale=1.0, digits=3):
    values = [v * scale for v in values]
    return dict(median=round(statistics.median(values), digits),
                min=round(min(values), digits),
                max=round(max(values), digits))


def _set_figures(times):
    """One set of runners: the paired medians."""
    plain, again, hooked = times
    return dict(
        iter_ms_plain=1e3 * statistics.median(plain),
        iter_ms_hooked=1e3 * statistics.median(hooked),
        ratio=statistics.median(h / p for h, p in zip(hooked, plain)),
        host_us=1e6 * statistics.median(h - p for h, p in zip(hooked, plain)),
        noise_ratio=statistics.median(a / p for a, p in zip(again, plain)),
        noise_us=1e6 * statistics.median(a - p for a, p in zip(again, plain)))


def _summarize(sets):
    keys = ('iter_ms_plain', 'iter_ms_hooked', 'ratio', 'host_us',
            'noise_ratio', 'noise_us')
    return dict((k, _median_range([s[k] for s in sets],
                                  digits=1 if k.endswith('us') else 3))
                for k in keys)


def input_check(device, calls):
    """The input check alone on float batches of :data:`CHECK_SHAPES`.

    Returns:
        list[dict]: ``shape`` and ``us`` (median, min, max) per shape.
    """
    import torch

    from mmnanhook._inputs import nonfinite_samples
    results = []
    for shape in CHECK_SHAPES:
        x = torch.randn(*shape, device=device)
        times = []
        for i in range(calls + 5):
            if device == 'cuda':
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            found = nonfinite_samples({'inputs': x})
            elapsed = time.perf_counter() - t0
            assert found == []
            if i >= 5:
                times.append(elapsed)
        results.append(dict(shape=list(shape), calls=calls,
                            us=_median_range(times, 1e6, 1)))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iters', type=int, default=30,
                        help='timed iterations per runner (default 30)')
    parser.add_argument('--warmup', type=int, default=5)
    parser.add_argument('--repeats', type=int, default=3,
                        help='sets of runners per run (default 3)')
    parser.add_argument('--batches', type=int, nargs='+', default=[2, 8])
    parser.add_argument('--float-batch', type=int, default=2,
                        help='batch of the float32-input run (0: none)')
    parser.add_argument('--amp', action='store_true',
                        help='AmpOptimWrapper (tools/train.py --amp)')
    parser.add_argument('--check-calls', type=int, default=200)
    parser.add_argument('--budget-s', type=float, default=None,
                        help='start no set of runners that would end later '
                        '(by the last set of its run) than this')
    parser.add_argument('--json', help='write the figures here')
    parser.add_argument('--work-dir', help='default: a temporary directory')
    args = parser.parse_args(argv)
    start = time.perf_counter()

    from mmnan_testing import cuda_zoo
    device = cuda_zoo.target()
    if device is None:
        print('no CUDA device (%s=cpu dry-runs this on the CPU)' %
              cuda_zoo.DRYRUN_ENV)
        return 2
    import mmcv
    import mmdet
    import torch

    import mmnanhook  # noqa: F401 - registers NanDetectHook
    focal = cuda_zoo.focal_loss(device)[1]
    figures = dict(
        date=datetime.datetime.now().isoformat(timespec='seconds'),
        device=device,
        gpu=torch.cuda.get_device_name(0) if device == 'cuda' else None,
        python=platform.python_version(), torch=torch.__version__,
        mmcv=mmcv.__version__, mmdet=mmdet.__version__,
        model='mmdet zoo RetinaNet R50-FPN 1x, %d px, %s' % (
            cuda_zoo.SIDE[device],
            'AmpOptimWrapper (fp16, dynamic scale)' if args.amp
            else 'float32 as shipped'),
        focal_loss=focal, iters=args.iters, warmup=args.warmup,
        budget_s=args.budget_s)
    figures['input_check'] = input_check(device, args.check_calls)
    runs = [(b, False) for b in args.batches]
    if args.float_batch:
        runs.append((args.float_batch, True))
    work_root = args.work_dir or tempfile.mkdtemp(prefix='mmnan_cuda_zoo_')
    sets = dict((run, []) for run in runs)
    took = {}
    skipped = []
    for repeat in range(args.repeats):
        for batch, float_inputs in runs:
            run = (batch, float_inputs)
            elapsed = time.perf_counter() - start
            # A run not measured yet may take as long as the longest so far.
            expected = took.get(run, max(took.values()) if took else 0)
            if args.budget_s is not None and \
                    elapsed + expected > args.budget_s:
                skipped.append(dict(batch=batch, float_inputs=float_inputs,
                                    repeat=repeat))
                continue
            t0 = time.perf_counter()
            name = 'b%d_%s' % (batch, 'float' if float_inputs else 'uint8')
            times = overhead._run_model(
                name, _build(device, batch, float_inputs, args.amp),
                args.iters, args.warmup, work_root, repeat, VARIANTS,
                probe=_synchronize)
            took[run] = time.perf_counter() - t0
            sets[run].append(_set_figures(times))
            print('# %s set %d: %s (%.0f s)' % (
                name, repeat, json.dumps(sets[run][-1]), took[run]))
            sys.stdout.flush()
    figures['runs'] = [
        dict(batch=batch, inputs='float32' if float_inputs else 'uint8',
             sets=len(sets[(batch, float_inputs)]),
             per_set=sets[(batch, float_inputs)],
             **(_summarize(sets[(batch, float_inputs)])
                if sets[(batch, float_inputs)] else {}))
        for batch, float_inputs in runs]
    figures['skipped_for_budget'] = skipped
    figures['elapsed_s'] = round(time.perf_counter() - start, 1)
    _print(figures)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(figures, f, indent=2)
    return 0


def _print(figures):
    print('# %s, %s; %s; focal loss: %s' % (
        figures['gpu'] or figures['device'], figures['torch'],
        figures['model'], figures['focal_loss']))
    print('| batch, inputs | sets | plain ms/iter | hooked ms/iter | ratio '
          '[min, max] | host µs | noise floor |')
    print('|---|---|---|---|---|---|---|')
    for run in figures['runs']:
        if not run['sets']:
            print('| %d, %s | 0 | - | - | - | - | - |' % (run['batch'],
                                                         run['inputs']))
            continue
        print('| %d, %s | %d | %.1f | %.1f | %.3fx [%.3f, %.3f] | %.0f '
              '[%.0f, %.0f] | %.3fx, %.0f µs |' % (
                  run['batch'], run['inputs'], run['sets'],
                  run['iter_ms_plain']['median'],
                  run['iter_ms_hooked']['median'], run['ratio']['median'],
                  run['ratio']['min'], run['ratio']['max'],
                  run['host_us']['median'], run['host_us']['min'],
                  run['host_us']['max'], run['noise_ratio']['median'],
                  run['noise_us']['median']))
    for check in figures['input_check']:
        print('# input check alone, float32 %s on %s: %.1f µs [%.1f, %.1f] '
              '(median of %d calls)' % (
                  'x'.join(map(str, check['shape'])), figures['device'],
                  check['us']['median'], check['us']['min'],
                  check['us']['max'], check['calls']))


if __name__ == '__main__':
    sys.exit(main())
