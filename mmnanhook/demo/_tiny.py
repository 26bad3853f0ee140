"""Tiny real detectors on synthetic data: the demo's configs and datasets.

The configs are the repository's ``configs/`` directory, shipped in the wheel
as ``mmnanhook/.mim/configs`` (where ``mmnanhook::`` configs resolve, as
``mmdet::`` ones do in mmdet), so users can read and copy them like any
OpenMMLab config.
"""
from __future__ import annotations

import itertools
import os.path as osp
from typing import Any, Dict, Union

from mmengine.config import Config

from . import synthetic

# Config name -> (file under configs/, dataset format it trains on).
TINY_CONFIGS = {
    'retinanet': ('tiny_retinanet.py', 'coco'),
    'retinanet_voc': ('tiny_retinanet_voc.py', 'voc'),
    'faster_rcnn': ('tiny_faster_rcnn.py', 'coco'),
    'rotated_retinanet': ('tiny_rotated_retinanet.py', 'dota'),
}

# Runner names its logger, message hub and scope after the config file and the
# current second, and reuses existing instances of that name: two runners of
# one config started within a second would share a message hub.
_run_ids = itertools.count()

_MAKERS = {
    'coco': synthetic.make_coco_dataset,
    'voc': synthetic.make_voc_dataset,
    'dota': synthetic.make_dota_dataset,
}


def config_dir() -> str:
    """Where mmnanhook's configs are: ``.mim/configs`` of the installed
    package (a copy in a wheel, a link in an editable install), else
    ``configs/`` of a source tree used without installing.

    Raises:
        FileNotFoundError: When neither exists.
    """
    package = osp.dirname(osp.dirname(osp.abspath(__file__)))
    for path in (osp.join(package, '.mim', 'configs'),
                 osp.join(osp.dirname(package), 'configs')):
        if osp.isdir(path):
            return path
    raise FileNotFoundError(
        'mmnanhook is installed without its configs (no %s): reinstall it '
        'from its wheel' % osp.join(package, '.mim', 'configs'))


def dataset_kind(name: str) -> str:
    """The dataset format (``'coco'``, ``'voc'``, ``'dota'``) a config uses.

    Args:
        name (str): A key of :data:`TINY_CONFIGS`.
    """
    return _lookup(name)[1]


def _lookup(name):
    if name not in TINY_CONFIGS:
        raise KeyError('unknown tiny config %r; choose from %s'
                       % (name, ', '.join(sorted(TINY_CONFIGS))))
    return TINY_CONFIGS[name]


def tiny_config(name: str, data_root: Union[str, Dict[str, Any]],
                work_dir: str, max_iters: int = 3,
                **overrides: Any) -> Config:
    """Load a tiny detector config, pointed at a dataset and a work dir.

    Args:
        name (str): ``'retinanet'``, ``'retinanet_voc'``, ``'faster_rcnn'`` or
            ``'rotated_retinanet'``.
        data_root (str | dict): Root of a dataset written by
            :func:`make_dataset` in the format :func:`dataset_kind` names, or
            the dict :func:`make_dataset` returned.
        work_dir (str): The runner's work directory.
        max_iters (int): Training iterations.
        **overrides: Merged last with ``Config.merge_from_dict``; dotted keys
            such as ``'optim_wrapper.optimizer.lr'`` are accepted.

    Returns:
        mmengine.Config: Ready for ``Runner.from_cfg``, with an
        ``experiment_name`` of its own.
    """
    filename = _lookup(name)[0]
    cfg = Config.fromfile(osp.join(config_dir(), filename))
    if isinstance(data_root, dict):
        data_root = data_root['data_root']
    cfg.train_dataloader.dataset.data_root = data_root
    cfg.work_dir = work_dir
    cfg.experiment_name = '%s_%d' % (osp.splitext(filename)[0], next(_run_ids))
    cfg.train_cfg.max_iters = max_iters
    if overrides:
        cfg.merge_from_dict(overrides)
    return cfg


def make_dataset(kind: str, root: str, **kwargs: Any) -> Dict[str, Any]:
    """Write a synthetic dataset of the given format.

    Args:
        kind (str): ``'coco'``, ``'voc'`` or ``'dota'``; a tiny config name is
            accepted too and means the format that config trains on.
        root (str): Directory to write into.
        **kwargs: Passed to the generator in :mod:`mmnanhook.demo.synthetic`
            (``num_images``, ``image_size``, ``seed``, ``defects``,
            ``classes``).

    Returns:
        dict: The generator's description of what it wrote.
    """
    if kind in TINY_CONFIGS:
        kind = dataset_kind(kind)
    if kind not in _MAKERS:
        raise KeyError('unknown dataset kind %r; choose from %s'
                       % (kind, ', '.join(sorted(_MAKERS))))
    return _MAKERS[kind](root, **kwargs)
