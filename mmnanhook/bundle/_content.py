"""What a bundle's torch files may hold, and whether they hold it.

A bundle can come from anyone, so its ``.pth`` files load through an
allowlist (nothing else is imported or called, see
:func:`._unpickle.torch_load_allowlisted`), and what loaded is checked
to be what its name says before a replay uses it.
"""
from __future__ import annotations

import importlib
import importlib.util
import random
from typing import Any, Dict, Optional

import numpy as np
import torch

from ._layout import DATA_BATCH, MODEL, OPTIMIZER, RNG

# numpy's part of the allowlist, module -> names: arrays (an RNG state,
# masks, metainfo). Torch's own types are the loader's.
_ALLOWED = {
    'numpy': ('ndarray', 'dtype'),
    'numpy.core.multiarray': ('_reconstruct', ),
}

# The OpenMMLab packages whose ``structures`` may be in a batch, where
# mmengine does not say (its table of ``package::`` scopes, PKG2PROJECT,
# is used where it has one): what a codebase's collate makes of a sample
# is one of its data samples, data elements, boxes or masks.
_OPENMMLAB = ('mmengine', 'mmdet', 'mmrotate', 'mmseg', 'mmpose',
              'mmpretrain', 'mmagic', 'mmyolo', 'mmocr', 'mmaction',
              'mmdet3d', 'mmcls', 'mmedit', 'mmtrack')

# numpy >= 1.20 makes each dtype an instance of a class of its own (e.g.
# UInt32DType, of the MT19937 key) that a pickle builds without naming it.
BUILT = tuple({type(np.dtype(code)) for code in '?bBhHiIlLqQefdFD'})

# numpy >= 2 pickles numpy.core's names as numpy._core's.
_NUMPY_CORE = ('numpy._core', 'numpy.core')


def find_allowed(module: str, name: str) -> Any:
    """The object ``module.name`` if the allowlist holds it, else ``None``.

    The allowlist: numpy's arrays (:data:`_ALLOWED`), and every class of an
    installed OpenMMLab package's ``structures`` (mmengine's, mmdet's,
    mmpose's, mmpretrain's, mmagic's...) that is a data element (a
    ``BaseDataElement``: data samples, ``InstanceData``, ``PixelData``) or
    mmdet's boxes or masks (:func:`_structure`). Only numpy's modules and
    the ``structures`` modules of installed OpenMMLab packages are ever
    imported.
    """
    canonical = module
    for alias in _NUMPY_CORE:
        if module == alias or module.startswith(alias + '.'):
            canonical = 'numpy.core' + module[len(alias):]
    if canonical not in _ALLOWED:
        return _structure(module, name)
    if name not in _ALLOWED[canonical]:
        return None
    if canonical == 'numpy.core.multiarray':
        # Whichever of the two this numpy has; numpy 2 warns on numpy.core.
        try:
            found = importlib.import_module('numpy._core.multiarray')
        except ImportError:
            found = importlib.import_module(canonical)
    else:
        found = importlib.import_module(canonical)
    return getattr(found, name)


def _openmmlab_packages():
    """The OpenMMLab packages mmengine knows, and :data:`_OPENMMLAB`."""
    try:
        from mmengine.config.utils import PKG2PROJECT
    except ImportError:
        PKG2PROJECT = {}
    return set(_OPENMMLAB) | set(PKG2PROJECT)


def _structure_bases():
    """The classes whose subclasses a batch may hold: mmengine's data
    element, and mmdet's boxes and masks where mmdet is installed."""
    from mmengine.structures import BaseDataElement
    bases = [BaseDataElement]
    if importlib.util.find_spec('mmdet') is not None:
        from mmdet.structures.bbox import BaseBoxes
        from mmdet.structures.mask import BaseInstanceMasks
        bases += [BaseBoxes, BaseInstanceMasks]
    return tuple(bases)


def _structure(module, name):
    """``module.name`` if it is a class of an installed OpenMMLab package's
    ``structures`` that :func:`_structure_bases` allows, else ``None``."""
    package, _, rest = module.partition('.')
    if (rest != 'structures' and not rest.startswith('structures.')) or \
            package not in _openmmlab_packages() or \
            importlib.util.find_spec(package) is None:
        return None
    try:
        found = getattr(importlib.import_module(module), name, None)
    except (ImportError, ValueError):
        return None
    if isinstance(found, type) and issubclass(found, _structure_bases()):
        return found
    return None


