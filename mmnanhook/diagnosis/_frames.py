"""Python stack frames: which are user code, and where a fault is.

The location of a fault is the innermost frame of *user code*: outside
torch, mmnanhook and the standard library (and, for the line tracer, numpy
and mmengine as well, which make no NaN but run on every attribute access
of mmengine's data elements).
"""
from __future__ import annotations

import os
import re
import sysconfig
import traceback
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import mmengine
import numpy as np
import torch

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Frames in these directories are not "user code": the location of a fault
# is the innermost frame outside them.
_SKIP_DIRS = tuple(
    os.path.normcase(os.path.abspath(d)) + os.sep
    for d in (os.path.dirname(torch.__file__), _PACKAGE_DIR,
              sysconfig.get_paths()['stdlib']))

# Also not traced line by line: infrastructure that creates no NaN but runs
# on every attribute access of mmengine data elements, which would make
# tracing a detector's forward slow.
_NO_TRACE_DIRS = _SKIP_DIRS + tuple(
    os.path.normcase(os.path.dirname(os.path.abspath(m.__file__))) + os.sep
    for m in (np, mmengine))

_FRAME_RE = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]*)'
    r'(?:\n[ \t]+(?P<code>[^\n]*))?')
# Anomaly mode's warning when a node fails in backward (torch 1.7-2.13).


def _normpath(path):
    return os.path.normcase(os.path.abspath(path))


def is_user_file(path: str) -> bool:
    """Whether ``path`` is user code: not torch, mmnanhook or the stdlib.

    Args:
        path (str): A source file path as a traceback shows it.
    """
    path = _normpath(path)
    return not path.startswith(_SKIP_DIRS)


def _is_traced_file(path):
    path = _normpath(path)
    return not path.startswith(_NO_TRACE_DIRS)


def parse_frames(text: Union[str, Sequence[str]]
                 ) -> List[Tuple[str, int, str, str]]:
    """Frames ``(file, line, function, code)`` of a formatted traceback.

    Args:
        text (str | list[str]): Traceback text, or a list of frame strings as
            anomaly mode stores them in ``node.metadata['traceback_']``.
    """
    if isinstance(text, (list, tuple)):
        text = ''.join(text)
    return [(m.group('file'), int(m.group('line')), m.group('func').strip(),
             (m.group('code') or '').strip())
            for m in _FRAME_RE.finditer(text)]


def user_location(frames: Sequence[Tuple[str, int, str, str]]
                  ) -> Tuple[Optional[str], Optional[str]]:
    """``(location, code)`` of the innermost user-code frame.

    ``(None, None)`` when no frame is user code.

    Args:
        frames (list[tuple]): ``(file, line, function, code)`` tuples,
            outermost first.
    """
    for path, line, _, code in reversed(frames):
        if is_user_file(path):
            return '{}:{}'.format(path, line), code or None
    return None, None


def node_traceback(node: Any) -> Optional[str]:
    """Anomaly mode's forward traceback of an autograd node, or ``None``.

    Anomaly mode must have been on while the forward created the node.

    Args:
        node: An autograd node (``tensor.grad_fn``).
    """
    try:
        stack = node.metadata.get('traceback_')
    except (AttributeError, RuntimeError):
        return None
    if not stack:
        return None
    return ''.join(stack) if isinstance(stack, (list, tuple)) else str(stack)


def format_user_frames(frames: Iterable[Tuple[str, int, str, str]]
                       ) -> str:
    """Traceback text of the user-code frames among ``frames``.

    Args:
        frames (list[tuple]): ``(file, line, function, code)``, outermost
            first.
    """
    return ''.join('  File "{}", line {}, in {}\n    {}\n'.format(*frame)
                   for frame in frames if is_user_file(frame[0]))


def _stack_frames():
    """The current Python stack as ``(file, line, function, code)``."""
    return [(f.filename, f.lineno, f.name, (f.line or '').strip())
            for f in traceback.extract_stack()]
