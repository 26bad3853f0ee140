"""Every torch / mmengine version shim of mmnanhook lives here.

mmnanhook supports Python 3.7+ and torch 1.7 through 2.14; code elsewhere
calls these helpers instead of testing versions itself.

Over 500 lines because it is one concern by rule: every version shim in one
module (the project's compatibility rule), so that one reading shows every
place a version, or a library's private layout (numpy's and CPython's
Mersenne Twister state, DDP's reducer), is relied on.
"""
from __future__ import annotations

import inspect
import logging
import os
import sys
import warnings
from typing import (Any, Callable, Dict, List, NoReturn, Optional,
                    Sequence, Set, Tuple, Union)

import torch

import mmengine
from mmengine.utils import digit_version

# logging's ``stacklevel`` (Python >= 3.8): a log record names the caller of
# mmnanhook's log helper, not the helper; on 3.7 it names the helper.
LOG_CALLER = {'stacklevel': 2} if sys.version_info >= (3, 8) else {}

TORCH_VERSION = digit_version(torch.__version__.split('+')[0])
MMENGINE_VERSION = digit_version(mmengine.__version__)

# torch < 1.8: the autograd engine's C++ destructor, run by the process's
# exit handlers, can wait forever for its worker threads after a backward
# (an upstream race, fixed by pytorch#47886; seen here in `mmnan replay` on
# torch 1.7.1, gdb: Engine::~Engine in __run_exit_handlers, one thread).
ENGINE_EXIT_RACE = TORCH_VERSION < digit_version('1.8.0')


def exit_process(code: Union[int, str, None]) -> NoReturn:
    """End a process that is done (a command line's), with ``code``.

    On torch < 1.8 (:data:`ENGINE_EXIT_RACE`) the output and the log files
    are flushed and the process leaves without the C++ exit handlers;
    elsewhere it is ``sys.exit(code)``.
    """
    if not ENGINE_EXIT_RACE:
        sys.exit(code)
    leave(code)


