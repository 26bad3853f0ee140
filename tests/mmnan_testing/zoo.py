"""Model-zoo configs as shipped inside the installed packages, on synthetic
data: the test bed that proves a feature on the configs users actually run.

Each run trains a child config whose ``_base_`` is the shipped file
(``<package>/.mim/configs/...``) with the zoo's own schedulers, pipelines,
samplers, loops, EMA and default hooks. The child changes only what a run on
a CPU with a synthetic dataset needs:

* the dataset's ``data_root`` / annotation paths, two images per batch, no
  loader worker processes (unless asked), no val/test loops;
* ``init_cfg=None`` for the backbone (nothing is downloaded);
* a short schedule (``max_epochs`` / ``max_iters``; a ``PipelineSwitchHook``
  switches before its last epoch) and a fixed seed, so that two runs can be
  compared;
* every image scale of the train pipelines (and of a ``PipelineSwitchHook``'s
  second pipeline, and mmseg's preprocessor crop) multiplied by one factor
  that brings the zoo's short side to 320 px.

:func:`child_config` writes that file and loads it; the rescaling (the
drill's, :func:`mmnanhook.drill._config.rescale`) is applied to the loaded
config (a text override would have to repeat each pipeline).
"""
import copy
import glob
import importlib
import itertools
import math
import os
import os.path as osp

import torch
from mmengine.config import Config
from mmengine.hooks import Hook

from mmnanhook._mmengine import unwrap_model
from mmnanhook import demo
from mmnanhook.demo import synthetic
from mmnanhook.drill._config import VOC_YEAR, rescale
from mmnan_testing import legs, testbed

SMALL_SIDE = 320
# The (w, h) top-down pose input of the zoo tier: multiples of 32 (the
# backbones' stride, which the heatmap and SimCC heads' sizes follow).
POSE_INPUT = (96, 128)


class ZooEntry(object):
    """One shipped config of the test tier.

    Args:
        package (str): The codebase that ships it (``'mmdet'``, ...).
        path (str): Path under ``<package>/.mim/configs``.
        data (str): Dataset kind: ``'coco'``, ``'coco_masks'``, ``'voc'``,
            ``'dota'``,
            ``'imagenet'``, ``'ade20k'``, ``'coco_keypoints'``, ``'pairs'``
            (mmagic LQ/GT pairs) or ``'image_folder'`` (mmagic, one
            folder of images).
        short_side (int, optional): The short side of the zoo's train scale,
            rescaled to :data:`SMALL_SIDE` (or a run's own side); ``None``
            keeps the scales.
        by_epoch (bool): Whether its train loop counts epochs.
        wrapped (int): Dataset wrappers (``MultiImageMixDataset``) around
            the dataset that reads the files.
        input_size (tuple, optional): ``(w, h)`` a top-down pose model
            (mmpose) is trained at instead of its codec's: every
            ``input_size`` of the model and the pipelines, and the heatmap
            and feature map sizes beside it, scaled alike
            (:func:`pose_input`).
        model (dict, optional): What the child config merges into
            ``model``; by default ``dict(backbone=dict(init_cfg=None))``
            (nothing is downloaded); ``{}`` for nothing (a model without
            a backbone, or without pretrained weights: mmagic's).
    """

    def __init__(self, package, path, data, short_side=None, by_epoch=True,
                 wrapped=0, input_size=None, model=None):
        self.package = package
        self.path = path
        self.data = data
        self.short_side = short_side
        self.by_epoch = by_epoch
        self.wrapped = wrapped
        self.input_size = input_size
        self.model = dict(backbone=dict(init_cfg=None)) if model is None \
            else model

    def scale(self, side=SMALL_SIDE):
        """The factor applied to the zoo's image scales to train at
        ``side``."""
        return None if self.short_side is None else \
            float(side) / self.short_side


