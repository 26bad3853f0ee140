"""Forward instrumentation of a replay: modules, and lines of one call.

- :class:`ForwardWatch` wraps every module's ``forward`` (an instance
  attribute, so positional *and* keyword inputs are seen on every torch
  version; module hooks see no kwargs before torch 2.0) and finds the
  *producer*: the first module, by completion order, whose output is
  non-finite while its inputs were finite.  Children complete before their
  parents, so a parent that merely propagates is never blamed.  It can also
  map autograd nodes to the module whose forward created them.
- :class:`LineLocator` traces the Python lines of one module call and finds
  the first line after which a tensor is non-finite.

Each is a context manager that undoes everything it installed on exit, also
when the replay raises (fairseq's ``NanDetector`` style); all of it is too
slow for every iteration and runs only in the tier-2 replay.
"""
from __future__ import annotations

import linecache
import sys
import weakref
from collections import Counter
from typing import Any, Optional, Set, Tuple

import torch

from .._patch import set_attribute
from ._backward import _is_accumulate_grad
from ._frames import (_is_traced_file, _stack_frames, is_user_file,
                      node_traceback, parse_frames, user_location)
from .._tensors import iter_tensors
from ._tensors import (FiniteMemo, _grad_fn_name, _is_float,
                       count_nonfinite, max_abs)

def _patch_forward(module, make_wrapper):
    """Replace ``module.forward`` by ``make_wrapper(forward)``.

    Returns the function that undoes it.
    """
    return set_attribute(module, 'forward', make_wrapper(module.forward))


class _Patches(object):
    """Base of the context managers that patch module forwards."""

    def __init__(self) -> None:
        self._undo = []

    def _install(self):
        raise NotImplementedError

    def __enter__(self):
        try:
            self._install()
        except BaseException:
            self._remove()
            raise
        return self

    def _remove(self):
        while self._undo:
            self._undo.pop()()

    def __exit__(self, *exc_info):
        self._remove()
        return False


def _is_strict_descendant(owner, name):
    return name == '' or owner.startswith(name + '.')


