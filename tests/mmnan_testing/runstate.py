"""A picture of everything a replay could change in a run, to compare.

:func:`take` takes it from a runner, :func:`diff` tells two apart. Written
for the tests and independently of mmnanhook's own restorer
(``mmnanhook.diagnosis``), so that it can catch what the restorer misses:
it reads the runner as it is, not what mmnanhook chose to save.

What the picture holds (each part a key of the dict :func:`take` returns):

* ``params``, ``buffers``, ``grads``: every parameter, buffer and gradient
  of the model (the wrapper's module), bitwise (dtype, shape and a digest
  of the bytes); ``param_ids``: which Parameter object each name is (an
  optimizer steps the objects it was given);
* ``optimizer``: the optim wrapper's ``state_dict()`` (the optimizer's
  state tensors bitwise, its ``param_groups``; an AMP wrapper's loss scaler)
  and the wrapper's own attributes (accumulation counters);
* ``schedulers``: each parameter scheduler's ``state_dict()``;
* ``rng``: torch's CPU generator, numpy's and Python's ``random``; every
  CUDA device's when CUDA is initialised;
* ``modules``: the Python attributes of every module of the model, the DDP
  wrapper, the data preprocessor and its ``batch_augments`` included
  (``vars(m)`` less ``_parameters``, ``_buffers``, ``_modules``; torch's
  hook dicts by their keys, so that a hook left behind shows);
* ``hooks``: the attributes of the runner's hooks that are not mmnanhook's
  (EMA models in full, the mode switches' flags);
* ``message_hub``: ``runtime_info``; ``log_scalars``: every scalar's
  history (what a diagnosis may log there is reported, not excluded);
* ``data``: the train dataloader's sampler and batch sampler, the
  dataset's attributes and its pipeline transforms' ``__dict__``
  (``CachedMosaic``'s cache), wrappers' inner datasets included, and the
  loader's iterator counters;
* ``process``: anomaly and grad mode, threads, default dtype, cuDNN
  flags, the loggers' levels, and which function object each collective of
  ``torch.distributed``, ``mmengine.dist`` and mmdet's helpers is (a
  replay that answers collectives on one rank must put them back).

Values are pictured by kind: plain values by value, containers
recursively, tensors and arrays by dtype, shape and digest, other objects
by their type and a picture of their ``__dict__`` to :data:`DEPTH` levels,
and by identity where that is all that can be said (a C++ object, a
generator, a lock).
"""
import hashlib
import math
import random
import types

import numpy as np
import torch

# Levels of __dict__ followed into objects that are neither containers nor
# tensors, from the attribute that holds them.
DEPTH = 3
# Container entries pictured one by one; longer ones by a digest of their
# pictures' text (the comparison stays exact, the difference less readable).
WIDE = 256

# torch's hook dicts of a Module: pictured by their keys only.
_HOOK_DICTS = frozenset((
    '_forward_hooks', '_forward_pre_hooks', '_backward_hooks',
    '_backward_pre_hooks', '_state_dict_hooks', '_state_dict_pre_hooks',
    '_load_state_dict_pre_hooks', '_load_state_dict_post_hooks',
    '_forward_hooks_with_kwargs', '_forward_hooks_always_called',
    '_forward_pre_hooks_with_kwargs'))
_SKIPPED = frozenset(('_parameters', '_buffers', '_modules'))
# The key that holds the order of an ordered mapping's keys.
_ORDER = '<order>'


class Leaf(tuple):
    """A value compared as a whole: ``(kind, ...)``."""

    def __repr__(self):
        return '<%s>' % ' '.join(str(v) for v in self)


def _digest(data):
    return hashlib.sha1(data).hexdigest()[:16]


def _tensor_bytes(tensor):
    tensor = tensor.detach()
    if tensor.is_sparse:
        tensor = tensor.coalesce()
        return (_tensor_bytes(tensor.indices()) +
                _tensor_bytes(tensor.values()))
    tensor = tensor.cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        # numpy has no bfloat16; the float32 copy is exact.
        tensor = tensor.float()
    return tensor.numpy().tobytes()


