"""Datasets of data infos only (no images): mmengine ``BaseDataset``\\ s as
large as a real one's annotation file, to measure and test what looks
samples up by file.

:class:`InfoDataset` holds ``len(paths)`` data infos shaped like mmdet's
(``img_path``, ``width``, ``height``, two instances), serialized as mmdet's
datasets keep them (``serialize_data=True``), and counts its
``get_data_info`` calls. :class:`ManyInfosDataset` has a million of them
in a second (made serialized), for a toy model (:class:`InfoModel`) on a
real Runner.
"""
import os
import pickle
import time

import numpy as np
import torch
from mmengine.dataset import BaseDataset
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.structures import BaseDataElement
from torch.utils.data import Sampler


def objects365_path(index):
    """An Objects365-like image path (the dataset has 1.7 M images)."""
    return 'data/objects365/train/images/v1/patch%d/objects365_v1_%08d.jpg' % (
        index // 34000, index)


def info_of(index, path):
    """A data info like mmdet's ``CocoDataset`` gives."""
    return dict(img_path=path, img_id=index, width=640, height=480,
                instances=[dict(bbox=[1.0, 2.0, 30.0, 40.0], bbox_label=3,
                                ignore_flag=0),
                           dict(bbox=[5.0, 6.0, 70.0, 80.0], bbox_label=7,
                                ignore_flag=0)])


class InfoDataset(BaseDataset):
    """Data infos of ``paths``, in order (a path may repeat); no pipeline.

    Args:
        paths (list[str | None]): Each sample's ``img_path`` (``None``: a
            sample that names no file).
        **kwargs: ``BaseDataset``'s (``serialize_data`` defaults to True).

    Attributes:
        calls (int): ``get_data_info`` calls in this process.
    """

    def __init__(self, paths, **kwargs):
        self.paths = paths
        self.calls = 0
        super(InfoDataset, self).__init__(ann_file='', **kwargs)

    def load_data_list(self):
        infos = [info_of(i, p) for i, p in enumerate(self.paths)]
        # Kept serialized only, as mmdet's are: 1.7 M path strings would be
        # 150 MB more of the process measured.
        self.paths = None
        return infos

    def get_data_info(self, idx):
        self.calls += 1
        return super(InfoDataset, self).get_data_info(idx)


class SlowInChild(object):
    """A mixin for a dataset of this module: its data infos come
    :attr:`slow` seconds each in any process but the one that built it (a
    walk forked from it is under way for a while)."""

    slow = 0.003

    def __init__(self, *args, **kwargs):
        self.owner = os.getpid()
        super(SlowInChild, self).__init__(*args, **kwargs)

    def get_data_info(self, idx):
        if os.getpid() != self.owner:
            time.sleep(self.slow)
        return super(SlowInChild, self).get_data_info(idx)


def fixed_path(index):
    """An Objects365-like path of one length for every index (the patch
    and the number zero-padded)."""
    return 'data/objects365/train/images/v1/patch%02d/objects365_v1_%08d.jpg' \
        % (index // 34000, index)


def serialized_infos(size):
    """What mmengine's ``BaseDataset._serialize_data`` makes of ``size``
    data infos of :func:`info_of`'s shape (``img_path`` :func:`fixed_path`,
    no ``img_id``): each pickled (protocol 4), one after the other, and the
    end offset of each. Made from one pickled info by writing each index's
    digits into a copy of it: a million in about a second, where pickling
    each takes 11 s here.

    Returns:
        tuple: ``(data_bytes, data_address)`` (uint8, int64 arrays).
    """
    info = info_of(0, fixed_path(0))
    del info['img_id']
    template = pickle.dumps(info, protocol=4)
    at = template.index(fixed_path(0).encode())
    rows = np.tile(np.frombuffer(template, dtype=np.uint8), (size, 1))
    index = np.arange(size)
    path = fixed_path(0)
    number = at + path.index('_v1_') + 4
    for digit in range(8):
        rows[:, number + 7 - digit] = 48 + index // 10**digit % 10
    patch = at + path.index('patch') + 5
    for digit in range(2):
        rows[:, patch + 1 - digit] = 48 + index // 34000 // 10**digit % 10
    return rows.reshape(-1), np.arange(1, size + 1,
                                       dtype=np.int64) * len(template)


class ManyInfosDataset(BaseDataset):
    """``size`` serialized data infos (:func:`serialized_infos`), each
    sample given to ``pipeline``.

    Args:
        size (int): Samples.
        **kwargs: ``BaseDataset``'s.
    """

    def __init__(self, size, **kwargs):
        self.size = size
        super(ManyInfosDataset, self).__init__(ann_file='',
                                               serialize_data=True, **kwargs)

    def load_data_list(self):
        # Placeholders: the infos are made serialized, below.
        return [None] * self.size

    def _serialize_data(self):
        self.data_list.clear()
        return serialized_infos(self.size)


class InfoInputs(object):
    """A data info -> a 16-vector (all NaN for the samples of ``bad``) and
    its data sample (``img_path``, ``sample_idx``)."""

    def __init__(self, bad=()):
        self.bad = set(bad)

    def __call__(self, info):
        index = info['sample_idx']
        inputs = torch.full((16, ), float(index % 7) / 7)
        if index in self.bad:
            inputs.fill_(float('nan'))
        return dict(inputs=inputs, data_samples=BaseDataElement(metainfo=dict(
            img_path=info['img_path'], sample_idx=index)))


class InfoModel(BaseModel):
    """One linear layer of :class:`InfoInputs`' vectors."""

    def __init__(self):
        super(InfoModel, self).__init__()
        self.fc = torch.nn.Linear(16, 1)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        y = self.fc(torch.stack(inputs))
        return dict(loss=y.pow(2).mean()) if mode == 'loss' else y


class TailSampler(Sampler):
    """The last ``count`` indices of ``dataset``, in order."""

    def __init__(self, dataset, count):
        self.start, self.count = len(dataset) - count, count

    def __iter__(self):
        return iter(range(self.start, self.start + self.count))

    def __len__(self):
        return self.count

    def set_epoch(self, epoch):
        pass


class IterTimes(Hook):
    """Each train iteration's wall time (``before_train_iter`` to
    ``after_train_iter``), by iteration."""

    priority = 'VERY_HIGH'

    def __init__(self):
        self.times = {}

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self._start = runner.iter, time.perf_counter()

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        at, start = self._start
        self.times[at] = time.perf_counter() - start
