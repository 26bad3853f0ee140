"""What a replay changes and must give back: RNG states, model state."""
import contextlib

from ..sentinel import BufferSnapshot, capture_rng, restore_rng

@contextlib.contextmanager
def preserved_rng():
    """Put every RNG (torch CPU and CUDA, numpy, python) back on exit."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)


class PreservedModelState(object):
    """Keep a model's gradients and buffers as they were before replays.

    Parameters are never written by a replay (there is no optimizer step);
    gradients and buffers (BN running statistics, counters) are.  On exit
    every parameter gets its original ``.grad`` object back and every
    buffer its original tensor and values.

    Args:
        model (nn.Module): The model to protect.
    """

    def __init__(self, model):
        self.model = model
        self._grads = None
        self._buffers = None

    def __enter__(self):
        self._grads = [(p, p.grad) for p in self.model.parameters()]
        self._buffers = BufferSnapshot(self.model)
        return self

    def reset(self):
        """Gradients to ``None`` and buffers to their saved values."""
        for param, _ in self._grads:
            param.grad = None
        self._buffers.restore()

    def __exit__(self, *exc_info):
        self.reset()
        for param, grad in self._grads:
            param.grad = grad
        return False
