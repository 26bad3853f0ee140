"""Two CPU ranks over gloo, started by torch's own launcher.

:func:`run_ranks` starts ``python -m mmnanhook.testing.ddp SCENARIO OUT``
on each rank; every rank trains the toy model under
``MMDistributedDataParallel`` and writes ``rank<r>.json``.

Scenarios:

* ``nan_loss``: rank :data:`BAD_RANK` alone sees an infinite loss with
  finite gradients in iteration :data:`BAD_ITER`; after the gradient
  all-reduce nothing on the other rank looks wrong, so only the exchanged
  loss flags can stop both ranks, in the same iteration, without a hang.
* ``rewind``: rank 0 alone sees a spiked loss in iterations
  :data:`SPIKE_ITERS`; both ranks judge the mean loss of the ranks, skip
  the first spike and rewind at the second, to the same snapshot.
"""
import importlib.util
import json
import os
import os.path as osp
import socket
import subprocess
import sys

# DefaultSampler(shuffle=False), 2 ranks, batch 2: rank r's iteration k holds
# samples r + 2 * (2k + j), j < 2; sample 5 is on rank 1 in iteration 1.
BAD_SAMPLE, BAD_RANK, BAD_ITER = 5, 1, 1


def _nan_loss(out_dir):
    from mmnanhook import NonFiniteError
    from mmnanhook.testing.toy import make_runner
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
    return result


def _drop(out_dir):
    """policy='drop' under DDP: not yet, so every rank skips alike."""
    import torch

    from mmnanhook.testing.toy import log_text, make_runner
    runner = make_runner(
        out_dir, faults={BAD_SAMPLE: 'inf_target'}, max_iters=4,
        hook=dict(type='NanDetectHook', policy='drop',
                  dump_dir=osp.join(out_dir, 'dumps')),
        launcher='pytorch', env_cfg=dict(dist_cfg=dict(backend='gloo')),
        cfg=dict(model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                        device_ids=None)))
    runner.train()
    hub = runner.message_hub.log_scalars
    weights = torch.cat([p.detach().reshape(-1)
                         for p in runner.model.parameters()])
    return dict(iter=runner.iter, skipped=int(
        hub['train/nan_skipped'].current()), weights=weights.tolist(),
        said="policy 'drop': not implemented under distributed training "
        'yet: the step is skipped' in log_text(runner))


# Samples on rank 0 in iterations 10 and 11 (see above): two spikes in a row.
SPIKE_SAMPLES = (40, 44)
SPIKE_ITERS = (10, 11)


def _rewind(out_dir):
    import torch

    from mmnanhook.testing.toy import make_runner
    runner = make_runner(
        out_dir, faults={s: 'spike' for s in SPIKE_SAMPLES}, max_iters=14,
        n=64, hook=dict(type='NanDetectHook', policy='rewind',
                        spike_policy='rewind', spike_window=10,
                        spike_warmup=5, snapshot_interval=4, cooldown=2,
                        dump_dir=osp.join(out_dir, 'dumps')),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01, momentum=0.9)),
        launcher='pytorch', env_cfg=dict(dist_cfg=dict(backend='gloo')),
        cfg=dict(model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                        device_ids=None)))
    runner.train()
    hub = runner.message_hub.log_scalars
    hook = [h for h in runner.hooks if type(h).__name__ == 'NanDetectHook'][0]
    rewound = [(r['iter'], r['rewind']) for r in hook._history.records()
               if 'rewind' in r]
    weights = torch.cat([p.detach().reshape(-1)
                         for p in runner.model.parameters()])
    return dict(rewinds=int(hub['train/rewinds'].current())
                if 'train/rewinds' in hub else 0,
                spikes=int(hub['train/spikes'].current()), rewound=rewound,
                weights=weights.tolist(), iter=runner.iter)


SCENARIOS = {'nan_loss': _nan_loss, 'rewind': _rewind, 'drop': _drop}


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _launcher():
    if importlib.util.find_spec('torch.distributed.run') is not None:
        return ['-m', 'torch.distributed.run']
    return ['-m', 'torch.distributed.launch', '--use_env']  # torch < 1.9


def run_ranks(scenario, out_dir, nproc=2, module='mmnanhook.testing.ddp'):
    """Run ``scenario`` on ``nproc`` ranks over gloo with torch's launcher.

    A hang (a rank waiting in a collective) ends in ``TimeoutExpired``.
    ``module`` is the one whose ``SCENARIOS`` has it (run with ``-m``).

    Returns:
        tuple[list[dict], str]: Each rank's result and the launcher's log.
    """
    cmd = [sys.executable] + _launcher() + [
        '--nproc_per_node', str(nproc), '--master_addr', '127.0.0.1',
        '--master_port', str(_free_port()), '-m', module,
        scenario, str(out_dir)
    ]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.run(cmd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=env, timeout=300)
    log = proc.stdout.decode(errors='replace')
    if proc.returncode != 0:
        raise AssertionError(log[-5000:])
    results = []
    for rank in range(nproc):
        with open(osp.join(str(out_dir), 'rank%d.json' % rank)) as f:
            results.append(json.load(f))
    return results, log


def main(argv=None, scenarios=None):
    scenario, out_dir = (argv or sys.argv[1:])[:2]
    import torch.distributed as dist
    dist.init_process_group('gloo')
    result = (scenarios or SCENARIOS)[scenario](out_dir)
    with open(osp.join(out_dir, 'rank%d.json' % dist.get_rank()), 'w') as f:
        json.dump(result, f)


if __name__ == '__main__':
    main()
