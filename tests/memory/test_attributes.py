"""What a forward sets outside tensors, kept and put back
(:class:`~mmnanhook.memory.Attributes`): rebound, added and removed
attributes, containers and plain tensors written in place, a module's own
parameters and hooks left alone."""
import collections

import torch
from torch import nn

from mmnanhook.memory import Attributes, module_attributes


class Resizer(nn.Module):
    """Keeps what its forward decides for the next one, as mmdet's
    ``BatchSyncRandomResize`` keeps ``_input_size``."""

    def __init__(self):
        super(Resizer, self).__init__()
        self._input_size = (32, 32)
        self.cache = [1, 2]
        self.seen = collections.OrderedDict(a=1)
        self.tags = {'x'}
        self.plain = torch.zeros(2)
        self.conv = nn.Conv2d(1, 1, 1)
        self.register_buffer('count', torch.zeros(1))

    def forward(self, x):
        self._input_size = (64, 96)
        self.cache.append(3)
        self.seen['b'] = 2
        self.tags.add('y')
        self.plain.add_(1)
        self.last = x
        return self.conv(x)


def test_everything_a_forward_set_is_put_back():
    module = Resizer()
    cache, seen, plain = module.cache, module.seen, module.plain
    weight = module.conv.weight
    kept = module_attributes(module)
    module(torch.ones(1, 1, 2, 2))
    del module.tags
    kept.restore()
    assert module._input_size == (32, 32)
    # Containers keep their identity (someone may hold them), with the old
    # contents.
    assert module.cache is cache and cache == [1, 2]
    assert module.seen is seen and list(seen.items()) == [('a', 1)]
    assert module.tags == {'x'}
    assert module.plain is plain and torch.equal(plain, torch.zeros(2))
    assert not hasattr(module, 'last')
    assert module.conv.weight is weight


def test_the_snapshot_before_a_step_puts_back_what_a_forward_rebinds():
    module = Resizer()
    cache = module.cache
    before_step = module_attributes(module, step=True)
    after_trigger = module_attributes(module)
    handle = module.register_forward_hook(lambda *args: None)
    module(torch.ones(1, 1, 2, 2))
    before_step.restore()
    assert module._input_size == (32, 32)
    assert not hasattr(module, 'last')
    # Shallow: a container written in place keeps what was written, and
    # torch's own entries (the hook) are left alone.
    assert module.cache is cache and cache == [1, 2, 3]
    assert len(module._forward_hooks) == 1
    after_trigger.restore()
    assert cache == [1, 2] and len(module._forward_hooks) == 0
    handle.remove()


def test_a_dict_is_kept_as_its_items():
    info = collections.OrderedDict(iter=3, epoch=1)
    kept = Attributes([info])
    info['iter'] = 4
    info['new'] = True
    kept.restore()
    assert list(info.items()) == [('iter', 3), ('epoch', 1)]


def test_a_tensor_in_a_container_is_compared_by_identity():
    # ``==`` of tensors is no answer: the restore must not ask it.
    module = nn.Module()
    module.stats = [torch.ones(3), torch.zeros(3)]
    first = module.stats[0]
    kept = Attributes([module])
    module.stats[0] = torch.full((3, ), 5.0)
    kept.restore()
    assert module.stats[0] is first
