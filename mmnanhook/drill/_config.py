"""The drill's configs: the user's config as ``tools/train.py`` builds it,
made a few iterations long, on the user's data when it is at hand here, else
on a small synthetic stand-in in the config's classes, format and image
sizes (:mod:`._data`).

What the drill changes, the same in the run with NanDetectHook and the run
without it (the clean comparison is between those two):

* the loader: two samples a batch, no worker processes, and a sampler that
  yields the first samples of the user's sampler only (:mod:`._sampler`);
* the loop: ``max_iters`` (iteration loops) or one epoch of those samples;
  no validation or test;
* every image size of the train pipelines scaled so that the short side is
  ``image_size`` (as the zoo tests do): an 800 px R50 iteration takes 15 s on
  one CPU core;
* pretrained weights that are not a local file (``init_cfg``'s
  ``Pretrained``, ``load_from``): not downloaded, the weights random;
* on a CPU with more than one rank, ``SyncBN`` made :mod:`._syncbn`'s
  (torch's refuses CPU tensors);
* NanDetectHook's ``dump_dir`` in the drill's directory, at least one bundle
  a run;
* with several ranks and no GPU, the gloo backend and DDP without device
  ids.
"""
from __future__ import annotations

import copy
import os.path as osp
from typing import Any, Dict, List, Optional

import torch

from ..doctor import config_dicts, load_config, try_build_dataset
# VOC_YEAR: the test beds' zoo datasets are written as the drill's are.
from ._data import VOC_YEAR  # noqa: F401
from ._data import (FORMATS, data_format, dataset_configs, empty_reason,
                    point_at, stand_in, write_stand_in)

# Keys of pipeline steps (and a preprocessor's, and mmdet's batch augments)
# that hold image sizes; RandomAffine's border is one in pixels.
SIZE_KEYS = ('scale', 'img_scale', 'crop_size', 'size', 'scales', 'border',
             'random_size_range')
HOOK_TYPES = ('NanDetectHook', 'mmnanhook.NanDetectHook')
# Samples a batch in a drill.
BATCH = 2


def rescale(cfg: Any, factor: float) -> None:
    """Multiply every image size of the train pipelines (and of a
    ``PipelineSwitchHook``'s second pipeline, a preprocessor's ``size`` and
    batch augments) by ``factor``; in place.

    Args:
        cfg (mmengine.Config): The loaded config.
        factor (float): The factor.
    """
    seen = set()
    for dataset in dataset_configs(cfg.train_dataloader.dataset):
        steps = dataset.get('pipeline') or []
        if id(steps) not in seen:  # Concat members may share one list
            seen.add(id(steps))
            _rescale_steps(steps, factor)
    for hook in cfg.get('custom_hooks') or []:
        _rescale_steps(hook.get('switch_pipeline') or [], factor)
    preprocessor = cfg.model.get('data_preprocessor') or {}
    if preprocessor.get('size') is not None:
        preprocessor['size'] = _scaled(preprocessor['size'], factor)
    _rescale_steps(preprocessor.get('batch_augments') or [], factor)


def _rescale_steps(steps, factor):
    for step in steps:
        for key in SIZE_KEYS:
            if key in step and not isinstance(step[key], dict):
                step[key] = _scaled(step[key], factor)
        for nested in step.get('transforms') or []:
            _rescale_steps(nested if isinstance(nested, list) else [nested],
                           factor)


def _scaled(value, factor):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(round(value * factor))
    if isinstance(value, (list, tuple)):
        return type(value)(_scaled(v, factor) for v in value)
    return value


def short_side(cfg: Any) -> Optional[int]:
    """The short side of the train pipeline's image scale (the largest,
    where it picks among several), or ``None`` where no step says one."""
    for dataset in dataset_configs(cfg.train_dataloader.dataset):
        for step in dataset.get('pipeline') or []:
            for key in ('scale', 'img_scale', 'scales'):
                sides = _sides(step.get(key))
                if sides:
                    return max(sides)
    return None


