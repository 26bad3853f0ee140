"""Recovery under DDP on the zoo's own configs: two CPU ranks over gloo,
started by :func:`mmnan_testing.ddp.run_ranks` with
``module='mmnan_testing.ddp_zoo'``.

Scenarios:

* ``retinanet_drop``: mmdet's RetinaNet R50 as shipped (shuffling
  ``DefaultSampler``, aspect-ratio batches), 2 epochs, ``policy='drop'``; the
  image of :func:`moving_index` declares twice its real width: on rank 1 in
  the first epoch, the sampler gives it to rank 0 in the second.
* ``rtmdet_skip`` (with ``quarantine_skips=True``) / ``rtmdet_drop``:
  mmdet's RTMDet-tiny with every norm layer a
  :class:`~mmnan_testing.syncbn.CpuSyncBatchNorm` (its shipped
  ``SyncBN``, made to run on CPUs), 2 epochs; image :data:`NODATA` (rank 1,
  iteration 1 of each epoch) is a nodata tile, all NaN. Its pipelines keep
  their steps but ``CachedMosaic``/``CachedMixUp`` (a cached tile would
  reach rank 0's batches as a partner: the composed case has tests of its
  own) and ``YOLOXHSVRandomAug`` (its cast to integers makes NaN pixels
  finite).

Each rank writes its own copy of the data (same seed, same bytes) and child
config; the work dir is shared.
"""
import copy
import hashlib
import os.path as osp

import torch

from mmnanhook._batch import split_batch
from .ddp import capture_replays, read_bundles
from .zoo import BatchFiles, model_state, weights

IMAGES, WORLD, BATCH = 8, 2, 2
# RTMDet: DefaultSampler(shuffle=False): rank 1 holds images 1, 3, 5, 7;
# image 5 is in its iteration 1 of each epoch.
NODATA = 5


def moving_index(seed=0):
    """An image the shipped shuffling sampler gives rank 1 in epoch 0 and
    rank 0 in epoch 1 (``DefaultSampler``: a permutation seeded by seed +
    epoch, rank r taking every second index from r; the synthetic images
    are one aspect-ratio group, so batches keep that order)."""
    def ranks(epoch):
        order = torch.randperm(IMAGES, generator=torch.Generator().manual_seed(
            seed + epoch)).tolist()
        return dict((index, position % WORLD)
                    for position, index in enumerate(order))

    first, second = ranks(0), ranks(1)
    return [i for i in range(IMAGES) if first[i] == 1 and second[i] == 0][0]


def _digest(runner):
    digest = hashlib.sha256()
    for name, value in sorted(weights(runner).items()):
        digest.update(name.encode())
        digest.update(value.numpy().tobytes())
    return digest.hexdigest()


def _finite(runner):
    return all(bool(torch.isfinite(v).all())
               for v in weights(runner).values())


def _config(out_dir, name, defects, policy, rank, **options):
    from mmengine.dist import broadcast_object_list

    from mmnan_testing import zoo
    # One dataset for every rank, as a real run reads (the quarantine is
    # keyed by file): rank 0 writes it, the others wait for its paths.
    box = [zoo.make_zoo_dataset(name, osp.join(out_dir, 'data'),
                                num_images=IMAGES, defects=defects)
           if rank == 0 else None]
    broadcast_object_list(box)
    data = box[0]
    cfg = zoo.child_config(name, data, osp.join(out_dir, 'cfg%d' % rank),
                           hook='line', hook_options=dict(
                               policy=policy,
                               dump_dir=osp.join(out_dir, 'dumps'),
                               **options))
    cfg.work_dir = osp.join(out_dir, 'work')
    cfg.log_level = 'INFO'
    cfg.launcher = 'pytorch'
    cfg.env_cfg.dist_cfg = dict(backend='gloo')
    cfg.model_wrapper_cfg = dict(type='MMDistributedDataParallel',
                                 device_ids=None)
    return data, cfg


class StepProbe(BatchFiles):
    """What a hand recompute needs: the batch, model state and optimizer
    state before each of ``iters``, and the model state after it.

    Args:
        iters (iterable[int]): The iterations recorded.
    """

    priority = 'VERY_LOW'

    def __init__(self, iters):
        super(StepProbe, self).__init__()
        self.iters = set(iters)
        self.steps = {}

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        super(StepProbe, self).before_train_iter(runner, batch_idx,
                                                 data_batch)
        if runner.iter in self.iters:
            self.steps[runner.iter] = dict(
                batch=data_batch, state=model_state(runner),
                optimizer=copy.deepcopy(runner.optim_wrapper.state_dict()))

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        super(StepProbe, self).after_train_iter(runner, batch_idx,
                                                data_batch, outputs)
        if runner.iter in self.steps:
            self.steps[runner.iter]['after'] = model_state(runner)