def _rng_problem(state):
    """Why ``state`` is not what :func:`~mmnanhook.memory.capture_rng`
    returns, or ``None``."""
    if not isinstance(state, dict) or not {'torch', 'numpy',
                                           'random'} <= set(state):
        return ('not an RNG state (a dict of torch, numpy and random '
                'states)')
    cuda = state.get('cuda') or []
    if not isinstance(cuda, (list, tuple)):
        return 'not an RNG state (its cuda states are not a list)'
    tensors = [state['torch']] + list(cuda)
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
               and t.dim() == 1 for t in tensors):
        return 'not an RNG state (its torch states are not byte tensors)'
    if not _numpy_state(state['numpy']):
        return ('not an RNG state (its numpy state is not a legacy MT19937 '
                'state)')
    # Setting them is what checks them; the generators are put back after.
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        torch.set_rng_state(state['torch'])
        np.random.set_state(state['numpy'])
        random.setstate(state['random'])
    except Exception as error:  # noqa: BLE001 - numpy and random raise
        # IndexError, KeyError, OverflowError ... for what is no state.
        return 'not an RNG state ({}: {})'.format(type(error).__name__, error)
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
    return None


def _numpy_state(state):
    """Whether ``state`` is what ``np.random.get_state()`` returns: numpy
    < 1.17 crashes (a segmentation fault) setting an ill-formed one."""
    return (isinstance(state, (tuple, list)) and len(state) == 5
            and state[0] == 'MT19937' and isinstance(state[1], np.ndarray)
            and state[1].shape == (624, ) and state[1].dtype == np.uint32
            and all(isinstance(v, (int, np.integer)) for v in state[2:4])
            and isinstance(state[4], (float, np.floating)))


def _batch_problem(batch):
    if not isinstance(batch, dict) or 'inputs' not in batch:
        return 'not a batch (a dict with inputs, as a dataloader yields)'
    return None


def _state_dict_problem(state):
    # A module's get_extra_state() may save other things than tensors.
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and (isinstance(v, torch.Tensor)
                                    or k.endswith('_extra_state'))
            for k, v in state.items()):
        return 'not a state dict (names to tensors)'
    return None


def _is_optimizer_state(state):
    return isinstance(state, dict) and {'state', 'param_groups'} <= set(state)


def _optimizer_problem(state):
    # An optim wrapper's state dict, or OptimWrapperDict's: one per name.
    if _is_optimizer_state(state) or (
            isinstance(state, dict) and state
            and all(_is_optimizer_state(v) for v in state.values())):
        return None
    return ('not an optimizer state dict (a dict with state and '
            'param_groups, or of such dicts by name)')


_CHECKS = {
    DATA_BATCH: _batch_problem,
    MODEL: _state_dict_problem,
    OPTIMIZER: _optimizer_problem,
    RNG: _rng_problem,
}


def _some(names, most=3):
    names = sorted(names)
    return ', '.join(names[:most]) + (', ...' if len(names) > most else '')


def state_dict_mismatch(expected: Dict[str, Any],
                        state: Dict[str, Any]) -> Optional[str]:
    """Why ``state`` is not a state dict of the model whose own state dict
    is ``expected`` (missing, unexpected or reshaped entries), or ``None``.
    """
    missing = set(expected) - set(state)
    unexpected = set(state) - set(expected)
    # Shapes of tensors only: a module's ``_extra_state`` may be anything.
    reshaped = [k for k in set(expected) & set(state)
                if getattr(expected[k], 'shape', None)
                != getattr(state[k], 'shape', None)]
    if not (missing or unexpected or reshaped):
        return None
    return 'not the state dict of the model its config.py builds: {}'.format(
        '; '.join('{} {} ({})'.format(len(keys), what, _some(keys))
                  for what, keys in (('missing', missing),
                                     ('unexpected', unexpected),
                                     ('of another shape', reshaped))
                  if keys))


def content_problem(stem: str, obj: Any) -> Optional[str]:
    """Why ``obj``, loaded from ``<stem>.pth``, is not what that file holds
    in a bundle, or ``None`` (also for a stem without a check)."""
    check = _CHECKS.get(stem)
    return check(obj) if check is not None else None
