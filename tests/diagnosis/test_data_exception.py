"""A forward that raises because a sample's input is not finite is a data
incident (kind ``data``, the exception kept, the fix replayed without the
sample); one that raises on finite data stays an ``exception``.

The toy matcher does what SimOTA does: ``binary_cross_entropy`` of sigmoid
scores, which raises on NaN ("all elements of input should be between 0 and
1").
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModel

from mmnanhook.diagnosis import diagnose


class _Matcher(BaseModel):

    def __init__(self, strict=False):
        super(_Matcher, self).__init__()
        self.fc = nn.Linear(4, 1)
        self.strict = strict

    def forward(self, inputs, data_samples=None, mode='loss'):
        scores = torch.sigmoid(self.fc(torch.stack(inputs)))
        if self.strict:
            raise RuntimeError('the matcher refuses every batch')
        cost = F.binary_cross_entropy(scores, torch.ones_like(scores))
        return {'loss_match': cost}


def _batch(bad=None, n=3):
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.rand(4, generator=gen) for _ in range(n)]
    if bad is not None:
        inputs[bad] = torch.full((4, ), float('nan'))
    return {'inputs': inputs, 'data_samples': None}


def test_a_forward_raising_on_a_nan_input_is_a_data_incident():
    report = diagnose(_Matcher(), _batch(bad=1)).to_dict()
    assert report['kind'] == 'data'
    assert [s['index'] for s in report['samples']] == [1]
    assert 'NaN' in report['samples'][0]['problems'][0]
    # The exception stays in the report, and the summary tells of it.
    assert report['exception']['type'] == 'RuntimeError'
    assert report['exception']['phase'] == 'forward'
    assert report['summary'].startswith('RuntimeError raised in forward')
    assert 'sample 1' in report['summary']
    # The fix: the batch without sample 1, replayed and finite.
    drop = [f for f in report['fixes'] if f['kind'] == 'drop_samples']
    assert [(f['status'], f['samples']) for f in drop] == [('verified', [1])]


def test_a_forward_raising_on_finite_data_stays_an_exception():
    report = diagnose(_Matcher(strict=True), _batch()).to_dict()
    assert report['kind'] == 'exception'
    assert report['samples'] == []
    assert report['exception']['phase'] == 'forward'