def leave(code: Union[int, str, None]) -> NoReturn:
    """End this process now with ``code``, its output and log files flushed,
    without the interpreter's finalization nor the C++ exit handlers (where
    threads that outlive them would hang or abort it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing to keep
            pass
    logging.shutdown()
    os._exit(code if isinstance(code, int) else 1)


def default_store() -> Any:
    """The key-value store of the default process group (a ``TCPStore``
    under torch's launchers), which outlives a failed collective of another
    group.

    Private in torch (``distributed_c10d._get_default_store``), there from
    1.7 through 2.13.
    """
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


# torch.load(weights_only=True) with an allowlist scoped to one load, a scan
# for the globals a file names and aliases (numpy.core for numpy._core):
# torch >= 2.6. Older torch has no weights_only (< 1.13), no allowlist
# (1.13-2.3) or one without aliases (2.5) or process-wide only (2.4).
WEIGHTS_ONLY_ALLOWLIST = TORCH_VERSION >= digit_version('2.6.0')


def set_detect_anomaly(mode: bool, check_nan: bool = True) -> None:
    """``torch.autograd.set_detect_anomaly`` with ``check_nan`` where it exists.

    Args:
        mode (bool): Whether anomaly mode is on.
        check_nan (bool): Raise on NaN in backward (torch >= 1.13 only; older
            torch always checks).
    """
    if TORCH_VERSION >= digit_version('1.13.0'):
        torch.autograd.set_detect_anomaly(mode, check_nan=check_nan)
    else:
        torch.autograd.set_detect_anomaly(mode)


def is_anomaly_check_nan_enabled() -> bool:
    """Whether anomaly mode checks for NaN (always, before torch 1.13)."""
    fn = getattr(torch, 'is_anomaly_check_nan_enabled', None)
    return fn() if fn is not None else True


def anomaly_state() -> Tuple[bool, bool]:
    """The (enabled, check_nan) pair to hand back to :func:`restore_anomaly`."""
    return torch.is_anomaly_enabled(), is_anomaly_check_nan_enabled()


def restore_anomaly(state: Tuple[bool, bool]) -> None:
    """Restore a state returned by :func:`anomaly_state`."""
    set_detect_anomaly(state[0], check_nan=state[1])


# torch.compile (dynamo) exists since torch 2.0; torch.compiler.disable since
# 2.1, torch._dynamo.disable in 2.0.
HAS_DYNAMO = TORCH_VERSION >= digit_version('2.0.0')


def not_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` excluded from ``torch.compile``.

    A compiled caller (MMEngine's ``compile``: the whole ``train_step``)
    graph-breaks at the call and runs ``fn`` eagerly, with every function
    it calls: dynamo neither traces mmnanhook's Python (host syncs, numpy,
    RNG states, replays: each a failure or a graph break inside it) nor
    guards on its state, which changes every iteration and would recompile
    the caller. ``fn`` itself on torch < 2.0 (nothing compiles there).

    Args:
        fn (callable): A function of mmnanhook's own making; its name, doc
            and attributes (a param scheduler's ``_with_counter``) carry
            over, but for dynamo's markers, which it loses.
    """
    if not HAS_DYNAMO:
        return fn
    # functools.wraps of a compiled function copies its dynamo markers onto
    # the wrapper; older torch (before dynamo's wrapper ids) follows them from
    # the wrapper to that function, and would disable it instead.
    for name in [k for k in vars(fn) if k.startswith('_torchdynamo')]:
        delattr(fn, name)
    compiler = getattr(torch, 'compiler', None)
    if hasattr(compiler, 'disable'):
        return compiler.disable(fn)
    import torch._dynamo as dynamo
    return dynamo.disable(fn)


def compiled_original(fn: Any) -> Optional[Callable[..., Any]]:
    """The eager callable that ``torch.compile`` made ``fn`` from (as
    MMEngine sets the compiled ``train_step`` on the model instance), or
    ``None`` when ``fn`` is not a compiled function.

    Args:
        fn (callable): Anything; a :func:`not_traced` function is not
            compiled.
    """
    if not HAS_DYNAMO or getattr(fn, '_torchdynamo_disable', False):
        return None
    return getattr(fn, '_torchdynamo_orig_callable', None)


HAS_FOREACH_NORM = hasattr(torch, '_foreach_norm')


def cpu_grad_scaler(**kwargs: Any) -> Any:
    """A GradScaler that runs on CPU (torch >= 2.3), else ``None``.

    Args:
        **kwargs: Passed to ``torch.amp.GradScaler``.
    """
    amp = getattr(torch, 'amp', None)
    if amp is None or not hasattr(amp, 'GradScaler'):
        return None
    return amp.GradScaler('cpu', **kwargs)


# clip_grad_norm_ computes per-gradient norms with _foreach_norm and sums them
# with linalg.vector_norm only since it grew ``foreach=`` (torch 2.0); doing the
# same keeps a reused norm bitwise equal to the one it would compute itself.
FOREACH_NORM_IN_CLIP = HAS_FOREACH_NORM and (
    'foreach' in inspect.signature(torch.nn.utils.clip_grad_norm_).parameters)


def clip_norm_groups(tensors: List[torch.Tensor]) -> List[List[int]]:
    """Index lists of ``tensors`` in the order ``clip_grad_norm_`` sums them.

    torch >= 2.0 groups gradients by device and dtype (in its own order);
    older torch keeps them as given.

    Args:
        tensors (list[torch.Tensor]): Gradients.
    """
    if not tensors:
        return []
    if not FOREACH_NORM_IN_CLIP:
        return [list(range(len(tensors)))]
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
    grouped = _group_tensors_by_device_and_dtype([list(tensors)],
                                                 with_indices=True)
    return [list(indices) for _, indices in grouped.values()]


def foreach_norm_supported(tensors: List[torch.Tensor],
                           device: torch.device) -> bool:
    """Whether ``clip_grad_norm_`` would use ``_foreach_norm`` for them.

    Args:
        tensors (list[torch.Tensor]): Gradients of one device and dtype.
        device (torch.device): Their device.
    """
    if not FOREACH_NORM_IN_CLIP:
        return False
    from torch.utils._foreach_utils import _has_foreach_support
    return _has_foreach_support(tensors, device)


def clip_vector_norm(tensor: torch.Tensor,
                     norm_type: float) -> torch.Tensor:
    """The p-norm of one tensor, computed as ``clip_grad_norm_`` does it.

    Args:
        tensor (torch.Tensor): Any tensor; it is treated as a flat vector.
        norm_type (float): The ``p`` of the norm (``inf`` allowed).
    """
    if FOREACH_NORM_IN_CLIP:
        return torch.linalg.vector_norm(tensor, norm_type)
    return torch.norm(tensor, norm_type)


def numpy_mt_reader() -> Optional[Callable[[], bytes]]:
    """A reader of the key and position of numpy's global Mersenne Twister
    as bytes (about 0.5 us), or ``None`` where it cannot be read so.

    numpy >= 1.17 gives the address of a bit generator's C state
    (``bit_generator.ctypes``); an ``MT19937``'s is its 624 key words and
    its position. That layout is checked here on a generator of its own,
    against ``get_state()``, before a draw and after one that regenerates
    the key; ``None`` on older numpy or another layout.
    """
    import ctypes

    import numpy as np
    size = 624 * 4 + ctypes.sizeof(ctypes.c_int)

    def reader(generator):
        return lambda: ctypes.string_at(
            generator._bit_generator.ctypes.state_address, size)

    try:
        probe = np.random.RandomState(47)
        read = reader(probe)
        for _ in range(2):
            _, key, pos = probe.get_state()[:3]
            raw = read()
            if (raw[:624 * 4] != key.astype(np.uint32).tobytes()
                    or ctypes.c_int.from_buffer_copy(raw, 624 * 4).value
                    != pos):
                return None
            probe.random_sample(700)
        # np.random.get_state is the global RandomState's, bound at import.
        return reader(np.random.get_state.__self__)
    except Exception:  # noqa: BLE001 - numpy < 1.17, or another layout
        return None


def python_mt_reader() -> Optional[Callable[[], bytes]]:
    """A reader of the index and key of ``random``'s global Mersenne Twister
    as bytes (about 0.5 us), or ``None`` where it cannot be read so.

    ``random.getstate()`` makes 625 int objects (7 us, and a collection of
    the young generation about every iteration when called every step).
    CPython's generator object is its header, then an ``int`` index and
    the 624 key words; that layout is checked here on a generator of its
    own, against ``getstate()``, before a draw and after one that
    regenerates the key; ``None`` on another interpreter or layout.
    """
    import ctypes
    import random
    import struct
    offset = object.__basicsize__
    size = ctypes.sizeof(ctypes.c_int) + 624 * 4

    def reader(generator):
        if type(generator).__basicsize__ < offset + size:
            raise TypeError('not the layout read here')
        address = id(generator) + offset
        # The default keeps the generator alive as long as its reader.
        return lambda kept=generator: ctypes.string_at(address, size)

    try:
        probe = random.Random(47)
        read = reader(probe)
        for _ in range(2):
            words = probe.getstate()[1]
            raw = read()
            if raw != struct.pack('=i624I', words[624], *words[:624]):
                return None
            for _ in range(700):
                probe.random()
        # random.getstate is the global generator's, bound at import.
        return reader(random.getstate.__self__)
    except Exception:  # noqa: BLE001 - another interpreter or layout
        return None


# Public since torch 2.6: scales gradients by a precomputed total norm.
clip_grads_with_norm_ = getattr(torch.nn.utils, 'clip_grads_with_norm_', None)

# clip_grad_norm_ multiplies by the clamped coefficient unconditionally since
# torch 1.10 (pytorch#61042); before, only when the coefficient is < 1.
CLIP_ALWAYS_MULTIPLIES = TORCH_VERSION >= digit_version('1.10.0')


def grad_scaler_scale(scaler: Any) -> Optional[torch.Tensor]:
    """A GradScaler's current scale as a tensor, without a host sync.

    Args:
        scaler: ``torch.cuda.amp.GradScaler`` / ``torch.amp.GradScaler`` or a
            duck-typed equivalent.

    Returns:
        torch.Tensor | None: ``None`` before the scaler's first ``scale()``.
    """
    get_async = getattr(scaler, '_get_scale_async', None)
    if get_async is not None:
        return get_async()
    return torch.tensor(float(scaler.get_scale()))


def add_exception_note(exc: BaseException, text: str) -> None:
    """Attach ``text`` to an exception without changing its type.

    Python >= 3.11 shows notes after the message; older Pythons get the text
    appended to the message (``args[0]``).

    Args:
        exc (BaseException): The exception, changed in place.
        text (str): What to attach.
    """
    if hasattr(exc, 'add_note'):
        exc.add_note(text)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (exc.args[0] + '\n' + text, ) + tuple(exc.args[1:])
    else:
        exc.args = tuple(exc.args) + (text, )


def autocast(device_type: str, dtype: torch.dtype) -> Any:
    """A fresh autocast context for ``device_type`` and ``dtype``, or ``None``.

    ``torch.autocast`` exists since torch 1.10 (CPU: bfloat16, and float16
    on newer torch); before it only CUDA float16 autocasts
    (``torch.cuda.amp.autocast``). ``None`` where this torch cannot autocast
    to ``dtype`` on ``device_type``.

    Args:
        device_type (str): ``'cuda'`` or ``'cpu'``.
        dtype (torch.dtype): ``torch.float16`` or ``torch.bfloat16``.
    """
    if hasattr(torch, 'autocast'):
        # An unsupported pair warns and disables itself; that means None.
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            try:
                ctx = torch.autocast(device_type=device_type, dtype=dtype)
            except (RuntimeError, ValueError):
                return None
        return ctx if getattr(ctx, '_enabled', True) else None
    if (device_type == 'cuda' and dtype == torch.float16
            and torch.cuda.is_available()):
        return torch.cuda.amp.autocast()
    return None


def valid_signals() -> Set[int]:
    """Every signal number this platform has (``signal.valid_signals``,
    Python 3.8+; on 3.7, those the ``signal`` module names)."""
    import signal
    valid = getattr(signal, 'valid_signals', None)
    return valid() if valid is not None else set(signal.Signals)


def distribution_version(names: Sequence[str]) -> Optional[str]:
    """Installed version of the first of ``names`` found, else ``None``.

    Args:
        names (Sequence[str]): Distribution names, e.g. ``('mmcv', 'mmcv-full')``.
    """
    try:
        from importlib.metadata import (  # novermin - 3.7 falls back
            PackageNotFoundError, version)
    except ImportError:  # Python 3.7
        import pkg_resources
        PackageNotFoundError = pkg_resources.DistributionNotFound

        def version(name):
            return pkg_resources.get_distribution(name).version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def nan_to_num(tensor: torch.Tensor,
               nan: float = 0.0,
               posinf: Optional[float] = None,
               neginf: Optional[float] = None) -> torch.Tensor:
    """``torch.nan_to_num`` (torch >= 1.8) on every torch."""
    if hasattr(torch, 'nan_to_num'):
        return torch.nan_to_num(tensor, nan=nan, posinf=posinf, neginf=neginf)
    big = torch.finfo(tensor.dtype).max if tensor.is_floating_point() else 0
    out = torch.where(torch.isnan(tensor), torch.full_like(tensor, nan),
                      tensor)
    out = torch.where(out == float('inf'), torch.full_like(
        out, big if posinf is None else posinf), out)
    return torch.where(out == float('-inf'), torch.full_like(
        out, -big if neginf is None else neginf), out)


class BackwardDrain(object):
    """Frees what a backward that raised left in autograd's ready queue.

    A backward interrupted by an exception (anomaly mode's NaN check, which
    torch < 1.13 cannot turn off; an in-place modification error) leaves
    the nodes it had queued in the calling thread's ready queue until a
    later backward on that thread pops them. torch 1.7 frees what is left at
    process exit, after Python's finalization, where freeing a node that
    holds Python objects (anomaly metadata, a hook) waits forever for the
    GIL: the process hangs. Calling the drain runs a backward of its own,
    tiny graph; built before the graphs it drains, its nodes are older, so
    the queue pops (and frees) the leftovers first.
    """

    def __init__(self) -> None:
        with torch.enable_grad():
            self._root = torch.zeros((), requires_grad=True) * 1.0

    def __call__(self) -> None:
        with torch.enable_grad():
            self._root.backward(retain_graph=True)


def dtensor_type() -> Optional[type]:
    """The ``DTensor`` class (FSDP2 ``fully_shard`` gradients), or ``None``.

    Public as ``torch.distributed.tensor`` since torch 2.4, private before
    (2.0+); absent on older torch and on builds without distributed. Imported
    only when a gradient is not a plain tensor, so a plain run never pays it.
    """
    for name in ('torch.distributed.tensor', 'torch.distributed._tensor'):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name, fromlist=['DTensor'])
            except ImportError:
                continue
        if hasattr(module, 'DTensor'):
            return module.DTensor
    return None


