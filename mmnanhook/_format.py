"""How mmnanhook writes values, name lists and one-line errors."""
from __future__ import annotations

import math
from typing import Any, Sequence, Union

# How many offending names a message or a record keeps.
MAX_NAMES = 20


def format_value(value: Union[float, str, None]) -> str:
    """A float for messages: ``nan``/``inf`` as such, else 6 significant.

    Strings pass through: strict JSON (``report.json``) stores non-finite
    floats as ``"nan"``, ``"inf"``, ``"-inf"``.
    """
    if value is None:
        return 'n/a'
    if isinstance(value, str):
        return value
    if not math.isfinite(value):
        return str(value)
    return '%.6g' % value


def strict_float(value: Any) -> Union[float, str]:
    """``value`` as strict JSON stores a float: non-finite ones as
    ``"nan"``, ``"inf"``, ``"-inf"`` (``report.json``, the journal)."""
    value = float(value)
    if math.isnan(value):
        return 'nan'
    if math.isinf(value):
        return 'inf' if value > 0 else '-inf'
    return value


def format_names(names: Sequence[str], count: int) -> str:
    """``'a, b, c'``, with ``' and N more'`` when ``count`` exceeds them."""
    text = ', '.join(names)
    if count > len(names):
        text += ' and %d more' % (count - len(names))
    return text


def one_line(text: Any) -> str:
    """``text`` with every run of whitespace (newlines too) made one space."""
    return ' '.join(str(text).split())