ZOO = {
    'retinanet_r50': ZooEntry('mmdet', 'retinanet/retinanet_r50_fpn_1x_coco.py',
                              'coco', 800),
    # IterBasedTrainLoop, InfiniteSampler (as mmseg and every long mmdet
    # schedule train).
    'retinanet_r50_90k': ZooEntry(
        'mmdet', 'retinanet/retinanet_r50_fpn_90k_coco.py', 'coco', 800,
        by_epoch=False),
    'faster_rcnn_r50': ZooEntry(
        'mmdet', 'faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py', 'coco', 800),
    'mask_rcnn_r50': ZooEntry(
        'mmdet', 'mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', 'coco_masks', 800),
    # RepeatDataset of a ConcatDataset of VOC2007 and VOC2012 (both read
    # one synthetic VOC2007 here; one repeat), bbox_min_size=32.
    'retinanet_r50_voc': ZooEntry(
        'mmdet', 'pascal_voc/retinanet_r50_fpn_1x_voc0712.py', 'voc', 600),
    'fcos_r50': ZooEntry('mmdet', 'fcos/fcos_r50-caffe_fpn_gn-head_1x_coco.py',
                         'coco', 800),
    'rtmdet_tiny': ZooEntry('mmdet', 'rtmdet/rtmdet_tiny_8xb32-300e_coco.py',
                            'coco', 640),
    # MultiImageMixDataset (Mosaic) over the COCO dataset.
    'yolox_tiny': ZooEntry('mmdet', 'yolox/yolox_tiny_8xb8-300e_coco.py',
                           'coco', 640, wrapped=1),
    # mmcv's deformable convolution (DeformConv2d / its CPU kernel): a NaN
    # input crashes the process (SIGSEGV) instead of making NaN.
    'vfnet_r50': ZooEntry('mmdet', 'vfnet/vfnet_r50_fpn_1x_coco.py', 'coco',
                          800),
    'reppoints_r50': ZooEntry(
        'mmdet', 'reppoints/reppoints-moment_r50_fpn-gn_head-gn_1x_coco.py',
        'coco', 800),
    'dino_r50': ZooEntry('mmdet', 'dino/dino-4scale_r50_8xb2-12e_coco.py',
                         'coco', 800),
    'rotated_retinanet': ZooEntry(
        'mmrotate',
        'rotated_retinanet/rotated-retinanet-rbox-le90_r50_fpn_1x_dota.py',
        'dota', 1024),
    'oriented_rcnn': ZooEntry(
        'mmrotate', 'oriented_rcnn/oriented-rcnn-le90_r50_fpn_1x_dota.py',
        'dota', 1024),
    # Mosaic in the dataset's own pipeline (handed the dataset), EMA,
    # yolov5_collate (data_samples a dict).
    'yolov5_s': ZooEntry(
        'mmyolo', 'yolov5/yolov5_s-v61_syncbn_fast_8xb16-300e_coco.py', 'coco',
        640),
    'resnet18_in1k': ZooEntry('mmpretrain', 'resnet/resnet18_8xb32_in1k.py',
                              'imagenet'),
    # A ViT: RandAugment, Mixup and CutMix in the data preprocessor (a
    # sample's pixels reach its batch mates), AdamW, clip_grad.
    'deit_tiny_in1k': ZooEntry('mmpretrain', 'deit/deit-tiny_4xb256_in1k.py',
                               'imagenet'),
    'segformer_b0_ade': ZooEntry(
        'mmseg', 'segformer/segformer_mit-b0_8xb2-160k_ade20k-512x512.py',
        'ade20k', 512, by_epoch=False),
    # mmpose's top-down COCO configs at 96x128 (half the zoo's 192x256):
    # one sample a person, one person an image. A heatmap head (Adam,
    # KeypointMSELoss) ...
    'td_hm_res50': ZooEntry(
        'mmpose', 'body_2d_keypoint/topdown_heatmap/coco/'
        'td-hm_res50_8xb64-210e_coco-256x192.py', 'coco_keypoints',
        input_size=POSE_INPUT),
    # ... the RLE regression (a flow model's log-likelihood loss) ...
    'td_reg_res50_rle': ZooEntry(
        'mmpose', 'body_2d_keypoint/topdown_regression/coco/'
        'td-reg_res50_rle-8xb64-210e_coco-256x192.py', 'coco_keypoints',
        input_size=POSE_INPUT),
    # ... and RTMPose-s: SimCC (RTMCCHead), CSPNeXt (mmdet's, SyncBN), its
    # EMA (ExpMomentumEMA) and PipelineSwitchHook, Albumentation and
    # mmdet's YOLOXHSVRandomAug in the pipeline (the -t config ships its
    # EMA commented out).
    'rtmpose_s': ZooEntry(
        'mmpose', 'body_2d_keypoint/rtmpose/coco/'
        'rtmpose-s_8xb256-420e_coco-256x192.py', 'coco_keypoints',
        input_size=POSE_INPUT),
    # mmagic's smallest restoration model (SRCNN; IterBasedTrainLoop,
    # InfiniteSampler, PairedRandomCrop of a 128 px GT), on LQ/GT pairs.
    'srcnn_x4': ZooEntry('mmagic', 'srcnn/srcnn_x4k915_1xb16-1000k_div2k.py',
                         'pairs', by_epoch=False, model={}),
    # A GAN: one train step steps two optim wrappers (an OptimWrapperDict:
    # the discriminator's, then the generator's) on 64 px images.
    'dcgan_64': ZooEntry(
        'mmagic', 'dcgan/dcgan_1xb128-5epoches_lsun-bedroom-64x64.py',
        'image_folder', by_epoch=False, model={}),
}

