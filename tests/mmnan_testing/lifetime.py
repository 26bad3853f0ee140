"""What outlives a diagnosis: hooks left on modules, graphs still reachable.

Helpers for tests that inspect what is reachable instead of timing exits.
"""
import gc
import os.path as osp
import types
from collections import deque

import torch

import mmnanhook

# mmnanhook's own code (the test beds are not in it).
_PACKAGE = osp.dirname(osp.abspath(mmnanhook.__file__)) + osp.sep


def is_graph_object(obj):
    """A tensor with a ``grad_fn``, or an autograd node."""
    if torch.is_tensor(obj):
        return obj.grad_fn is not None
    return hasattr(type(obj), 'next_functions')


def reachable_graph(roots, frames='ours', limit=500000):
    """Graph objects reachable from ``roots``, each with the path to it.

    Args:
        roots (list): Where to start.
        frames (str): ``'ours'``: enter only frames of mmnanhook code (the
            caller's own frames, e.g. the train step's, hold its training
            graph, which is not ours); ``'all'``: every frame.
        limit (int): Objects visited at most.

    Returns:
        list[tuple]: ``(object, 'Type <- ... <- root')`` per object found.

    Raises:
        RuntimeError: The walk reached ``limit`` before it saw everything:
            an answer of "nothing found" would not be one.
    """
    parent = {}
    objects = {}
    queue = deque()
    for root in roots:
        parent[id(root)] = None
        objects[id(root)] = root
        queue.append(root)
    found = []
    while queue and len(parent) < limit:
        obj = queue.popleft()
        if isinstance(obj, (type, types.ModuleType)):
            continue
        if isinstance(obj, types.FrameType):
            ours = osp.abspath(obj.f_code.co_filename).startswith(_PACKAGE)
            if frames != 'all' and not ours:
                refs = [obj.f_back] if obj.f_back is not None else []
            else:
                refs = list(obj.f_locals.values()) + [obj.f_back]
        else:
            refs = gc.get_referents(obj)
        for ref in refs:
            if ref is None or id(ref) in parent:
                continue
            parent[id(ref)] = id(obj)
            objects[id(ref)] = ref
            if is_graph_object(ref):
                found.append((ref, _path(ref, parent, objects)))
                continue
            queue.append(ref)
    if queue:
        raise RuntimeError(
            'reachable_graph stopped at its limit of %d objects with %d left '
            'to visit: raise the limit' % (limit, len(queue)))
    return found


def _path(obj, parent, objects):
    names = []
    key = id(obj)
    while key is not None:
        item = objects[key]
        name = type(item).__name__
        if isinstance(item, types.FrameType):
            name += '(%s)' % item.f_code.co_name
        names.append(name)
        key = parent[key]
    return ' <- '.join(names)


def module_hooks(model):
    """Hooks and patched methods left on a model's modules and parameters.

    Returns:
        list[str]: ``'<module name>: <what>'`` for each one found.
    """
    left = []
    for name, module in model.named_modules():
        for attr in ('_forward_hooks', '_forward_pre_hooks',
                     '_backward_hooks'):
            if getattr(module, attr, None):
                left.append('%s: %s' % (name, attr))
        if 'forward' in vars(module):
            left.append('%s: forward patched on the instance' % name)
    for name, param in model.named_parameters():
        if getattr(param, '_backward_hooks', None):
            left.append('%s: tensor hooks' % name)
    return left


def live_graph_ids():
    """Ids of every tensor with a ``grad_fn`` alive in the process."""
    gc.collect()
    return set(id(o) for o in gc.get_objects()
               if torch.is_tensor(o) and o.grad_fn is not None)


def bindings_left(optim_wrapper):
    """Methods of mmnanhook still bound on an optim wrapper instance."""
    left = []
    for name, value in vars(optim_wrapper).items():
        func = getattr(value, '__func__', value)
        if callable(func) and getattr(func, '__qualname__', '').startswith(
                'mmnanhook.'):
            left.append(name)
    return left
