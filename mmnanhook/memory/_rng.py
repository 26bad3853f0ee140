"""Capture and restore every random number generator a training step uses.

A replay only reproduces a failure whose forward draws random numbers
(samplers of two-stage detectors, dropout, random augmentations inside the
model) when it starts from the generator states of the original iteration.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch
from .. import compat
from .._log import log


def capture_rng(numpy_state: Optional[Callable[[], Any]] = None,
                random_state: Optional[Callable[[], Any]] = None,
                cuda: Optional[bool] = None) -> Dict[str, Any]:
    """Snapshot the torch CPU, CUDA, numpy and python ``random`` states.

    A few kilobytes of host copies. CUDA states are captured only once CUDA
    is initialised, because querying them would otherwise initialise CUDA
    (slow, and unwanted in a CPU-only run on a GPU machine); before that
    nothing has drawn from them.

    Args:
        numpy_state, random_state (callable, optional): Return numpy's and
            ``random``'s global states as ``np.random.get_state()`` and
            ``random.getstate()`` do (:class:`StepRng` answers again what
            it captured while a generator was not drawn from).
        cuda (bool, optional): Whether CUDA is available, when known.

    Returns:
        dict: ``torch``, ``numpy``, ``random`` and, when CUDA is initialised,
        ``cuda`` (one state per visible device).
    """
    state = {
        'torch': torch.get_rng_state(),
        'numpy': (numpy_state or np.random.get_state)(),
        'random': (random_state or random.getstate)(),
    }
    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


class StepRng(object):
    """:func:`capture_rng` before every train step, at a fraction of its
    cost where numpy's and ``random``'s global generators were not drawn
    from since the step before.

    ``np.random.get_state()`` copies the 624 words of its Mersenne Twister
    one by one (about 30 us, three quarters of a capture), and
    ``random.getstate()`` makes 625 int objects (7 us, and the garbage
    collections they bring); a training process whose data workers are
    processes of their own seldom draws from either. Their key and position
    are read as 2.5 kB of bytes (:func:`mmnanhook.compat.numpy_mt_reader`,
    :func:`~mmnanhook.compat.python_mt_reader`), and the state captured
    last is answered again while those bytes are unchanged and no cached
    Gaussian was made or used (making one draws, so it changes the bytes;
    using one does not, so that case is told apart): the state is then the
    one the full capture gives, exactly. Where a reader is ``None``, the
    full capture every time.
    """

    def __init__(self) -> None:
        generator = getattr(random.getstate, '__self__', None)
        self._numpy = _Unchanged(compat.numpy_mt_reader(),
                                 np.random.get_state,
                                 # has_gauss: its cached value unused.
                                 lambda state: not state[3])
        self._random = _Unchanged(
            compat.python_mt_reader(), random.getstate,
            lambda state: getattr(generator, 'gauss_next', None) is state[2])
        # The devices a process sees do not change while it runs.
        self._cuda = torch.cuda.is_available()

    def capture(self) -> Dict[str, Any]:
        """:func:`capture_rng` now."""
        return capture_rng(self._numpy, self._random, self._cuda)


class _Unchanged(object):
    """One generator's state, captured again only when it has changed.

    Args:
        read (callable, optional): The generator's key and position as
            bytes.
        capture (callable): Its full state.
        unchanged (callable): ``state -> bool``: whether what the bytes do
            not cover is as in ``state`` (the cached Gaussian).
    """

    def __init__(self, read: Optional[Callable[[], bytes]],
                 capture: Callable[[], Any],
                 unchanged: Callable[[Any], bool]) -> None:
        self._read = read
        self._capture = capture
        self._unchanged = unchanged
        # (the bytes, the state captured with them)
        self._kept = None

    def __call__(self):
        if self._read is None:
            return self._capture()
        raw = self._read()
        kept = self._kept
        if kept is not None and kept[0] == raw and self._unchanged(kept[1]):
            return kept[1]
        state = self._capture()
        self._kept = (raw, state)
        return state


def restore_rng(state: Dict[str, Any],
                logger: Optional[logging.Logger] = None) -> None:
    """Restore a state returned by :func:`capture_rng`.

    A bundle written on a GPU machine also replays on a CPU-only one: its
    CUDA states are then skipped with a note in the log, and when fewer
    devices are visible than were captured, the visible ones are restored.

    Args:
        state (dict): The captured state.
        logger (logging.Logger, optional): Where notes go; the current
            MMLogger by default.
    """
    torch.set_rng_state(state['torch'])
    np.random.set_state(state['numpy'])
    random.setstate(state['random'])
    cuda_states = state.get('cuda')
    if not cuda_states:
        return
    if not torch.cuda.is_available():
        log('mmnanhook: CUDA RNG states were captured but CUDA is not '
            'available here; they are not restored, so CUDA random draws '
            'of the replay differ from the original run.', logging.WARNING,
            logger)
        return
    visible = torch.cuda.device_count()
    if visible < len(cuda_states):
        log('mmnanhook: {} CUDA RNG states were captured but {} device(s) '
            'are visible; only those are restored.'.format(
                len(cuda_states), visible), logging.WARNING, logger)
    for index, cuda_state in enumerate(cuda_states[:visible]):
        torch.cuda.set_rng_state(cuda_state, index)