def fsdp_sharded_params(model: torch.nn.Module) -> Optional[Set[int]]:
    """The ids of the parameters FSDP (``FullyShardedDataParallel``, FSDP1)
    shards across ranks inside ``model``, as its ``clip_grad_norm_`` selects
    them; ``None`` when no module of ``model`` is FSDP1.

    Flat parameters, and their original parameters under
    ``use_orig_params=True``; ``NO_SHARD`` handles are not sharded. torch
    1.13 keeps a list ``_handles``, torch >= 2.0 one ``_handle``.

    Raises:
        RuntimeError: A module shards over fewer ranks than the world
            (``HYBRID_SHARD``).
    """
    if 'torch.distributed.fsdp' not in sys.modules:
        return None  # nothing can have been wrapped with it
    from torch.distributed.fsdp import FullyShardedDataParallel
    ids, found = set(), False
    world = (torch.distributed.get_world_size()
             if torch.distributed.is_initialized() else 1)
    for module in model.modules():
        if not isinstance(module, FullyShardedDataParallel):
            continue
        found = True
        group = getattr(module, 'process_group', None)
        if group is not None and group.size() != world:
            # The shards' powers are summed over the world: with replicas of
            # each shard (HYBRID_SHARD) the norm would count each shard once
            # per replica; refused rather than checked and clipped wrong.
            raise RuntimeError(
                'mmnanhook: FSDP shards over {} of the {} ranks (HYBRID_SHARD '
                'or a process group of its own): its global gradient norm is '
                'not supported'.format(group.size(), world))
        handles = getattr(module, '_handles', None)
        if handles is None:
            handles = [getattr(module, '_handle', None)]
        for handle in handles:
            if handle is None or not getattr(
                    handle, 'uses_sharded_strategy', True):
                continue
            flat = handle.flat_param
            ids.add(id(flat))
            if getattr(handle, '_use_orig_params', False):
                ids.update(id(p) for p in getattr(flat, '_params', None) or [])
    return ids if found else None


