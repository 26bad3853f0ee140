"""Two CPU ranks over gloo, started by torch's own launcher.

:func:`run_ranks` starts ``python -m mmnan_testing.ddp SCENARIO OUT``
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
* ``hung``: rank :data:`BAD_RANK` stops answering in iteration
  :data:`BAD_ITER` (its forward sleeps until the other rank gave up on it),
  under ``env_cfg.dist_cfg.timeout`` = :data:`HUNG_TIMEOUT` in the runner's
  config: the other rank stops at its vote before backward, naming it.
"""
import contextlib
import importlib.util
import json
import math
import os
import os.path as osp
import signal
import socket
import subprocess
import sys
import tempfile
import time

# DefaultSampler(shuffle=False), 2 ranks, batch 2: rank r's iteration k holds
# samples r + 2 * (2k + j), j < 2; sample 5 is on rank 1 in iteration 1.
BAD_SAMPLE, BAD_RANK, BAD_ITER = 5, 1, 1


def _nan_loss(out_dir):
    from mmnanhook import NonFiniteError
    from mmnan_testing.toy import make_runner
    env_cfg = dict(dist_cfg=dict(backend='gloo'))
    runner = make_runner(
        out_dir, faults={BAD_SAMPLE: 'inf_target'}, max_iters=4,
        hook=dict(type='NanDetectHook', dump_dir=osp.join(out_dir, 'dumps')),
        launcher='pytorch', env_cfg=env_cfg,
        cfg=dict(env_cfg=env_cfg,
                 model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                        device_ids=None)))
    result = dict(raised=False)
    with ranks_started() as started:
        try:
            runner.train()
        except NonFiniteError as exc:
            result = dict(raised=True, trigger=exc.trigger, iter=exc.iter,
                          rank=exc.rank, bad_ranks=exc.bad_ranks,
                          message=str(exc), bundle=exc.bundle,
                          kind=(exc.report or {}).get('kind'))
    result.update(timeouts=started)
    return result


@contextlib.contextmanager
def ranks_started():
    """The timeouts (seconds: the votes', the exchange's) of the
    :class:`~mmnanhook.distributed.Ranks` that runs start meanwhile."""
    from mmnanhook.distributed import Ranks
    started, start = [], Ranks.__dict__['start']

    def recorded(cls, timeout=None):
        ranks = start.__func__(cls, timeout)
        started.append([ranks.timeout.total_seconds(),
                        ranks.exchange_timeout.total_seconds()])
        return ranks

    Ranks.start = classmethod(recorded)
    try:
        yield started
    finally:
        Ranks.start = start


# The runner's env_cfg.dist_cfg.timeout (seconds) in the 'hung' scenario.
HUNG_TIMEOUT = 3
# Counts, in the default group's store, the ranks that gave up on the
# sleeping one.
_GIVEN_UP = 'mmnan_testing/given_up'


def _hung(out_dir):
    """The forward of the batch that holds :data:`BAD_SAMPLE` (rank
    :data:`BAD_RANK`, iteration :data:`BAD_ITER` with 2 ranks) sleeps, well
    past the timeout, until every other rank has given up on it; then it
    votes, alone."""
    import torch.distributed as dist

    from mmnanhook import compat
    from mmnanhook.errors import RankTimeoutError
    from mmnan_testing.toy import ToyModel, log_text, make_runner
    store = compat.default_store()
    entered, slept = [], []
    others = dist.get_world_size() - 1

    class Sleepy(ToyModel):

        def forward(self, inputs, fault=None, mode='tensor'):
            entered.append(time.time())
            if 'hang' in (fault or []):
                slept.append(True)
                # Bounded: ranks that never give up fail the launch.
                deadline = time.time() + 120
                while (store.add(_GIVEN_UP, 0) < others
                       and time.time() < deadline):
                    time.sleep(0.1)
            return super(Sleepy, self).forward(inputs, fault, mode)

    env_cfg = dict(dist_cfg=dict(backend='gloo', timeout=HUNG_TIMEOUT))
    runner = make_runner(
        out_dir, faults={BAD_SAMPLE: 'hang'}, model=Sleepy(), max_iters=4,
        hook=dict(type='NanDetectHook', dump_dir=osp.join(out_dir, 'dumps')),
        launcher='pytorch', env_cfg=env_cfg,
        cfg=dict(env_cfg=env_cfg,
                 model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                        device_ids=None)))
    result = dict(raised=None, iter=None)
    with ranks_started() as started:
        try:
            runner.train()
        except RankTimeoutError as exc:
            # From the start of this rank's last forward: its vote follows.
            result.update(raised=type(exc).__name__, message=str(exc),
                          ranks=exc.ranks, iter=runner.iter,
                          seconds=time.time() - entered[-1])
        finally:
            if not slept:
                store.add(_GIVEN_UP, 1)
    result.update(timeouts=started, log=log_text(runner))
    return result


