"""Counting host syncs: every read of a tensor's value into Python.

On a CUDA run each of these waits for the device; on a CPU run they are free,
so they are counted, not timed. :func:`count_syncs` wraps the ``Tensor``
methods that bring a value to the host (``item``, ``tolist``, ``float()``,
``int()``, ``bool()``, ``numpy``, ``cpu``, ``to`` the host from a device)
for the duration of a ``with`` block, and attributes each call to the first
caller outside torch: mmnanhook's own code or anyone else's.
:func:`iteration_window` limits the count to a runner's train iterations (what a run does once, before or after them, is not a cost
per iteration). Works on every torch the package supports (no
``TorchFunctionMode`` on 1.7).
"""
import collections
import contextlib
import os.path as osp
import sys

import torch
from mmengine.hooks import Hook

import mmnanhook

# mmnanhook's own code (the test beds are not in it).
_PACKAGE = osp.dirname(osp.abspath(mmnanhook.__file__)) + osp.sep
_TORCH = osp.dirname(osp.abspath(torch.__file__)) + osp.sep
_METHODS = ('item', 'tolist', '__float__', '__int__', '__bool__', '__index__',
            'numpy', 'cpu', 'to')


class SyncCount(object):
    """What :func:`count_syncs` saw.

    Attributes:
        ours (collections.Counter): ``'file:line method'`` -> calls, for
            calls made by mmnanhook's code.
        theirs (collections.Counter): The same for every other caller
            (torch excluded: its frames are skipped to find the caller).
    """

    def __init__(self):
        self.ours = collections.Counter()
        self.theirs = collections.Counter()
        # Whether calls are counted now (see iteration_window).
        self.counting = True

    @property
    def n_ours(self):
        return sum(self.ours.values())

    @property
    def n_theirs(self):
        return sum(self.theirs.values())


def _moves_to_host(tensor, args, kwargs):
    # ``to`` is a transfer only from a device to the host; ``to(x.device)``
    # for a tensor already there is none (the same code on a GPU run keeps
    # everything on the GPU).
    target = kwargs.get('device', args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    try:
        target = None if target is None else torch.device(target)
    except (TypeError, RuntimeError):  # a dtype: no device change
        return False
    return (target is not None and target.type == 'cpu'
            and tensor.device.type != 'cpu')


@contextlib.contextmanager
def count_syncs():
    """Count the host syncs made inside the block.

    Yields:
        SyncCount: Filled while the block runs.
    """
    seen = SyncCount()
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}
    own = set(name for name in _METHODS if name in vars(torch.Tensor))

    def counted(name, method):
        def wrapper(self, *args, **kwargs):
            if seen.counting and (name != 'to'
                                  or _moves_to_host(self, args, kwargs)):
                _record(seen, name)
            return method(self, *args, **kwargs)
        return wrapper

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        yield seen
    finally:
        for name, method in originals.items():
            if name in own:
                setattr(torch.Tensor, name, method)
            else:  # inherited from the C base class: inherit it again
                delattr(torch.Tensor, name)


def _record(seen, name):
    frame = sys._getframe(2)
    while frame is not None and osp.abspath(
            frame.f_code.co_filename).startswith(_TORCH):
        frame = frame.f_back
    if frame is None:
        return
    path = osp.abspath(frame.f_code.co_filename)
    key = '%s:%d %s' % (path, frame.f_lineno, name)
    ours = path.startswith(_PACKAGE)
    (seen.ours if ours else seen.theirs)[key] += 1


class _Window(Hook):

    def __init__(self, seen, priority, counting):
        self.seen = seen
        self.priority = priority
        self.counting = counting

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if self.counting:
            self.seen.counting = True

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        if not self.counting:
            self.seen.counting = False


def iteration_window(runner, seen):
    """Count ``seen``'s syncs only inside ``runner``'s train iterations: from
    the first ``before_train_iter`` hook to the last ``after_train_iter``
    hook of each.

    Args:
        runner (Runner): The runner (two hooks are registered).
        seen (SyncCount): What :func:`count_syncs` yielded.
    """
    seen.counting = False
    runner.register_hook(_Window(seen, 'HIGHEST', True))
    runner.register_hook(_Window(seen, 'LOWEST', False))
