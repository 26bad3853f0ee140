"""Tier-1 overhead on a GPU: SmallResNet (mmnan_testing.cuda_toy), or
torchvision's ResNet-50 (``--model resnet50``), under the real
AmpOptimWrapper (fp16, dynamic loss scale), with and without NanDetectHook.
Paired and interleaved: each repeat trains one run of each, alternating
which goes first; per run the median iteration time after the
warm-up (a CUDA synchronize closes every iteration in both variants); the
figure is the median over repeats of the paired ratio.

Usage (on a device machine, by scripts/device_check.sh)::

    python benchmarks/cuda_overhead.py --json overhead.json
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import json
import statistics
import sys
import tempfile
import time


def _resnet50(size):
    """torchvision's ResNet-50 (161 parameter tensors, 53 batch norms) with
    one output, behind the toy data's projection to a ``size``-square image:
    the zoo R50's backbone without mmcv, which the device machine lacks."""
    import torch
    import torch.nn as nn
    import torchvision
    from mmengine.model import BaseModel

    class ResNet50(BaseModel):

        def __init__(self):
            super().__init__()
            self.project = nn.Linear(4, 3 * size * size)
            self.net = torchvision.models.resnet50(num_classes=1)

        def forward(self, inputs, fault=None, mode='tensor'):
            x = self.project(torch.stack(inputs)).view(-1, 3, size, size)
            y = self.net(x).float()
            if mode != 'loss':
                return y
            return dict(loss=(y - 1.0).pow(2).mean())

    return ResNet50()


def _iteration_times(hook, iters, width, work_dir, lr=0.01, size=16,
                     model='smallresnet'):
    import torch
    from mmengine.hooks import Hook

    from mmnan_testing.cuda_toy import SmallResNet
    from mmnan_testing.toy import make_runner

    times = []

    class Timer(Hook):
        priority = 'LOWEST'

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def after_train_iter(self, runner, batch_idx, data_batch=None,
                             outputs=None):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    optim = dict(type='AmpOptimWrapper', dtype='float16',
                 loss_scale='dynamic',
                 optimizer=dict(type='SGD', lr=lr, momentum=0.9))
    net = _resnet50(size) if model == 'resnet50' else SmallResNet(
        width=width, size=size)
    runner = make_runner(work_dir, model=net,
                         optim_wrapper=optim, hook=hook, max_iters=iters,
                         n=2 * iters)
    runner.register_hook(Timer())
    runner.train()
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iters', type=int, default=60)
    parser.add_argument('--warmup', type=int, default=10)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--width', type=int, default=256)
    # Wider nets diverge to NaN at 0.01 within 60 iterations (a real
    # divergence, which the hooked run stops at): 1e-3 for them.
    parser.add_argument('--lr', type=float, default=0.01)
    # Input side: 16 keeps the GPU waiting for the host's launches; 256
    # at width 512 makes the iteration compute-bound.
    parser.add_argument('--size', type=int, default=16)
    parser.add_argument('--model', choices=['smallresnet', 'resnet50'],
                        default='smallresnet')
    parser.add_argument('--json', help='write the figures here')
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print('no CUDA device')
        return 2
    import mmnanhook  # noqa: F401 - registers NanDetectHook
    ratios, base, hooked = [], [], []
    for repeat in range(args.repeats):
        order = [None, dict(type='NanDetectHook')]
        if repeat % 2:
            order.reverse()
        result = {}
        for hook in order:
            times = _iteration_times(hook, args.iters, args.width,
                                     tempfile.mkdtemp(prefix='mmnan_cuda_'),
                                     args.lr, args.size, args.model)
            result[hook is None] = statistics.median(times[args.warmup:])
        base.append(result[True])
        hooked.append(result[False])
        ratios.append(result[False] / result[True])
    figures = dict(
        gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
        model='%s, %d px, batch 2, fp16 AmpOptimWrapper, SGD lr %g' % (
            'torchvision ResNet-50' if args.model == 'resnet50' else
            'SmallResNet width %d' % args.width, args.size, args.lr),
        iters=args.iters,
        warmup=args.warmup,
        repeats=args.repeats, iter_ms_without=1e3 * statistics.median(base),
        iter_ms_with=1e3 * statistics.median(hooked),
        median_ratio=statistics.median(ratios),
        ratios=ratios)
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == '__main__':
    sys.exit(main())
