"""What mmnanhook's own recovery costs at scale: bundle bytes, trigger ->
resumed, peak memory, on a real Runner with synthetic stand-ins.

The stand-ins: a dataset of ``--entries`` data infos (mmengine
``BaseDataset``, serialized as mmdet's are; ``img_path`` strings shaped as
Objects365's, no images: the pipeline makes a 16-vector per sample) whose
last ``--window`` samples are the ones trained on (a sampler over the tail,
so the bad samples sit near the end of 1.7M entries); every
``window / bad``-th of them has a NaN input, or (``--bad-iters``) the
second sample of each iteration named. The model: ``--width`` wide
linear layers (4000: 48M parameters) with AdamW (its state: 2 x the
parameters).  ``NanDetectHook(policy=...)`` with its defaults otherwise.

Measured in one run, per policy:

* ``bundle_bytes``: bytes written by this process while training
  (``/proc/self/io`` ``write_bytes``: what reached the block layer; the
  bundles are fsynced), and the dump dir's size at the end;
* ``state_bytes``: one model + optimizer state as torch.save writes it;
* ``trigger_s``: median wall time of the iterations with a trigger, minus
  the median of the clean ones (``before_train_iter`` to
  ``after_train_iter``): diagnosis, bundle, quarantine; ``triggers``: each
  trigger's own (by iteration): the first (``first_trigger_s``) is where a
  lookup that waits for an index built from ``before_train`` shows, the
  last (``late_trigger_s``) comes after any such index is ready;
* ``rss_growth_mb``: RSS after training minus RSS before it (the
  dataset is built before; its build's own peak is not counted).

Usage (``benchmarks/beside.sh REV 1 .venv/bin/python benchmarks/scale.py``
runs it beside an earlier commit)::

    OMP_NUM_THREADS=1 python benchmarks/scale.py --entries 8 1700000
    # the first trigger in iteration 2, on 16 and on 1.7M entries
    python benchmarks/scale.py --entries 16 1700000 --window 16 \
        --bad-iters 2 --policies drop
"""
import argparse
import io
import json
import os
import os.path as osp
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
from mmengine.dataset import BaseDataset
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import (DATA_SAMPLERS, DATASETS, HOOKS, MODELS,
                               TRANSFORMS)
from mmengine.runner import Runner
from mmengine.structures import BaseDataElement
from torch.utils.data import Sampler

import mmnanhook  # noqa: F401 - registers NanDetectHook


@TRANSFORMS.register_module()
class ScaleInputs(object):
    """A data info -> a 16-vector (NaN for a bad sample) and its sample."""

    def __call__(self, info):
        index = info['sample_idx']
        inputs = torch.full((16, ), float(index % 7) / 7)
        if info['bad']:
            inputs[3] = float('nan')
        return dict(inputs=inputs, data_samples=BaseDataElement(metainfo=dict(
            img_path=info['img_path'], sample_idx=index)))


@DATASETS.register_module()
class ScaleDataset(BaseDataset):
    """``entries`` data infos; the bad ones among the last ``window``."""

    METAINFO = dict(classes=('object', ))

    def __init__(self, entries, window, bad, **kwargs):
        # ``bad``: the positions in the window of the bad samples.
        self.entries, self.window, self.bad = entries, window, set(bad)
        super().__init__(ann_file='', **kwargs)

    def load_data_list(self):
        first = self.entries - self.window
        return [dict(img_path='data/objects365/train/images/v1/patch{}/'
                     'objects365_v1_{:08d}.jpg'.format(i % 51, i),
                     width=640, height=480,
                     bad=i - first in self.bad,
                     instances=[dict(bbox=[0., 0., 10., 10.],
                                     bbox_label=0)])
                for i in range(self.entries)]


@DATA_SAMPLERS.register_module()
class TailSampler(Sampler):
    """The last ``window`` indices of the dataset, in order."""

    def __init__(self, dataset, window, seed=None):
        self.start = len(dataset) - window
        self.window = window

    def __iter__(self):
        return iter(range(self.start, self.start + self.window))

    def __len__(self):
        return self.window

    def set_epoch(self, epoch):
        pass


@MODELS.register_module()
class WideModel(BaseModel):
    """Linear layers ``width`` wide: ``3 * width ** 2`` parameters."""

    def __init__(self, width):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width),
            nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, inputs, data_samples=None, mode='tensor'):
        y = self.net(torch.stack(inputs))
        if mode == 'loss':
            return dict(loss=y.pow(2).mean())
        return y


