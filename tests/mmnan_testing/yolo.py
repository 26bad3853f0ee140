"""mmyolo's YOLOv5-s zoo config (its ``yolov5_collate``: stacked inputs,
``data_samples`` one dict of the batch's boxes, no sample's metainfo) with
one sample that loads as float pixels, all NaN (a nodata tile), in one
epoch of :data:`IMAGES` images, batches of 2.

The shipped pipeline, changed where this data needs it: the loading step is
:class:`~mmnan_testing.nodata.LoadNodataImage` (the main image; Mosaic's
partners load through its own ``pre_transform``, finite), and
``mmdet.Albu`` and ``YOLOv5HSVRandomAug`` are left out (their OpenCV steps
take ``uint8`` images only).
"""
import os.path as osp

import torch

from mmnanhook import NonFiniteError
from mmnanhook._mmengine import unwrap_model
from mmnan_testing import zoo
from mmnan_testing.nodata import (nodata_pipeline, read_log,
                                  register_nodata_transforms)

IMAGES = 4
# On seed 0 the shuffled order is images 0, 1, 3, 2: this one is the second
# sample of iteration 1's batch (the test checks it).
BAD = 2
# Steps that take uint8 images only.
_UINT8_ONLY = ('Albu', 'YOLOv5HSVRandomAug')


def _pipeline(steps, tile, log_file):
    edited = []
    for step in nodata_pipeline(steps, tile, log_file):
        kind = step['type'].rpartition('.')[2]
        if kind in _UINT8_ONLY:
            continue
        if kind in ('LoadNodataImage', 'LogComposedParts'):
            # mmyolo's scope does not hold mmdet's registry entries.
            step = dict(step, type='mmdet.' + kind)
        edited.append(step)
    return edited


def run(work_dir, policy=None):
    """Train the epoch.

    Args:
        work_dir (str): Where its data and work dir go.
        policy (str, optional): ``NanDetectHook``'s; ``None``: its default.

    Returns:
        dict: ``runner``, ``tile`` (the NaN file), ``error`` (the
        ``NonFiniteError``, or ``None``), ``order`` (the main images loaded,
        by base name, in order; the diagnosis loads the tile again), ``finite`` (every weight finite),
        ``work`` (the work dir).
    """
    from mmengine.runner import Runner
    torch.set_num_threads(1)
    register_nodata_transforms()
    data = zoo.make_zoo_dataset('yolov5_s', osp.join(work_dir, 'data'),
                                num_images=IMAGES)
    work = osp.join(work_dir, 'work')
    cfg = zoo.child_config('yolov5_s', data, work, length=1, hook='line',
                           hook_options={} if policy is None else dict(
                               policy=policy))
    cfg.log_level = 'WARNING'
    tile = data['images'][BAD]
    log_file = osp.join(work_dir, 'loads.log')
    dataset = cfg.train_dataloader.dataset
    dataset.pipeline = _pipeline(dataset.pipeline, tile, log_file)
    runner = Runner.from_cfg(cfg)
    error = None
    try:
        runner.train()
    except NonFiniteError as exc:
        error = exc
    order = [words[1] for _, _, words in read_log(log_file)
             if words[0] in ('load', 'seen')]
    return dict(runner=runner, tile=tile, error=error, order=order,
                finite=all(bool(torch.isfinite(p).all()) for p in
                           unwrap_model(runner.model).parameters()),
                work=work)
