"""A sample of the failing batch through the train pipeline again, with a fix.

The pipeline is rebuilt from the run's config (the same in training and in an
offline replay of a bundle) and given the sample's data info as the dataset
gives it. Its random transforms draw from a fixed seed, every RNG put back
afterwards: a run with a fix and the run without it (the control) draw alike,
and the control tells whether the pipeline makes the bad box again at all.
Failure path only.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os.path as osp
import random
from typing import Any, Dict, Iterable, Optional

import numpy as np
import torch

from .._log import log
from ._state import preserved_rng

# The hint's filter: box sides at or below this many pixels are dropped,
# far below any real object and far above the sides that overflow log(w).
FILTER_MIN_WH = (1e-2, 1e-2)
# Larger images are not read again for a fix (a DOTA scene can be hundreds
# of MB decoded): the report says the fix was left out for time.
MAX_IMAGE_BYTES = 32 << 20
_SEED = 0


@contextlib.contextmanager
def _seeded(seed):
    with preserved_rng():
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        yield


def _innermost_dataset(cfg_dataset):
    """The config of the dataset that loads the files (its pipeline loads
    and packs a sample), inside RepeatDataset, ClassBalancedDataset,
    MultiImageMixDataset ...; for a ConcatDataset, its datasets' one when
    they share type and pipeline (VOC2007 + VOC2012), else ``None``."""
    dataset = cfg_dataset
    while isinstance(dataset, dict) and isinstance(dataset.get('dataset'),
                                                   dict):
        dataset = dataset['dataset']
    members = dataset.get('datasets') if isinstance(dataset, dict) else None
    if isinstance(members, (list, tuple)) and members:
        inner = [_innermost_dataset(member) for member in members]
        shared = set(repr((d.get('type'), d.get('pipeline')))
                     if isinstance(d, dict) else None for d in inner)
        return inner[0] if len(shared) == 1 else None
    return dataset


def _type_name(step):
    return str(step.get('type', '')).split('.')[-1] if isinstance(
        step, dict) else type(step).__name__


class TrainPipeline(object):
    """The train dataset's pipeline, as the run's config writes it.

    Args:
        steps (list[dict]): The transforms' configs.
        dataset_type (str): The dataset's ``type``.
        scope (str, optional): The config's ``default_scope``.
    """

    def __init__(self, steps: Iterable[Any], dataset_type: str,
                 scope: Optional[str] = None) -> None:
        self.steps = list(steps)
        self.dataset_type = dataset_type
        self.scope = scope

    @classmethod
    def from_config(cls, cfg: Any) -> Optional[TrainPipeline]:
        """The train pipeline of a config, or ``None`` when it has none a
        sample can be given to (no train dataloader, a ``ConcatDataset``
        whose datasets differ). Under a ``MultiImageMixDataset`` (mosaic)
        the inner pipeline, which packs nothing: the fixes then say that it
        failed.

        Args:
            cfg (mmengine.Config | dict): The run's config.
        """
        loader = cfg.get('train_dataloader') or {}
        dataset = _innermost_dataset(loader.get('dataset'))
        if not isinstance(dataset, dict) or not dataset.get('pipeline'):
            return None
        return cls(copy.deepcopy(list(dataset['pipeline'])),
                   str(dataset.get('type')), cfg.get('default_scope'))

    @property
    def pack_at(self) -> int:
        """Where a filter goes: before the step that packs the sample (after
        every resize, crop and flip), or last."""
        for index, step in enumerate(self.steps):
            if _type_name(step).startswith('Pack'):
                return index
        return len(self.steps)

    def filter_step(self) -> Dict[str, Any]:
        """The hint's ``FilterAnnotations`` step, named for the scope."""
        name = 'FilterAnnotations' if self.scope in (None, 'mmdet') else \
            'mmdet.FilterAnnotations'
        return dict(type=name, min_gt_bbox_wh=FILTER_MIN_WH)

    def where(self) -> str:
        """Where :meth:`filter_step` goes, in words."""
        at = self.pack_at
        if at < len(self.steps):
            return 'before {}'.format(_type_name(self.steps[at]))
        return 'at its end'

    def drops_outside_declared(self) -> bool:
        """Whether the dataset drops, when it loads an annotation, the boxes
        outside the image size it declares (mmdet's ``CocoDataset`` and its
        subclasses skip a box with no overlap)."""
        from mmengine.registry import DATASETS
        with DATASETS.switch_scope_and_registry(self.scope) as registry:
            cls = registry.get(self.dataset_type)
        return cls is not None and any(c.__name__ == 'CocoDataset'
                                       for c in cls.__mro__)

    def run(self, info: Dict[str, Any],
            with_filter: bool = False) -> Optional[Dict[str, Any]]:
        """One sample through the pipeline.

        Args:
            info (dict): Its data info, as the dataset gives it.
            with_filter (bool): Insert :meth:`filter_step` at
                :attr:`pack_at`.

        Returns:
            dict | None: The packed sample (``inputs``, ``data_samples``), or
            ``None`` when a step dropped it.
        """
        from mmengine.dataset import Compose
        steps = list(self.steps)
        if with_filter:
            steps.insert(self.pack_at, self.filter_step())
        with _scope(self.scope), _seeded(_SEED):
            return Compose(copy.deepcopy(steps))(copy.deepcopy(info))


