"""fp16 headroom from fp32 iterations: a model whose activations pass fp16's
range is named (and, where torch autocasts fp16 on a CPU, confirmed by
running it), one well inside is not."""
import pytest
import torch
from mmengine.model import BaseModel
from mmengine.optim import OptimWrapper

from mmnanhook.doctor import (FP16_MAX, INIT_SCALE, RangeRecorder,
                              confirm_overflow, cpu_fp16_autocast, measure)


class Gained(BaseModel):
    """Two linear layers; the first one's weights times ``gain``."""

    def __init__(self, gain):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.first.weight.mul_(gain)

    def forward(self, inputs, data_samples=None, mode='loss'):
        out = self.second(self.first(torch.stack(inputs)))
        return {'loss': out.float().abs().mean() * 1e-6}


def _batches(n=2):
    torch.manual_seed(1)
    return [dict(inputs=list(torch.randn(4, 8) * 10)) for _ in range(n)]


def _run(gain):
    model = Gained(gain)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.0))
    return model, {r.name: r for r in measure(model, _batches(), wrapper)}


def test_a_model_that_overflows_fp16_is_named():
    model, ranges = _run(gain=1e4)
    first = ranges['first']
    assert first.activation > FP16_MAX
    assert first.verdict() == 'overflow'
    assert 'first: largest activation' in first.line()
    confirmed = confirm_overflow(model, _batches(1)[0], 'first')
    if cpu_fp16_autocast() is None:
        assert confirmed is None  # torch cannot autocast fp16 on a CPU
    else:
        assert confirmed is True


def test_a_model_inside_fp16s_range_is_not():
    model, ranges = _run(gain=1.0)
    assert all(r.verdict() is None for r in ranges.values()), [
        r.line() for r in ranges.values()]
    if cpu_fp16_autocast() is not None:
        assert confirm_overflow(model, _batches(1)[0], 'first') is False


def test_gradients_against_the_loss_scale():
    _, ranges = _run(gain=1.0)
    second = ranges['second']
    # The loss is 1e-6 * mean|out|: d loss / d out = 1e-6 / 4.
    assert second.gradient == pytest.approx(2.5e-7)
    # A static scale that overflows it, a dynamic one that backs off.
    scale = 2 * FP16_MAX / second.gradient
    assert second.verdict(loss_scale=scale) == 'overflow'
    assert second.verdict() is None and second.backoff() == 0
    second.gradient = 4 * FP16_MAX / INIT_SCALE
    assert second.backoff() == 2


def test_the_recorder_leaves_no_hook():
    model = Gained(1.0)
    with RangeRecorder(model):
        assert model.first._forward_hooks
    assert not model.first._forward_hooks and not model.second._forward_hooks
