"""A nodata tile: an image its loader yields as float pixels, all NaN.

Remote-sensing loaders read rasters as float and give a tile outside the
sensor's footprint as NaN (nodata). :class:`LoadNodataImage` is mmcv's
``LoadImageFromFile`` with ``to_float32=True`` that does that for the files
named in ``nodata``, and appends one line ``pid time load name`` to
``log_file`` for each load of one of them (``seen name`` for any other
file; worker processes included), so a test can count where and when the
tile was loaded, and which processes loaded images at all.
:class:`LogComposedParts` appends a line for each composed sample that holds
one of ``watch`` as a part (a Mosaic or MixUp served from a cache).
:class:`LoadNodataEditImage` is :class:`LoadNodataImage`'s sibling for
mmagic's loader (one pipeline key's image, ``'img'`` or ``'gt'``;
:func:`edit_nodata_pipeline`). Register them with
:func:`register_nodata_transforms`. :func:`log_index` logs what a worker
process holds of the dataset's index.
"""
import os
import os.path as osp
import time

import numpy as np
from mmcv.transforms import BaseTransform, LoadImageFromFile

from mmnanhook.quarantine import PARTS


def _append(log_file, text):
    # One write of a short line: atomic in append mode, across processes.
    with open(log_file, 'a') as f:
        f.write('%d %.6f %s\n' % (os.getpid(), time.time(), text))


class LoadNodataImage(LoadImageFromFile):
    """Load every image as float32; the ``nodata`` files as all NaN.

    Args:
        nodata (list[str]): Base names of the nodata files.
        log_file (str, optional): Where their loads are appended.
        **kwargs: ``LoadImageFromFile``'s.
    """

    def __init__(self, nodata=(), log_file=None, **kwargs):
        kwargs['to_float32'] = True
        super(LoadNodataImage, self).__init__(**kwargs)
        self.nodata = set(nodata)
        self.log_file = log_file

    def transform(self, results):
        results = super(LoadNodataImage, self).transform(results)
        name = osp.basename(results['img_path']) if results else None
        if name in self.nodata:
            results['img'] = np.full_like(results['img'], np.nan)
        if self.log_file and name is not None:
            _append(self.log_file, '%s %s' % (
                'load' if name in self.nodata else 'seen', name))
        return results


class LoadNodataEditImage(BaseTransform):
    """mmagic's ``LoadImageFromFile`` of one ``key`` (``'img'``: the LQ
    input, ``'gt'``: the target) as float32; the ``nodata`` files' image all
    NaN. A sibling of :class:`LoadNodataImage`, which is mmcv's loader
    (``img`` and ``img_path`` only).

    Args:
        nodata (list[str]): Base names of the nodata files.
        **kwargs: mmagic's ``LoadImageFromFile``'s (``key`` among them).
    """

    def __init__(self, nodata=(), **kwargs):
        from mmagic.datasets.transforms import LoadImageFromFile as Load
        kwargs['to_float32'] = True
        self.load = Load(**kwargs)
        self.key = kwargs['key']
        self.nodata = set(nodata)

    def transform(self, results):
        results = self.load(results)
        if osp.basename(str(results[self.key + '_path'])) in self.nodata:
            results[self.key] = np.full_like(results[self.key], np.nan)
        return results


def edit_nodata_pipeline(steps, tile, key):
    """An mmagic train pipeline (config steps) whose ``key`` images load
    as float32, ``tile``'s all NaN (:class:`LoadNodataEditImage`).

    Args:
        steps (list[dict]): The shipped pipeline.
        tile (str): Base name of the nodata file.
        key (str): Which image of a sample: ``'img'`` or ``'gt'``.
    """
    edited = [dict(step, type='LoadNodataEditImage', nodata=[tile])
              if step['type'].rpartition('.')[2] == 'LoadImageFromFile'
              and step.get('key') == key else step for step in steps]
    assert edited != list(steps), 'no %r load step' % key
    return edited


class LogComposedParts(BaseTransform):
    """Log each composed sample holding a part in ``watch``.

    Args:
        watch (list[str]): Base names of the files watched.
        log_file (str): Where the lines are appended.
        where (str): Names the place in the pipeline in each line.
    """

    def __init__(self, watch, log_file, where=''):
        self.watch = set(watch)
        self.log_file = log_file
        self.where = where

    def transform(self, results):
        names = [osp.basename(str(p)) for _, p in results.get(PARTS) or ()]
        for name in names:
            if name in self.watch:
                _append(self.log_file, 'serve %s %s' % (self.where, name))
        return results


# Casts to an integer type and back: NaN pixels come out finite.
_HIDES_NAN = ('YOLOXHSVRandomAug', )
_MIXING = ('Mosaic', 'MixUp', 'CachedMosaic', 'CachedMixUp')


def nodata_pipeline(steps, tile, log_file=None, mixing=True):
    """A train pipeline (config steps) that loads ``tile`` as nodata.

    The loading step becomes :class:`LoadNodataImage`; steps that would
    hide NaN pixels are left out; each mixing step is followed by a
    :class:`LogComposedParts` (with ``log_file``), or left out too when
    ``mixing`` is False.

    Args:
        steps (list[dict]): The shipped pipeline.
        tile (str): Base name of the nodata file.
        log_file (str, optional): Where loads and served parts are logged.
        mixing (bool): Keep the steps that compose samples.
    """
    edited = []
    for step in steps:
        # mmrotate's configs name mmdet's transforms with its scope.
        scope, _, kind = step['type'].rpartition('.')
        # mmpose's load step is its own LoadImage (mmcv's, and an image
        # already in the results kept): the same for a file.
        if kind in ('LoadImageFromFile', 'LoadImage'):
            step = dict(step, type=scope + '.LoadNodataImage' if scope
                        else 'LoadNodataImage', nodata=[tile],
                        log_file=log_file)
        if kind in _HIDES_NAN or (kind in _MIXING and not mixing):
            continue
        edited.append(step)
        if kind in _MIXING and log_file:
            edited.append(dict(type='LogComposedParts', watch=[tile],
                               log_file=log_file, where=kind))
    return edited


def register_nodata_transforms():
    """Register both transforms in mmengine's root ``TRANSFORMS``: every
    codebase's registry (mmdet's, mmpretrain's, mmpose's, mmagic's) finds
    them through its parent, scoped or not."""
    from mmengine.registry import TRANSFORMS
    TRANSFORMS.register_module(module=LoadNodataImage, force=True)
    TRANSFORMS.register_module(module=LogComposedParts, force=True)
    TRANSFORMS.register_module(module=LoadNodataEditImage, force=True)


def read_log(log_file):
    """The lines of ``log_file``: ``(pid, time, words)``."""
    if not osp.exists(log_file):
        return []
    lines = []
    with open(log_file) as f:
        for line in f:
            pid, stamp, rest = line.split(' ', 2)
            lines.append((int(pid), float(stamp), rest.split()))
    return lines


def log_index(log_file, path, worker_id):
    """A ``worker_init_fn`` that appends ``index BUILDS BUILT SEARCHED
    FOUND`` for the worker's dataset: the walks of its :class:`SampleIndex`
    (inherited from the process that forked it), whether it holds the
    arrays, whether its lookups search the infos, and, when it can answer
    without a walk, the indices that load ``path``."""
    from torch.utils.data import get_worker_info
    from mmnanhook.quarantine import sample_index
    index = sample_index(get_worker_info().dataset)
    built = index.nbytes > 0
    found = index.indices(path) if built or index.searched else []
    _append(log_file, 'index %d %d %d %s' % (
        index.builds, built, index.searched, ','.join(map(str, found)) or
        '-'))
