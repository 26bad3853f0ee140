"""What a replay changes and must give back: RNG states, model state, and
the Python state of the run (attributes of every module, the MessageHub's
runtime info, the sampler and the dataset's transforms)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from .._mmengine import wrapped_datasets
from ..memory import (Attributes, BufferSnapshot, capture_rng,
                      module_attributes, restore_rng)

@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Put every RNG (torch CPU and CUDA, numpy, python) back on exit."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)


def _run_objects(runner):
    """What a replay may change of a run besides its model: the
    MessageHub's runtime info, the train loop's sampler, and the transforms
    of the train dataset (and of every dataset it wraps)."""
    objects = [runner.message_hub.runtime_info]
    loader = getattr(runner, '_train_dataloader', None)
    if loader is not None and not isinstance(loader, dict):
        objects.append(loader.sampler)
        batch_sampler = getattr(loader, 'batch_sampler', None)
        if batch_sampler is not None:
            objects.append(batch_sampler)
        for dataset in wrapped_datasets(loader.dataset):
            objects.append(dataset)
            pipeline = getattr(dataset, 'pipeline', None)
            objects.extend(getattr(pipeline, 'transforms', None) or [])
    return [o for o in objects if o is not None]


@contextlib.contextmanager
def preserved_run(runner: Any, model: Any) -> Iterator[None]:
    """Put the run back as it was on exit: the Python attributes of every
    module of ``model`` (its data preprocessor and batch augments
    included), and those of :func:`_run_objects`. The replays inside run
    on the weights, buffers and RNG states their own contexts keep.

    Args:
        runner (Runner): The run.
        model (nn.Module): Its unwrapped model.
    """
    modules = module_attributes(model)
    others = Attributes(_run_objects(runner))
    try:
        yield
    finally:
        others.restore()
        modules.restore()


class PreservedModelState(object):
    """Keep a model's gradients and buffers as they were before replays.

    Parameters are never written by a replay (there is no optimizer step);
    gradients and buffers (BN running statistics, counters) are.  On exit
    every parameter gets its original ``.grad`` object back and every
    buffer its original tensor and values.

    Args:
        model (nn.Module): The model to protect.
        start (Attributes, optional): What each replay starts from besides:
            the data preprocessor's attributes before the failing forward
            (put back before every replay; :func:`preserved_run` puts the
            run's back afterwards).
    """

    def __init__(self, model: Any,
                 start: Optional[Attributes] = None) -> None:
        self.model = model
        self.start = start
        self._grads = None
        self._buffers = None

    def __enter__(self):
        self._grads = [(p, p.grad) for p in self.model.parameters()]
        self._buffers = BufferSnapshot(self.model)
        return self

    def reset(self) -> None:
        """Gradients to ``None`` and buffers to their saved values."""
        for param, _ in self._grads:
            param.grad = None
        self._buffers.restore()
        if self.start is not None:
            self.start.restore()

    def __exit__(self, *exc_info):
        self.reset()
        for param, grad in self._grads:
            param.grad = grad
        return False