@HOOKS.register_module()
class IterTimes(Hook):
    """Each iteration's wall time."""

    priority = 'VERY_HIGH'

    def __init__(self):
        self.times = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self._start = time.perf_counter()

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        self.times.append(time.perf_counter() - self._start)


def _io_written():
    with open('/proc/self/io') as f:
        return dict(line.split(': ') for line in f.read().splitlines())[
            'write_bytes']


def _rss_mb():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) / 1024.


def _dir_bytes(path):
    return sum(osp.getsize(osp.join(root, name))
               for root, _, names in os.walk(path) for name in names)


def _state_bytes(model):
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(),
                    optimizer=optimizer.state_dict()), buffer)
    return buffer.tell()


def _bad_positions(args):
    """Positions in the window of the bad samples."""
    if args.bad_iters:
        return [k * args.batch + args.batch - 1 for k in args.bad_iters]
    step = args.window // args.bad
    return [i for i in range(args.window) if i % step == step - 1]


def run(entries, policy, args, work):
    window, bad = args.window, _bad_positions(args)
    start = time.perf_counter()
    dataset = dict(
        type='ScaleDataset', entries=entries, window=window, bad=bad,
        pipeline=[dict(type='ScaleInputs')],
        serialize_data=True)
    times = IterTimes()
    bad_positions = set()
    cfg = dict(
        model=dict(type='WideModel', width=args.width),
        work_dir=work,
        train_dataloader=dict(
            batch_size=args.batch, num_workers=0, dataset=dataset,
            sampler=dict(type='TailSampler', window=window),
            collate_fn=dict(type='pseudo_collate')),
        train_cfg=dict(by_epoch=False, max_iters=window // args.batch),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-5)),
        # No checkpoint: its writes are not mmnanhook's.
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1000),
                           checkpoint=None),
        custom_hooks=[dict(type='NanDetectHook', policy=policy,
                           max_skips=10 ** 6)],
        log_level='ERROR', randomness=dict(seed=0))
    runner = Runner.from_cfg(__import__('mmengine').Config(cfg))
    runner.register_hook(times, 'VERY_HIGH')
    # The dataset is built here: its build is not what is measured.
    runner.train_loop
    built = time.perf_counter() - start
    for i in range(window):
        if runner.train_dataloader.dataset.get_data_info(
                entries - window + i)['bad']:
            bad_positions.add(i // args.batch)
    rss0, written0 = _rss_mb(), int(_io_written())
    runner.train()
    written = int(_io_written()) - written0
    grown = _rss_mb() - rss0
    clean = [t for i, t in enumerate(times.times) if i not in bad_positions]
    hit = [t for i, t in enumerate(times.times) if i in bad_positions]
    each = dict((i, round(t - statistics.median(clean), 3))
                for i, t in enumerate(times.times) if i in bad_positions)
    return dict(
        entries=entries, policy=policy, build_s=round(built, 1),
        bad_iters=len(hit), iter_s=round(statistics.median(clean), 4),
        trigger_s=round(statistics.median(hit) - statistics.median(clean),
                        3),
        triggers=each, first_trigger_s=each[min(each)],
        late_trigger_s=each[max(each)],
        bundle_bytes=written,
        dump_dir_bytes=_dir_bytes(osp.join(work, 'nan_dumps')),
        rss_growth_mb=round(grown, 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--entries', type=int, nargs='+',
                        default=[80, 1700000])
    parser.add_argument('--policies', nargs='+', default=['drop', 'skip'])
    parser.add_argument('--window', type=int, default=80)
    parser.add_argument('--bad', type=int, default=20)
    parser.add_argument('--bad-iters', type=int, nargs='+', default=None,
                        help='iterations whose batch holds a bad sample '
                        '(instead of --bad spread over the window)')
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--width', type=int, default=4000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = WideModel(args.width)
    params = sum(p.numel() for p in model.parameters())
    state = _state_bytes(model)
    del model
    print(json.dumps(dict(params=params, state_bytes=state)))
    sys.stdout.flush()
    for entries in args.entries:
        for policy in args.policies:
            with tempfile.TemporaryDirectory() as work:
                result = run(max(entries, args.window), policy, args, work)
            result['bundle_states'] = round(result['bundle_bytes'] / state, 2)
            print(json.dumps(result))
            sys.stdout.flush()


if __name__ == '__main__':
    main()