def tensor_leaf(tensor):
    """``('tensor', dtype, shape, digest)``; a Parameter says so."""
    kind = 'parameter' if isinstance(tensor, torch.nn.Parameter) else \
        'tensor'
    return Leaf((kind, str(tensor.dtype).replace('torch.', ''),
                 tuple(tensor.shape), _digest(_tensor_bytes(tensor))))


def _qualname(kind):
    return '%s.%s' % (getattr(kind, '__module__', '?'),
                      getattr(kind, '__qualname__', kind.__name__))


def _identity(value):
    return Leaf(('id', _qualname(type(value)), id(value)))


def _float(value):
    # NaN equals itself here; -0.0 and 0.0 differ (bitwise).
    return Leaf(('float', repr(float(value)))) if (
        math.isnan(value) or value == 0) else float(value)


def picture(value, depth=DEPTH, path=()):
    """A comparable picture of ``value`` (see the module docstring).

    Args:
        value: Anything.
        depth (int): Levels of object ``__dict__`` still followed.
        path (tuple): ids of the containers and objects above (cycles).
    """
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return value
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, torch.Tensor):
        return tensor_leaf(value)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return ['ndarray(object)', picture(value.tolist(), depth, path)]
        return Leaf(('ndarray', str(value.dtype), value.shape,
                     _digest(np.ascontiguousarray(value).tobytes())))
    if isinstance(value, np.generic):
        return picture(value.item(), depth, path)
    if isinstance(value, (torch.dtype, torch.device, torch.Size, complex,
                          range, slice)):
        return Leaf((type(value).__name__, str(value)))
    if isinstance(value, type):
        return Leaf(('class', _qualname(value)))
    if isinstance(value, types.ModuleType):
        return Leaf(('module', value.__name__))
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return Leaf(('function', _qualname(value), id(value)))
    if isinstance(value, types.MethodType):
        return Leaf(('method', _qualname(value.__func__),
                     id(value.__self__)))
    if id(value) in path:
        return Leaf(('cycle', _qualname(type(value))))
    path = path + (id(value), )
    if isinstance(value, dict):
        items = [(_key(k), picture(v, depth, path))
                 for k, v in value.items()]
        if len(items) > WIDE:
            return Leaf(('dict', len(items), _digest(repr(items).encode())))
        # Insertion order is part of a dict's state (an OrderedDict's).
        return dict(items, **{_ORDER: Leaf(('keys', tuple(
            k for k, _ in items)))}) if type(value) is not dict else \
            dict(items)
    if isinstance(value, (list, tuple)):
        items = [picture(v, depth, path) for v in value]
        if len(items) > WIDE:
            return Leaf((type(value).__name__, len(items),
                         _digest(repr(items).encode())))
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, (set, frozenset)):
        return Leaf(('set', tuple(sorted(repr(picture(v, 0, path))
                                         for v in value))))
    if isinstance(value, torch.nn.Module):
        # A module held as an attribute: its own picture is where it
        # belongs (the model's, a hook's EMA model); here, which one.
        return _identity(value)
    attrs = getattr(value, '__dict__', None)
    if depth <= 0 or not isinstance(attrs, dict):
        return _identity(value)
    return {'<type>': Leaf(('type', _qualname(type(value)))),
            '<attrs>': picture(dict(attrs), depth - 1, path)}


def _key(key):
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    return repr(picture(key, 0))


def module_attrs(module):
    """The picture of a module's Python attributes (hook dicts by keys)."""
    attrs = {}
    for name, value in vars(module).items():
        if name in _SKIPPED:
            continue
        if name in _HOOK_DICTS and isinstance(value, dict):
            attrs[name] = Leaf(('hooks', tuple(value.keys())))
            continue
        attrs[name] = picture(value)
    return attrs