def filter_advice(pipeline: Optional[TrainPipeline]) -> str:
    """The fix that drops degenerate GT boxes, in words: the
    ``FilterAnnotations`` step named for the scope, where it goes.

    Args:
        pipeline (TrainPipeline, optional): The train pipeline (``None``:
            unknown; the step and its place are then said generically).
    """
    step = pipeline.filter_step() if pipeline else dict(
        type='FilterAnnotations', min_gt_bbox_wh=FILTER_MIN_WH)
    return ('add `dict(type={!r}, min_gt_bbox_wh={!r})` to the train '
            'pipeline {}'.format(
                step['type'], step['min_gt_bbox_wh'],
                pipeline.where() if pipeline else 'before its packing step'))


def train_pipeline(cfg: Any) -> Optional[TrainPipeline]:
    """:meth:`TrainPipeline.from_config`, or ``None`` (said in the log)
    when the config's cannot be read: the fixes that need it stay
    untested, the diagnosis goes on."""
    try:
        return TrainPipeline.from_config(cfg)
    except Exception as error:  # noqa: BLE001 - fixes untested only
        log('mmnanhook: the train pipeline is unknown ({}: {})'.format(
            type(error).__name__, error), logging.WARNING)
        return None


def _scope(scope):
    # The config's scope, as the dataset that built the pipeline had it.
    from mmengine.registry import DefaultScope
    return DefaultScope.overwrite_default_scope(scope)


def with_declared_size(info: Dict[str, Any], width: int, height: int,
                       drops_outside: bool) -> Dict[str, Any]:
    """A data info declaring another image size, as the dataset would have
    loaded the annotation had it declared that size.

    Args:
        info (dict): The data info.
        width, height (int): The size to declare.
        drops_outside (bool): The dataset skips boxes with no overlap with
            the declared image (:meth:`TrainPipeline.drops_outside_declared`).
    """
    info = copy.deepcopy(info)
    info['width'], info['height'] = int(width), int(height)
    if drops_outside:
        info['instances'] = [
            inst for inst in info.get('instances') or []
            if _overlaps(inst.get('bbox'), width, height)]
    return info


def _overlaps(box, width, height):
    # CocoDataset.parse_data_info: ``inter_w * inter_h == 0`` is skipped.
    if box is None or len(box) != 4:
        return True
    x1, y1, x2, y2 = box
    inter_w = max(0.0, min(x2, width) - max(x1, 0.0))
    inter_h = max(0.0, min(y2, height) - max(y1, 0.0))
    return inter_w * inter_h > 0


def image_too_large(path: str) -> Optional[str]:
    """Why the image at ``path`` is not read again, or ``None``."""
    try:
        size = osp.getsize(path)
    except OSError as error:
        return 'its image cannot be read ({})'.format(error.strerror)
    if size > MAX_IMAGE_BYTES:
        return 'its image is {} MB, over the {} MB a fix reads'.format(
            size >> 20, MAX_IMAGE_BYTES >> 20)
    return None
