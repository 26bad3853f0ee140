"""Tier 1, pure torch: gradient norms, clipping with a reused norm, naming.

Reference results come from torch's own ``clip_grad_norm_`` on copies of the
same gradients.
"""
import math
import warnings

import pytest
import torch

from mmnanhook import _losses, _norms, compat
from mmnanhook._anomaly import capture_anomaly_warnings
from mmnanhook.records import NonFiniteEvent

NORM_TYPES = [2.0, 1.0, 3.0, float('inf'), 'inf']


def _params(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5, ), (3, 4, 2), (1, )]
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        p.grad = torch.randn(shape, generator=g) * scale
        params.append(p)
    return params


def _copy(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append(q)
    return out


@pytest.mark.parametrize('norm_type', NORM_TYPES)
def test_total_norm_equals_clip_grad_norm(norm_type):
    params = _params()
    ref = torch.nn.utils.clip_grad_norm_(_copy(params), 1e9, norm_type)
    norms = _norms.GradNorms([p.grad for p in params], norm_type)
    assert torch.equal(norms.total, ref)


@pytest.mark.parametrize('norm_type', NORM_TYPES)
@pytest.mark.parametrize('max_norm', [0.5, 1e6])
def test_clip_with_reused_norm_equals_clip_grad_norm(norm_type, max_norm):
    params = _params(seed=1)
    ref = _copy(params)
    torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    norms = _norms.GradNorms([p.grad for p in params], norm_type)
    _norms.clip_grads_with_norm_(params, max_norm, norms.total)
    for p, q in zip(params, ref):
        assert torch.equal(p.grad, q.grad)
    if max_norm < 1:
        # The test is only meaningful if clipping changed something.
        assert not torch.equal(params[0].grad, _params(seed=1)[0].grad)


def test_mixed_dtypes_follow_torch_grouping():
    params = _params(seed=2)
    params[1].data = params[1].data.double()
    params[1].grad = params[1].grad.double()
    ref = torch.nn.utils.clip_grad_norm_(_copy(params), 1e9)
    norms = _norms.GradNorms([p.grad for p in params])
    assert torch.equal(norms.total, ref)
    assert sorted(norms.order) == list(range(len(params)))


def test_no_gradients():
    norms = _norms.GradNorms([])
    assert float(norms.total) == 0.0
    assert norms.nonfinite() == []


def test_fast_norm_agrees_with_the_exact_one():
    params = _params(seed=5)
    exact = _norms.GradNorms([p.grad for p in params]).total
    fast = _norms.GradNorms([p.grad for p in params], exact=False).total
    assert torch.allclose(fast, exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize('exact', [True, False])
@pytest.mark.parametrize('bad', [float('nan'), float('inf')])
def test_nonfinite_names_exactly_the_bad_gradients(bad, exact):
    params = _params(seed=3)
    params[2].grad[1, 2, 0] = bad
    norms = _norms.GradNorms([p.grad for p in params], exact=exact)
    assert not math.isfinite(float(norms.total))
    assert norms.nonfinite() == [2]


@pytest.mark.parametrize('exact', [True, False])
def test_norm_overflow_with_finite_gradients(exact):
    params = _params(seed=4, scale=1e30)
    assert all(torch.isfinite(p.grad).all() for p in params)
    norms = _norms.GradNorms([p.grad for p in params], exact=exact)
    # torch's clip would see the same overflow and zero every gradient.
    ref = _copy(params)
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert all(float(q.grad.abs().max()) == 0.0 for q in ref)
    assert math.isinf(float(norms.total))
    assert norms.nonfinite() == []
    assert norms.largest_abs() > 1e29


def test_describe_losses_names_the_bad_term():
    terms = _losses.loss_terms({
        'loss': torch.tensor(float('nan')),
        'loss_cls': torch.tensor(0.5, requires_grad=True),
        'loss_bbox': torch.tensor(float('inf')),
        'acc': torch.tensor(float('nan')),
    })
    assert list(terms) == ['loss', 'loss_cls', 'loss_bbox']
    assert not any(t.requires_grad for t in terms.values())
    values, bad = _losses.describe_losses(terms)
    assert values['loss_cls'] == 0.5 and math.isinf(values['loss_bbox'])
    assert bad == ['loss_bbox']
    # Only the total is known: it is the one named.
    total = {'loss': torch.tensor(float('nan'))}
    assert _losses.describe_losses(total)[1] == ['loss']


def test_anomaly_traceback_is_extracted_from_warnings():
    state = compat.anomaly_state()
    compat.set_detect_anomaly(True)
    try:
        a = torch.ones(3, requires_grad=True)
        with warnings.catch_warnings(record=True) as others:
            warnings.simplefilter('always')
            with capture_anomaly_warnings() as anomaly:
                b = a.sigmoid()
                c = b * 2
                b.add_(1)  # the in-place write that breaks backward
                warnings.warn('unrelated')
                with pytest.raises(RuntimeError):
                    c.sum().backward()
    finally:
        compat.restore_anomaly(state)
    assert 'b = a.sigmoid()' in anomaly.traceback
    assert [str(w.message) for w in others] == ['unrelated']


def test_event_rejects_unknown_trigger():
    with pytest.raises(ValueError, match='trigger'):
        NonFiniteEvent('nope', 'message')