def _sides(value):
    """The short side of a ``(w, h)`` scale, or of each of a list of
    them."""
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and all(isinstance(v, int) for v in value):
            return [min(value)]
        return [s for v in value for s in _sides(v)]
    return []


def _undownloaded(node):
    """``init_cfg``s of type ``Pretrained`` whose checkpoint is not a local
    file, and old-style ``pretrained`` URLs, set to ``None``; in place.
    Returns how many."""
    count = 0
    for _, found in config_dicts(node):
        init = found.get('init_cfg')
        if isinstance(init, dict) and init.get('type') == 'Pretrained' and \
                not osp.isfile(str(init.get('checkpoint'))):
            found['init_cfg'] = None
            count += 1
        pretrained = found.get('pretrained')
        if isinstance(pretrained, str) and not osp.isfile(pretrained):
            found['pretrained'] = None
            count += 1
    return count


def hook_config(cfg: Any) -> Optional[Dict[str, Any]]:
    """NanDetectHook's config in ``cfg`` (``default_hooks`` or
    ``custom_hooks``), or ``None``."""
    for hook in list((cfg.get('default_hooks') or {}).values()) + list(
            cfg.get('custom_hooks') or []):
        if isinstance(hook, dict) and hook.get('type') in HOOK_TYPES:
            return hook
    return None


def without_hook(cfg: Any) -> Any:
    """``cfg`` with NanDetectHook taken out (a copy)."""
    cfg = copy.deepcopy(cfg)
    hooks = cfg.get('default_hooks') or {}
    for key in [k for k, v in hooks.items()
                if isinstance(v, dict) and v.get('type') in HOOK_TYPES]:
        hooks.pop(key)
    if cfg.get('custom_hooks'):
        cfg.custom_hooks = [h for h in cfg.custom_hooks
                            if h.get('type') not in HOOK_TYPES]
    return cfg


class Prepared(object):
    """The drill's config, and what it changed of the user's.

    Args:
        cfg (mmengine.Config): The config with NanDetectHook.
        data (str): ``'own'`` (the config's dataset) or the synthetic
            format written.
        changes (list[str]): What the drill changed, for the user.
    """

    def __init__(self, cfg: Any, data: str,
                 changes: List[str]) -> None:
        self.cfg = cfg
        self.data = data
        self.changes = changes


