"""Tier 1 on an MMEngine ``OptimWrapper``: the check bound onto the instance.

MMEngine wraps methods of the built wrapper *on the instance* before any hook
runs: every param scheduler replaces ``optim_wrapper.step`` with a counting
function that calls the ``step`` of the class the wrapper had at that moment.
Re-classing the wrapper later would change nothing that ``update_params``
calls. So mmnanhook never touches the class: :func:`install_nan_detect` binds
five small methods onto the instance, each wrapping what the instance
resolved before (the scheduler's counter included, whose ``_with_counter``
marker it carries on), and puts one
:class:`~._sentinel.WrapperSentinel` into one attribute. The bindings
delegate to it; without it they pass straight through.
:meth:`NanDetectHandle.remove` puts back exactly what was there.

A scheduler built *after* the install wraps the bound ``step`` in turn,
which still runs the check; and whatever replaces it without calling it is
caught by the bypass guard (:mod:`._guard`).
"""
from __future__ import annotations

import types
from typing import Any, Dict, List, Optional, Tuple

from mmengine.logging import MessageHub
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS

from .. import compat
from .._mmengine import members
from ..options import CheckOptions
from ..recovery import Policy
from ._listener import Listener
from ._sentinel import WrapperSentinel
from ._supported import check_supported

# The one attribute the install adds to a wrapper instance.
ATTRIBUTE = '_nan_detect'

# Wrapper method -> WrapperSentinel method it delegates to.
_BINDINGS = (
    ('update_params', 'update_params'),
    ('backward', 'backward'),
    ('step', 'step'),
    ('_clip_grad', 'clip_grad'),
    ('optim_context', 'optim_context'),
)