_run_ids = itertools.count()


def available(name):
    """Whether the package shipping ``name`` imports here (with its ops)."""
    try:
        importlib.import_module(ZOO[name].package)
        importlib.import_module('mmcv.ops')
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


def shipped_config(name):
    """The absolute path of ``name``'s config inside its installed package."""
    entry = ZOO[name]
    package = importlib.import_module(entry.package)
    path = osp.join(osp.dirname(package.__file__), '.mim', 'configs',
                    entry.path)
    if not osp.isfile(path):
        raise FileNotFoundError('%s does not ship %s' % (entry.package, path))
    return path


def make_zoo_dataset(name, root, num_images=4, defects=None, seed=0):
    """Write the synthetic dataset ``name`` trains on, at 320 px.

    Args:
        name (str): A key of :data:`ZOO`.
        root (str): Directory to write into.
        num_images (int): Number of images.
        defects (dict, optional): Image index -> defect kind (detection
            datasets only; see :mod:`mmnanhook.demo.synthetic`).
        seed (int): Dataset seed.

    Returns:
        dict: The generator's description, with ``kind``.
    """
    kind = ZOO[name].data
    if kind in ('coco', 'coco_masks'):
        data = synthetic.make_coco_dataset(
            root, num_images=num_images, image_size=SMALL_SIDE, seed=seed,
            defects=defects, masks=kind == 'coco_masks')
    elif kind == 'voc':
        data = synthetic.make_voc_dataset(
            osp.join(root, VOC_YEAR), num_images=num_images,
            image_size=SMALL_SIDE, seed=seed, defects=defects)
        data['data_root'] = root
    elif kind == 'dota':
        data = synthetic.make_dota_dataset(
            root, num_images=num_images, image_size=SMALL_SIDE, seed=seed,
            defects=defects)
    elif kind == 'coco_keypoints':
        data = demo.make_coco_keypoints_dataset(
            root, num_images=num_images, image_size=SMALL_SIDE, seed=seed)
    elif kind == 'pairs':
        # The GT at the 128 px of SRCNN's PairedRandomCrop.
        data = demo.make_pairs_dataset(root, num_images=num_images,
                                       gt_size=128, scale=4, seed=seed)
    elif kind == 'image_folder':
        data = demo.make_image_folder(root, num_images=num_images,
                                      image_size=64, seed=seed)
    elif kind == 'imagenet':
        data = demo.make_imagenet_dataset(
            root, num_images=num_images, image_size=SMALL_SIDE, seed=seed)
    else:
        data = demo.make_ade20k_dataset(
            root, num_images=num_images, image_size=SMALL_SIDE, seed=seed)
    data['kind'] = kind
    return data


