"""What a leg's versions cannot do, and how the tests read what mmnanhook
wrote: shared by the tests, never used by the package itself."""
import inspect
import pickle
import types

import numpy as np
import torch
from mmengine.utils import digit_version

from mmnanhook.compat import MMENGINE_VERSION, TORCH_VERSION

# mmengine >= 0.10.3: an iteration-based loop resumed at iteration k first
# skips the k batches already trained; before, it begins again at the
# dataloader's first batch (mmengine's behaviour, with or without mmnanhook).
RESUME_SKIPS_TRAINED_BATCHES = MMENGINE_VERSION >= digit_version('0.10.3')

# mmengine 0.10.7 resumes with torch.load's default weights_only, which torch
# >= 2.6 makes True, and its own checkpoints then fail to load (mmengine's
# limit, not mmnanhook's): why a resume cannot be tested there, or None.
RESUME_BROKEN = (
    "mmengine 0.10.7 resumes with torch.load's default weights_only, which "
    'torch >= 2.6 makes True and its checkpoints fail (mmengine, not '
    'mmnanhook); the DOTA leg (torch 1.7) runs it'
    if TORCH_VERSION >= digit_version('2.6.0') else None)

# torch.load(weights_only=) exists since 1.13 and defaults to True since 2.6;
# bundles hold data samples with numpy metainfo, so they need False.
_LOAD_HAS_WEIGHTS_ONLY = 'weights_only' in inspect.signature(torch.load).parameters
_LOAD_KWARGS = {'weights_only': False} if _LOAD_HAS_WEIGHTS_ONLY else {}


class _Numpy2Unpickler(pickle.Unpickler):
    """Finds numpy>=2's ``numpy._core`` names in numpy<2's ``numpy.core``."""

    def find_class(self, module, name):
        if module == 'numpy._core' or module.startswith('numpy._core.'):
            module = 'numpy.core' + module[len('numpy._core'):]
        return super(_Numpy2Unpickler, self).find_class(module, name)


# A bundle written with numpy>=2 pickles its arrays as numpy._core objects,
# which numpy<2 (the one torch 1.7 runs with) lacks.
if digit_version(np.__version__) < digit_version('2.0.0'):
    _numpy2_pickle = types.ModuleType('mmnanhook_numpy2_pickle')
    _numpy2_pickle.__dict__.update(
        (key, value) for key, value in vars(pickle).items()
        if not key.startswith('__'))
    _numpy2_pickle.Unpickler = _Numpy2Unpickler
    _LOAD_KWARGS['pickle_module'] = _numpy2_pickle


def torch_load(path, map_location='cpu'):
    """Load a file written by :func:`torch.save` with full unpickling.

    Args:
        path (str): File to load.
        map_location: Passed to :func:`torch.load`; ``'cpu'`` so that a
            bundle written on a GPU loads on a CPU-only machine.
    """
    return torch.load(path, map_location=map_location, **_LOAD_KWARGS)
