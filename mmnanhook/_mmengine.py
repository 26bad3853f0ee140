"""MMEngine idioms the adapters share."""
from mmengine.model import is_model_wrapper


def unwrap_model(model):
    """The model inside a DDP / FSDP wrapper, or ``model`` itself."""
    return model.module if is_model_wrapper(model) else model


def is_ddp(model):
    """Whether ``model`` is wrapped in ``DistributedDataParallel`` (mmengine's
    ``MMDistributedDataParallel`` included)."""
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(model, DistributedDataParallel)
