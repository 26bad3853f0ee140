"""A plain torch ``Dataset``, as many users write one: no data infos
(no ``get_data_info``), each sample a dict with its input and a data sample
whose metainfo names its file, and a small model that trains on it.

* :class:`PlainDataset`: sample ``i``'s input is ``[first + i, ...]`` (its
  first value its own index, so a test can tell which sample a batch
  holds), ``img_path`` ``plain/00i.png`` (or no file at all); ``deadly`` samples make the model kill its
  process in the forward (``SIGKILL``, as the OOM killer; ``SIGSEGV``, a
  read of address 0, as a C++ op's crash); ``nan`` samples load as NaN.
  ``log_file`` gets one line ``pid index`` per load.
* :class:`PlainModel`: a linear layer and an MSE loss.
* :func:`plain_runner`: a real Runner on them.
"""
import ctypes
import os
import signal
import uuid

import torch
import torch.nn as nn
from mmengine.model import BaseModel
from mmengine.runner import Runner
from mmengine.structures import BaseDataElement
from torch.utils.data import Dataset, Sampler

from mmnanhook import NanDetectHook

# The value of an input's second entry that makes the model kill its
# process (the first is the sample's index).
DEADLY = 666.0
BATCH = 2


class InOrder(Sampler):
    """A sampler that yields ``order`` (indices may come back).

    Args:
        order (list[int]): The indices.
    """

    def __init__(self, order):
        self.order = list(order)

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)


def file_of(index):
    """The file a sample's metainfo names."""
    return 'plain/%03d.png' % index


class PlainDataset(Dataset):
    """``n`` samples of 4 values; no ``get_data_info``.

    Args:
        n (int): Samples.
        deadly (list[int]): Samples whose forward kills the process.
        nan (list[int]): Samples whose input loads as NaN.
        log_file (str, optional): Where each load appends ``pid index``.
        files (bool): Whether a sample's metainfo names its file.
        first (int): What sample 0's first value is (a dataset that is
            the second part of a concatenation: its indices there).
    """

    def __init__(self, n=8, deadly=(), nan=(), log_file=None, files=True,
                 first=0):
        self.n = n
        self.deadly = set(deadly)
        self.nan = set(nan)
        self.log_file = log_file
        self.files = files
        self.first = first

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if self.log_file:
            with open(self.log_file, 'a') as f:
                f.write('%d %d\n' % (os.getpid(), index))
        g = torch.Generator().manual_seed(index)
        inputs = torch.randn(4, generator=g)
        inputs[0] = float(self.first + index)
        if index in self.deadly:
            inputs[1] = DEADLY
        if index in self.nan:
            inputs[2:] = float('nan')
        return dict(inputs=inputs, data_samples=BaseDataElement(
            metainfo=dict(img_path=file_of(index)) if self.files else {}))


def loads(log_file):
    """``[(pid, index), ...]`` of every load logged."""
    if not os.path.exists(log_file):
        return []
    with open(log_file) as f:
        return [tuple(int(v) for v in line.split()) for line in f]


class PlainModel(BaseModel):
    """A linear layer and an MSE loss; a sample whose input's second value
    is :data:`DEADLY` kills the process in the forward (``how``:
    ``'KILL'`` or ``'SEGV'``).

    Args:
        how (str): How the process dies.
    """

    def __init__(self, how='KILL'):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.how = how

    def forward(self, inputs, data_samples=None, mode='tensor',
                targets=None):
        x = torch.stack(list(inputs)) if isinstance(inputs, (list, tuple)) \
            else inputs
        if bool((x[:, 1] == DEADLY).any()):
            if self.how == 'SEGV':
                ctypes.string_at(0)
            os.kill(os.getpid(), signal.SIGKILL)
        y = self.fc(x)[:, 0]
        if mode != 'loss':
            return y
        # Two targets a sample (:func:`two_targets`): the first is the one.
        goal = 1.0 if targets is None else targets.view(len(x), 2)[:, 0]
        return dict(loss=((y - goal) ** 2).mean())


def two_targets(samples):
    """A collate function of a layout mmnanhook does not know: the inputs
    stacked, and ``targets`` two rows a sample (``(2N, )``), which no
    entry says how to split."""
    inputs = torch.stack([s['inputs'] for s in samples])
    return dict(inputs=inputs, targets=torch.ones(2 * len(samples)))


def plain_runner(work_dir, dataset, hook=None, max_iters=4, resume=False,
                 how='KILL', sampler='InfiniteSampler', workers=0,
                 custom_hooks=(), checkpoint=False, collate='pseudo_collate',
                 epochs=None, shuffle=False):
    """A Runner training :class:`PlainModel` on ``dataset``
    (``IterBasedTrainLoop``, batches of :data:`BATCH` in order).

    Args:
        hook (dict | NanDetectHook, optional): ``NanDetectHook``'s options,
            or the hook (``None``: no hook).
        resume (bool): Resume from the last checkpoint in ``work_dir``.
        checkpoint (bool): A checkpoint after every iteration.
        workers (int): Dataloader worker processes (persistent when any).
        collate: The collate function (a registered name or a function).
        epochs (int, optional): Train ``EpochBasedTrainLoop`` for so many
            epochs instead.
        shuffle (bool): The sampler shuffles.
        sampler (str | Sampler): The sampler's type, or a sampler.
    """
    hooks = list(custom_hooks)
    if hook is not None:
        hooks.insert(0, NanDetectHook(**hook) if isinstance(hook, dict)
                     else hook)
    loader = dict(dataset=dataset,
                  sampler=dict(type=sampler, shuffle=shuffle)
                  if isinstance(sampler, str) else sampler,
                  batch_size=BATCH, num_workers=workers,
                  persistent_workers=bool(workers),
                  collate_fn=dict(type=collate) if isinstance(collate, str)
                  else collate)
    return Runner(
        model=PlainModel(how), work_dir=str(work_dir),
        experiment_name='plain_' + uuid.uuid4().hex,
        train_dataloader=loader,
        train_cfg=dict(by_epoch=False, max_iters=max_iters)
        if epochs is None else dict(by_epoch=True, max_epochs=epochs),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        custom_hooks=hooks, resume=resume,
        default_hooks=dict(checkpoint=dict(
            type='CheckpointHook', interval=1, by_epoch=False)
            if checkpoint else None),
        log_level='WARNING', default_scope='mmengine',
        randomness=dict(seed=0))