def ddp_syncs_buffers(ddp: Any) -> bool:
    """Whether the next forward of ``ddp`` (a ``DistributedDataParallel``)
    broadcasts the module's buffers from rank 0 first: a collective called
    from C++, which no Python call of ``torch.distributed`` shows.
    ``_check_sync_bufs_pre_fwd`` is torch's own test (torch >= 1.11); before,
    the forward broadcast them when ``broadcast_buffers`` and it syncs."""
    check = getattr(ddp, '_check_sync_bufs_pre_fwd', None)
    if check is not None:
        return bool(check())
    buffers = getattr(ddp, 'modules_buffers', None) or []
    if buffers and isinstance(buffers[0], list):
        # torch < 1.9: one list per module replica.
        buffers = buffers[0]
    return bool(getattr(ddp, 'require_forward_param_sync', True)
                and getattr(ddp, 'broadcast_buffers', False) and buffers)


def ddp_forward_collectives(ddp: Any, buffers: bool) -> None:
    """The collectives the forward of ``ddp`` makes from C++ before the
    module's: the one-time broadcast of its rebuilt gradient buckets (the
    reducer does nothing where none is pending, alike on every rank) and,
    with ``buffers``, the module's buffers broadcast from rank 0
    (``_sync_buffers``, torch >= 1.11; ``_sync_params`` before)."""
    if torch.is_grad_enabled():
        ddp.reducer._rebuild_buckets()
    if buffers:
        sync = getattr(ddp, '_sync_buffers', None) or ddp._sync_params
        sync()


def compiled_forward(model: torch.nn.Module,
                     options: Dict[str, Any]) -> Optional[Callable[..., Any]]:
    """``model.forward`` through ``torch.compile(**options)`` (the options a
    run compiled its train_step with), or ``None`` where torch has no
    ``compile`` (< 2.0)."""
    if not HAS_DYNAMO:
        return None
    return torch.compile(model.forward, **options)
