"""A sample whose ground truth other than its boxes is not finite (a NaN
keypoint, as mmpose packs it) is found and named: a forward that raises on
it, or makes NaN of it, is a data incident of that sample.

The toy model does what mmpose's RLE loss does: the log-likelihood of the
error between prediction and keypoint label under torch's
``MultivariateNormal``, whose argument check raises ``ValueError`` on NaN.
The fields are packed as mmpose packs them: ``gt_instances.keypoints`` a
numpy array, ``gt_instance_labels.keypoint_labels`` a tensor,
``gt_fields.heatmaps`` a ``PixelData`` tensor (mmengine's structures).
"""
import numpy as np
import torch
import torch.nn as nn
from mmengine.model import BaseModel
from mmengine.structures import BaseDataElement, InstanceData, PixelData

from mmnanhook.diagnosis import check_batch, diagnose
from mmnanhook.records import NONFINITE_DATA, ProblemCategory

NAN = float('nan')


class _Flow(BaseModel):
    """A regression head whose loss is a flow prior's negative
    log-likelihood (mmpose's ``RLELoss``)."""

    def __init__(self):
        super(_Flow, self).__init__()
        self.fc = nn.Linear(4, 2)
        self.prior = torch.distributions.MultivariateNormal(
            torch.zeros(2), torch.eye(2), validate_args=True)

    def forward(self, inputs, data_samples=None, mode='loss'):
        pred = self.fc(torch.stack(inputs))
        labels = torch.stack([s.gt_instance_labels.keypoint_labels[0, 0]
                              for s in data_samples])
        return {'loss_kpt': -self.prior.log_prob(pred - labels).mean()}


def _sample(i, keypoint=None, label=None, heatmap=None, box=None):
    keypoints = np.array([[[2.0, 3.0], [4.0, 5.0]]], dtype=np.float32)
    labels = torch.tensor([[[0.2, 0.3], [0.4, 0.5]]])
    heatmaps = torch.zeros(2, 4, 3)
    bboxes = np.array([[1.0, 1.0, 6.0, 7.0]], dtype=np.float32)
    if keypoint is not None:
        keypoints[0, 1, 0] = keypoint
    if label is not None:
        labels[0, 0, 1] = label
    if heatmap is not None:
        heatmaps[1, 2, 2] = heatmap
    if box is not None:
        bboxes[0, 2] = box
    return BaseDataElement(
        metainfo=dict(img_path='%d.png' % i, img_shape=(8, 8)),
        gt_instances=InstanceData(
            keypoints=keypoints, bboxes=bboxes,
            keypoints_visible=np.ones((1, 2), dtype=np.float32)),
        gt_instance_labels=InstanceData(
            keypoint_labels=labels, keypoint_weights=torch.ones(1, 2)),
        gt_fields=PixelData(heatmaps=heatmaps),
        # An integer target is never read as one that could be NaN.
        gt_label=torch.tensor([1]))


def _batch(samples):
    gen = torch.Generator().manual_seed(0)
    return {'inputs': [torch.rand(4, generator=gen) for _ in samples],
            'data_samples': samples}


def test_every_nonfinite_target_field_is_named_once():
    samples = [_sample(0), _sample(1, keypoint=NAN, label=NAN),
               _sample(2, heatmap=float('inf')), _sample(3, box=NAN)]
    found = check_batch(_batch(samples))
    assert [f.img_path for f in found] == ['0.png', '1.png', '2.png',
                                           '3.png']
    texts = [[p.text for p in f.problems] for f in found]
    assert texts[0] == []
    assert texts[1] == [
        'gt_instance_labels.keypoint_labels has 1 NaN and 0 Inf values',
        'gt_instances.keypoints has 1 NaN and 0 Inf values']
    assert texts[2] == ['gt_fields.heatmaps has 0 NaN and 1 Inf values']
    # A box is the box check's (one problem, its own category), not a
    # second target problem.
    assert len(texts[3]) == 1 and found[3].problems[0].category == \
        ProblemCategory.NONFINITE_BOX
    for f in found[1:3]:
        assert f.categories == {ProblemCategory.NONFINITE_TARGET}
    assert ProblemCategory.NONFINITE_TARGET in NONFINITE_DATA


def test_a_loss_raising_on_a_nan_keypoint_is_a_data_incident():
    batch = _batch([_sample(0), _sample(1, label=NAN), _sample(2)])
    report = diagnose(_Flow(), batch).to_dict()
    # torch's own argument check raised, in the loss.
    assert report['exception']['type'] == 'ValueError'
    assert report['exception']['phase'] == 'forward'
    assert report['kind'] == 'data'
    (sample, ) = report['samples']
    assert (sample['index'], sample['img_path']) == (1, '1.png')
    assert sample['problems'] == [
        'gt_instance_labels.keypoint_labels has 1 NaN and 0 Inf values']
    drop = [f for f in report['fixes'] if f['kind'] == 'drop_samples']
    assert [(f['status'], f['samples']) for f in drop] == [('verified', [1])]
    assert any('ground-truth targets' in h and '1.png' in h
               for h in report['hints'])


def test_finite_targets_leave_a_raising_loss_an_exception():
    class _Refuses(_Flow):
        def forward(self, inputs, data_samples=None, mode='loss'):
            raise ValueError('refused')

    report = diagnose(_Refuses(), _batch([_sample(0), _sample(1)])).to_dict()
    assert report['kind'] == 'exception' and report['samples'] == []
