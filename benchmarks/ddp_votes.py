"""Votes per iteration of a zoo config under DDP (CPU, gloo, one host).

A train step waits for the ranks' vote (``mmnanhook.distributed.Ranks.vote``)
before its backward and before the first collective it calls from Python
(``ForwardGuard``; before each of them in the first step, which records
them). This script trains ``--config`` (a key of ``mmnan_testing.zoo.ZOO``:
its synthetic images, short schedule and small scales) on ``--ranks``
processes with the hook and prints, from rank 0, the votes of each
iteration and the collectives each train step called: voting before each
would take one more vote per collective. mmdet's DINO: about 2 minutes on 2
CPU cores.

Usage::

    python benchmarks/ddp_votes.py                  # mmdet's DINO, 2 ranks
    python benchmarks/ddp_votes.py --config fcos_r50   # 2 reduce_mean a step
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import json
import os
import tempfile


def _measure(config, out_dir):
    import torch
    import torch.distributed as dist
    from mmengine.logging import MessageHub
    from mmengine.runner import Runner

    from mmnanhook.distributed import ForwardGuard, Ranks
    from mmnan_testing.ddp_zoo import _config
    torch.set_num_threads(1)
    dist.init_process_group('gloo')
    _, cfg = _config(out_dir, config, None, 'skip', dist.get_rank())
    votes, seen = [], [0]
    vote, end = Ranks.vote, ForwardGuard.end

    def counted(self, raised):
        votes.append(MessageHub.get_current_instance().get_info('iter'))
        return vote(self, raised)

    def ended(self):
        seen.append(self.seen)
        return end(self)

    Ranks.vote, ForwardGuard.end = counted, ended
    runner = Runner.from_cfg(cfg)
    runner.train()
    if dist.get_rank() == 0:
        print(json.dumps(dict(
            config=config, ranks=dist.get_world_size(),
            votes=[votes.count(i) for i in range(runner.iter)],
            collectives=[b - a for a, b in zip(seen, seen[1:])])))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--config', default='dino_r50')
    parser.add_argument('--ranks', type=int, default=2)
    parser.add_argument('--worker', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _measure(args.config, args.worker)
        return
    import subprocess

    from mmnan_testing.ddp import launch_command
    env = dict(os.environ, OMP_NUM_THREADS='1')
    with tempfile.TemporaryDirectory() as out_dir:
        subprocess.run(launch_command([
            os.path.abspath(__file__), '--config', args.config, '--worker',
            out_dir], args.ranks), env=env, check=True)


if __name__ == '__main__':
    main()
