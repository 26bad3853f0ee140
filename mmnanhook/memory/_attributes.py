"""The Python attributes a forward sets, kept to be put back.

A replay must leave the run as it was, and tensors are not all a forward
changes: mmdet's ``BatchSyncRandomResize`` keeps the next input size in
``self._input_size`` (set, under DDP, from a ``broadcast`` every tenth
iteration), heads keep the last assignment in attributes, a pipeline's
``CachedMosaic`` appends to a list. :class:`Attributes` keeps the instance
``__dict__`` of some objects (modules, transforms, a sampler, the
MessageHub's runtime info) and puts it back: entries added are removed,
rebound ones rebound, and the contents of plain containers (``list``,
``dict``, ``set``, ``OrderedDict``) and of tensors held as plain attributes
written back in place, so that whoever shares them sees the old contents.
A module's parameters, buffers and submodules are not attributes here: the
tensors have their own snapshots (:class:`BufferSnapshot`), and the
submodules are objects of their own.
"""
from __future__ import annotations

import collections
from typing import Any, Iterable

import torch

# What nn.Module keeps in its __dict__ that is not one of its attributes.
_MODULE_OWN = frozenset(('_parameters', '_buffers', '_modules'))
# Everything torch itself keeps there (hook dicts, ``training``...): no
# forward sets these, so the snapshot taken before every step leaves them.
_TORCH_OWN = frozenset(vars(torch.nn.Module()))


def _contents(value):
    """A copy of a plain container's or a plain tensor's contents (``None``
    for anything else: kept by reference only)."""
    kind = type(value)
    if kind is list:
        return list(value)
    if kind in (dict, collections.OrderedDict):
        return list(value.items())
    if kind is set:
        return set(value)
    if isinstance(value, torch.Tensor) and not isinstance(
            value, torch.nn.Parameter):
        return value.detach().clone()
    return None


def _put_back(value, contents):
    """Write ``contents`` back into the container or tensor ``value``."""
    if isinstance(value, torch.Tensor):
        if value.shape == contents.shape and not torch.equal(value,
                                                             contents):
            with torch.no_grad():
                value.copy_(contents)
        return
    if isinstance(value, list):
        if not _same(value, contents):
            value[:] = contents
    elif isinstance(value, dict):
        if not _same(value.items(), contents):
            value.clear()
            value.update(contents)
    else:
        value.clear()
        value.update(contents)


def _same(items, kept):
    """Whether ``items`` are the objects ``kept`` (identity: values may be
    tensors, whose ``==`` is no answer)."""
    items = list(items)
    return len(items) == len(kept) and all(
        a is b or (isinstance(a, tuple) and a[0] == b[0] and a[1] is b[1])
        for a, b in zip(items, kept))


class Attributes(object):
    """The instance attributes of ``objects``, as they are now.

    Args:
        objects (iterable): Objects with a ``__dict__`` (modules, transforms,
            samplers, dicts themselves: a ``dict`` is kept as its items).
        step (bool): Taken before every train step (the data
            preprocessor's): a shallow copy of each ``__dict__`` (about a
            microsecond a module), which puts back what a forward rebinds
            (``BatchSyncRandomResize._input_size``) and removes what it
            adds, but not what it writes into a container in place, and
            leaves torch's own entries (hook dicts, ``training``: no
            forward sets them). Otherwise (a trigger's replays, which hook
            modules) containers' and plain tensors' contents are kept and
            written back too, and torch's entries are put back.
    """

    def __init__(self, objects: Iterable[Any], step: bool = False) -> None:
        self._step = step
        self._kept = []
        for obj in objects:
            own = obj if type(obj) in (dict, collections.OrderedDict) \
                else vars(obj)
            if step:
                self._kept.append((own, dict(own), isinstance(
                    obj, torch.nn.Module)))
                continue
            skip = _MODULE_OWN if isinstance(obj, torch.nn.Module) else ()
            self._kept.append((own, dict(
                (name, (value, _contents(value)))
                for name, value in own.items() if name not in skip), skip))

    def restore(self) -> None:
        """Put every attribute back: entries added since are removed."""
        if self._step:
            for own, kept, module in self._kept:
                skip = _MODULE_OWN | _TORCH_OWN if module else ()
                kept = dict((name, (value, None)) for name, value in
                            kept.items() if name not in skip)
                _restore(own, kept, skip)
            return
        for own, kept, skip in self._kept:
            _restore(own, kept, skip)


def _restore(own, kept, skip):
    """``own`` (a ``__dict__``) back to ``kept`` (name -> ``(value,
    contents)``), but the names in ``skip``."""
    for name in [n for n in own if n not in kept and n not in skip]:
        del own[name]
    for name, (value, contents) in kept.items():
        if own.get(name, own) is not value:
            own[name] = value
        if contents is not None:
            _put_back(value, contents)


def module_attributes(module: torch.nn.Module,
                      step: bool = False) -> Attributes:
    """:class:`Attributes` of ``module`` and every submodule of it."""
    return Attributes(module.modules(), step)