def _modules(root, skip=()):
    return dict((name or '<root>', module_attrs(m))
                for name, m in root.named_modules() if m not in skip)


def _unwrap(model):
    return getattr(model, 'module', model) if hasattr(
        model, 'module') and isinstance(model.module, torch.nn.Module) \
        else model


def _tensors(module):
    return dict(
        params=dict((n, tensor_leaf(p))
                    for n, p in module.named_parameters()),
        param_ids=dict((n, id(p)) for n, p in module.named_parameters()),
        buffers=dict((n, tensor_leaf(b)) for n, b in module.named_buffers()),
        grads=dict((n, None if p.grad is None else tensor_leaf(p.grad))
                   for n, p in module.named_parameters()))


def _rng():
    state = dict(torch=tensor_leaf(torch.get_rng_state()),
                 numpy=picture(np.random.get_state()),
                 python=picture(random.getstate()))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = [tensor_leaf(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _optimizer(runner):
    wrapper = getattr(runner, 'optim_wrapper', None)
    if wrapper is None:
        return None
    attrs = dict((k, v) for k, v in vars(wrapper).items()
                 if k not in ('optimizer', 'message_hub'))
    return dict(state_dict=picture(wrapper.state_dict(), DEPTH + 2),
                attrs=picture(attrs, 1))


def _schedulers(runner):
    schedulers = getattr(runner, 'param_schedulers', None)
    if not schedulers:
        return None
    if isinstance(schedulers, dict):
        return dict((k, [picture(s.state_dict()) for s in v])
                    for k, v in schedulers.items())
    return [picture(s.state_dict()) for s in schedulers]


def _is_ours(hook):
    module = type(hook).__module__
    return module.startswith('mmnanhook') or module.startswith(
        'mmnan_testing')


def _hooks(runner):
    found = {}
    # The model itself is pictured once, under its own parts.
    model = (runner.model, _unwrap(runner.model))
    for index, hook in enumerate(getattr(runner, 'hooks', ())):
        if _is_ours(hook):
            continue
        name = '%d:%s' % (index, type(hook).__name__)
        attrs = {}
        for key, value in vars(hook).items():
            if any(value is m for m in model):
                attrs[key] = Leaf(('the model', id(value)))
            elif isinstance(value, torch.nn.Module):
                inner = _unwrap(value)
                attrs[key] = dict(_tensors(value), modules=_modules(value),
                                  wraps=id(inner))
            else:
                attrs[key] = picture(value)
        found[name] = attrs
    return found


def _loader(runner):
    loop = getattr(runner, 'train_loop', None)
    loader = getattr(loop, 'dataloader', None) if loop is not None else \
        None
    return loader if hasattr(loader, 'dataset') else None


def _dataset(dataset, depth=0):
    """The dataset's attributes, its pipeline's transforms one by one,
    and the datasets it wraps."""
    if dataset is None or depth > 4:
        return _identity(dataset) if dataset is not None else None
    attrs = {}
    for key, value in vars(dataset).items():
        if key in ('pipeline', 'transforms'):
            continue
        if key in ('dataset', 'datasets'):
            continue
        attrs[key] = picture(value)
    pictured = {'<type>': _qualname(type(dataset)), '<attrs>': attrs}
    pipeline = getattr(dataset, 'pipeline', None)
    if pipeline is not None:
        pictured['<pipeline>'] = _transforms(pipeline)
    inner = getattr(dataset, 'dataset', None)
    if inner is not None and not isinstance(inner, (list, tuple)):
        pictured['<dataset>'] = _dataset(inner, depth + 1)
    members = getattr(dataset, 'datasets', None)
    if isinstance(members, (list, tuple)):
        pictured['<datasets>'] = [_dataset(d, depth + 1) for d in members]
    return pictured


def _transforms(pipeline):
    """Each transform of a pipeline (a ``Compose``, a list of transforms,
    nested ``transforms``), by position: its type and ``__dict__``."""
    steps = getattr(pipeline, 'transforms', pipeline)
    if not isinstance(steps, (list, tuple)):
        return picture(steps)
    pictured = []
    for step in steps:
        attrs = dict(getattr(step, '__dict__', None) or {})
        nested = attrs.pop('transforms', None)
        entry = {'<type>': _qualname(type(step)),
                 '<attrs>': picture(attrs, DEPTH + 1)}
        if nested is not None:
            entry['<transforms>'] = _transforms(nested)
        pictured.append(entry)
    return pictured


def _sampler(sampler):
    if sampler is None:
        return None
    attrs = {}
    for key, value in vars(sampler).items():
        if key in ('dataset', 'data_source'):
            attrs[key] = _identity(value)
        elif key == 'sampler' and hasattr(value, '__dict__'):
            attrs[key] = _sampler(value)
        else:
            attrs[key] = picture(value)
    return {'<type>': _qualname(type(sampler)), '<attrs>': attrs}


def _iterator(loader):
    iterator = getattr(loader, '_iterator', None)
    if iterator is None:
        return None
    return dict((k, v) for k, v in vars(iterator).items()
                if isinstance(v, (bool, int)) and not k.startswith('_worker_'
                                                                 'pids'))


def _data(runner):
    loader = _loader(runner)
    if loader is None:
        return None
    return dict(sampler=_sampler(getattr(loader, 'sampler', None)),
                batch_sampler=_sampler(getattr(loader, 'batch_sampler',
                                               None)),
                dataset=_dataset(loader.dataset),
                iterator=_iterator(loader))


def _log_scalars(hub):
    scalars = {}
    for key, buffer in hub.log_scalars.items():
        scalars[key] = picture(vars(buffer))
    return scalars


# Functions a replay may replace while it runs (to answer a collective on
# one rank, to watch a forward): each must be the same object after it.
_PATCHABLE = {
    'torch.distributed': (
        'all_reduce', 'all_gather', 'all_gather_into_tensor',
        '_all_gather_base', 'broadcast', 'barrier', 'reduce',
        'reduce_scatter', 'reduce_scatter_tensor', 'all_to_all',
        'all_gather_object', 'broadcast_object_list', 'gather', 'scatter',
        'send', 'recv', 'get_rank', 'get_world_size', 'is_initialized'),
    'torch.distributed.distributed_c10d': (
        'all_reduce', 'all_gather', 'broadcast', 'barrier'),
    'mmengine.dist': ('all_reduce', 'all_gather', 'broadcast', 'barrier',
                      'get_rank', 'get_world_size', 'get_dist_info',
                      'all_gather_object', 'broadcast_object_list'),
    'mmengine.dist.dist': ('all_reduce', 'all_gather', 'broadcast',
                           'barrier'),
    'mmdet.utils.dist_utils': ('reduce_mean', 'all_reduce_dict'),
    'mmdet.models.data_preprocessors.data_preprocessor': (
        'barrier', 'broadcast', 'get_dist_info'),
    'torch.nn.functional': ('batch_norm', 'interpolate',
                            'binary_cross_entropy'),
}
# Methods of classes, as above: module -> class -> names.
_PATCHABLE_METHODS = {
    'torch.nn.modules.module': ('Module', ('__call__', '_call_impl')),
    'torch.nn.parallel.distributed': ('DistributedDataParallel', (
        'forward', '_pre_forward', '_sync_buffers')),
}


def _process():
    """The process-wide switches and functions a replay may turn or
    replace: anomaly mode, grad mode, threads, default dtype, cuDNN flags,
    the root and mmengine loggers' levels, the collectives' functions."""
    import importlib
    import logging
    import sys
    state = dict(
        anomaly=torch.is_anomaly_enabled(), grad=torch.is_grad_enabled(),
        threads=torch.get_num_threads(),
        dtype=str(torch.get_default_dtype()),
        cudnn=(torch.backends.cudnn.benchmark,
               torch.backends.cudnn.deterministic,
               torch.backends.cudnn.enabled))
    if hasattr(torch, 'are_deterministic_algorithms_enabled'):
        state['deterministic'] = torch.are_deterministic_algorithms_enabled()
    if hasattr(torch, 'is_inference_mode_enabled'):
        state['inference'] = torch.is_inference_mode_enabled()
    loggers = {}
    for name in ('', 'mmengine'):
        logger = logging.getLogger(name)
        loggers[name or '<root>'] = (logger.level, logger.disabled, tuple(
            (type(h).__name__, h.level) for h in logger.handlers))
    state['loggers'] = loggers
    functions = {}

    def seen(where, value):
        if value is not None:
            functions[where] = Leaf(('object', _qualname(type(value)),
                                     id(value)))

    for module, names in _PATCHABLE.items():
        if module in sys.modules:
            owner = importlib.import_module(module)
            for name in names:
                seen('%s.%s' % (module, name), getattr(owner, name, None))
    for module, (cls, names) in _PATCHABLE_METHODS.items():
        owner = getattr(sys.modules.get(module), cls, None)
        if owner is not None:
            for name in names:
                seen('%s.%s.%s' % (module, cls, name),
                     owner.__dict__.get(name))
    state['functions'] = functions
    return state


def take(runner):
    """The picture of everything a replay could change in ``runner``.

    Returns:
        dict: Part name -> picture (see the module docstring).
    """
    model = runner.model
    module = _unwrap(model)
    picture_ = _tensors(module)
    picture_.update(
        optimizer=_optimizer(runner), schedulers=_schedulers(runner),
        rng=_rng(), modules=_modules(model), hooks=_hooks(runner),
        message_hub=picture(runner.message_hub.runtime_info),
        log_scalars=_log_scalars(runner.message_hub), data=_data(runner),
        process=_process())
    return picture_


def _same(a, b):
    if type(a) is not type(b):
        return False
    return a == b


def _flat(values):
    return len(values) <= 16 and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in values)


def _show(value, width=160):
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + '...'


def _walk(before, after, where, out):
    if isinstance(before, Leaf) or isinstance(after, Leaf) or \
            type(before) is not type(after):
        if not _same(before, after):
            out.append('%s: %s -> %s' % (where or '<root>', _show(before),
                                         _show(after)))
        return
    if isinstance(before, dict):
        for key in before:
            at = '%s[%r]' % (where, key)
            if key == _ORDER and set(before) != set(after):
                continue  # the keys added or removed say it
            if key not in after:
                out.append('%s: removed (was %s)' % (at, _show(before[key])))
            else:
                _walk(before[key], after[key], at, out)
        for key in after:
            if key not in before:
                out.append('%s[%r]: added %s' % (where, key,
                                                 _show(after[key])))
        return
    if isinstance(before, (list, tuple)):
        if _flat(before) and _flat(after):
            if not _same(before, after):
                out.append('%s: %s -> %s' % (where or '<root>',
                                             _show(before), _show(after)))
            return
        if len(before) != len(after):
            out.append('%s: %d entries -> %d' % (where, len(before),
                                                 len(after)))
        for index, (a, b) in enumerate(zip(before, after)):
            _walk(a, b, '%s[%d]' % (where, index), out)
        return
    if not _same(before, after):
        out.append('%s: %s -> %s' % (where or '<root>', _show(before),
                                     _show(after)))


def diff(before, after):
    """Readable differences between two pictures of :func:`take`; empty
    when they are identical.

    Returns:
        list[str]: ``"<part>[key]...: before -> after"`` per difference.
    """
    out = []
    for part in sorted(set(before) | set(after)):
        if part not in after:
            out.append('%s: missing after' % part)
        elif part not in before:
            out.append('%s: missing before' % part)
        else:
            _walk(before[part], after[part], part, out)
    return out


__all__ = ['take', 'diff', 'picture', 'tensor_leaf', 'module_attrs']
