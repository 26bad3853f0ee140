"""What torch's anomaly mode says, captured instead of printed.

Anomaly mode reports the forward traceback of a failing backward op only as
a warning, which warning filters may drop; tier 1 (around a backward that
raised) and tier 2 (the replay) both keep it.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional

# The text anomaly mode's forward-traceback warning starts with (torch 1.7
# through 2.13).
_ANOMALY_PREFIX = 'Error detected in '


class AnomalyMessages(object):
    """The anomaly-mode messages seen inside :func:`capture_anomaly_warnings`.

    Attributes:
        messages (list[str]): Each forward traceback anomaly mode reported.
    """

    def __init__(self) -> None:
        self.messages = []

    @property
    def traceback(self) -> Optional[str]:
        """All messages joined, or ``None`` when anomaly mode reported none."""
        return '\n'.join(self.messages) if self.messages else None


@contextlib.contextmanager
def capture_anomaly_warnings(record: Optional[AnomalyMessages] = None
                             ) -> Iterator[AnomalyMessages]:
    """Record anomaly mode's warnings; re-emit every other one once on exit.

    Args:
        record (AnomalyMessages, optional): What to fill; a new one by
            default.

    Yields:
        AnomalyMessages: Filled when the block exits.
    """
    record = AnomalyMessages() if record is None else record
    catcher = warnings.catch_warnings(record=True)
    caught = catcher.__enter__()
    try:
        warnings.simplefilter('always')
        yield record
    finally:
        # Restored first, so the user's filters apply to the re-emitted ones.
        catcher.__exit__(None, None, None)
        others = []
        for warning in caught:
            text = str(warning.message)
            if text.startswith(_ANOMALY_PREFIX):
                record.messages.append(text)
                continue
            key = (text, warning.category, warning.filename, warning.lineno)
            if key not in others:
                others.append(key)
        for text, category, filename, lineno in others:
            warnings.warn_explicit(text, category, filename, lineno)


def is_anomaly_nan_error(exc: BaseException) -> bool:
    """Whether ``exc`` is anomaly mode's "returned nan values" error."""
    return isinstance(exc, RuntimeError) and 'returned nan values' in str(exc)
