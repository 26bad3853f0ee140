"""Rewind snapshots shared by the ranks of a DDP run: each rank holds its
share, a restore broadcasts them (run by ``tests/sentinel/test_rewind.py``
on two gloo ranks)."""
import torch
import torch.nn as nn

# The model's layer widths.
WIDTHS = (64, 48, 32, 16)


def _model():
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])]
    return nn.Sequential(layers[0], nn.BatchNorm1d(WIDTHS[1]), *layers[1:])


def _train(model, optimizer, steps):
    # The same batches on every rank: the same parameters, as under DDP.
    for step in range(steps):
        torch.manual_seed(step)
        model(torch.randn(8, WIDTHS[0])).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _state(model, optimizer):
    return ([t.clone() for t in model.state_dict().values()],
            [t.clone() for entry in optimizer.state_dict()['state'].values()
             for t in entry.values() if torch.is_tensor(t)])


def tensor_bytes(obj):
    """The bytes of the tensors in ``obj`` (nested dicts, lists, tuples)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _shares(out_dir):
    import torch.distributed as dist

    from mmnanhook.sentinel import Rewinder
    from mmnanhook.distributed._ranks import Ranks
    from mmnanhook.options import RewindOptions

    class _Wrapper(object):
        def __init__(self, optimizer):
            self.optimizer = optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrappers = [_Wrapper(optimizer)]
    _train(model, optimizer, 2)
    # BN statistics need not agree across ranks (DDP does not share them).
    model[1].running_mean.add_(rank)
    expected = _state(model, optimizer)
    rewinder = Rewinder(RewindOptions(snapshot_interval=1))
    rewinder.start(model, wrappers, Ranks(rank, world, dist.group.WORLD))
    # Training goes on while the copy is made (the forward changes the BN
    # statistics); it is waited for before the next step.
    model(torch.randn(8, WIDTHS[0])).sum().backward()
    rewinder.store.settle()
    snapshot = rewinder.store.before(0)
    held = tensor_bytes(snapshot.model) + tensor_bytes(snapshot.optimizers)
    full = tensor_bytes(model.state_dict()) + tensor_bytes(
        optimizer.state_dict()['state'])
    optimizer.zero_grad()
    _train(model, optimizer, 3)
    rewinder.store.restore(snapshot, model, wrappers)
    restored = _state(model, optimizer)
    return dict(
        held=held, full=full,
        buffers=tensor_bytes([t for n, t in model.state_dict().items()
                              if n not in dict(model.named_parameters())]),
        bitwise=all(torch.equal(a, b) for a, b in zip(
            expected[0] + expected[1], restored[0] + restored[1])),
        count=[len(expected[0]), len(restored[0]), len(expected[1]),
               len(restored[1])])


SCENARIOS = {'shares': _shares}

if __name__ == '__main__':
    from mmnan_testing.ddp import main
    main(scenarios=SCENARIOS)
