"""Every torch / mmengine version shim of mmnanhook lives here.

mmnanhook supports Python 3.7+ and torch 1.7 through 2.13; code elsewhere
calls these helpers instead of testing versions itself.
"""
import inspect

import torch

from mmengine.utils import digit_version

TORCH_VERSION = digit_version(torch.__version__.split('+')[0])

# torch.load(weights_only=) exists since 1.13 and defaults to True since 2.6;
# bundles hold data samples with numpy metainfo, so they need False.
_LOAD_HAS_WEIGHTS_ONLY = 'weights_only' in inspect.signature(torch.load).parameters


def torch_load(path, map_location='cpu'):
    """Load a file written by :func:`torch.save` with full unpickling.

    Args:
        path (str): File to load.
        map_location: Passed to :func:`torch.load`; ``'cpu'`` so that a
            bundle written on a GPU loads on a CPU-only machine.
    """
    if _LOAD_HAS_WEIGHTS_ONLY:
        return torch.load(path, map_location=map_location, weights_only=False)
    return torch.load(path, map_location=map_location)


def set_detect_anomaly(mode, check_nan=True):
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


def is_anomaly_check_nan_enabled():
    """Whether anomaly mode checks for NaN (always, before torch 1.13)."""
    fn = getattr(torch, 'is_anomaly_check_nan_enabled', None)
    return fn() if fn is not None else True


def anomaly_state():
    """The (enabled, check_nan) pair to hand back to :func:`restore_anomaly`."""
    return torch.is_anomaly_enabled(), is_anomaly_check_nan_enabled()


def restore_anomaly(state):
    """Restore a state returned by :func:`anomaly_state`."""
    set_detect_anomaly(state[0], check_nan=state[1])


HAS_FOREACH_NORM = hasattr(torch, '_foreach_norm')


def register_backward_hook(module, hook):
    """Full backward hook on torch >= 1.8; ``None`` on 1.7 (its hook is buggy)."""
    if hasattr(module, 'register_full_backward_hook'):
        return module.register_full_backward_hook(hook)
    return None


def cpu_grad_scaler(**kwargs):
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


def clip_vector_norm(tensor, norm_type):
    """The p-norm of one tensor, computed as ``clip_grad_norm_`` does it.

    Args:
        tensor (torch.Tensor): Any tensor; it is treated as a flat vector.
        norm_type (float): The ``p`` of the norm (``inf`` allowed).
    """
    if FOREACH_NORM_IN_CLIP:
        return torch.linalg.vector_norm(tensor, norm_type)
    return torch.norm(tensor, norm_type)


# Public since torch 2.6: scales gradients by a precomputed total norm.
clip_grads_with_norm_ = getattr(torch.nn.utils, 'clip_grads_with_norm_', None)


def grad_scaler_scale(scaler):
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


def add_exception_note(exc, text):
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