def _toy_runner(out_dir, faults, hook, model=None, probe=None, ddp=None,
                **kwargs):
    from mmnan_testing.toy import make_runner
    return make_runner(
        out_dir, faults=faults, max_iters=4, model=model, probe=probe,
        hook=dict(dict(type='NanDetectHook',
                       dump_dir=osp.join(out_dir, 'dumps')), **hook),
        launcher='pytorch', env_cfg=dict(dist_cfg=dict(backend='gloo')),
        cfg=dict(model_wrapper_cfg=dict(dict(
            type='MMDistributedDataParallel', device_ids=None),
            **(ddp or {}))), **kwargs)


def rank_batch(rank, iter, world_size=2, batch=2):
    """The samples of ``rank``'s batch in iteration ``iter``
    (``DefaultSampler(shuffle=False)``)."""
    return [rank + world_size * (batch * iter + j) for j in range(batch)]


def by_hand(model, before, batches, shared_stats=False):
    """The DDP update step of the toy model from the state ``before``
    (parameters by name, optimizer state): each rank's batch (a list of
    samples; empty for a rank that takes part with a zero loss) through the
    model in train mode, its loss's gradient divided by the world size and
    summed over the ranks as DDP's reducer does, then SGD with momentum.
    The losses of the ranks with samples are multiplied by ``world size /
    those ranks``, so that the mean is over them. ``shared_stats``: the
    model's batch statistics are shared across the ranks (SyncBN): one
    forward of every batch at once, each rank's loss from its rows.

    Returns:
        dict: Parameters after the step, by name.
    """
    import torch
    world = len(batches)
    model.load_state_dict(dict((k.replace('module.', '', 1), v)
                               for k, v in before[0].items()), strict=False)
    model.train()
    present = [b for b in batches if b]
    factor = float(world) / len(present)

    def forward(samples):
        return model(inputs=[s['inputs'] for s in samples],
                     fault=[s['fault'] for s in samples], mode='tensor')

    every = forward([s for b in present for s in b]) if shared_stats \
        else None
    grads, start = None, 0
    for batch in batches:
        if not batch:
            continue
        y = every[start:start + len(batch)] if shared_stats else \
            forward(batch)
        start += len(batch)
        loss, _ = model.parse_losses(model.loss(
            y, set(s['fault'] for s in batch if s['fault'])))
        model.zero_grad()
        (loss * factor if factor != 1.0 else loss).backward(
            retain_graph=shared_stats)
        mine = [p.grad / world for p in model.parameters()]
        grads = mine if grads is None else [a + b for a, b in zip(grads,
                                                                   mine)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(before[1]['optimizer'] if 'optimizer' in
                              before[1] else before[1])
    for param, grad in zip(model.parameters(), grads):
        param.grad = grad
    optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _weights(runner):
    import torch
    return torch.cat([p.detach().reshape(-1)
                      for p in runner.model.parameters()]).tolist()


def _drop_run(out_dir, faults, model_type=None, policy='drop',
              shared_stats=False, ddp=None, check_by_hand=True):
    """``policy`` on the toy model, the faults on rank 1 in iteration
    :data:`BAD_ITER`; rank 0 writes the hand recompute of that step
    (``check_by_hand``: a model whose preprocessor changes the inputs has
    none)."""
    import torch

    from mmnan_testing.toy import Probe, ToyDataset, ToyModel, log_text
    model_type = model_type or ToyModel
    probe = Probe()
    runner = _toy_runner(out_dir, faults, dict(policy=policy),
                         model=model_type(), probe=probe, ddp=ddp,
                         log_level='INFO')
    captured = capture_replays(runner)
    runner.train()
    hub = runner.message_hub.log_scalars
    data = ToyDataset(16, faults)
    dropped = [[i for i in rank_batch(r, BAD_ITER) if i in faults]
               for r in range(2)]
    kept = [[data[i] for i in rank_batch(r, BAD_ITER) if i not in faults]
            for r in range(2)]
    same = close = None
    if check_by_hand:
        expected = by_hand(model_type(), probe.before[BAD_ITER], kept,
                           shared_stats)
        after = probe.after[BAD_ITER][0]
        same = all(torch.equal(after[k],
                               expected[k.replace('module.', '', 1)])
                   for k in after)
        close = all(torch.allclose(after[k], expected[k.replace(
            'module.', '', 1)], rtol=1e-5, atol=1e-7) for k in after)
    return dict(
        iter=runner.iter, weights=_weights(runner), dropped=dropped,
        by_hand=same, by_hand_close=close,
        finite=all(math.isfinite(w) for w in _weights(runner)),
        skipped=int(hub['train/nan_skipped'].current()),
        samples_dropped=int(hub['train/samples_dropped'].current())
        if 'train/samples_dropped' in hub else 0,
        replay_buffers=captured, log=log_text(runner))


def capture_replays(runner):
    """Wrap the diagnosis of the run's triggers, from its examination to
    its bundle written: whether the model's buffers (BN running statistics)
    after it equal those before it, per diagnosis."""
    import torch
    from mmnanhook.diagnosis import _in_run
    seen, before = [], []
    examine, conclude = _in_run.examine, _in_run.conclude

    def examined(*args, **kwargs):
        before[:] = [b.detach().clone() for b in runner.model.buffers()]
        return examine(*args, **kwargs)

    def concluded(*args, **kwargs):
        try:
            return conclude(*args, **kwargs)
        finally:
            seen.append(all(torch.equal(a, b) for a, b in zip(
                before, runner.model.buffers())))

    # This rank's process trains this one runner.
    _in_run.examine, _in_run.conclude = examined, concluded
    return seen


# The most differences a picture's comparison keeps (a run whose replays
# changed everything says so in these, and how many more).
_DIFFS_KEPT = 40


def capture_pictures(runner):
    """Compare the run before and after each handling of a trigger's
    diagnosis: :mod:`mmnan_testing.runstate`'s picture of ``runner`` taken
    right before this rank's examination of it
    (``mmnanhook.diagnosis._in_run.Diagnostician._examine``: the micro-step
    search and every replay) and right after its bundle is written
    (``Diagnostician.write``); a rank that does not diagnose only exchanges.

    Returns:
        list[dict]: Per diagnosis on this rank, in order: ``iter``,
        ``diff`` (the differences, empty when nothing changed; at most
        :data:`_DIFFS_KEPT`), ``more`` (those left out), ``seconds`` (from
        the examination to the bundle written). Filled as the run goes.
    """
    from mmnanhook.diagnosis._in_run import Diagnostician
    seen = []
    _pictures['seen'] = seen
    if not getattr(Diagnostician._examine, 'pictured', False):
        examine, write = Diagnostician._examine, Diagnostician.write
        pending = []

        def examined(self, *args, **kwargs):
            from mmnan_testing import runstate
            pending[:] = [runstate.take(self.runner), time.time()]
            return examine(self, *args, **kwargs)

        def written(self, *args, **kwargs):
            from mmnan_testing import runstate
            try:
                return write(self, *args, **kwargs)
            finally:
                if pending:
                    before, start = pending
                    del pending[:]
                    found = runstate.diff(before, runstate.take(self.runner))
                    _pictures['seen'].append(dict(
                        iter=self.runner.iter, diff=found[:_DIFFS_KEPT],
                        more=max(len(found) - _DIFFS_KEPT, 0),
                        seconds=round(time.time() - start, 2)))

        examined.pictured = True
        # This rank's process trains one runner at a time; a later
        # scenario's call only points the records elsewhere.
        Diagnostician._examine, Diagnostician.write = examined, written
    return seen


_pictures = {}


def read_bundles(out_dir):
    """What the bundles under ``out_dir/dumps`` say: path, summary, kind,
    every rank's findings, the implicated samples, the modules made
    local, the iteration (its manifest's)."""
    import glob
    found = []
    for path in sorted(glob.glob(osp.join(out_dir, 'dumps', '*',
                                          'report.json'))):
        with open(path) as f:
            report = json.load(f)
        found.append(dict(path=path, summary=report['summary'],
                          kind=report['kind'], ranks=report['ranks'],
                          samples=[s['index'] for s in report['samples']],
                          files=[s['img_path'] for s in report['samples']],
                          local=report['local_modules'],
                          notes=report.get('notes') or [],
                          iter=_manifest_iter(osp.dirname(path))))
    return found


def _manifest_iter(bundle):
    path = osp.join(bundle, 'manifest.json')
    if not osp.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get('iter')


def _drop(out_dir):
    """policy='drop' under DDP: rank 1 leaves its sample out, rank 0 takes
    its batch unchanged."""
    return _drop_run(out_dir, {BAD_SAMPLE: 'inf_target'})


def _drop_whole(ddp=None):
    def scenario(out_dir):
        """Every sample of rank 1's batch fails: it takes part with a zero
        loss, rank 0's loss counts for both (``ddp``: the DDP wrapper's
        options)."""
        return _drop_run(out_dir, dict(
            (i, 'inf_target') for i in rank_batch(BAD_RANK, BAD_ITER)),
            ddp=ddp)
    return scenario


def _raise_skip(out_dir):
    """Rank 1's NaN input stops its forward on entry (the input check), not
    rank 0's; 'skip'."""
    return _drop_run(out_dir, {BAD_SAMPLE: 'nan_input'}, policy='skip')


def _raise_reduce(out_dir):
    """The forward raises on rank 1 alone (``raise_in_loss``), before a
    collective of the loss (a ``reduce_mean``) that rank 0 then calls,
    'skip'."""
    from mmnan_testing.toy import ToyNormalizedModel
    return _drop_run(out_dir, {BAD_SAMPLE: 'raise_in_loss'},
                     ToyNormalizedModel, policy='skip')


# Rank 1's sample in the third iteration (2): ranks have recorded a step.
LATE_SAMPLE, LATE_ITER = 9, 2


def _raise_late(out_dir):
    """The forward raises on rank 1 alone in iteration :data:`LATE_ITER`,
    between the 5th and the 6th of its loss's 20 ``reduce_mean``, which
    rank 0 goes on calling; 'skip'. ``votes``: the votes of each iteration
    (:meth:`~mmnanhook.distributed.Ranks.vote`)."""
    from mmengine.logging import MessageHub

    from mmnanhook.distributed import Ranks
    from mmnan_testing.toy import ToyNormalizedModel
    votes, vote = [], Ranks.vote

    def counted(self, raised):
        votes.append(MessageHub.get_current_instance().get_info('iter'))
        return vote(self, raised)

    Ranks.vote = counted
    try:
        result = _drop_run(out_dir, {LATE_SAMPLE: 'raise_in_loss'},
                           lambda: ToyNormalizedModel(5, 15), policy='skip')
    finally:
        Ranks.vote = vote
    result.update(votes=[votes.count(i) for i in range(result['iter'])])
    return result


def _raise_drop(out_dir):
    """The same input, 'drop': rank 1 takes the step again without it."""
    return _drop_run(out_dir, {BAD_SAMPLE: 'nan_input'})


def _nodes(out_dir):
    """Two nodes of one rank each with work dirs of their own (nodes that do
    not share a file system): the tiny RetinaNet on VOC data, 'drop', image
    :data:`BAD_SAMPLE` (rank 1, iteration 1) with a zero-width box. Each
    node writes the list every rank learned."""
    import torch.distributed as dist
    from mmengine.dist import broadcast_object_list
    from mmengine.runner import Runner

    from mmnanhook.quarantine import read_quarantine
    from mmnan_testing import testbed
    rank = dist.get_rank()
    box = [testbed.make_dataset(
        'retinanet_voc', osp.join(out_dir, 'data'), num_images=8,
        defects={BAD_SAMPLE: 'zero_size'}) if rank == 0 else None]
    broadcast_object_list(box)
    work = osp.join(out_dir, 'node%d' % rank)
    cfg = testbed.tiny_config('retinanet_voc', box[0], work, max_iters=4,
                              log_level='INFO')
    cfg.custom_imports = dict(imports=['mmnanhook'],
                              allow_failed_imports=False)
    cfg.custom_hooks = [dict(type='NanDetectHook', policy='drop')]
    cfg.launcher = 'pytorch'
    cfg.env_cfg.dist_cfg = dict(backend='gloo')
    cfg.model_wrapper_cfg = dict(type='MMDistributedDataParallel',
                                 device_ids=None)
    runner = Runner.from_cfg(cfg)
    runner.train()
    path = osp.join(work, 'nan_quarantine.json')
    return dict(
        rank=rank, local_rank=os.environ.get('LOCAL_RANK'),
        iter=runner.iter, bad=box[0]['defect_images'][0],
        quarantine=[(s.file, s.indices, s.rank)
                    for s in read_quarantine(path)]
        if osp.exists(path) else None,
        samples_dropped=int(runner.message_hub.get_scalar(
            'train/samples_dropped').current()))


def _syncbn(policy):
    def scenario(out_dir):
        """Rank 1's forward makes its sample's features NaN before the
        shared batch statistics (``nan_made``): every rank's loss is NaN."""
        from mmnan_testing.toy import ToySyncBNModel
        return _drop_run(out_dir, {BAD_SAMPLE: 'nan_made'}, ToySyncBNModel,
                         policy=policy, shared_stats=True)
    return scenario


def _input(policy, ddp=None, sample=BAD_SAMPLE):
    def scenario(out_dir):
        """Rank 1's NaN input (``nan_input``, ``sample``), stopped by the
        input check on entry to a forward whose first op shares batch
        statistics (``CpuSyncBatchNorm``), where rank 0 waited for it before
        issue 65; ``ddp``: the DDP wrapper's options (DDP's default
        ``broadcast_buffers=True`` otherwise). Under ``'raise'``: what each
        rank raised, and its weights."""
        from mmnanhook import NonFiniteError
        from mmnan_testing.toy import ToySyncBNModel
        if policy != 'raise':
            return _drop_run(out_dir, {sample: 'nan_input'}, ToySyncBNModel,
                             policy=policy, shared_stats=True, ddp=ddp,
                             check_by_hand=sample == BAD_SAMPLE)
        runner = _toy_runner(out_dir, {sample: 'nan_input'},
                             dict(policy=policy), model=ToySyncBNModel(),
                             ddp=ddp, log_level='INFO')
        try:
            runner.train()
            error = None
        except NonFiniteError as exc:
            error = dict(trigger=exc.trigger, iter=exc.iter, rank=exc.rank,
                         bad_ranks=exc.bad_ranks, message=str(exc),
                         kind=(exc.report or {}).get('kind'))
        return dict(error=error, iter=runner.iter, weights=_weights(runner),
                    finite=all(math.isfinite(w) for w in _weights(runner)))
    return scenario


# Samples on rank 0 in iterations 10 and 11 (see above): two spikes in a row.
SPIKE_SAMPLES = (40, 44)
SPIKE_ITERS = (10, 11)


def _rewind(out_dir):
    import torch

    from mmnan_testing.toy import make_runner
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


SCENARIOS = {'nan_loss': _nan_loss, 'rewind': _rewind, 'drop': _drop,
             'drop_whole': _drop_whole(),
             'drop_whole_unused': _drop_whole(dict(
                 find_unused_parameters=True)),
             'drop_whole_static': _drop_whole(dict(static_graph=True)),
             'raise_skip': _raise_skip, 'raise_reduce': _raise_reduce,
             'raise_late': _raise_late, 'raise_drop': _raise_drop,
             'syncbn_skip': _syncbn('skip'), 'syncbn_drop': _syncbn('drop'),
             'input_skip': _input('skip'), 'input_drop': _input('drop'),
             'input_raise': _input('raise'),
             'input_unbroadcast_drop': _input(
                 'drop', dict(broadcast_buffers=False)),
             'input_first_skip': _input(
                 'skip', dict(broadcast_buffers=False), sample=1),
             'nodes': _nodes, 'hung': _hung}


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def launch_command(args, nproc=1, port=None, node=None):
    """The command that starts ``args`` (``-m MODULE ...``, or a script and
    its arguments) in ``nproc`` ranks with torch's launcher (torch 1.7's
    too), its master on 127.0.0.1.

    Args:
        port (int, optional): The master's port; a free one by default.
        node (tuple, optional): ``(nnodes, node_rank)``: this launcher is
            one node of a multi-node job.
    """
    if importlib.util.find_spec('torch.distributed.run') is not None:
        launcher = ['-m', 'torch.distributed.run']
    else:  # torch < 1.9
        launcher = ['-m', 'torch.distributed.launch', '--use_env']
    nodes = ['--nnodes', str(node[0]), '--node_rank', str(node[1])] \
        if node is not None else []
    return [sys.executable] + launcher + nodes + [
        '--nproc_per_node', str(nproc), '--master_addr', '127.0.0.1',
        '--master_port', str(port or _free_port())] + list(args)


def _launch(commands, timeout):
    """Run the launcher ``commands`` at once, each in a session of its own;
    a hang (a rank waiting in a collective) past ``timeout`` seconds kills
    every process they started and fails.

    Returns:
        str: Their output, one after the other.
    """
    env = dict(os.environ, OMP_NUM_THREADS='1')
    # Files, not pipes: a launcher blocked on a full pipe would stall the
    # others in their collectives.
    outputs = [tempfile.TemporaryFile() for _ in commands]
    procs = [subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                              env=env, start_new_session=True)
             for cmd, out in zip(commands, outputs)]
    deadline = time.time() + timeout
    hung = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            hung = True
            break
    if hung:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
    logs = []
    for out in outputs:
        out.seek(0)
        logs.append(out.read().decode(errors='replace'))
        out.close()
    log = '\n'.join(logs)
    if hung:
        raise AssertionError('the ranks did not finish in %d s (a hang):\n%s'
                             % (timeout, log[-5000:]))
    if any(proc.returncode != 0 for proc in procs):
        raise AssertionError(log[-5000:])
    return log


