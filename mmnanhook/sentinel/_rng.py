"""Capture and restore every random number generator a training step uses.

A replay only reproduces a failure whose forward draws random numbers
(samplers of two-stage detectors, dropout, random augmentations inside the
model) when it starts from the generator states of the original iteration.
"""
import logging
import random

import numpy as np
import torch
from .._log import log


def capture_rng():
    """Snapshot the torch CPU, CUDA, numpy and python ``random`` states.

    Cheap enough to run before every iteration: a few kilobytes of host
    copies. CUDA states are captured only once CUDA is initialised, because
    querying them would otherwise initialise CUDA (slow, and unwanted in a
    CPU-only run on a GPU machine); before that nothing has drawn from them.

    Returns:
        dict: ``torch``, ``numpy``, ``random`` and, when CUDA is initialised,
        ``cuda`` (one state per visible device).
    """
    state = {
        'torch': torch.get_rng_state(),
        'numpy': np.random.get_state(),
        'random': random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state, logger=None):
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
