"""mmnanhook: NaN/Inf debugger for MMEngine-based training.

Importing the package registers ``NanDetectHook`` in mmengine's root
``HOOKS``, the ``NanDetect*OptimWrapper`` classes in its root
``OPTIM_WRAPPERS`` and ``NanDetectRunner`` in its root ``RUNNERS``, so every
downstream scope (mmdet, mmrotate, mmpretrain, mmseg) finds them.
"""
from .errors import (BundleError, CheckBypassedError, NonFiniteError,
                     NonFiniteInputError)
from .hook import NanDetectHook
from .runner import NanDetectRunner
from .sentinel import (NanDetectAmpOptimWrapper, NanDetectOptimWrapper,
                       install_nan_detect)
from .version import __version__

__all__ = [
    'BundleError', 'CheckBypassedError', 'NanDetectAmpOptimWrapper',
    'NanDetectHook', 'NanDetectOptimWrapper', 'NanDetectRunner',
    'NonFiniteError', 'NonFiniteInputError', '__version__', 'install_nan_detect'
]
