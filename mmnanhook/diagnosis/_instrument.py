"""Instrumentation for replaying one bad iteration: forward, backward, lines.

Each tool is a context manager that undoes everything it installed on exit,
also when the replay raises (fairseq's ``NanDetector`` style), so a
diagnosis never leaves patched modules, autograd hooks, anomaly mode or a
tracer behind.  All of it is too slow for every iteration; it runs only in
the tier-2 replay.

- :class:`ForwardWatch` wraps every module's ``forward`` (an instance
  attribute, so positional *and* keyword inputs are seen on every torch
  version; module hooks see no kwargs before torch 2.0) and finds the
  *producer*: the first module, by completion order, whose output is
  non-finite while its inputs were finite.  Children complete before their
  parents, so a parent that merely propagates is never blamed.  It can also
  map autograd nodes to the module whose forward created them.
- :class:`BackwardWatch` hooks every autograd node of a loss and finds the
  first node, in backward execution order, that produces NaN **or Inf**
  from finite incoming gradients (anomaly mode checks NaN only).
- :class:`LineLocator` traces the Python lines of one module call and finds
  the first line after which a tensor is non-finite.
- :func:`anomaly_mode` turns anomaly mode on for forward and backward and
  records its forward tracebacks instead of leaving them as warnings.
"""
import contextlib
import linecache
import os
import re
import sys
import sysconfig
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Mapping

import mmengine
import numpy as np
import torch

from .. import compat
from ..sentinel import capture_rng, restore_rng

# Frames in these directories are not "user code": the location of a fault
# is the innermost frame outside them.
_SKIP_DIRS = tuple(
    os.path.normcase(os.path.abspath(d)) + os.sep
    for d in (os.path.dirname(torch.__file__), os.path.dirname(__file__),
              sysconfig.get_paths()['stdlib']))

# Also not traced line by line: infrastructure that creates no NaN but runs
# on every attribute access of mmengine data elements, which would make
# tracing a detector's forward slow.
_NO_TRACE_DIRS = _SKIP_DIRS + tuple(
    os.path.normcase(os.path.dirname(os.path.abspath(m.__file__))) + os.sep
    for m in (np, mmengine))

# Except the test fixtures: their planted faults stand for user code.
_FIXTURE_DIR = os.path.join(_SKIP_DIRS[1], 'testing') + os.sep

_FRAME_RE = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]*)'
    r'(?:\n[ \t]+(?P<code>[^\n]*))?')
# Anomaly mode's warning when a node fails in backward (torch 1.7-2.13).
_ANOMALY_PREFIX = 'Error detected in '
_ANOMALY_NODE_RE = re.compile(r'Error detected in (\S+?)\.')

# Nesting that real model outputs reach (data sample -> instances -> boxes
# -> tensor is 4); the limit only guards against self-referencing objects.
_MAX_DEPTH = 8


