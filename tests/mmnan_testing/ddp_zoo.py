"""Recovery under DDP on the zoo's own configs: two CPU ranks over gloo,
started by :func:`mmnan_testing.ddp.run_ranks` with
``module='mmnan_testing.ddp_zoo'``.

Scenarios:

* ``retinanet_drop``: mmdet's RetinaNet R50 as shipped (shuffling
  ``DefaultSampler``, aspect-ratio batches), 2 epochs, ``policy='drop'``; the
  image of :func:`moving_index` declares twice its real width: on rank 1 in
  the first epoch, the sampler gives it to rank 0 in the second.
* ``rtmdet_skip`` (with ``quarantine_skips=True``) / ``rtmdet_drop`` /
  ``rtmdet_raise``: mmdet's RTMDet-tiny with every norm layer a
  :class:`~mmnanhook.drill.CpuSyncBatchNorm` (its shipped
  ``SyncBN``, made to run on CPUs), 2 epochs; images :data:`NODATA` (rank 1,
  iterations 0 and 1 of each epoch) are nodata tiles, all NaN. Its pipelines keep
  their steps but ``CachedMosaic``/``CachedMixUp`` (a cached tile would
  reach rank 0's batches as a partner: the composed case has tests of its
  own) and ``YOLOXHSVRandomAug`` (its cast to integers makes NaN pixels
  finite).

* ``yolox_skip`` / ``yolox_drop`` (``broadcast_buffers=False``, as
  mmengine wraps), ``yolox_broadcast_skip`` / ``yolox_broadcast_drop``
  (DDP's default ``broadcast_buffers=True``: a collective DDP makes from
  C++ at the start of each forward), ``yolox_unused_drop``
  (``find_unused_parameters=True``): mmdet's YOLOX-tiny with its own hooks
  (mode switch, ``SyncNormHook``, EMA) and its ``BatchSyncRandomResize``
  (``barrier()`` + ``broadcast()`` when ``(iter + 1) % 10 == 0``, the size
  kept in ``self._input_size``), one epoch of :data:`YOLOX_ITERS`
  iterations; nodata tiles on rank 1 in iterations 0, 9 and 10
  (:data:`YOLOX_TILES`): the input check stops its forward on entry, after
  the preprocessor's collectives, rank 0's goes on.
* ``vfnet_tile_*`` / ``rotated_tile_*`` (``drop``, ``skip``, ``raise``):
  mmdet's VFNet (its head's deformable convolution crashes the process on a
  NaN input on the CPU) / mmrotate's rotated RetinaNet, DDP's default
  ``broadcast_buffers=True``, one epoch of :data:`TILE_IMAGES` images, image
  :data:`TILE` (rank 1's) a nodata tile.

The ``rtmdet`` and ``yolox`` scenarios take the picture of
:mod:`mmnan_testing.runstate` before and after each diagnosis
(:func:`~mmnan_testing.ddp.capture_pictures`).

Each rank writes its own copy of the data (same seed, same bytes) and child
config; the work dir is shared.
"""
import copy
import hashlib
import json
import os.path as osp

import torch

from mmnanhook._batch import split_batch
from .ddp import capture_pictures, capture_replays
from .zoo import SMALL_SIDE, BatchFiles, model_state, weights

IMAGES, WORLD, BATCH = 8, 2, 2
# The short side of the runs that test mmnanhook's part, not the model's.
SIDE = 192
# RTMDet: DefaultSampler(shuffle=False): rank 1 holds images 1, 3, 5, 7;
# images 1 and 5 are in its iterations 0 and 1 of each epoch: the first
# iteration (nothing recorded yet) and one after it (every iteration's
# SyncBN synchronises).
NODATA = (1, 5)


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


