"""MMEngine's ``FlexibleRunner`` strategies and sharded gradients, on two CPU
ranks over gloo (started by :func:`mmnan_testing.ddp.run_ranks`).

Scenarios:

* ``flexible_ddp``: the zoo RetinaNet R50 under ``FlexibleRunner`` +
  ``DDPStrategy``, image :data:`BAD_IMAGE` (declared twice as wide as its
  file) on rank :data:`BAD_RANK` in iteration :data:`BAD_ITER`.
* ``shards``: :class:`~mmnanhook.sentinel.StepCheck` on plain tensors split
  across the ranks as FSDP1 shards them (one gradient halved, one whole on
  every rank): the global norm, the inf-norm, a NaN on one rank's shard.
* ``fsdp2``: FSDP2 ``fully_shard`` (DTensor gradients, CPU) under an
  ``OptimWrapper`` with mmnanhook installed: the norm it logs and clips by is
  the unsharded model's, a NaN in one rank's shard stops both ranks.
"""
import copy
import math
import os.path as osp

import torch


# 8 images, 2 ranks, batch 2, DefaultSampler(shuffle=False): rank r's
# iteration k holds images r + 2 * (2k + j), j < 2; image 5 is on rank 1 in
# iteration 1.
NUM_IMAGES, BAD_IMAGE, BAD_RANK, BAD_ITER = 8, 5, 1, 1


def _flexible_ddp(out_dir):
    from mmengine.dist import get_rank
    from mmengine.runner import FlexibleRunner

    from mmnanhook import NonFiniteError
    from mmnan_testing import zoo

    torch.set_num_threads(1)
    # Each rank writes its own copy (same seed, same bytes) and child config:
    # none reads a file another is still writing. The work dir is shared.
    rank = get_rank()
    data = zoo.make_zoo_dataset('retinanet_r50',
                                osp.join(out_dir, 'data%d' % rank),
                                num_images=NUM_IMAGES,
                                defects={BAD_IMAGE: 'size_mismatch'})
    cfg = zoo.child_config('retinanet_r50', data,
                           osp.join(out_dir, 'cfg%d' % rank), hook='line')
    cfg.work_dir = osp.join(out_dir, 'work')
    cfg.train_dataloader.sampler.shuffle = False
    cfg.log_level = 'WARNING'
    cfg.launcher = 'pytorch'
    cfg.env_cfg.dist_cfg = dict(backend='gloo')
    cfg.strategy = dict(
        type='DDPStrategy',
        model_wrapper=dict(type='MMDistributedDataParallel',
                           broadcast_buffers=False, device_ids=None))
    runner = FlexibleRunner.from_cfg(cfg)
    probe = zoo.BatchFiles()
    runner.register_hook(probe)
    result = dict(raised=False, runner=type(runner).__name__,
                  strategy=type(runner.strategy).__name__,
                  bad_file=osp.join(data['img_dir'],
                                    data['defect_images'][0]))
    try:
        runner.train()
    except NonFiniteError as exc:
        iter_, before, optim = probe.before
        result.update(
            raised=True, trigger=exc.trigger, iter=exc.iter,
            probe_iter=iter_, rank=exc.rank, bad_ranks=exc.bad_ranks,
            message=str(exc), bundle=exc.bundle,
            bundle_exists=bool(exc.bundle) and osp.isdir(exc.bundle),
            files=probe.files,
            samples=[s.get('img_path')
                     for s in (exc.report or {}).get('samples', [])],
            weights_unchanged=all(
                torch.equal(v, before[k])
                for k, v in zoo.weights(runner).items()),
            optimizer_unchanged=_equal(runner.optim_wrapper.state_dict(),
                                       optim),
            wrapper=type(runner.optim_wrapper).__name__)
    return result


