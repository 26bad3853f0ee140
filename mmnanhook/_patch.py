"""Instance attributes set for a while (a module's ``forward``, a model's
``train_step``, a transform's ``get_indexes``) and put back as they were."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator


def set_attribute(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``obj.<name>`` as an instance attribute.

    Returns:
        callable: Puts back what the instance had: its own attribute, or
        none (the class's shows again). The class is never touched.
    """
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, value)

    def undo():
        if had:
            setattr(obj, name, old)
        else:
            vars(obj).pop(name, None)

    return undo


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.<name>`` is ``value`` while the block runs
    (:func:`set_attribute`)."""
    undo = set_attribute(obj, name, value)
    try:
        yield
    finally:
        undo()