def _config(out_dir, name, defects, policy, rank, images=IMAGES, length=2,
            wrapper=None, timeout=None, side=SMALL_SIDE, **options):
    """The child config of the shipped ``name`` for one rank, and its data.

    Args:
        images (int): Images of the synthetic dataset.
        length (int): Epochs.
        wrapper (dict, optional): More options of the DDP wrapper
            (``broadcast_buffers``, ``find_unused_parameters``).
        timeout (int, optional): ``env_cfg.dist_cfg.timeout`` (seconds).
        side (int): The short side it trains at.
        **options: The hook's.
    """
    from mmengine.dist import broadcast_object_list

    from mmnan_testing import zoo
    # One dataset for every rank, as a real run reads (the quarantine is
    # keyed by file): rank 0 writes it, the others wait for its paths.
    box = [zoo.make_zoo_dataset(name, osp.join(out_dir, 'data'),
                                num_images=images, defects=defects)
           if rank == 0 else None]
    broadcast_object_list(box)
    data = box[0]
    cfg = zoo.child_config(name, data, osp.join(out_dir, 'cfg%d' % rank),
                           length=length, hook='line', hook_options=dict(
                               policy=policy,
                               dump_dir=osp.join(out_dir, 'dumps'),
                               **options), side=side)
    cfg.work_dir = osp.join(out_dir, 'work')
    cfg.log_level = 'INFO'
    cfg.launcher = 'pytorch'
    cfg.env_cfg.dist_cfg = dict(backend='gloo')
    if timeout is not None:
        cfg.env_cfg.dist_cfg['timeout'] = timeout
    cfg.model_wrapper_cfg = dict(dict(type='MMDistributedDataParallel',
                                      device_ids=None), **(wrapper or {}))
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
    # 192 px: the drop under DDP, not the model, is what it tests.
    data, cfg = _config(out_dir, 'retinanet_r50',
                        {bad_index: 'size_mismatch'}, 'drop', rank,
                        side=SIDE)
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
        replays=replays)


def _outcome(runner, rank, probe, out_dir, **more):
    """What a scenario's rank reports of its run (with ``more``): where it
    ended, its batches, its weights' digest, what it skipped, dropped and
    quarantined, the bundles."""
    from mmnanhook.quarantine import read_quarantine
    scalars = runner.message_hub.log_scalars
    quarantine = osp.join(runner.work_dir, 'nan_quarantine.json')

    def count(key):
        # None before the first update step (a raise in iteration 0).
        return int(scalars[key].current()) if key in scalars else 0

    return dict(
        rank=rank, epoch=runner.epoch, iter=runner.iter,
        files=probe.files, hooks=probe.hooks,
        digest=_digest(runner), finite=_finite(runner),
        samples_dropped=count('train/samples_dropped'),
        skipped=count('train/nan_skipped'),
        quarantine=[(s.file, s.indices)
                    for s in read_quarantine(quarantine)]
        if osp.exists(quarantine) else None,
        **more)


def _rtmdet(policy, **options):

    def scenario(out_dir):
        from mmengine.dist import get_rank
        from mmengine.runner import Runner

        from .nodata import register_nodata_transforms
        from mmnanhook.drill import use_cpu_syncbn
        torch.set_num_threads(1)
        register_nodata_transforms()
        rank = get_rank()
        data, cfg = _config(out_dir, 'rtmdet_tiny', None, policy, rank,
                            **options)
        tiles = [data['images'][i] for i in NODATA]
        cfg.train_dataloader.sampler.shuffle = False
        assert use_cpu_syncbn(cfg) > 0
        dataset = cfg.train_dataloader.dataset
        dataset.pipeline = _nodata_steps(dataset.pipeline, tiles)
        for hook in cfg.custom_hooks:
            if hook['type'] == 'PipelineSwitchHook':
                hook['switch_pipeline'] = _nodata_steps(
                    hook['switch_pipeline'], tiles)
        runner = Runner.from_cfg(cfg)
        probe = BatchFiles()
        runner.register_hook(probe)
        replays = capture_replays(runner)
        pictures = capture_pictures(runner)
        error = _train(runner)
        return _outcome(
            runner, rank, probe, out_dir, error=error,
            tiles=[osp.join(data['img_dir'], t) for t in tiles],
            syncbn=sum(type(m).__name__ == 'CpuSyncBatchNorm'
                       for m in runner.model.modules()),
            replays=replays, pictures=pictures)

    return scenario


def _train(runner):
    """Train ``runner``; what the hook raised (``'raise'``), or ``None``."""
    from mmnanhook import NonFiniteError
    try:
        runner.train()
    except NonFiniteError as exc:
        return dict(trigger=exc.trigger, iter=exc.iter, rank=exc.rank,
                    bad_ranks=exc.bad_ranks, message=str(exc),
                    kind=(exc.report or {}).get('kind'))
    return None


def _nodata_steps(steps, tiles):
    """``steps`` loading every one of ``tiles`` as nodata, without the
    steps that mix samples (:func:`~mmnan_testing.nodata.nodata_pipeline`)."""
    from .nodata import nodata_pipeline
    edited = nodata_pipeline(steps, tiles[0], mixing=False)
    for step in edited:
        if step['type'] == 'LoadNodataImage':
            step['nodata'] = list(tiles)
    assert any(s['type'] == 'LoadNodataImage' for s in edited)
    return edited