def _results(out_dir, ranks):
    results = []
    for rank in range(ranks):
        with open(osp.join(str(out_dir), 'rank%d.json' % rank)) as f:
            results.append(json.load(f))
    return results


def run_ranks(scenario, out_dir, nproc=2, module='mmnan_testing.ddp',
              timeout=300):
    """Run ``scenario`` on ``nproc`` ranks over gloo with torch's launcher.

    ``module`` is the one whose ``SCENARIOS`` has it (run with ``-m``); a
    run past ``timeout`` seconds is a hang, and fails.

    Returns:
        tuple[list[dict], str]: Each rank's result and the launcher's log.
    """
    log = _launch([launch_command(['-m', module, scenario, str(out_dir)],
                                  nproc)], timeout)
    return _results(out_dir, nproc), log


def run_scenarios(scenarios, out_dir, nproc=2,
                  module='mmnan_testing.ddp', timeout=600):
    """Run several scenarios one after the other in the same ranks (one
    launch: the processes' start, seconds of imports each, is paid once),
    each in ``out_dir/<scenario>``.

    Returns:
        tuple[dict, str]: Scenario -> each rank's result; the launcher's
        log.
    """
    for scenario in scenarios:
        os.makedirs(osp.join(str(out_dir), scenario), exist_ok=True)
    log = _launch([launch_command(
        ['-m', module, ','.join(scenarios), str(out_dir)], nproc)], timeout)
    return dict((scenario, _results(osp.join(str(out_dir), scenario), nproc))
                for scenario in scenarios), log


