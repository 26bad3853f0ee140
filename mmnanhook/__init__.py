"""mmnanhook: NaN/Inf debugger for MMEngine-based training.

Importing the package registers ``NanDetectHook`` in mmengine's root
``HOOKS`` and the ``NanDetect*OptimWrapper`` classes in its root
``OPTIM_WRAPPERS``, so every downstream scope (mmdet, mmrotate) finds them.
"""
from .errors import BundleError, NonFiniteError
from .hook import NanDetectHook
from .optim_wrapper import (NanDetectAmpOptimWrapper, NanDetectOptimWrapper,
                            install_nan_detect)
from .version import __version__

__all__ = [
    'BundleError', 'NanDetectAmpOptimWrapper', 'NanDetectHook',
    'NanDetectOptimWrapper', 'NonFiniteError', '__version__',
    'install_nan_detect'
]