# YOLOX-tiny: one epoch of 12 iterations over 48 images,
# DefaultSampler(shuffle=False): rank 1's iteration k holds images 4k + 1
# and 4k + 3. A nodata tile on rank 1 in iteration 0 (the first: nothing
# recorded yet), 9 (BatchSyncRandomResize synchronises: (iter + 1) % 10 ==
# 0) and 10 (the first with the size drawn at 9); 11 is clean.
YOLOX_IMAGES, YOLOX_ITERS = 48, 12
YOLOX_TILES = {0: 1, 9: 37, 10: 41}
# env_cfg.dist_cfg.timeout (seconds): a rank left waiting in one of
# mmnanhook's votes fails then, naming the rank, instead of at the test's
# bound (the ranks that wait while another diagnoses do so in the
# exchange, which waits at least 2 hours).
YOLOX_TIMEOUT = 120


def _yolox_config(out_dir, policy, rank, wrapper, timeout=None):
    """YOLOX-tiny's child config, the hook in its one-line form (the
    shipped custom hooks kept: mode switch, SyncNormHook, EMA), with the
    nodata tiles of :data:`YOLOX_TILES`. The pipeline keeps its steps
    but the sample-mixing ones (``Mosaic``, ``MixUp``: a tile would reach
    rank 0's batches as a partner; the composed case has tests of its own)
    and ``YOLOXHSVRandomAug`` (its cast to integers makes NaN pixels
    finite); without Mosaic's canvas twice the image, ``RandomAffine``'s
    border (half the canvas, negative) is 0. The sampler does not shuffle,
    so that the tiles are where :data:`YOLOX_TILES` says."""
    from .nodata import nodata_pipeline, register_nodata_transforms
    register_nodata_transforms()
    data, cfg = _config(out_dir, 'yolox_tiny', None, policy, rank,
                        images=YOLOX_IMAGES, length=1, wrapper=wrapper,
                        timeout=timeout)
    tiles = [data['images'][i] for i in sorted(YOLOX_TILES.values())]
    cfg.train_dataloader.sampler.shuffle = False
    mixed = cfg.train_dataloader.dataset
    assert mixed['type'] == 'MultiImageMixDataset'
    mixed.dataset.pipeline = _nodata_steps(mixed.dataset.pipeline, tiles)
    # The outer pipeline loads nothing: the same steps left out.
    mixed.pipeline = nodata_pipeline(mixed.pipeline, tiles[0], mixing=False)
    for step in mixed.pipeline:
        if step['type'] == 'RandomAffine':
            step['border'] = (0, 0)
    augments = cfg.model.data_preprocessor.batch_augments
    assert [a['type'] for a in augments] == ['BatchSyncRandomResize']
    return data, cfg


def _yolox(policy, **wrapper):

    def scenario(out_dir):
        from mmengine.dist import get_rank
        from mmengine.runner import Runner
        torch.set_num_threads(1)
        _bound_memory()
        rank = get_rank()
        data, cfg = _yolox_config(out_dir, policy, rank, wrapper,
                                  timeout=YOLOX_TIMEOUT)
        runner = Runner.from_cfg(cfg)
        probe = BatchFiles()
        runner.register_hook(probe)
        pictures = capture_pictures(runner)
        sizes = _record_input_sizes(runner)
        raised = _record_raises(runner)
        try:
            runner.train()
        finally:
            # What the diagnoses changed, also when the run failed.
            with open(osp.join(out_dir, 'pictures%d.json' % rank),
                      'w') as f:
                json.dump(pictures, f, indent=1)
        return _outcome(
            runner, rank, probe, out_dir,
            tiles=dict((str(k), osp.join(data['img_dir'],
                                         data['images'][i]))
                       for k, i in YOLOX_TILES.items()),
            input_sizes=sizes, raised=raised, pictures=pictures,
            memory=_memory())

    return scenario


# The address space of a YOLOX rank (bytes): a size made of uninitialised
# memory (a broadcast answered locally) fails to allocate, instead of
# taking the machine's memory (an upsampling to 10^13 pixels).
YOLOX_ADDRESS_SPACE = 12 << 30


def _bound_memory():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > YOLOX_ADDRESS_SPACE:
        resource.setrlimit(resource.RLIMIT_AS, (YOLOX_ADDRESS_SPACE, hard))


def _memory():
    """This process's peak address space and resident set (``VmPeak``,
    ``VmHWM`` of ``/proc/self/status``, kB), where Linux says."""
    found = {}
    try:
        with open('/proc/self/status') as f:
            for line in f:
                key, _, value = line.partition(':')
                if key in ('VmPeak', 'VmHWM'):
                    found[key] = int(value.split()[0])
    except (IOError, OSError):
        pass
    return found


