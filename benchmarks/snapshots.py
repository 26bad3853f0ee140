"""What ``'rewind'``'s snapshots cost per rank: host memory, the training
thread's time, a restore (CPU, gloo, one host).

``--ranks`` processes (torch.multiprocessing, a gloo group) each build the
same model (``--layers`` linear layers ``--width`` wide: 12 x 2000, 48M
parameters) with AdamW, take ``--takes`` snapshots the way
``NanDetectHook(policy='rewind')`` does under DDP (``Rewinder.start``
with the run's ranks, then ``Rewinder.after_update`` at each interval), with a forward and backward of
``--batch`` samples between a take and the wait before the next step, as in
training, and report per rank (medians):

* ``held_mb``: bytes the newest snapshot holds on this rank (its tensors);
  ``state_mb``: one full model + optimizer state;
* ``take_ms``: the training thread's time in the take (what it copies at
  once, starting the background copy); ``wait_ms``: its wait for the
  background copy before the next step (0 when the forward and backward
  took longer); ``fwd_bwd_ms``: that forward and backward;
* ``restore_s``: one restore of the snapshot on every rank at once.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/snapshots.py --ranks 1 2 4
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from mmnan_testing.snapshots import tensor_bytes


class _Wrapper(object):
    def __init__(self, optimizer):
        self.optimizer = optimizer


def _worker(rank, world, init, args, out):
    from mmnanhook.options import RewindOptions
    from mmnanhook.sentinel import Rewinder
    from mmnanhook.distributed._ranks import Ranks
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=init, rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    width = args.width
    layers = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(args.layers):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    wrappers = [_Wrapper(optimizer)]
    batch = torch.randn(args.batch, 16)

    def step():
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    rewinder = Rewinder(RewindOptions(snapshot_interval=1,
                                      max_snapshots=1))
    shared = Ranks(rank, world, dist.group.WORLD) if world > 1 else None
    # The commit before (benchmarks/beside.sh) copies the whole state on
    # every rank, at once: no ranks to share with, nothing to wait for.
    settle = getattr(rewinder.store, 'settle', lambda: None)
    try:
        rewinder.start(model, wrappers, shared)
    except TypeError:
        rewinder.start(model, wrappers)
    settle()
    takes, waits, passes = [], [], []
    for _ in range(args.takes):
        start = time.perf_counter()
        rewinder.after_update(0, True, model, wrappers, [])
        takes.append(time.perf_counter() - start)
        start = time.perf_counter()
        model(batch).pow(2).mean().backward()
        passes.append(time.perf_counter() - start)
        start = time.perf_counter()
        settle()
        waits.append(time.perf_counter() - start)
        optimizer.step()
        optimizer.zero_grad()
    snapshot = rewinder.store.before(1)
    held = tensor_bytes(snapshot.model) + tensor_bytes(snapshot.optimizers)
    state = tensor_bytes(model.state_dict()) + tensor_bytes(
        optimizer.state_dict()['state'])
    dist.barrier()
    start = time.perf_counter()
    rewinder.store.restore(snapshot, model, wrappers)
    restore = time.perf_counter() - start
    with open(os.path.join(out, 'rank%d.json' % rank), 'w') as f:
        json.dump(dict(
            ranks=world, rank=rank, held_mb=round(held / 2 ** 20, 1),
            state_mb=round(state / 2 ** 20, 1),
            take_ms=round(1e3 * statistics.median(takes), 1),
            wait_ms=round(1e3 * statistics.median(waits), 1),
            fwd_bwd_ms=round(1e3 * statistics.median(passes), 1),
            restore_s=round(restore, 2)), f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ranks', type=int, nargs='+', default=[1, 2, 4])
    parser.add_argument('--width', type=int, default=2000)
    parser.add_argument('--layers', type=int, default=12)
    parser.add_argument('--batch', type=int, default=64)
    parser.add_argument('--takes', type=int, default=5)
    args = parser.parse_args()
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as out:
            init = 'file://' + os.path.join(out, 'store')
            mp.spawn(_worker, args=(world, init, args, out), nprocs=world)
            for rank in range(world):
                with open(os.path.join(out, 'rank%d.json' % rank)) as f:
                    print(f.read())


if __name__ == '__main__':
    main()