def _equal(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _shards(out_dir):
    """FSDP1's layout on plain tensors: ``w`` halved, ``b`` whole."""
    import torch.distributed as dist

    from mmnanhook.options import CheckOptions
    from mmnanhook.sentinel import StepCheck
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(10, generator=gen) * 3
    b = torch.randn(4, generator=gen)
    grads = [w[5 * rank:5 * rank + 5].clone(), b.clone()]
    params = [torch.zeros_like(g) for g in grads]
    check = StepCheck(CheckOptions(policy='raise', spike_policy=None))
    result = {}
    for p in (2.0, 1.0, float('inf')):
        outcome = check.check(params, grads, p, clips=True,
                              sharded=[True, False])
        result['norm_%s' % p] = outcome.grad_norm
        result['expected_%s' % p] = float(torch.cat([w, b]).norm(p))
        result['local_%s' % p] = float(torch.cat(grads).norm(p))
    # A NaN in rank 1's half only: both ranks see it.
    if rank == 1:
        grads[0][2] = float('nan')
    outcome = check.check(params, grads, 2.0, clips=True,
                          sharded=[True, False])
    event = outcome.event
    result.update(nan_norm=outcome.grad_norm,
                  nan_trigger=event and event.trigger.value,
                  nan_grads=event and event.nonfinite_grad_count)
    # Finite shards whose norm overflows fp32 only once summed over ranks.
    big = [torch.full((5, ), 1.4e19 / math.sqrt(5)), torch.zeros(4)]
    result['big_local'] = float(big[0].norm())
    outcome = check.check(params, big, 2.0, clips=True,
                          sharded=[True, False])
    result.update(big_norm=outcome.grad_norm,
                  big_message=outcome.event and outcome.event.message)
    return result


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


class _Net(torch.nn.Module):
    """``body`` sharded by FSDP2; ``gain`` left whole on every rank."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 7),
                                        torch.nn.ReLU(),
                                        torch.nn.Linear(7, 3))
        self.gain = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.body(x) * self.gain


def _fsdp2(out_dir):
    import torch.distributed as dist
    from mmengine.logging import MessageHub
    from mmengine.optim import OptimWrapper

    from mmnanhook import NonFiniteError, compat
    from mmnanhook.sentinel import install_nan_detect
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _Net()
    net = copy.deepcopy(ref)
    _fully_shard()(net.body)
    # Every rank the same input, so the unsharded model is the reference
    # (FSDP averages the ranks' gradients) and gain's gradient is equal.
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)) * 4
    max_norm = 0.5

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).square().sum().backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(),
                                                    max_norm))
    ref_opt.step()

    wrapper = OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1),
                           clip_grad=dict(max_norm=max_norm))
    hub = MessageHub.get_current_instance()
    install_nan_detect(wrapper, policy='raise', spike_policy=None,
                       message_hub=hub)
    with wrapper.optim_context(net):
        loss = net(x).square().sum()
    dtensor = compat.dtensor_type()
    result = dict(dtensor_grads=None)
    wrapper.backward(loss)
    result['dtensor_grads'] = sorted(
        n for n, p in net.named_parameters() if isinstance(p.grad, dtensor))
    # What mmengine's FSDPStrategy clips by: the local shards' norm.
    result['local_norm'] = float(torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(
            p.grad.to_local() if isinstance(p.grad, dtensor) else p.grad)
        for p in net.parameters()
    ])))
    wrapper.step()
    wrapper.zero_grad()
    result['ref_norm'] = ref_norm
    result['logged_norm'] = hub.get_scalar('train/grad_norm').current()
    full = dict((n, p.full_tensor() if isinstance(p, dtensor) else p.data)
                for n, p in net.named_parameters())
    result['max_weight_diff'] = max(
        float((full[n] - p.data).abs().max())
        for n, p in ref.named_parameters())

    # A NaN in rank 1's shard of one gradient only.
    with wrapper.optim_context(net):
        loss = net(x).square().sum()
    wrapper.backward(loss)
    if rank == 1:
        net.body[2].weight.grad.to_local().view(-1)[0] = float('nan')
    before = dict((n, p.to_local().clone() if isinstance(p, dtensor) else
                   p.detach().clone()) for n, p in net.named_parameters())
    result['raised'] = False
    try:
        wrapper.step()
    except NonFiniteError as exc:
        result.update(raised=True, trigger=exc.trigger, message=str(exc))
    result['unchanged'] = all(
        torch.equal(p.to_local() if isinstance(p, dtensor) else p.detach(),
                    before[n]) for n, p in net.named_parameters())
    result['finite'] = all(math.isfinite(v) for v in (
        result['ref_norm'], result['logged_norm']))
    return result


def toy_flexible_runner(work_dir, optim_wrapper, hook=None, max_iters=2):
    """A ``FlexibleRunner`` (its default strategy) training the toy model.

    Args:
        work_dir (str): The run's work dir.
        optim_wrapper (dict): Its config (``type`` a wrapper class name).
        hook (dict, optional): Put in ``custom_hooks``.
    """
    import uuid

    from mmengine.runner import FlexibleRunner

    from .toy import BATCH, ToyDataset, ToyModel
    return FlexibleRunner(
        model=ToyModel(), work_dir=str(work_dir),
        experiment_name='toy_' + uuid.uuid4().hex,
        train_dataloader=dict(dataset=ToyDataset(16),
                              sampler=dict(type='DefaultSampler',
                                           shuffle=False),
                              batch_size=BATCH, num_workers=0,
                              collate_fn=dict(type='pseudo_collate')),
        train_cfg=dict(by_epoch=False, max_iters=max_iters),
        optim_wrapper=optim_wrapper,
        custom_hooks=[hook] if hook is not None else [],
        default_hooks=dict(checkpoint=None), log_level='WARNING',
        default_scope='mmengine', randomness=dict(seed=0))


SCENARIOS = {
    'flexible_ddp': _flexible_ddp,
    'shards': _shards,
    'fsdp2': _fsdp2
}


def fsdp2_available():
    """Whether FSDP2 ``fully_shard`` imports here (torch >= 2.4)."""
    try:
        _fully_shard()
    except ImportError:
        return False
    return True


if __name__ == '__main__':
    from mmnan_testing.ddp import main
    main(scenarios=SCENARIOS)
