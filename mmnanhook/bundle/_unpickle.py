"""Loading a bundle's ``.pth`` files without running code from them.

Tensors, storages and plain containers load; any other global a pickle
names loads only as the caller's allowlist resolves it (the bundle's content
checks, :mod:`._content`).
"""
from __future__ import annotations

import codecs
import pickle
import types
import zipfile
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

from ..compat import WEIGHTS_ONLY_ALLOWLIST

# Where torch has no scoped allowlist (compat.WEIGHTS_ONLY_ALLOWLIST),
# mmnanhook's own restricted unpickler applies the same allowlist, and a
# command that loads says so.
ALLOWLIST_FALLBACK = None if WEIGHTS_ONLY_ALLOWLIST else (
    'torch {} has no torch.load(weights_only=True) with a scoped allowlist '
    "(torch >= 2.6 has): mmnanhook's own restricted unpickler loads the "
    "bundle's .pth files, with the same allowlist".format(torch.__version__))


class ForeignObjectError(pickle.UnpicklingError):
    """A pickle names a global that the allowlist does not hold."""


# What torch's own unpickling may name besides torch's tensor rebuilds,
# storage types, dtypes, Size and device: torch's weights_only allows the
# same. Protocol 2 pickles bytes through _codecs.encode (empty ones through
# bytes).
_PLAIN_GLOBALS = {
    ('collections', 'OrderedDict'): OrderedDict,
    ('_codecs', 'encode'): codecs.encode,
    ('builtins', 'set'): set,
    ('builtins', 'bytes'): bytes,
    ('builtins', 'bytearray'): bytearray,
    ('builtins', 'complex'): complex,
}


def _torch_global(module, name):
    """An object of :data:`_PLAIN_GLOBALS` or of torch's serialization."""
    if (module, name) in _PLAIN_GLOBALS:
        return _PLAIN_GLOBALS[module, name]
    if module == 'torch._utils' and name in ('_rebuild_tensor_v2',
                                             '_rebuild_parameter'):
        return getattr(torch._utils, name)
    if module != 'torch':
        return None
    obj = getattr(torch, name, None)
    if (obj in (torch.Size, torch.device) or isinstance(obj, torch.dtype)
            or (isinstance(obj, type) and name.endswith('Storage')
                and obj in torch._storage_classes)):
        return obj
    return None


def _restricted_pickle_module(find):
    """A ``pickle`` module for ``torch.load`` whose unpickler resolves a
    global only through ``find`` (or torch's own), never by an import."""

    class Unpickler(pickle.Unpickler):

        def find_class(self, module: str, name: str) -> Any:
            if module == '__builtin__':  # how protocol 2 names builtins
                module = 'builtins'
            obj = _torch_global(module, name)
            if obj is None:
                obj = find(module, name)
            if obj is None:
                raise ForeignObjectError('{}.{}'.format(module, name))
            return obj

    restricted = types.ModuleType('mmnanhook_restricted_pickle')
    restricted.Unpickler = Unpickler
    restricted.load = lambda file, **kwargs: Unpickler(file, **kwargs).load()
    return restricted


def torch_load_allowlisted(path: str, find: Callable[[str, str], Any],
                           built: Sequence[type] = (),
                           map_location: Any = 'cpu') -> Any:
    """Load a :func:`torch.save` zip file without running code from it.

    Tensors, storages and plain containers load; any other global the
    pickle names loads only as ``find`` resolves it. torch >= 2.6: torch's
    ``weights_only=True`` with those globals allowed for this load; older
    torch: an unpickler with the same allowlist (:data:`ALLOWLIST_FALLBACK`).

    Args:
        path (str): The file.
        find (Callable[[str, str], object]): ``(module, name)`` -> the
            allowed object, ``None`` for anything else; it must not import
            what it does not allow.
        built (Sequence[type]): Types the file may build instances of
            without naming them (numpy's dtype classes).
        map_location: Passed to :func:`torch.load`.

    Raises:
        ForeignObjectError: The file names a global outside the allowlist
            (nothing of it ran).
        Exception: Whatever torch raises for a file it cannot read.
    """
    # torch would hand a TorchScript archive to torch.jit.load, and read a
    # pre-1.6 file by other code paths (a tar whose members it extracts, links
    # included); a bundle is neither. torch tells a zip file by its first
    # bytes, not by the directory at its end that zipfile.is_zipfile finds
    # in a tar with a zip appended.
    with open(path, 'rb') as f:
        if f.read(4) != b'PK\x03\x04' or not zipfile.is_zipfile(path):
            raise pickle.UnpicklingError('not a torch zip file')
    with zipfile.ZipFile(path) as archive:
        if any(n.split('/')[-1] == 'constants.pkl'
               for n in archive.namelist()):
            raise pickle.UnpicklingError('a TorchScript archive')
    if not WEIGHTS_ONLY_ALLOWLIST:
        return torch.load(path, map_location=map_location,
                          pickle_module=_restricted_pickle_module(find))
    allowed = []
    for full in torch.serialization.get_unsafe_globals_in_checkpoint(path):
        module, _, name = full.rpartition('.')
        obj = _torch_global(module, name)
        if obj is None:
            obj = find(module, name)
        if obj is None:
            raise ForeignObjectError(full)
        # Under the name the file uses, which may be an alias (numpy.core).
        allowed.append((obj, full))
    try:
        with torch.serialization.safe_globals(allowed + list(built)):
            return torch.load(path, map_location=map_location,
                              weights_only=True)
    except pickle.UnpicklingError as error:
        # torch wraps the reason in advice to load with weights_only=False.
        reason = str(error).split('WeightsUnpickler error:', 1)[-1]
        raise pickle.UnpicklingError(' '.join(
            reason.split('Check the documentation', 1)[0].split()))