def prepare(config_path: str, data_dir: str, length: int,
            policy: Optional[str] = None, image_size: int = 320,
            synthetic_data: bool = False, distributed: bool = False,
            writes: bool = True, timeout: float = 900.0) -> 'Prepared':
    """Load and shorten the user's config for the drill.

    Args:
        config_path (str): The user's config.
        data_dir (str): Where a synthetic dataset is written.
        length (int): Iterations each run trains.
        policy (str, optional): NanDetectHook's policy for the drill; else
            the config's, else the hook's default.
        image_size (int): The short side images are scaled to; 0 keeps the
            config's sizes.
        synthetic_data (bool): Use a synthetic dataset even where the
            config's own data is at hand.
        distributed (bool): Ranks of a process group train it.
        writes (bool): This process writes the synthetic dataset (rank 0);
            else it waits for it.
        timeout (float): Seconds a rank waits for rank 0's dataset.

    Returns:
        Prepared: The config and what was changed.

    Raises:
        DatasetError: The config cannot be loaded, or neither its data nor
            a synthetic stand-in can be had.
    """
    from ..errors import DatasetError
    cfg = load_config(config_path, 'load')
    changes = []
    side = short_side(cfg)
    factor = float(image_size) / side if image_size and side and \
        side > image_size else None
    data = 'own'
    if synthetic_data or not _own_data_here(cfg):
        data = data_format(cfg)
        if data is None:
            raise DatasetError(
                'the train dataset of {} cannot be built here and the drill '
                'has no synthetic stand-in of its format ({}): run the drill '
                'where the data is'.format(config_path, FORMATS))
        images = BATCH * length * 8
        stand = stand_in(cfg, data, factor)
        point_at(cfg, stand, write_stand_in(stand, data_dir, images, writes,
                                            timeout))
        changes.append(stand.says(images))
    loader = cfg.train_dataloader
    loader.update(batch_size=BATCH, num_workers=0, persistent_workers=False)
    # Assigned, not updated: ConfigDict.update merges into the old sampler.
    loader['sampler'] = dict(type='DrillSampler',
                             sampler=copy.deepcopy(loader.sampler),
                             length=BATCH * length)
    changes.append('{} samples a batch, no loader workers'.format(BATCH))
    _shorten(cfg, length)
    changes.append('{} iterations'.format(length))
    if factor is not None:
        rescale(cfg, factor)
        changes.append('images scaled {}/{}'.format(image_size, side))
    undownloaded = _undownloaded(cfg.model)
    if cfg.get('load_from') and not osp.isfile(str(cfg.load_from)):
        cfg.load_from = None
        undownloaded += 1
    if undownloaded:
        changes.append('random weights (pretrained weights not downloaded)')
    cfg.resume = False
    randomness = cfg.get('randomness') or {}
    if randomness.get('seed') is None:
        # Else each run draws its own seed: no two runs could be compared.
        cfg.randomness = dict(randomness, seed=0)
        changes.append('seed 0 (the config sets none)')
    if distributed and not torch.cuda.is_available():
        from ._syncbn import use_cpu_syncbn
        if use_cpu_syncbn(cfg):
            changes.append("SyncBN as the drill's CPU all-reduce batch norm")
        cfg.setdefault('env_cfg', {}).setdefault('dist_cfg', {})
        cfg.env_cfg.dist_cfg['backend'] = 'gloo'
        wrapper = dict(cfg.get('model_wrapper_cfg') or
                       dict(type='MMDistributedDataParallel'))
        cfg.model_wrapper_cfg = dict(wrapper, device_ids=None)
    _place_hook(cfg, policy)
    return Prepared(cfg, data, changes)


def _own_data_here(cfg):
    """Whether the config's own train dataset is here: it builds, or its
    files are read and it is empty (its runs then say why, in the config's
    terms, instead of training a stand-in its own data would not be)."""
    return try_build_dataset(cfg)[0] is not None or \
        empty_reason(cfg) is not None


def _shorten(cfg, length):
    train_cfg = cfg.train_cfg
    if 'max_iters' in train_cfg or 'Iter' in str(train_cfg.get('type', '')):
        train_cfg.update(max_iters=length, val_interval=length + 1)
    else:
        train_cfg.update(max_epochs=1, val_interval=2)
    for hook in cfg.get('custom_hooks') or []:
        # A PipelineSwitchHook's switch falls inside the one epoch.
        if 'switch_epoch' in hook:
            hook['switch_epoch'] = min(hook['switch_epoch'], 0)
    for key in ('val_dataloader', 'val_cfg', 'val_evaluator',
                'test_dataloader', 'test_cfg', 'test_evaluator'):
        cfg[key] = None
    hooks = cfg.get('default_hooks') or {}
    if hooks.get('checkpoint'):
        # Each checkpoint is a write of the whole state: none but the last.
        hooks['checkpoint'].update(interval=length + 1, by_epoch=False,
                                   save_last=False)


def _place_hook(cfg, policy):
    hook = hook_config(cfg)
    if hook is None:
        cfg.setdefault('default_hooks', {})
        cfg.default_hooks['nan_detect'] = dict(
            type='mmnanhook.NanDetectHook')
        # The ConfigDict it became, not the dict given.
        hook = cfg.default_hooks['nan_detect']
    if policy is not None:
        hook['policy'] = policy
    hook['max_dumps'] = max(int(hook.get('max_dumps', 5)), 1)