def _dataset_override(kind, data):
    root = data['data_root']
    if kind in ('coco', 'coco_masks'):
        return dict(data_root=root, ann_file=synthetic.COCO_ANN_FILE,
                    data_prefix=dict(img=synthetic.COCO_IMG_DIR + '/'))
    if kind == 'voc':
        # The VOC sub-datasets are pointed at the data after loading.
        return dict(times=1)
    if kind == 'dota':
        return dict(data_root=root, ann_file=synthetic.DOTA_ANN_DIR + '/',
                    data_prefix=dict(img_path=synthetic.DOTA_IMG_DIR + '/'))
    if kind == 'coco_keypoints':
        return dict(data_root=root, ann_file=demo.KEYPOINTS_ANN_FILE,
                    data_prefix=dict(img=synthetic.COCO_IMG_DIR + '/'))
    if kind == 'imagenet':
        return dict(data_root=root, split=demo.IMAGENET_SPLIT)
    if kind == 'pairs':
        return dict(data_root=root, ann_file=demo.PAIRS_ANN_FILE,
                    data_prefix=dict(img=demo.PAIRS_LQ_DIR,
                                     gt=demo.PAIRS_GT_DIR))
    if kind == 'image_folder':
        return dict(data_root=root, data_prefix=dict(gt=''))
    return dict(data_root=root,
                data_prefix=dict(img_path=demo.ADE_IMG_DIR,
                                 seg_map_path=demo.ADE_ANN_DIR))


def hook_line(**options):
    """The one-line form that adds NanDetectHook to any config."""
    return 'default_hooks = dict(nan_detect=%r)\n' % (
        dict(type='mmnanhook.NanDetectHook', **options), )


def child_config(name, data, work_dir, length=2, hook=None,
                 hook_options=None, extra=None, seed=0, workers=False,
                 side=SMALL_SIDE):
    """Write and load a child config of the shipped ``name``.

    Args:
        name (str): A key of :data:`ZOO`.
        data (dict): What :func:`make_zoo_dataset` returned.
        work_dir (str): The run's work dir; the child config goes there.
        length (int): Epochs (epoch-based loops) or iterations.
        hook (str, optional): ``'line'`` adds NanDetectHook with the one-line
            ``default_hooks`` form, ``'base'`` with the ``_base_`` snippet
            (``configs/_base_/nan_detect.py``); ``None`` trains without it.
        hook_options (dict, optional): The hook's options.
        extra (str, optional): More config text, appended last (a fault such
            as ``optim_wrapper = dict(optimizer=dict(lr=...))``).
        seed (int): The run's seed.
        workers (bool): Keep the shipped dataloader's worker processes
            (``num_workers``, ``persistent_workers``); by default none.
        side (int): The short side to train at: where the test is about
            mmnanhook, not the model, a smaller one costs less.

    Returns:
        mmengine.Config: Ready for ``Runner.from_cfg`` (or, with
        ``hook='base'``, ``RUNNERS.build``).
    """
    entry = ZOO[name]
    bases = [shipped_config(name)]
    if hook == 'base':
        bases.append(osp.join(config_dir(), '_base_', 'nan_detect.py'))
    loop = dict(max_epochs=length) if entry.by_epoch else dict(
        max_iters=length)
    dataset = _dataset_override(entry.data, data)
    for _ in range(entry.wrapped):
        dataset = dict(dataset=dataset)
    loader = dict(batch_size=2, dataset=dataset)
    if not workers:
        loader.update(num_workers=0, persistent_workers=False)
    lines = [
        '_base_ = %r' % (bases, ),
        'train_dataloader = %r' % (loader, ),
        'train_cfg = dict(%s, val_interval=1000)' % ', '.join(
            '%s=%r' % kv for kv in loop.items()),
        'val_dataloader = None', 'val_cfg = None', 'val_evaluator = None',
        'test_dataloader = None', 'test_cfg = None', 'test_evaluator = None',
        'randomness = dict(seed=%d)' % seed,
    ]
    if entry.model:
        lines.append('model = %r' % (entry.model, ))
    if hook == 'line':
        lines.append(hook_line(**(hook_options or {})))
    elif hook == 'base' and hook_options:
        lines.append('nan_detect = %r' % (dict(hook_options), ))
    if extra:
        lines.append(extra)
    os.makedirs(work_dir, exist_ok=True)
    path = osp.join(work_dir, 'child_%s.py' % name)
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    cfg = Config.fromfile(path)
    if entry.data == 'voc':
        _point_voc(cfg, data)
    if entry.input_size is not None:
        pose_input(cfg, entry.input_size)
    if entry.package == 'mmagic':
        # mmagic's runtimes save checkpoints under ./work_dirs (out_dir),
        # wherever the run's work dir is: into the work dir instead.
        cfg.default_hooks.checkpoint.out_dir = None
    if entry.short_side is not None:
        rescale(cfg, entry.scale(side))
    schedule = cfg.get('param_scheduler')
    if isinstance(schedule, list):
        # A phase without an end of its own ends with the run, and mmengine
        # refuses one that begins after the short run has ended (Swin's and
        # DeiT's cosine from epoch 20): it is out of the run.
        cfg.param_scheduler = [
            s for s in schedule
            if 'end' in s or s.get('begin', 0) < length or
            s.get('by_epoch', True) != entry.by_epoch]
    for hook_cfg in cfg.get('custom_hooks') or []:
        # The short schedule still reaches a PipelineSwitchHook's switch.
        if 'switch_epoch' in hook_cfg and entry.by_epoch:
            hook_cfg['switch_epoch'] = min(hook_cfg['switch_epoch'],
                                           max(length - 1, 0))
    cfg.work_dir = work_dir
    cfg.experiment_name = '%s_%d' % (name, next(_run_ids))
    return cfg


