"""Backward instrumentation: anomaly mode, and a hook on every graph node.

- :func:`anomaly_mode` turns anomaly mode on for forward and backward and
  records its forward tracebacks instead of leaving them as warnings.
- :class:`BackwardWatch` hooks every autograd node of a loss and finds the
  first node, in backward execution order, that produces NaN **or Inf**
  from finite incoming gradients (anomaly mode checks NaN only).

Both undo what they installed on exit, also when the replay raises.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterable, Iterator, List, Optional, Set, Tuple

from .. import compat
from .._anomaly import AnomalyMessages, capture_anomaly_warnings
from ._frames import parse_frames
from ._tensors import count_nonfinite, first_nonfinite

_ANOMALY_NODE_RE = re.compile(r'Error detected in (\S+?)\.')


class AnomalyRecord(AnomalyMessages):
    """Anomaly-mode forward tracebacks captured by :func:`anomaly_mode`.

    Attributes:
        messages (list[str]): The text of each anomaly warning
            (``Error detected in X. Traceback of forward call ...``, or
            ``... No forward pass information available`` for a node
            created while anomaly mode was off).
    """

    @property
    def node(self) -> Optional[str]:
        """Name of the node anomaly mode reported (the last one), or None."""
        for message in reversed(self.messages):
            match = _ANOMALY_NODE_RE.search(message)
            if match:
                return match.group(1)
        return None

    @property
    def frames(self) -> List[Tuple[str, int, str, str]]:
        """Frames of the last reported forward traceback."""
        return parse_frames(self.messages[-1]) if self.messages else []


@contextlib.contextmanager
def anomaly_mode() -> Iterator[AnomalyRecord]:
    """Anomaly mode on for the block; its warnings captured, not emitted.

    Where torch allows it (>= 1.13) the NaN check is off:
    :class:`BackwardWatch` finds non-finite gradients itself, and backward
    should run to the end.  Older torch always checks (see
    :func:`mmnanhook._anomaly.is_anomaly_nan_error`); the node hooks have run
    by the time it raises.  Other warnings raised in the block are
    re-emitted once each on exit.

    Yields:
        AnomalyRecord: Filled with the anomaly messages when the block exits.
    """
    state = compat.anomaly_state()
    with capture_anomaly_warnings(AnomalyRecord()) as record:
        compat.set_detect_anomaly(True, check_nan=False)
        try:
            yield record
        finally:
            compat.restore_anomaly(state)


def _is_accumulate_grad(node):
    # AccumulateGrad nodes are parameters' leaves: they produce no gradient
    # and belong to no forward call.
    return hasattr(node, 'variable')


def graph_nodes(roots: Iterable[Any]) -> Set[Any]:
    """All autograd nodes reachable from the ``grad_fn`` of ``roots``.

    Args:
        roots (Iterable[Tensor]): Output tensors (e.g. the loss).
    """
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return seen


class BackwardWatch(object):
    """Find the first autograd node that produces NaN or Inf gradients.

    A post-hook on every node of the graph (``Node.register_hook``, present
    in torch 1.7) sees the gradients each node produced and the ones it
    received, in backward execution order.

    Args:
        roots (Iterable[Tensor]): Tensors ``backward()`` will start from.

    Attributes:
        producer (dict | None): The first node that produced a non-finite
            gradient from finite incoming gradients: ``node``, ``op``
            (``node.name()``, e.g. ``SqrtBackward0``; ``SqrtBackward`` on
            torch 1.7), ``nan``, ``inf``.
        first (dict | None): The first node that produced a non-finite
            gradient at all (same keys).
    """

    def __init__(self, roots: Iterable[Any]) -> None:
        self.roots = list(roots)
        self.producer = None
        self.first = None
        self._handles = []

    def __enter__(self):
        try:
            for node in graph_nodes(self.roots):
                if not _is_accumulate_grad(node):
                    self._handles.append(
                        node.register_hook(self._make_hook(node)))
        except BaseException:
            self._remove()
            raise
        return self

    def _remove(self):
        while self._handles:
            self._handles.pop().remove()

    def __exit__(self, *exc_info):
        self._remove()
        return False

    def _make_hook(self, node):

        def hook(grad_inputs, grad_outputs):
            if self.producer is not None:
                return
            bad = first_nonfinite(grad_inputs)
            if bad is None:
                return
            record = dict(node=node, op=node.name(), **count_nonfinite(bad))
            if self.first is None:
                self.first = record
            if first_nonfinite(grad_outputs) is None:
                self.producer = record

        return hook