def _binding(name, delegate, prev):
    """A method for ``name`` that hands ``prev`` to the sentinel's
    ``delegate``, or calls ``prev`` when the wrapper has no sentinel."""

    def method(self, *args, **kwargs):
        sentinel = self.__dict__.get(ATTRIBUTE)
        if sentinel is None:
            return prev(*args, **kwargs)
        return getattr(sentinel, delegate)(self, prev, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = 'mmnanhook.' + name
    method.__doc__ = getattr(prev, '__doc__', None)
    # Markers others put on what they wrapped stay visible: a param
    # scheduler looks for `_with_counter` on optim_wrapper.step.
    source = getattr(prev, '__func__', prev)
    method.__dict__.update((k, v) for k, v in vars(source).items()
                           if not k.startswith('__'))
    # A compiled train_step reaches the checks through these bindings.
    return compat.not_traced(method)


def bind(wrapper: OptimWrapper) -> Dict[str, Tuple[bool, Any, Any]]:
    """Bind the delegating methods onto ``wrapper``.

    Returns:
        dict: name -> (had an instance attribute, its value, the binding),
        for :func:`unbind`.
    """
    saved = {}
    own = vars(wrapper)
    for name, delegate in _BINDINGS:
        had, old = name in own, own.get(name)
        # A bound method, not a plain function: a param scheduler built
        # later takes ``step.__func__`` / ``__self__`` apart.
        bound = types.MethodType(
            _binding(name, delegate, getattr(wrapper, name)), wrapper)
        own[name] = bound
        saved[name] = (had, old, bound)
    return saved


def unbind(wrapper: OptimWrapper,
           saved: Dict[str, Tuple[bool, Any, Any]]) -> None:
    """Undo :func:`bind`.

    A binding that something else has wrapped since (a scheduler built after
    the install) stays; with the sentinel gone it only passes through.
    """
    own = vars(wrapper)
    for name, (had, old, bound) in saved.items():
        if own.get(name) is not bound:
            continue
        if had:
            own[name] = old
        else:
            del own[name]


def sentinel_of(wrapper: OptimWrapper) -> Optional[WrapperSentinel]:
    """The :class:`~._sentinel.WrapperSentinel` checking ``wrapper``, or
    ``None``."""
    return vars(wrapper).get(ATTRIBUTE)


class _SelfChecking(object):
    """Makes a registered wrapper class check itself from construction:
    the check options are taken out of its keyword arguments, the rest go
    to the wrapper."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = CheckOptions.take(kwargs)
        refused = Policy(options).needs_hook()
        if refused:
            raise ValueError(refused)
        super().__init__(*args, **kwargs)
        bind(self)
        vars(self)[ATTRIBUTE] = WrapperSentinel(options)


@OPTIM_WRAPPERS.register_module()
class NanDetectOptimWrapper(_SelfChecking, OptimWrapper):
    """``OptimWrapper`` that checks every step (see
    :class:`~._sentinel.WrapperSentinel`).

    Args:
        *args: ``OptimWrapper`` arguments.
        policy (str): ``'raise'`` (default), ``'skip'`` or ``'warn'``.
        max_skips (int): Consecutive skipped steps after which ``'skip'``
            raises. Defaults to 10.
        min_loss_scale (float, optional): AMP loss scale below which training
            is considered broken. Defaults to 1.
        max_overflow_skips (int, optional): Consecutive AMP overflow skips
            tolerated. Defaults to 20.
        spike_policy (str, optional): ``None``, ``'warn'`` (default),
            ``'skip'`` or ``'raise'`` (see ``NanDetectHook``).
        spike_window, spike_warmup, spike_factor: The spike band (see
            ``NanDetectHook``).
        **kwargs: ``OptimWrapper`` arguments.

    Example:
        >>> optim_wrapper = dict(type='NanDetectOptimWrapper',
        ...                      optimizer=dict(type='SGD', lr=0.01),
        ...                      policy='raise')
    """


@OPTIM_WRAPPERS.register_module()
class NanDetectAmpOptimWrapper(_SelfChecking, AmpOptimWrapper):
    """``AmpOptimWrapper`` that checks every step; options as
    :class:`NanDetectOptimWrapper`.

    Example:
        >>> optim_wrapper = dict(type='NanDetectAmpOptimWrapper',
        ...                      optimizer=dict(type='SGD', lr=0.01),
        ...                      loss_scale='dynamic', min_loss_scale=1.0)
    """


class NanDetectHandle(object):
    """What :func:`install_nan_detect` changed; :meth:`remove` undoes it."""

    def __init__(self, entries: List[Tuple[Any, ...]]) -> None:
        self._entries = entries

    @property
    def wrappers(self) -> List[OptimWrapper]:
        """The checked ``OptimWrapper`` instances."""
        return [entry[0] for entry in self._entries]

    @property
    def sentinels(self) -> List[WrapperSentinel]:
        """Their :class:`~._sentinel.WrapperSentinel` objects, in the same
        order."""
        return [entry[1] for entry in self._entries]

    def remove(self) -> None:
        """Restore every wrapper's attributes exactly as they were."""
        entries, self._entries = self._entries, []
        for wrapper, _, previous, saved in reversed(entries):
            unbind(wrapper, saved)
            if previous is None:
                vars(wrapper).pop(ATTRIBUTE, None)
            else:
                vars(wrapper)[ATTRIBUTE] = previous


def install_nan_detect(optim_wrapper: OptimWrapper,
                       listener: Optional[Listener] = None,
                       message_hub: Optional[MessageHub] = None,
                       options: Optional[CheckOptions] = None,
                       run_policy: Optional[Policy] = None,
                       **kwargs: Any) -> NanDetectHandle:
    """Add the checks to an already-built optim wrapper.

    Binds the checks onto each wrapper instance (an ``OptimWrapperDict``'s
    members one by one), whatever was bound there before; a wrapper that
    already checks itself (a configured ``NanDetectOptimWrapper``) only gets
    a new sentinel with ``listener`` and ``options`` until removal. Nothing
    is changed unless every member is supported.

    Args:
        optim_wrapper (OptimWrapper | OptimWrapperDict): Built wrapper.
        listener (Listener, optional): Told about loss terms and triggers,
            e.g. ``NanDetectHook``.
        message_hub (MessageHub, optional): Where scalars are logged and the
            iteration is read; the current instance when not given.
        options (CheckOptions, optional): The options; built from
            ``kwargs`` when not given.
        run_policy (Policy, optional): The run's policy (the listener's
            too); one of ``options`` when not given.
        **kwargs: See :class:`~mmnanhook.options.CheckOptions`.

    Returns:
        NanDetectHandle: Call ``remove()`` to restore the wrappers.

    Raises:
        RuntimeError: For an unsupported wrapper (e.g. DeepSpeed).
        ValueError: For a bad option.
    """
    if options is None:
        options = CheckOptions(**kwargs)
    wrappers = members(optim_wrapper)
    for wrapper in wrappers:
        check_supported(wrapper)
    entries = []
    for wrapper in wrappers:
        previous = sentinel_of(wrapper)
        saved = bind(wrapper) if previous is None else {}
        sentinel = WrapperSentinel(options, listener, message_hub,
                                   run_policy)
        vars(wrapper)[ATTRIBUTE] = sentinel
        entries.append((wrapper, sentinel, previous, saved))
    if len(entries) > 1:
        # One train/nan_skipped for the run, whichever member skipped.
        peers = [entry[1] for entry in entries]
        for sentinel in peers:
            sentinel.peers = peers
    return NanDetectHandle(entries)