def pose_input(cfg, size):
    """Train a top-down pose config at ``size``; in place.

    Every dict of the model, of the train pipelines and of a
    ``PipelineSwitchHook``'s pipeline that says an ``input_size`` (the
    codecs, the heads, ``TopdownAffine``) says ``size`` instead, and its
    ``heatmap_size`` / ``in_featuremap_size`` are scaled alike.

    Args:
        cfg (Config): The loaded config.
        size (tuple): ``(w, h)``.
    """
    def visit(node):
        if isinstance(node, dict):
            old = node.get('input_size')
            if isinstance(old, (list, tuple)) and len(old) == 2:
                factor = [float(n) / o for n, o in zip(size, old)]
                for key in ('heatmap_size', 'in_featuremap_size'):
                    if key in node:
                        scaled = [v * f for v, f in zip(node[key], factor)]
                        assert all(v == int(v) for v in scaled), (key, node)
                        node[key] = tuple(int(v) for v in scaled)
                node['input_size'] = tuple(size)
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    # (A dict already at ``size`` is left as it is: one visited twice.)
    visit(cfg.model)
    visit(cfg.train_dataloader.dataset)
    for hook in cfg.get('custom_hooks') or []:
        visit(hook.get('switch_pipeline') or [])


def _point_voc(cfg, data):
    """Every VOC sub-dataset of the shipped ConcatDataset reads the one
    synthetic VOC2007 (its pipeline and filters as shipped)."""
    for member in cfg.train_dataloader.dataset.dataset.datasets:
        member.update(data_root=data['data_root'],
                      ann_file=osp.join(VOC_YEAR, synthetic.VOC_SPLIT_FILE),
                      data_prefix=dict(sub_data_root=VOC_YEAR + '/'))


def config_dir():
    """The repository's ``configs/`` directory (for the ``_base_`` snippet)."""
    return testbed.config_dir()


class ZooProbe(Hook):
    """Records what a zoo run did, per iteration, for comparisons.

    Runs last in every stage, so it sees the values the schedulers set and
    the weights the optimizer wrote.

    Attributes:
        hooks (list[str]): Class names of every hook of the run.
        lr (list[list[float]]): LR of each param group, per iteration.
        momentum (list[list]): Momentum (or Adam betas) of each group.
        loss (list[float]): The total loss each iteration logged.
        finite (list[bool]): Whether every weight was finite after it.
        before (tuple): ``(iter, weights, optimizer state)`` copied before
            the latest iteration.
    """

    priority = 'VERY_LOW'

    def __init__(self):
        self.hooks = []
        self.lr, self.momentum, self.loss, self.finite = [], [], [], []
        self.started = 0
        self.before = None

    def before_train(self, runner):
        self.hooks = [type(h).__name__ for h in runner.hooks]

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.started += 1
        self.before = (runner.iter, weights(runner),
                       copy.deepcopy(runner.optim_wrapper.state_dict()))

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        groups = param_groups(runner.optim_wrapper)
        self.lr.append([g['lr'] for g in groups])
        self.momentum.append(
            [g.get('momentum', g.get('betas')) for g in groups])
        loss = (outputs or {}).get('loss')
        self.loss.append(None if loss is None else float(loss.detach()))
        self.finite.append(all(
            bool(torch.isfinite(p).all())
            for p in unwrap_model(runner.model).parameters()))

    @property
    def first_bad_iter(self):
        """The first iteration whose loss, or the weights after it, were not
        finite, or that raised; ``None`` for a clean run."""
        for i, (loss, finite) in enumerate(zip(self.loss, self.finite)):
            if loss is None or not math.isfinite(loss) or not finite:
                return i
        return len(self.loss) if self.started > len(self.loss) else None


