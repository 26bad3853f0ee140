"""What a run keeps of its steps so that a failing one can be replayed, and
its history for the bundle: written by tier 1 every iteration, read by tier
2 once per trigger. Neither tier imports the other for it.

* :mod:`._steps`: :class:`StepMemory` (the batches and RNG states of the
  micro-steps since the last update step), :class:`BufferSnapshot` and
  :class:`ForwardStart` (what a forward wrote, put back).
* :mod:`._rng`: every generator a step draws from, captured and restored.
* :mod:`._attributes`: the Python attributes a forward sets, put back.
* :mod:`._history`: the per-iteration scalars kept for a bundle.
"""
from ._attributes import Attributes, module_attributes
from ._history import History, StepState, step_record
from ._rng import capture_rng, restore_rng
from ._steps import BufferSnapshot, ForwardStart, StepMemory

__all__ = [
    'Attributes', 'BufferSnapshot', 'capture_rng', 'ForwardStart', 'History',
    'module_attributes', 'restore_rng', 'step_record', 'StepMemory',
    'StepState'
]
