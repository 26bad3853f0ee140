"""The ``mmnanhook`` scope of MMEngine's registries.

A config type written ``'mmnanhook.NanDetectHook'`` (or the ``_base_``
snippet's ``runner_type = 'mmnanhook.NanDetectRunner'``) names the scope
``mmnanhook``. Every MMEngine (0.7 to 0.10) looks a scoped name up by
importing ``<scope>.registry``, this module, which imports mmnanhook and so
registers its classes in the root registries, and then asking the scope's
registry, whose parent is the root. MMEngine >= 0.8 would also find the name
as a module path; 0.7 finds it only through this scope. No class is
registered here: the registries below only name the scope.
"""
from mmengine.registry import HOOKS as _ROOT_HOOKS
from mmengine.registry import OPTIM_WRAPPERS as _ROOT_OPTIM_WRAPPERS
from mmengine.registry import RUNNERS as _ROOT_RUNNERS
from mmengine.registry import Registry

import mmnanhook  # noqa: F401 - registers the classes in the roots

HOOKS = Registry('hook', parent=_ROOT_HOOKS, scope='mmnanhook')
OPTIM_WRAPPERS = Registry('optim_wrapper', parent=_ROOT_OPTIM_WRAPPERS,
                          scope='mmnanhook')
RUNNERS = Registry('runner', parent=_ROOT_RUNNERS, scope='mmnanhook')