def param_groups(optim_wrapper):
    """Every param group of a run's optim wrapper; an ``OptimWrapperDict``'s
    members' one after the other (mmagic's GANs: generator, discriminator).
    """
    groups = optim_wrapper.param_groups
    if isinstance(groups, dict):
        return [g for key in groups for g in groups[key]]
    return groups


class BatchFiles(ZooProbe):
    """Also records the image files of every iteration's batch.

    Attributes:
        files (list[list[str]]): Per iteration, its samples' ``img_path``.
        epochs (list[int]): Per iteration, its epoch.
    """

    def __init__(self):
        super(BatchFiles, self).__init__()
        self.files = []
        self.epochs = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        super(BatchFiles, self).before_train_iter(runner, batch_idx,
                                                  data_batch)
        # mmagic's GAN samples (real images alone) name their file gt_path.
        self.files.append([
            s.metainfo.get('img_path', s.metainfo.get('gt_path'))
            for s in data_batch['data_samples']
        ])
        self.epochs.append(runner.epoch)


class DropProbe(BatchFiles):
    """Also keeps the batch, and the state before and after (parameters and
    buffers) and the optimizer state before, of the iteration whose batch
    holds ``bad``.

    Args:
        bad (str): The image file.
    """

    def __init__(self, bad):
        super(DropProbe, self).__init__()
        self.bad = bad
        self.at = None

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        super(DropProbe, self).before_train_iter(runner, batch_idx,
                                                 data_batch)
        if self.bad in self.files[-1]:
            self.at = dict(
                iter=runner.iter, batch=data_batch,
                state=model_state(runner),
                optimizer=copy.deepcopy(runner.optim_wrapper.state_dict()))

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        super(DropProbe, self).after_train_iter(runner, batch_idx,
                                                data_batch, outputs)
        if self.at is not None and self.at['iter'] == runner.iter:
            self.at['after'] = model_state(runner)


def step_by_hand(runner, probe, bad):
    """The step of ``probe``'s iteration by hand, on its batch without
    ``bad`` (one sample left), from the state before it (weights, BN
    buffers, optimizer state and LR), through the run's own model and optim
    wrapper (its clip_grad included), which training left without
    mmnanhook's bindings.

    Args:
        probe (DropProbe): What the run kept of that iteration.

    Returns:
        dict: The model state after it (:func:`model_state`).
    """
    batch = probe.at['batch']
    keep = [i for i, s in enumerate(batch['data_samples'])
            if s.metainfo['img_path'] != bad]
    assert len(keep) == 1
    model = runner.model
    model.load_state_dict(probe.at['state'])
    runner.optim_wrapper.load_state_dict(probe.at['optimizer'])
    runner.optim_wrapper.zero_grad()
    data_in = model.data_preprocessor(
        {'inputs': [batch['inputs'][i] for i in keep],
         'data_samples': [batch['data_samples'][i] for i in keep]}, True)
    loss, _ = model.parse_losses(model(**data_in, mode='loss'))
    runner.optim_wrapper.update_params(loss)
    return model_state(runner)


def dropped_alone(runner, bad, images):
    """Assert that ``bad`` is the one sample the run dropped (no step
    skipped) and quarantined.

    Args:
        images (int): The train dataset's size.

    Returns:
        QuarantinedSample: Its entry.
    """
    from mmnanhook.quarantine import read_quarantine
    hub = runner.message_hub
    assert hub.get_scalar('train/samples_dropped').current() == 1
    assert hub.get_scalar('train/nan_skipped').current() == 0
    (sample, ) = read_quarantine(
        osp.join(runner.work_dir, 'nan_quarantine.json'), images)
    assert sample.file == bad and sample.source == 'drop'
    return sample


