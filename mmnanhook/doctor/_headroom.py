"""fp16 / bf16 headroom: which modules would overflow in half precision.

A few fp32 training iterations record, per module, the largest magnitude of
its output and of the gradient reaching that output. An activation past
fp16's largest finite number overflows in an fp16 forward, which no loss
scale helps; one within ``NEAR`` times of it is named as close. A gradient
is taken times the loss scale: a static one (``loss_scale=512.``) overflows
it for good; a dynamic ``GradScaler`` (initial scale 2**16) skips a step and
halves the scale per overflow, so there the cost is the number of halvings
(:meth:`ModuleRange.backoff`) and only a gradient past the range at scale 1
overflows. bf16 has fp32's range: only its precision differs, so its
headroom is fp32's.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from .._tensors import iter_tensors

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
# GradScaler's default init_scale, as mmengine's AmpOptimWrapper('dynamic')
# makes it.
INIT_SCALE = 2.0 ** 16
# Named as close to the range: within this factor of FP16_MAX.
NEAR = 8.0


class ModuleRange(object):
    """The largest magnitudes one module saw.

    Args:
        name (str): The module's name in the model.
        activation (float): Largest ``|output|``.
        gradient (float): Largest ``|d loss / d output|`` (fp32, unscaled).
    """

    __slots__ = ('name', 'activation', 'gradient')

    def __init__(self, name: str, activation: float = 0.0,
                 gradient: float = 0.0) -> None:
        self.name = name
        self.activation = activation
        self.gradient = gradient

    def verdict(self, loss_scale: Optional[float] = None) -> Optional[str]:
        """``'overflow'``, ``'near'`` (within :data:`NEAR` times of the
        range) or ``None``, for fp16.

        Args:
            loss_scale (float, optional): A static loss scale the gradients
                are multiplied by; ``None`` for a dynamic one, which backs off
                from an overflow by itself (:meth:`backoff`), so only a
                gradient past the range at scale 1 is one.
        """
        gradient = self.gradient * (loss_scale or 1.0)
        peak = max(self.activation, gradient)
        if peak > FP16_MAX:
            return 'overflow'
        if peak * NEAR > FP16_MAX:
            return 'near'
        return None

    def backoff(self) -> int:
        """Halvings a dynamic ``GradScaler`` needs from its initial scale
        before this module's gradient fits (each one a skipped step)."""
        halvings = 0
        while self.gradient * INIT_SCALE / 2.0 ** halvings > FP16_MAX:
            halvings += 1
        return halvings

    def line(self, loss_scale: Optional[float] = None) -> str:
        scale = loss_scale or INIT_SCALE
        return ('{}: largest activation {:.3g}, gradient {:.3g} ({:.3g} at '
                '{} loss scale {:g}); fp16\'s largest is {:g}').format(
                    self.name, self.activation, self.gradient,
                    self.gradient * scale,
                    'the static' if loss_scale else "GradScaler's initial",
                    scale, FP16_MAX)


def _largest(tensor):
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0.0
    finite = tensor.detach()[torch.isfinite(tensor.detach())]
    return float(finite.abs().max()) if finite.numel() else 0.0


class RangeRecorder(object):
    """Records each leaf module's ranges while it is entered (a context
    manager that always removes its hooks).

    Args:
        model (torch.nn.Module): The model to watch.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.ranges = {}
        self._handles = []

    def _watch(self, name):
        record = self.ranges.setdefault(name, ModuleRange(name))

        def on_grad(grad: torch.Tensor) -> None:
            record.gradient = max(record.gradient, _largest(grad))

        def on_forward(module: torch.nn.Module, inputs: Any,
                       output: Any) -> None:
            for tensor in iter_tensors(output):
                record.activation = max(record.activation, _largest(tensor))
                if tensor.requires_grad:
                    tensor.register_hook(on_grad)

        return on_forward

    def __enter__(self):
        for name, module in self.model.named_modules():
            if name and not list(module.children()):
                self._handles.append(
                    module.register_forward_hook(self._watch(name)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False


def measure(model: Any, batches: Iterable[Any],
            optim_wrapper: Any) -> List[ModuleRange]:
    """Train ``model`` on ``batches`` in fp32 and record every leaf module's
    ranges.

    Args:
        model (mmengine.model.BaseModel): The model (its ``train_step``).
        batches (iterable): Data batches as the dataloader yields them.
        optim_wrapper (mmengine.optim.OptimWrapper): Its optim wrapper.

    Returns:
        list[ModuleRange]: Every leaf module's, largest peak first.
    """
    model.train()
    with RangeRecorder(model) as recorder:
        for batch in batches:
            model.train_step(batch, optim_wrapper)
    return sorted(recorder.ranges.values(), key=lambda r: -max(
        r.activation, r.gradient))


def cpu_fp16_autocast() -> Optional[Callable[..., Any]]:
    """Whether this torch runs fp16 autocast on a CPU (``None`` if not)."""
    autocast = getattr(torch, 'autocast', None)
    if autocast is None:
        return None
    try:
        with autocast('cpu', dtype=torch.float16):
            torch.nn.functional.linear(torch.ones(1, 2), torch.ones(2, 2))
    except (RuntimeError, TypeError, ValueError):
        return None
    return autocast


def confirm_overflow(model: Any, batch: Dict[str, Any],
                     name: str) -> Optional[bool]:
    """Run one forward under fp16 autocast on the CPU and say whether module
    ``name`` then outputs a non-finite value.

    Args:
        model (mmengine.model.BaseModel): The model.
        batch (dict): One data batch.
        name (str): The module predicted to overflow.

    Returns:
        bool | None: ``None`` where torch cannot autocast fp16 on a CPU.
    """
    autocast = cpu_fp16_autocast()
    if autocast is None:
        return None
    module = dict(model.named_modules())[name]
    seen = []

    def on_forward(module: torch.nn.Module, inputs: Any,
                   output: Any) -> None:
        seen.extend(not bool(torch.isfinite(t).all())
                    for t in iter_tensors(output) if t.is_floating_point())

    handle = module.register_forward_hook(on_forward)
    try:
        with torch.no_grad(), autocast('cpu', dtype=torch.float16):
            data = model.data_preprocessor(batch, True)
            model(**data, mode='loss')
    except Exception:  # noqa: BLE001 - a forward that fails in fp16 also
        pass           # tells; what the module saw before decides
    finally:
        handle.remove()
    return any(seen)
