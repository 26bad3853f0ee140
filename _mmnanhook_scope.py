"""Teach mmengine's config loader the ``mmnanhook::`` prefix.

``_base_ = ['mmnanhook::_base_/nan_detect.py']`` resolves like
``'mmdet::...'``: to ``mmnanhook/.mim/configs/_base_/nan_detect.py``. MMEngine
accepts ``package::`` only for the packages in its table
``mmengine.config.utils.MODULE2PACKAGE`` (a fixed list of OpenMMLab projects
in 0.7 - 0.10), and the table is read while the config's ``_base_`` list is
resolved, before ``custom_imports`` could import anything of ours. So the
wheel installs ``_mmnanhook_scope.pth``, which imports this module at
interpreter start: it imports nothing heavy (no mmengine, no torch) and waits
until ``mmengine.config.utils`` is imported, then adds one entry to that
table and leaves the import system as it was. Nothing else of mmengine
changes; a config without ``mmnanhook::`` sees no difference.
"""
import sys

_WATCHED = 'mmengine.config.utils'


def register(module):
    """Add ``mmnanhook`` to ``module.MODULE2PACKAGE`` (mmengine's table).

    Args:
        module (module): ``mmengine.config.utils``.
    """
    table = getattr(module, 'MODULE2PACKAGE', None)
    if isinstance(table, dict):
        table.setdefault('mmnanhook', 'mmnanhook')


class _RegisteringLoader(object):
    """The real loader of ``mmengine.config.utils``, registering after it."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        register(module)

    def __getattr__(self, name):  # get_source etc., for tracebacks
        return getattr(self._loader, name)


class _Finder(object):
    """A meta path finder that answers only for ``mmengine.config.utils``."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != _WATCHED:
            return None
        # Once: whatever happens below, the import system is as before.
        uninstall()
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec is not None and hasattr(spec.loader, 'exec_module'):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install():
    """Register now if mmengine's table is loaded, else when it is."""
    module = sys.modules.get(_WATCHED)
    if module is not None:
        register(module)
    elif _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


def uninstall():
    """Stop watching imports (nothing to undo once registered)."""
    if _Finder in sys.meta_path:
        sys.meta_path.remove(_Finder)


try:
    install()
except Exception:  # noqa: BLE001 - interpreter start must never fail here
    pass
