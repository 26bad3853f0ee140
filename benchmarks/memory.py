"""Memory around a trigger: does everything the diagnosis allocated go back?

mmdet's RetinaNet R50 config as shipped (320 px, see
:mod:`mmnan_testing.zoo`) trains on a synthetic COCO dataset; before
iteration ``--fault-iter`` a hook turns one GT box of that batch into a
zero-width box, which the zoo's box coder turns into ``log(0)``.
``NanDetectHook`` (policy ``raise``) diagnoses and writes the bundle; the
script keeps the error and the runner, as a sweep or notebook would.

Reported: the resident set size (RSS) at the start of the failing iteration
(before), its peak during the iteration and the diagnosis (sampled every
5 ms), and after the error reached the caller (after ``gc.collect()``);
with CUDA, ``torch.cuda.memory_allocated`` the same way.

Usage::

    python benchmarks/memory.py --threads 1
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import datetime
import gc
import sys
import tempfile
import threading
import time

import torch


class _Sampler(threading.Thread):

    def __init__(self, read):
        super(_Sampler, self).__init__(daemon=True)
        self.read = read
        self.peak = 0
        self.running = True

    def run(self):
        while self.running:
            self.peak = max(self.peak, self.read())
            time.sleep(0.005)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--fault-iter', type=int, default=5)
    parser.add_argument('--threads', type=int)
    parser.add_argument('--work-dir')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmengine.hooks import Hook
    from mmengine.runner import Runner

    from mmnanhook import NonFiniteError
    from mmnan_testing import zoo
    from mmnan_testing.soak import rss_bytes, trimmed_rss_bytes

    work = args.work_dir or tempfile.mkdtemp(prefix='mmnan_memory_')
    data = zoo.make_zoo_dataset('retinanet_r50', work + '/data',
                                num_images=16)
    cfg = zoo.child_config('retinanet_r50', data, work + '/run', length=1,
                           hook='line')
    cfg.log_level = 'WARNING'
    cfg.default_hooks.checkpoint = None
    runner = Runner.from_cfg(cfg)
    cuda = torch.cuda.is_available()
    marks = {}
    sampler = _Sampler(rss_bytes)

    class Poison(Hook):
        priority = 'VERY_HIGH'

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            if runner.iter != args.fault_iter:
                return
            gc.collect()
            marks['before'] = rss_bytes()
            if cuda:
                marks['cuda_before'] = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            sampler.start()
            boxes = data_batch['data_samples'][0].gt_instances.bboxes.tensor
            boxes[0, 2] = boxes[0, 0]

    runner.register_hook(Poison())
    error = None
    try:
        runner.train()
    except NonFiniteError as exc:
        error = exc
    sampler.running = False
    sampler.join()
    gc.collect()
    after = rss_bytes()
    trimmed = trimmed_rss_bytes()
    mb = 2.0**20
    print('# mmnanhook memory around a trigger, %s, torch %s, zoo RetinaNet '
          'R50 320 px, fault at iter %d' % (
              datetime.date.today().isoformat(), torch.__version__,
              args.fault_iter))
    print('trigger: %s at iter %s, bundle %s' % (
        getattr(error, 'trigger', None), getattr(error, 'iter', None),
        getattr(error, 'bundle', None)))
    before, peak = marks['before'], max(sampler.peak, after)
    print('RSS before %.0f MB, peak %.0f MB, after %.0f MB: after - before '
          '= %+.0f MB (%+.1f%%)' % (before / mb, peak / mb, after / mb,
                                    (after - before) / mb,
                                    100.0 * (after - before) / before))
    if trimmed is not None:
        print('RSS after malloc_trim(0) (free heap handed back): %.0f MB: '
              '%+.0f MB (%+.1f%%) over before' % (
                  trimmed / mb, (trimmed - before) / mb,
                  100.0 * (trimmed - before) / before))
    if cuda:
        print('CUDA allocated before %.0f MB, peak %.0f MB, after %.0f MB' % (
            marks['cuda_before'] / mb, torch.cuda.max_memory_allocated() / mb,
            torch.cuda.memory_allocated() / mb))
    return 0 if error is not None else 1


if __name__ == '__main__':
    sys.exit(main())
