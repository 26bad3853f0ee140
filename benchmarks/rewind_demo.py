"""policy='rewind' on the model zoo's own RetinaNet R50-FPN 1x (mmdet's
shipped config, 320 px, synthetic COCO data, CPU) with a far too high LR
and no warmup: the run the issue describes.

Trains ``--iters`` iterations with ``NanDetectHook(policy='rewind',
spike_policy='rewind')``, prints loss, LR and the rewinds per iteration,
and plots the hook's whole history (spikes, rewinds, the LR cut) into
``--plot``. The same run without the hook is printed first for comparison.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/rewind_demo.py --plot docs/rewind_zoo_r50.png
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import math
import os.path as osp
import sys
import tempfile


def _train(work, data, lr, iters, hook_options):
    from mmengine.runner import Runner

    from mmnan_testing import zoo
    extra = ('optim_wrapper = dict(optimizer=dict(lr=%r))\n'
             'param_scheduler = []\n'
             'train_cfg = dict(type="IterBasedTrainLoop", max_iters=%d, '
             'val_interval=1000, _delete_=True)' % (lr, iters))
    cfg = zoo.child_config('retinanet_r50', data, work,
                           hook='line' if hook_options else None,
                           hook_options=hook_options, extra=extra)
    # Edited after loading: a second `default_hooks = ...` in the child
    # file would replace the one that adds the hook.
    cfg.default_hooks.checkpoint = None
    cfg.log_level = 'WARNING'
    runner = Runner.from_cfg(cfg)
    probe = zoo.ZooProbe()
    runner.register_hook(probe)
    error = None
    try:
        runner.train()
    except Exception as exc:  # noqa: BLE001 - reported, not re-raised
        error = exc
    return runner, probe, error


def _scalar(runner, key):
    value = runner.message_hub.log_scalars.get(key)
    return 0 if value is None else value.current()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--lr', type=float, default=20.0)
    parser.add_argument('--iters', type=int, default=24)
    parser.add_argument('--plot', help='PNG of the rewound run\'s history')
    parser.add_argument('--work-dir')
    parser.add_argument('--no-plain', action='store_true',
                        help='skip the run without mmnanhook')
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    from mmnanhook import NanDetectHook
    from mmnanhook.bundle import plot_history
    from mmnan_testing import zoo

    work = args.work_dir or tempfile.mkdtemp(prefix='mmnan_rewind_')
    data = zoo.make_zoo_dataset('retinanet_r50', osp.join(work, 'data'),
                                num_images=16)
    if not args.no_plain:
        _, plain, error = _train(osp.join(work, 'plain'), data, args.lr,
                                 args.iters, None)
        print('without mmnanhook: first non-finite iteration %s (%s)' % (
            plain.first_bad_iter,
            type(error).__name__ if error else 'no error'))
    # Scaled to a 24-iteration run: spikes judged after 4 iterations (not
    # 20), a snapshot every 4 (not 50), 3 kept, 6 steps of cooldown.
    options = dict(policy='rewind', spike_policy='rewind', spike_warmup=4,
                   spike_window=20, snapshot_interval=4, max_snapshots=3,
                   cooldown=6)
    runner, probe, error = _train(osp.join(work, 'rewind'), data, args.lr,
                                  args.iters, options)
    hook = [h for h in runner.hooks if isinstance(h, NanDetectHook)][0]
    print('with policy=rewind: %s; %d iterations, weights finite: %s, '
          'rewinds: %s' % (type(error).__name__ if error else 'finished',
                           len(probe.loss), all(probe.finite),
                           _scalar(runner, 'train/rewinds')))
    for i, (loss, lr) in enumerate(zip(probe.loss, probe.lr)):
        print('  iter %2d  loss %-12s lr %g' % (
            i, '%.4g' % loss if loss is not None and math.isfinite(loss)
            else loss, lr[0]))
    if args.plot:
        plot_history(hook._history.records(), args.plot)
        print('plot: %s' % args.plot)
    return 0 if error is None else 1


if __name__ == '__main__':
    sys.exit(main())