def _record_raises(runner):
    """What the detector's ``loss`` raised in the train steps the loop ran
    (not in mmnanhook's replays; not mmnanhook's own ``PeerForwardFailed``,
    which a rank's guard raises to stop a forward another rank's failure
    ended): ``[iter, type, message]`` each."""
    import sys

    from mmnanhook._mmengine import unwrap_model
    detector = unwrap_model(runner.model)
    loss = detector.loss
    raised = []

    def in_replay():
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == 'diagnose' and \
                    code.co_filename.endswith(
                        osp.join('mmnanhook', 'diagnosis', '_in_run.py')):
                return True
            frame = frame.f_back
        return False

    def recorded(*args, **kwargs):
        try:
            return loss(*args, **kwargs)
        except Exception as exc:
            if not type(exc).__module__.startswith('mmnanhook') and \
                    not in_replay():
                raised.append([runner.iter, type(exc).__name__,
                               str(exc)[:200]])
            raise

    detector.loss = recorded
    return raised


def _record_input_sizes(runner):
    """``BatchSyncRandomResize``'s ``_input_size`` after each iteration
    (the size the next one trains at), per iteration."""
    from mmengine.hooks import Hook

    from mmnanhook._mmengine import unwrap_model
    sizes = []

    class Sizes(Hook):
        priority = 'VERY_LOW'

        def after_train_iter(self, runner, batch_idx, data_batch=None,
                             outputs=None):
            augment = unwrap_model(
                runner.model).data_preprocessor.batch_augments[0]
            size = augment._input_size
            sizes.append(None if size is None else [int(v) for v in size])

    runner.register_hook(Sizes())
    return sizes


# VFNet / the rotated RetinaNet: one epoch of 8 images, 2 ranks, batch 2,
# DefaultSampler(shuffle=False): image 5 is a nodata tile, on rank 1 (in
# iteration 1 of VFNet's COCO order, 0 of the DOTA dataset's).
TILE_IMAGES, TILE = 8, 5


def _tile(name, policy):
    """A scenario of the zoo config ``name`` with one nodata tile on rank 1
    (:data:`TILE`), under ``policy``, DDP's default
    ``broadcast_buffers=True`` (VFNet's and the rotated RetinaNet's batch
    norms are frozen, none shares statistics: DDP's broadcast of their
    buffers is the forward's only collective); ``error``: what a rank
    raised (``'raise'``)."""

    def scenario(out_dir):
        from mmengine.dist import get_rank
        from mmengine.runner import Runner

        from .nodata import nodata_pipeline, register_nodata_transforms
        torch.set_num_threads(1)
        register_nodata_transforms()
        rank = get_rank()
        data, cfg = _config(out_dir, name, None, policy, rank,
                            images=TILE_IMAGES, length=1)
        tile = data['images'][TILE]
        cfg.train_dataloader.sampler.shuffle = False
        dataset = cfg.train_dataloader.dataset
        dataset.pipeline = nodata_pipeline(dataset.pipeline, tile)
        runner = Runner.from_cfg(cfg)
        probe = BatchFiles()
        runner.register_hook(probe)
        error = _train(runner)
        return _outcome(runner, rank, probe, out_dir, error=error,
                        tile=osp.join(data['img_dir'], tile))

    return scenario


SCENARIOS = {
    'retinanet_drop': _retinanet_drop,
    'rtmdet_skip': _rtmdet('skip', quarantine_skips=True),
    'rtmdet_drop': _rtmdet('drop'),
    'rtmdet_raise': _rtmdet('raise'),
    'vfnet_tile_drop': _tile('vfnet_r50', 'drop'),
    'vfnet_tile_skip': _tile('vfnet_r50', 'skip'),
    'vfnet_tile_raise': _tile('vfnet_r50', 'raise'),
    'rotated_tile_drop': _tile('rotated_retinanet', 'drop'),
    'rotated_tile_skip': _tile('rotated_retinanet', 'skip'),
    'rotated_tile_raise': _tile('rotated_retinanet', 'raise'),
    'yolox_skip': _yolox('skip', broadcast_buffers=False),
    'yolox_drop': _yolox('drop', broadcast_buffers=False),
    'yolox_broadcast_skip': _yolox('skip', broadcast_buffers=True),
    'yolox_broadcast_drop': _yolox('drop', broadcast_buffers=True),
    'yolox_unused_drop': _yolox('drop', broadcast_buffers=False,
                                find_unused_parameters=True),
}

if __name__ == '__main__':
    from .ddp import main
    main(scenarios=SCENARIOS)