def iter_tensors(obj, _depth=0):
    """Yield the tensors inside ``obj``.

    Looks into mappings, lists, tuples, mmengine data elements (their data
    fields) and box structures (their ``tensor``).

    Args:
        obj: Anything a module takes or returns.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if _depth >= _MAX_DEPTH:
        return
    # Attributes are looked up on the class or in __dict__ only: objects
    # found among a frame's locals may have a __getattr__ that raises.
    attrs = getattr(obj, '__dict__', None)
    if isinstance(obj, Mapping):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif callable(getattr(type(obj), 'all_values', None)):
        children = obj.values()  # an mmengine data element's data fields
    elif (isinstance(attrs, dict)
          and isinstance(attrs.get('tensor'), torch.Tensor)):
        children = (attrs['tensor'], )  # an mmdet/mmrotate box structure
    else:
        return
    for child in children:
        for tensor in iter_tensors(child, _depth + 1):
            yield tensor


def _is_float(tensor):
    return (tensor.is_floating_point() and not tensor.is_sparse
            and tensor.numel() > 0)


def first_nonfinite(tensors):
    """The first floating-point tensor holding NaN or Inf, else ``None``.

    Args:
        tensors (Iterable[Tensor | None]): Tensors to check.
    """
    for tensor in tensors:
        if (tensor is not None and _is_float(tensor)
                and not bool(torch.isfinite(tensor.detach()).all())):
            return tensor
    return None


def max_abs(tensors):
    """Largest absolute value over floating-point ``tensors`` (0.0 if none).

    Args:
        tensors (Iterable[Tensor]): Tensors to check.
    """
    best = 0.0
    for tensor in tensors:
        if _is_float(tensor):
            best = max(best, float(tensor.detach().abs().max()))
    return best


def count_nonfinite(tensor):
    """``{'nan': n, 'inf': m}`` counts of a tensor.

    Args:
        tensor (Tensor): A floating-point tensor.
    """
    tensor = tensor.detach()
    return {'nan': int(torch.isnan(tensor).sum()),
            'inf': int(torch.isinf(tensor).sum())}


def _grad_fn_name(tensor):
    fn = getattr(tensor, 'grad_fn', None)
    return fn.name() if fn is not None else None


def _normpath(path):
    return os.path.normcase(os.path.abspath(path))


def is_user_file(path):
    """Whether ``path`` is user code: not torch, mmnanhook or the stdlib.

    Args:
        path (str): A source file path as a traceback shows it.
    """
    path = _normpath(path)
    return path.startswith(_FIXTURE_DIR) or not path.startswith(_SKIP_DIRS)


def _is_traced_file(path):
    path = _normpath(path)
    return path.startswith(_FIXTURE_DIR) or not path.startswith(
        _NO_TRACE_DIRS)


def parse_frames(text):
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


def user_location(frames):
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


def node_traceback(node):
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


def format_user_frames(frames):
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


class AnomalyRecord(object):
    """Anomaly-mode forward tracebacks captured by :func:`anomaly_mode`.

    Attributes:
        messages (list[str]): The text of each anomaly warning
            (``Error detected in X. Traceback of forward call ...``, or
            ``... No forward pass information available`` for a node
            created while anomaly mode was off).
    """

    def __init__(self):
        self.messages = []

    @property
    def node(self):
        """Name of the node anomaly mode reported (the last one), or None."""
        for message in reversed(self.messages):
            match = _ANOMALY_NODE_RE.search(message)
            if match:
                return match.group(1)
        return None

    @property
    def frames(self):
        """Frames of the last reported forward traceback."""
        return parse_frames(self.messages[-1]) if self.messages else []


@contextlib.contextmanager
def anomaly_mode():
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
    record = AnomalyRecord()
    catcher = warnings.catch_warnings(record=True)
    caught = catcher.__enter__()
    try:
        warnings.simplefilter('always')
        compat.set_detect_anomaly(True, check_nan=False)
        yield record
    finally:
        compat.restore_anomaly(state)
        catcher.__exit__(None, None, None)
        others = []
        for warning in caught:
            text = str(warning.message)
            if text.startswith(_ANOMALY_PREFIX):
                record.messages.append(text)
            else:
                key = (text, warning.category, warning.filename,
                       warning.lineno)
                if key not in others:
                    others.append(key)
        for text, category, filename, lineno in others:
            warnings.warn_explicit(text, category, filename, lineno)


def _patch_forward(module, make_wrapper):
    """Replace ``module.forward`` by ``make_wrapper(forward)``.

    Returns the function that undoes it.
    """
    had_own = 'forward' in module.__dict__
    own = module.__dict__.get('forward')
    module.forward = make_wrapper(module.forward)

    def undo():
        if had_own:
            module.forward = own
        else:
            del module.forward

    return undo


class _Patches(object):
    """Base of the context managers that patch module forwards."""

    def __init__(self):
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


def _is_accumulate_grad(node):
    # AccumulateGrad nodes are parameters' leaves: they produce no gradient
    # and belong to no forward call.
    return hasattr(node, 'variable')


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
    """

    def __init__(self, model, claim_nodes=False, range_limit=None):
        super(ForwardWatch, self).__init__()
        self.model = model
        self.claim_nodes = claim_nodes
        self.range_limit = range_limit
        self.producer = None
        self.over_range = None
        self.failed = None
        self._calls = Counter()
        self._owner = {}

    def owner(self, node):
        """Dotted name of the module whose forward created ``node``, or None.

        Args:
            node: An autograd node.
        """
        return self._owner.get(node)

    def find_owner(self, op, location):
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
                          and first_nonfinite(inputs) is None)
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
            bad = first_nonfinite(outputs)
            if bad is not None:
                self.producer = dict(module=name, call=call,
                                     op=_grad_fn_name(bad),
                                     frames=_stack_frames(),
                                     **count_nonfinite(bad))
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


def graph_nodes(roots):
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

    def __init__(self, roots):
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


class LineLocator(_Patches):
    """Find the first source line in one module call that makes a NaN/Inf.

    During the ``call``-th call of ``module`` every Python line outside
    torch, numpy, mmengine, mmnanhook and the stdlib is traced; after each
    line the frame's local tensors are checked (each tensor once per
    version).  The first non-finite one blames the line that made it.  A
    non-finite argument of a traced function blames the caller's line.

    Args:
        module (nn.Module): The producer module.
        call (int): Which of its calls (0-based) to trace.

    Attributes:
        found (dict | None): ``location`` (``file:line``), ``code`` (the
            source line) and ``op`` (the ``grad_fn`` of the tensor, if any).
    """

    def __init__(self, module, call):
        super(LineLocator, self).__init__()
        self.module = module
        self.call = call
        self.found = None
        self._calls = 0
        self._checked = {}
        self._last_line = {}

    def _install(self):
        self._undo.append(_patch_forward(self.module, self._make_wrapper))

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


@contextlib.contextmanager
def preserved_rng():
    """Put every RNG (torch CPU and CUDA, numpy, python) back on exit."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)


class PreservedModelState(object):
    """Keep a model's gradients and buffers as they were before replays.

    Parameters are never written by a replay (there is no optimizer step);
    gradients and buffers (BN running statistics, counters) are.  On exit
    every parameter gets its original ``.grad`` object back and every
    buffer its original tensor and values.

    Args:
        model (nn.Module): The model to protect.
    """

    def __init__(self, model):
        self.model = model
        self._grads = None
        self._buffers = None

    def __enter__(self):
        self._grads = [(p, p.grad) for p in self.model.parameters()]
        self._buffers = []
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    self._buffers.append(
                        (module, name, buf, buf.detach().clone()))
        return self

    def reset(self):
        """Gradients to ``None`` and buffers to their saved values."""
        for param, _ in self._grads:
            param.grad = None
        with torch.no_grad():
            for module, name, buf, saved in self._buffers:
                module._buffers[name] = buf
                buf.copy_(saved)

    def __exit__(self, *exc_info):
        self.reset()
        for param, grad in self._grads:
            param.grad = grad
        return False