class ForwardWatch(_Patches):
    """Watch every module call of a model during a replay's forward.

    Args:
        model (nn.Module): The (unwrapped) model; all its modules, itself
            included, are watched.
        claim_nodes (bool): Record which module's forward created each
            autograd node (for :meth:`owner`).  Nodes created outside every
            module (e.g. in ``parse_losses``) have no owner.
        range_limit (float, optional): Also find the first module whose
            output exceeds this absolute value while its inputs did not
            (e.g. 65504 for float16).

    Attributes:
        producer (dict | None): The first module call whose output is
            non-finite while its inputs were finite: ``module`` (dotted name,
            ``''`` for the model itself), ``call`` (0-based index among that
            module's calls), ``nan``, ``inf``, ``op`` (the ``grad_fn`` of the
            non-finite output) and ``frames`` (the Python stack of that call,
            ``(file, line, function, code)``, outermost first).
        over_range (dict | None): ``module``, ``call`` and ``max_abs`` of the
            first module call exceeding ``range_limit``.
        failed (str | None): The innermost module whose forward raised.
        finite_calls (set): ``(module, call)`` of the calls whose inputs
            and outputs were seen finite before the producer was found
            (:class:`LineLocator` need not trace inside them).
    """

    def __init__(self, model: torch.nn.Module, claim_nodes: bool = False,
                 range_limit: Optional[float] = None) -> None:
        super(ForwardWatch, self).__init__()
        self.model = model
        self.claim_nodes = claim_nodes
        self.range_limit = range_limit
        self.producer = None
        self.over_range = None
        self.failed = None
        self.finite_calls = set()
        self._finite = FiniteMemo()
        self._calls = Counter()
        self._owner = {}

    def owner(self, node: Any) -> Optional[str]:
        """Dotted name of the module whose forward created ``node``, or None.

        Args:
            node: An autograd node.
        """
        return self._owner.get(node)

    def find_owner(self, op: str,
                   location: Optional[str]) -> Optional[str]:
        """Owner of the node named ``op`` created at ``location``, or None.

        For a node known only by name and anomaly traceback, e.g. the one an
        exception in backward names.

        Args:
            op (str): Node name, e.g. ``MulBackward0``.
            location (str): ``file:line`` of its user-code frame.
        """
        for node, name in self._owner.items():
            if node.name() == op:
                stack = node_traceback(node)
                if stack and user_location(parse_frames(stack))[0] == location:
                    return name
        return None

    def _install(self):
        for name, module in self.model.named_modules():
            self._undo.append(_patch_forward(module, self._make_wrapper(name)))

    def _make_wrapper(self, name):

        def make(forward):

            def watched_forward(*args, **kwargs):
                return self._call(name, forward, args, kwargs)

            return watched_forward

        return make

    def _call(self, name, forward, args, kwargs):
        call = self._calls[name]
        self._calls[name] += 1
        inputs = list(iter_tensors((args, kwargs)))
        look_nonfinite = (self.producer is None
                          and self._finite.first_nonfinite(inputs) is None)
        look_range = (self.range_limit is not None
                      and self.over_range is None
                      and max_abs(inputs) <= self.range_limit)
        stops = None
        if self.claim_nodes:
            stops = set(t.grad_fn for t in inputs if t.grad_fn is not None)
        try:
            output = forward(*args, **kwargs)
        except BaseException:
            # Modules complete innermost first, so the first to see it is
            # the one that raised.
            if self.failed is None:
                self.failed = name
            raise
        if not (look_nonfinite or look_range or self.claim_nodes):
            return output
        outputs = list(iter_tensors(output))
        # Children ran inside this call and may have found one first.
        if look_nonfinite and self.producer is None:
            bad = self._finite.first_nonfinite(outputs)
            if bad is not None:
                self.producer = dict(module=name, call=call,
                                     op=_grad_fn_name(bad),
                                     frames=_stack_frames(),
                                     **count_nonfinite(bad))
            else:
                self.finite_calls.add((name, call))
        if look_range and self.over_range is None:
            peak = max_abs(outputs)
            if peak > self.range_limit:
                self.over_range = dict(module=name, call=call, max_abs=peak)
        if self.claim_nodes:
            self._claim(name, outputs, stops)
        return output

    def _claim(self, name, outputs, stops):
        """Own the nodes between this call's outputs and its inputs.

        Walks back from the outputs; nodes already owned by a submodule are
        crossed (this call's own nodes may lie behind them), nodes owned by
        anything else, and the inputs' nodes, end the walk.
        """
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        seen = set()
        while stack:
            node = stack.pop()
            if (node is None or node in seen or node in stops
                    or _is_accumulate_grad(node)):
                continue
            seen.add(node)
            owner = self._owner.get(node)
            if owner is None:
                self._owner[node] = name
            elif not _is_strict_descendant(owner, name):
                continue
            stack.extend(next_node for next_node, _ in node.next_functions)


