"""The per-iteration training history kept for the bundle."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict, List, Optional

from ..records import HISTORY_FIELDS


_FIELDS = ('iter', ) + HISTORY_FIELDS


def _as_float(value):
    return None if value is None else float(value)


@dataclasses.dataclass
class StepState(object):
    """What one train iteration's update step came to, as the hook's run
    learns it from the sentinel (reset before every train step).

    Args:
        loss, grad_norm, loss_scale (float, optional): What the check
            measured, as every rank saw it.
        spikes (list[str], optional): The series that spiked.
        triggered (bool): A trigger (not a spike) happened in it.
        applied (bool, optional): Whether the update step was applied.
        dropped (Recomputation, optional): The drop recomputed and applied
            in it: what the train step returns are its values.
    """

    loss: Optional[float] = None
    grad_norm: Optional[float] = None
    loss_scale: Optional[float] = None
    spikes: Optional[List[str]] = None
    triggered: bool = False
    applied: Optional[bool] = None
    dropped: Any = None


def step_record(scalars: Dict[str, Any], step: StepState,
                lr_factor: Optional[float] = None,
                **values: Any) -> Dict[str, Any]:
    """One iteration's history record, as :meth:`History.append` takes it.

    Args:
        scalars (dict): MessageHub's ``log_scalars`` (host floats already:
            no sync).
        step (StepState): What the check of this iteration's update step
            measured (what every rank saw; MessageHub's loss is this
            rank's).
        lr_factor (float, optional): The factor a rewind's cooldown lowers
            the scheduled LR by: the LR the step really used.
        **values: Override the others (``iter``, ``rewind`` among them).
    """
    record = {}
    for field in HISTORY_FIELDS:
        buffer = scalars.get('train/' + field)
        record[field] = None if buffer is None else buffer.current()
    for field in ('loss', 'grad_norm', 'loss_scale'):
        if getattr(step, field) is not None:
            record[field] = getattr(step, field)
    if lr_factor and record['lr'] is not None:
        record['lr'] *= lr_factor
    record['spike'] = step.spikes
    record.update(values)
    return record


class History(object):
    """Ring buffer of the last ``maxlen`` iterations' scalars.

    Args:
        maxlen (int): How many iterations to keep.
    """

    def __init__(self, maxlen: int = 200) -> None:
        self._records = collections.deque(maxlen=maxlen)

    @property
    def maxlen(self) -> Optional[int]:
        return self._records.maxlen

    def append(self, iter: int, loss: Optional[float] = None,
               grad_norm: Optional[float] = None,
               lr: Optional[float] = None,
               loss_scale: Optional[float] = None,
               spike: Optional[List[str]] = None,
               rewind: Optional[int] = None) -> None:
        """Record one iteration; any value may be non-finite or ``None``.

        Args:
            iter (int): Global iteration (``runner.iter``).
            loss (float, optional): Total loss.
            grad_norm (float, optional): Total gradient norm.
            lr (float, optional): Learning rate (of the first param group)
                the step used.
            loss_scale (float, optional): AMP loss scale.
            spike (list[str], optional): The series that spiked.
            rewind (int, optional): The iteration whose snapshot this one
                went back to.
        """
        # A tuple, made a dict only when the records are read (a trigger).
        self._records.append((
            int(iter), _as_float(loss), _as_float(grad_norm), _as_float(lr),
            _as_float(loss_scale), list(spike) if spike else None,
            None if rewind is None else int(rewind)))

    def records(self) -> List[Dict[str, Any]]:
        """The kept records, oldest first, as a list of dicts."""
        records = []
        for values in self._records:
            record = dict(zip(_FIELDS, values[:5]))
            # Only when they happened: most records stay the plain five.
            for name, value in zip(('spike', 'rewind'), values[5:]):
                if value is not None:
                    record[name] = value
            records.append(record)
        return records

    def __len__(self):
        return len(self._records)
