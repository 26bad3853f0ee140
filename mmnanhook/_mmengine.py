"""MMEngine idioms the adapters share."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapperDict


def unwrap_model(model: Any) -> Any:
    """The model inside a DDP / FSDP wrapper, or ``model`` itself."""
    return model.module if is_model_wrapper(model) else model


def is_ddp(model: Any) -> bool:
    """Whether ``model`` is wrapped in ``DistributedDataParallel`` (mmengine's
    ``MMDistributedDataParallel`` included)."""
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(model, DistributedDataParallel)


def wrapped_datasets(dataset: Any) -> Iterator[Any]:
    """``dataset`` and every dataset it wraps (``RepeatDataset``,
    ``ConcatDataset``, ``MultiImageMixDataset``...: their ``dataset`` and
    ``datasets``), outermost first, each once."""
    queue, seen = [dataset], set()
    while queue:
        node = queue.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        queue.append(getattr(node, 'dataset', None))
        queue.extend(getattr(node, 'datasets', None) or [])


def compile_options(runner: Any) -> Optional[Dict[str, Any]]:
    """The ``torch.compile`` options ``runner`` compiles the model with, or
    ``None``: the config's ``compile`` (``Runner._maybe_compile``), or
    FlexibleRunner's ``compile`` argument; ``True`` is no options (an empty
    dict), ``None`` and ``False`` are no compile."""
    value = getattr(runner, '_compile', None)
    if value is None:
        cfg = getattr(runner, 'cfg', None)
        value = cfg.get('compile', None) if cfg is not None else None
    if value is None or value is False:
        return None
    return {} if value is True else dict(value)


def members(optim_wrapper: Any) -> List[Any]:
    """The ``OptimWrapper`` instances of a wrapper or ``OptimWrapperDict``."""
    if isinstance(optim_wrapper, OptimWrapperDict):
        return list(optim_wrapper.values())
    return [optim_wrapper]
