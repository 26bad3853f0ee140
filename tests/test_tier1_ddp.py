"""Tier 1 under DDP: two CPU processes over gloo, started by a real launcher.

Rank 1 alone sees an infinite loss whose gradients are finite, so after the
gradient all-reduce nothing on rank 0 looks wrong: only the exchanged loss
flags can make both ranks stop, in the same iteration, without a hang.

Run as a script, this file is the worker the launcher starts.
"""
import importlib.util
import json
import os
import os.path as osp
import socket
import subprocess
import sys

import pytest

# DefaultSampler(shuffle=False), 2 ranks, batch 2: rank r's iteration k holds
# samples r + 2 * (2k + j), j < 2; sample 5 is on rank 1 in iteration 1.
BAD_SAMPLE, BAD_RANK, BAD_ITER = 5, 1, 1


def _worker(out_dir):
    import torch.distributed as dist
    dist.init_process_group('gloo')
    rank = dist.get_rank()
    from mmnanhook.testing.toy import make_runner

    from mmnanhook import NonFiniteError
    runner = make_runner(
        out_dir, faults={BAD_SAMPLE: 'inf_target'}, max_iters=4,
        hook=dict(type='NanDetectHook', dump_dir=osp.join(out_dir, 'dumps')),
        launcher='pytorch', env_cfg=dict(dist_cfg=dict(backend='gloo')),
        cfg=dict(model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                        device_ids=None)))
    result = dict(raised=False)
    try:
        runner.train()
    except NonFiniteError as exc:
        result = dict(raised=True, trigger=exc.trigger, iter=exc.iter,
                      rank=exc.rank, bad_ranks=exc.bad_ranks,
                      message=str(exc), bundle=exc.bundle,
                      kind=(exc.report or {}).get('kind'))
    with open(osp.join(out_dir, 'rank%d.json' % rank), 'w') as f:
        json.dump(result, f)


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _launcher():
    if importlib.util.find_spec('torch.distributed.run') is not None:
        return ['-m', 'torch.distributed.run']
    return ['-m', 'torch.distributed.launch', '--use_env']  # torch < 1.9

def run_two_ranks(script, out_dir):
    """Start ``script out_dir`` on 2 ranks over gloo with torch's launcher;
    return the ``rank<r>.json`` results of the ranks and the launcher log.
    A hang (one rank waiting in a collective) ends in TimeoutExpired."""
    cmd = [sys.executable] + _launcher() + [
        '--nproc_per_node', '2', '--master_addr', '127.0.0.1',
        '--master_port', str(_free_port()), script, str(out_dir)
    ]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.run(cmd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=env, timeout=300)
    log = proc.stdout.decode(errors='replace')
    assert proc.returncode == 0, log[-5000:]
    results = []
    for rank in range(2):
        with open(osp.join(str(out_dir), 'rank%d.json' % rank)) as f:
            results.append(json.load(f))
    return results, log


@pytest.mark.ddp
def test_one_rank_nan_loss_stops_every_rank_in_the_same_iteration(tmp_path):
    results, log = run_two_ranks(__file__, tmp_path)
    for rank, result in enumerate(results):
        assert result['raised'], (rank, log[-5000:])
        assert result['trigger'] == 'loss'
        assert result['iter'] == BAD_ITER
        assert result['rank'] == rank
        assert result['bad_ranks'] == [BAD_RANK]
        assert 'on rank %d' % BAD_RANK in result['message']
        assert 'rank %d of 2' % rank in result['message']
    assert 'loss_aux=inf' in results[BAD_RANK]['message']


if __name__ == '__main__':
    _worker(sys.argv[1])