def run_nodes(scenario, out_dir, nnodes=2, module='mmnan_testing.ddp',
              timeout=300):
    """Run ``scenario`` as ``nnodes`` nodes of one rank each: a launcher per
    node (``--nnodes``, ``--node_rank``) on 127.0.0.1, as a multi-node job
    starts. Returns and fails as :func:`run_ranks`."""
    port = _free_port()
    log = _launch([launch_command(['-m', module, scenario, str(out_dir)],
                                  port=port, node=(nnodes, node))
                   for node in range(nnodes)], timeout)
    return _results(out_dir, nnodes), log


def main(argv=None, scenarios=None):
    """``SCENARIO[,SCENARIO...] OUT_DIR``: one scenario in ``OUT_DIR``, or
    several in turn, each in ``OUT_DIR/<scenario>``."""
    names, out_dir = (argv or sys.argv[1:])[:2]
    import torch.distributed as dist
    dist.init_process_group('gloo')
    names = names.split(',')
    scenarios = scenarios or SCENARIOS
    wheres = [out_dir if len(names) == 1 else osp.join(out_dir, name)
              for name in names]
    for name, where in zip(names, wheres):
        result = scenarios[name](where)
        with open(_result_path(where), 'w') as f:
            json.dump(result, f)
    # Every rank done before any leaves, and before the bundles are read: a
    # rank may still be writing its diagnosis when another's run has ended
    # (a step left out on every rank in the last iteration).
    dist.barrier()
    for where in wheres:
        with open(_result_path(where)) as f:
            result = json.load(f)
        result.update(bundles=read_bundles(where))
        with open(_result_path(where), 'w') as f:
            json.dump(result, f)
    dist.destroy_process_group()
    _leave()


