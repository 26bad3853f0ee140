"""What tier 1 keeps of each train step, in case it has to be replayed.

Kept by reference, never copied: the raw batch (``train_step`` does not
mutate it) and the RNG states before its forward, for the micro-steps since
the last update step only; the bad loss may be an earlier micro-step's.
With them, the data preprocessor's attributes before the forward (a few
entries: ``BatchSyncRandomResize`` resizes by the size it kept, and sets
the next one in the same forward), and the dataset index of each sample
(what the diagnosis names and a drop quarantines).
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._attributes import Attributes
from ._rng import StepRng


class StepMemory(object):
    """Raw batches and RNG states of the last ``window`` train steps.

    Args:
        window (int): How many steps to keep: the gradient accumulation
            count, so that every micro-step of an update can be replayed.
        preprocessor (nn.Module, optional): The model's data preprocessor,
            whose attributes (its batch augments' too) a step's forward may
            set (:meth:`preprocessor_attributes`).
    """

    def __init__(self, window: int = 1,
                 preprocessor: Optional[torch.nn.Module] = None) -> None:
        self.window = max(1, int(window))
        self._steps = collections.OrderedDict()
        self._indices = {}
        self._rng = StepRng()
        self._preprocessor = list(preprocessor.modules()) if isinstance(
            preprocessor, torch.nn.Module) else []

    def preprocessor_attributes(self) -> Optional[Attributes]:
        """The data preprocessor's :class:`Attributes` now, before a step's
        forward: what a step skipped or taken again, and every replay, start
        from (about 2 us: a shallow copy of a few ``__dict__`` s); ``None``
        without a preprocessor."""
        if not self._preprocessor:
            return None
        return Attributes(self._preprocessor, step=True)

    def keep(self, iter: int, data_batch: Any,
             attributes: Optional[Attributes] = None,
             indices: Optional[List[Optional[int]]] = None) -> None:
        """Keep ``data_batch`` and the RNG states now, for iteration ``iter``.

        Args:
            iter (int): The iteration.
            data_batch: Its raw batch.
            attributes (Attributes, optional): The data preprocessor's
                attributes before its forward.
            indices (list, optional): The dataset index of each of its
                samples (``None`` where unknown).
        """
        self._steps[iter] = (data_batch, self._rng.capture(), attributes)
        self._indices[iter] = indices
        while len(self._steps) > self.window:
            gone, _ = self._steps.popitem(last=False)
            self._indices.pop(gone, None)

    def indices(self, iter: int) -> Optional[List[Optional[int]]]:
        """The dataset index of each sample of ``iter``'s batch, or
        ``None``."""
        return self._indices.get(iter)

    def get(self, iter: int) -> Tuple[Any, Optional[Dict[str, Any]]]:
        """``(data_batch, rng_state)`` of ``iter``, or ``(None, None)``."""
        return self._steps.get(iter, (None, None, None))[:2]

    def attributes(self, iter: int) -> Optional[Attributes]:
        """The preprocessor's :class:`Attributes` before ``iter``'s forward,
        or ``None``."""
        return self._steps.get(iter, (None, None, None))[2]

    def steps(self) -> List[Tuple[int, Any, Dict[str, Any]]]:
        """``(iter, data_batch, rng_state)`` of every step kept, oldest
        first: the micro-steps since the last update step."""
        return [(i, batch, rng) for i, (batch, rng, _) in self._steps.items()]

    def clear(self) -> None:
        """Release everything kept."""
        self._steps.clear()
        self._indices.clear()

    def __len__(self):
        return len(self._steps)


class ForwardStart(object):
    """What a forward writes, as it was before it: the model's buffers and
    the data preprocessor's attributes; :meth:`restore` undoes the forward
    (a step skipped or taken again).

    Args:
        buffers (BufferSnapshot): The model's buffers.
        attributes (Attributes, optional): The preprocessor's.
    """

    def __init__(self, buffers: BufferSnapshot,
                 attributes: Optional[Attributes] = None) -> None:
        self.buffers = buffers
        self.attributes = attributes

    def restore(self) -> None:
        """Write both back."""
        self.buffers.restore()
        if self.attributes is not None:
            self.attributes.restore()


class BufferSnapshot(object):
    """Copies of a module's buffers, to undo what one forward wrote.

    ``policy='skip'`` must also undo the BN running statistics the failing
    forward updated; only that policy pays for the copy. A forward may also
    replace a buffer instead of writing it (torch < 1.8 BatchNorm assigns
    ``num_batches_tracked + 1``): the original tensor is put back in place.

    Taken before every update step under those policies: the copy is one
    flat tensor per device and dtype (one kernel each, not one per buffer:
    a ResNet-50 has 159 buffers), split back only to restore.

    Args:
        module (torch.nn.Module): Whose buffers to copy now.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        groups = collections.OrderedDict()
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    groups.setdefault((b.device, b.dtype), []).append(
                        (m, name, b))
        with torch.no_grad():
            self._flat = [(kept, torch.cat([b.reshape(-1)
                                            for _, _, b in kept]))
                          for kept in groups.values()]

    def restore(self) -> None:
        """Write the copies back."""
        with torch.no_grad():
            for kept, flat in self._flat:
                parts = flat.split([b.numel() for _, _, b in kept])
                for (module, name, buffer), saved in zip(kept, parts):
                    module._buffers[name] = buffer
                    buffer.copy_(saved.view_as(buffer))