class LineLocator(_Patches):
    """Find the first source line in one module call that makes a NaN/Inf.

    During the ``call``-th call of ``module`` every Python line outside
    torch, numpy, mmengine, mmnanhook and the stdlib is traced; after each
    line the frame's local tensors are checked (each tensor once per
    version).  The first non-finite one blames the line that made it.  A
    non-finite argument of a traced function blames the caller's line.

    Tracing every line of a large call (the whole model, when its loss
    dict is what turns non-finite) costs far more than the forward itself:
    inside the calls of submodules that are known finite (``quiet``, from
    :attr:`ForwardWatch.finite_calls`) nothing is traced.

    Args:
        module (nn.Module): The producer module.
        call (int): Which of its calls (0-based) to trace.
        name (str): The producer's dotted name in the model (``''``: the
            model itself), as ``quiet`` names modules.
        quiet (set, optional): ``(module, call)`` of the submodule calls
            not to trace inside.

    Attributes:
        found (dict | None): ``location`` (``file:line``), ``code`` (the
            source line) and ``op`` (the ``grad_fn`` of the tensor, if any).
    """

    def __init__(self, module: torch.nn.Module, call: int, name: str = '',
                 quiet: Optional[Set[Tuple[str, int]]] = None) -> None:
        super(LineLocator, self).__init__()
        self.module = module
        self.call = call
        self.name = name
        self.quiet = quiet or set()
        self.found = None
        self._calls = 0
        self._sub_calls = Counter()
        self._checked = {}
        self._last_line = {}

    def _install(self):
        self._undo.append(_patch_forward(self.module, self._make_wrapper))
        if not self.quiet:
            return
        for sub, module in self.module.named_modules():
            if sub:
                full = '{}.{}'.format(self.name, sub) if self.name else sub
                self._undo.append(_patch_forward(module,
                                                 self._make_quiet(full)))

    def _make_quiet(self, name):

        def make(forward):

            def quiet_forward(*args, **kwargs):
                call = self._sub_calls[name]
                self._sub_calls[name] += 1
                previous = sys.gettrace()
                if previous is None or (name, call) not in self.quiet:
                    return forward(*args, **kwargs)
                sys.settrace(None)
                try:
                    return forward(*args, **kwargs)
                finally:
                    sys.settrace(previous)

            return quiet_forward

        return make

    def _make_wrapper(self, forward):

        def located_forward(*args, **kwargs):
            call = self._calls
            self._calls += 1
            if call != self.call or self.found is not None:
                return forward(*args, **kwargs)
            previous = sys.gettrace()
            sys.settrace(self._trace_call)
            try:
                return forward(*args, **kwargs)
            finally:
                sys.settrace(previous)
                self._last_line.clear()

        return located_forward

    def _scan(self, values):
        """The first not yet seen non-finite tensor in ``values``."""
        for value in values:
            for tensor in iter_tensors(value):
                if not _is_float(tensor):
                    continue
                # The weak reference tells a checked tensor from a new one
                # that reuses its id; the version, an in-place change.
                seen = self._checked.get(id(tensor))
                if (seen is not None and seen[0]() is tensor
                        and seen[1] == tensor._version):
                    continue
                self._checked[id(tensor)] = (weakref.ref(tensor),
                                             tensor._version)
                if not bool(torch.isfinite(tensor.detach()).all()):
                    return tensor
        return None

    def _blame(self, frame, line, tensor):
        path = frame.f_code.co_filename
        code = linecache.getline(path, line).strip() or None
        self.found = dict(location='{}:{}'.format(path, line), code=code,
                          op=_grad_fn_name(tensor))

    def _trace_call(self, frame, event, arg):
        if self.found is not None or event != 'call':
            return None
        if not _is_traced_file(frame.f_code.co_filename):
            return None
        bad = self._scan(frame.f_locals.values())
        if bad is not None:
            caller = frame.f_back
            while (caller is not None
                   and not is_user_file(caller.f_code.co_filename)):
                caller = caller.f_back
            if caller is not None:
                self._blame(caller, caller.f_lineno, bad)
            return None
        self._last_line[frame] = frame.f_lineno
        return self._trace_line

    def _trace_line(self, frame, event, arg):
        if self.found is not None:
            return None
        if event == 'line':
            bad = self._scan(frame.f_locals.values())
            if bad is not None:
                line = self._last_line.get(frame, frame.f_lineno)
                self._blame(frame, line, bad)
                return None
            self._last_line[frame] = frame.f_lineno
        elif event == 'return':
            bad = self._scan(list(frame.f_locals.values()) + [arg])
            if bad is not None:
                self._blame(frame, frame.f_lineno, bad)
            self._last_line.pop(frame, None)
        return self._trace_line