def _result_path(where):
    import torch.distributed as dist
    return osp.join(where, 'rank%d.json' % dist.get_rank())


def _leave():
    """End a rank that is done, without the interpreter's finalization.

    Once ``torch.distributed.fsdp`` is imported (torch 2.13; mmengine.runner
    imports it), ``destroy_process_group`` leaves the default group's gloo
    worker threads running. One that drops a finished collective's tensors
    after the finalization began takes the GIL, CPython ends that thread with
    ``pthread_exit``, and the unwinding through the work's ``noexcept``
    destructor aborts the rank ("terminate called without an active
    exception"), now and then (seen after the rewind's broadcasts; core
    dumps: ``~AsyncBroadcastWork`` -> ``decref`` -> ``take_gil`` ->
    ``pthread_exit`` while the main thread is in ``Py_FinalizeEx``). On
    torch 1.7 the autograd engine can hang in the exit handlers after a
    backward (pytorch#47886). What a normal exit would have caught is
    checked first: a thread of ours, or any that would keep the process
    alive, still running fails the rank.
    """
    import threading

    from mmnanhook import compat
    left = [t.name for t in threading.enumerate()
            if t is not threading.main_thread()
            and (not t.daemon or t.name.startswith('mmnanhook'))]
    if left:
        print('threads still running at the end of the scenario: %s'
              % ', '.join(left), file=sys.stderr)
    compat.leave(1 if left else 0)


if __name__ == '__main__':
    main()