def runner_with_files(cfg, hook=None):
    """A ``Runner`` built from ``cfg`` with a :class:`BatchFiles` probe.

    Args:
        cfg (Config): The config.
        hook (dict, optional): ``NanDetectHook``'s options, added as the
            config's custom hook (imported the way ``tools/train.py``
            imports it); else the config's own hooks.

    Returns:
        tuple: ``(runner, files)``.
    """
    from mmengine.runner import Runner
    if hook is not None:
        cfg.custom_imports = dict(imports=['mmnanhook'],
                                  allow_failed_imports=False)
        cfg.custom_hooks = [dict(hook, type='NanDetectHook')]
    runner = Runner.from_cfg(cfg)
    files = BatchFiles()
    runner.register_hook(files)
    return runner, files


def weights(runner):
    """Copies of the model's parameters, by name."""
    return {k: v.detach().clone()
            for k, v in unwrap_model(runner.model).named_parameters()}


def model_state(runner):
    """Copies of the model's parameters and buffers (its state dict)."""
    return {k: v.detach().clone()
            for k, v in unwrap_model(runner.model).state_dict().items()}


def last_checkpoint(runner):
    """The newest checkpoint a run wrote into its work dir (loaded), or
    ``None``."""
    paths = sorted(glob.glob(osp.join(runner.work_dir, '*.pth')))
    return legs.torch_load(paths[-1]) if paths else None


def assert_equal(a, b, path='state'):
    """``a`` and ``b`` (tensors in nested dicts and lists) equal bitwise;
    ``path`` names where in an assertion that fails."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_equal(a[k], b[k], '%s.%s' % (path, k))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, '%s[%d]' % (path, i))
    else:
        assert a == b, path


def codebase_marks(package, everyday=False):
    """The marks of a zoo test of the codebases leg's ``package``: in that
    leg's make test (``everyday``), else in the full tier."""
    import pytest
    return [pytest.mark.zoo, getattr(pytest.mark, package),
            pytest.mark.everyday_leg('codebases') if everyday
            else pytest.mark.zoo_full]


def assert_stopped_before(runner, probe, at, error):
    """``error`` stopped iteration ``at``, the one the probe saw start last,
    before anything of it was applied: every weight and every optimizer
    state bitwise those before it."""
    assert error.iter == at == probe.before[0]
    assert_equal(weights(runner), probe.before[1], 'weights')
    assert_equal(runner.optim_wrapper.state_dict(), probe.before[2],
                 'optimizer')


def assert_same_checkpoints(runner, ref):
    """The newest checkpoints of two runs hold the same parts, bitwise
    equal (the model's, its EMA's, the optimizers', the schedulers')."""
    ours, theirs = last_checkpoint(runner), last_checkpoint(ref)
    assert ours is not None and theirs is not None
    for key in ('state_dict', 'ema_state_dict', 'optimizer',
                'param_schedulers'):
        assert (key in ours) == (key in theirs), key
        if key in ours:
            assert_equal(ours[key], theirs[key], key)
    return ours


def train_with_files(cfg):
    """Build ``cfg``'s runner with a :class:`BatchFiles` probe and train it
    until it ends or raises ``NonFiniteError``.

    Returns:
        tuple: ``(runner, files, error)``, ``error`` ``None`` for a run
        that ended.
    """
    from mmengine.runner import Runner

    from mmnanhook import NonFiniteError
    runner = Runner.from_cfg(cfg)
    files = BatchFiles()
    return runner, files, train_catching(runner, files, NonFiniteError)


def train_catching(runner, probe, catch=Exception):
    """Register ``probe`` on ``runner`` and train it.

    Args:
        runner (Runner): Built, not trained.
        probe (Hook): The test's probe.
        catch (type): What training may raise, returned to the test.

    Returns:
        Exception, optional: What training raised, ``None`` for a run that
        ended.
    """
    runner.register_hook(probe)
    try:
        runner.train()
    except catch as error:
        return error
    return None


def once_per_name(tmp_path_factory, run):
    """``name -> run(tmp_dir, name)``, each name run once (a module
    fixture's: the checks that read one training share it)."""
    runs = {}

    def once(name):
        if name not in runs:
            runs[name] = run(tmp_path_factory.mktemp(name), name)
        return runs[name]
    return once
