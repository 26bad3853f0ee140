"""A forward that raises because a sample's target is not finite is a data
incident (kind ``data``, the exception kept, the fix replayed without the
sample); one that raises on finite data stays an ``exception``; a sample
whose input is not finite is stopped before the forward in every replay
(no op of the model runs on it) and named as such.

The toy matcher does what SimOTA does: ``binary_cross_entropy`` of sigmoid
scores (shifted by the sample's GT box), which raises on NaN ("all elements
of input should be between 0 and 1").
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.structures import BaseDataElement, InstanceData

from mmnanhook.diagnosis import diagnose


class _Matcher(BaseModel):

    def __init__(self, strict=False):
        super(_Matcher, self).__init__()
        self.fc = nn.Linear(4, 1)
        self.strict = strict
        # Per forward call: whether every input it was given was finite.
        self.inputs_finite = []

    def forward(self, inputs, data_samples=None, mode='loss'):
        x = torch.stack(inputs)
        self.inputs_finite.append(bool(torch.isfinite(x).all()))
        shift = torch.stack([s.gt_instances.bboxes.sum()
                             for s in data_samples])
        scores = torch.sigmoid(self.fc(x).squeeze(1) + shift)
        if self.strict:
            raise RuntimeError('the matcher refuses every batch')
        cost = F.binary_cross_entropy(scores, torch.ones_like(scores))
        return {'loss_match': cost}


def _batch(bad_box=None, bad_input=None, n=3):
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.rand(4, generator=gen) for _ in range(n)]
    samples = []
    for i in range(n):
        boxes = torch.tensor([[1.0, 1.0, 3.0, 3.0]]) * 0.01
        if i == bad_box:
            boxes[0, 2] = float('nan')
        if i == bad_input:
            inputs[i] = torch.full((4, ), float('nan'))
        samples.append(BaseDataElement(
            metainfo=dict(img_path='%d.tif' % i, img_shape=(8, 8)),
            gt_instances=InstanceData(bboxes=boxes,
                                      labels=torch.zeros(1).long())))
    return {'inputs': inputs, 'data_samples': samples}


def test_a_forward_raising_on_a_nan_target_is_a_data_incident():
    report = diagnose(_Matcher(), _batch(bad_box=1)).to_dict()
    assert report['kind'] == 'data'
    assert [s['index'] for s in report['samples']] == [1]
    assert 'non-finite' in report['samples'][0]['problems'][0]
    # The exception stays in the report, and the summary tells of it.
    assert report['exception']['type'] == 'RuntimeError'
    assert report['exception']['phase'] == 'forward'
    assert report['summary'].startswith('RuntimeError raised in forward')
    assert 'sample 1' in report['summary']
    # The fix: the batch without sample 1, replayed and finite.
    drop = [f for f in report['fixes'] if f['kind'] == 'drop_samples']
    assert [(f['status'], f['samples']) for f in drop] == [('verified', [1])]


def test_a_nan_input_is_never_run_and_is_named_as_the_input():
    model = _Matcher()
    report = diagnose(model, _batch(bad_input=2)).to_dict()
    assert report['kind'] == 'data'
    assert [s['index'] for s in report['samples']] == [2]
    assert report['samples'][0]['problems'] == [
        'input has 4 NaN and 0 Inf values']
    assert report['exception']['type'] == 'NonFiniteInputError'
    # No op of the model ran on it: no place in the model is named.
    assert report['location'] is None and report['module'] is None
    assert any('the forward was not run' in n for n in report['notes'])
    assert report['summary'].startswith(
        'the input is not finite: sample 2 (2.tif): input has 4 NaN'), \
        report['summary']
    # Every replay the model saw (the fix without sample 2) was finite.
    assert model.inputs_finite and all(model.inputs_finite)
    drop = [f for f in report['fixes'] if f['kind'] == 'drop_samples']
    assert [(f['status'], f['samples']) for f in drop] == [('verified', [2])]


def test_a_forward_raising_on_finite_data_stays_an_exception():
    report = diagnose(_Matcher(strict=True), _batch()).to_dict()
    assert report['kind'] == 'exception'
    assert report['samples'] == []
    assert report['exception']['phase'] == 'forward'