def _by_hand(runner, step, bad):
    """The step by hand: this rank's batch without ``bad`` (rank 0's
    unchanged) through the plain DDP train step from the same state, on
    every rank at once (DDP averages the gradients), through the run's own
    optim wrapper, which training left without mmnanhook's bindings.

    Returns:
        bool: Whether the model state after it is the run's, bitwise.
    """
    batch = step['batch']
    keep = [i for i, s in enumerate(batch['data_samples'])
            if s.metainfo['img_path'] != bad]
    module = runner.model.module
    module.load_state_dict(step['state'])
    runner.optim_wrapper.load_state_dict(step['optimizer'])
    runner.optim_wrapper.zero_grad()
    runner.model.train_step(split_batch(batch, keep),
                            optim_wrapper=runner.optim_wrapper)
    after = model_state(runner)
    return all(torch.equal(after[k], step['after'][k]) for k in after)


def _retinanet_drop(out_dir):
    from mmengine.dist import all_gather_object, get_rank
    from mmengine.runner import Runner

    from mmnanhook.quarantine import read_quarantine
    torch.set_num_threads(1)
    rank = get_rank()
    bad_index = moving_index()
    data, cfg = _config(out_dir, 'retinanet_r50',
                        {bad_index: 'size_mismatch'}, 'drop', rank)
    bad = osp.join(data['img_dir'], data['defect_images'][0])
    runner = Runner.from_cfg(cfg)
    probe = StepProbe(range(IMAGES // (WORLD * BATCH)))
    runner.register_hook(probe)
    replays = capture_replays(runner)
    runner.train()
    hub = runner.message_hub
    drops = [i for i, files in enumerate(probe.files) if bad in files]
    drop_iter = drops[0] if drops else None
    # Both ranks recompute the same iteration (the bad image's, on rank 1).
    iters = sorted(probe.steps)
    at = [i for i in all_gather_object(drop_iter) if i is not None]
    by_hand = _by_hand(runner, probe.steps[at[0]], bad) if at else False
    quarantine = osp.join(runner.work_dir, 'nan_quarantine.json')
    return dict(
        rank=rank, epoch=runner.epoch, iter=runner.iter, files=probe.files,
        bad=bad, bad_index=bad_index, drops=drops, iters=iters,
        digest=_digest(runner), finite=_finite(runner), by_hand=by_hand,
        samples_dropped=int(
            hub.get_scalar('train/samples_dropped').current()),
        skipped=int(hub.get_scalar('train/nan_skipped').current()),
        quarantine=[(s.file, s.indices) for s in read_quarantine(quarantine)]
        if osp.exists(quarantine) else None,
        replays=replays, bundles=read_bundles(out_dir))


def _rtmdet(policy, **options):

    def scenario(out_dir):
        from mmengine.dist import get_rank
        from mmengine.runner import Runner

        from mmnanhook.quarantine import read_quarantine
        from .nodata import nodata_pipeline, register_nodata_transforms
        from .syncbn import use_cpu_syncbn
        torch.set_num_threads(1)
        register_nodata_transforms()
        rank = get_rank()
        data, cfg = _config(out_dir, 'rtmdet_tiny', None, policy, rank,
                            **options)
        tile = data['images'][NODATA]
        cfg.train_dataloader.sampler.shuffle = False
        assert use_cpu_syncbn(cfg) > 0
        dataset = cfg.train_dataloader.dataset
        dataset.pipeline = nodata_pipeline(dataset.pipeline, tile,
                                           mixing=False)
        for hook in cfg.custom_hooks:
            if hook['type'] == 'PipelineSwitchHook':
                hook['switch_pipeline'] = nodata_pipeline(
                    hook['switch_pipeline'], tile, mixing=False)
        runner = Runner.from_cfg(cfg)
        probe = BatchFiles()
        runner.register_hook(probe)
        replays = capture_replays(runner)
        runner.train()
        hub = runner.message_hub
        quarantine = osp.join(runner.work_dir, 'nan_quarantine.json')
        dropped = hub.get_scalar('train/samples_dropped') \
            if 'train/samples_dropped' in hub.log_scalars else None
        return dict(
            rank=rank, epoch=runner.epoch, iter=runner.iter,
            files=probe.files, tile=osp.join(data['img_dir'], tile),
            digest=_digest(runner), finite=_finite(runner),
            syncbn=sum(type(m).__name__ == 'CpuSyncBatchNorm'
                       for m in runner.model.modules()),
            samples_dropped=int(dropped.current()) if dropped else 0,
            skipped=int(hub.get_scalar('train/nan_skipped').current()),
            quarantine=[(s.file, s.indices)
                        for s in read_quarantine(quarantine)]
            if osp.exists(quarantine) else None,
            replays=replays, bundles=read_bundles(out_dir))

    return scenario


SCENARIOS = {
    'retinanet_drop': _retinanet_drop,
    'rtmdet_skip': _rtmdet('skip', quarantine_skips=True),
    'rtmdet_drop': _rtmdet('drop'),
}

if __name__ == '__main__':
    from .ddp import main
    main(scenarios=SCENARIOS)
