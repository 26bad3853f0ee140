"""Tier-2 diagnosis on toy mmengine models: one test per failure kind.

Each model is a real ``mmengine.model.BaseModel`` with the default data
preprocessor, so :func:`diagnose` replays exactly what ``train_step`` runs.
Expected lines are found in this file by a marker comment, so the tests
check the reported ``file:line`` without hard-coding numbers.
"""
import inspect
import json
import math
import sys

import pytest
import torch
import torch.nn as nn
from mmengine.model import BaseModel
from mmengine.structures import BaseDataElement, InstanceData

from mmnanhook import compat
from mmnanhook.bundle import to_strict_json
from mmnanhook.diagnosis import diagnose
from mmnanhook.diagnosis._backward import BackwardWatch
from mmnanhook.diagnosis._producer import ForwardWatch, LineLocator
from mmnanhook.report import KINDS, format_report
from mmnan_testing.faults import is_op


def _line_of(marker):
    """``file:line`` of the line of this file holding ``marker``."""
    lines, _ = inspect.findsource(inspect.getmodule(_line_of))
    hits = [i + 1 for i, text in enumerate(lines)
            if text.rstrip().endswith('# MARK ' + marker)]
    assert len(hits) == 1, marker
    return '{}:{}'.format(inspect.getsourcefile(_line_of), hits[0])


class _Toy(BaseModel):
    """``inputs``: list of (4,) tensors; ``data_samples``: targets."""

    def __init__(self, loss_fn=None):
        super(_Toy, self).__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.loss_fn = loss_fn or nn.L1Loss()

    def forward(self, inputs, data_samples=None, mode='loss'):
        x = torch.stack(inputs)
        target = torch.stack(data_samples)
        return {'loss_toy': self.loss_fn(self.body(x), target)}


def _batch(n=3, targets=None):
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.rand(4, generator=gen) for _ in range(n)]
    targets = targets or [torch.rand(2, generator=gen) for _ in range(n)]
    return {'inputs': inputs, 'data_samples': targets}


def _loss(model, batch):
    """The parsed loss of one forward, as ``train_step`` computes it."""
    data = model.data_preprocessor(batch, True)
    return model.parse_losses(model._run_forward(data, mode='loss'))[0]


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_untouched(model, before):
    after = model.state_dict()
    assert set(after) == set(before)
    for key, value in before.items():
        same = ((after[key] == value)
                | (torch.isnan(after[key]) & torch.isnan(value)))
        assert after[key].shape == value.shape and bool(same.all()), key
    for module in model.modules():
        assert 'forward' not in module.__dict__, module


def _check_report(report):
    # Checked as report.json renders it.
    report = report.to_dict()
    assert report['kind'] in KINDS
    assert isinstance(report['summary'], str)
    assert '\n' not in report['summary']
    text = format_report(report)
    assert report['summary'] in text and report['kind'] in text
    # What the bundle writes: strict JSON.
    json.dumps(to_strict_json(report), allow_nan=False)
    return report


class _SqrtDistance(nn.Module):

    def forward(self, pred, target):
        dist = ((pred - target)**2).sum(-1)
        return torch.sqrt(dist).mean()  # MARK sqrt


def test_sqrt_at_zero_names_the_sqrt_node_not_anomaly_modes_later_node():
    model = _Toy(_SqrtDistance())
    # A zero second layer predicts 0: sample 1's target 0 puts sqrt at 0.
    nn.init.zeros_(model.body[2].weight)
    nn.init.zeros_(model.body[2].bias)
    batch = _batch(targets=[torch.ones(2), torch.zeros(2), torch.ones(2)])
    before = _state(model)
    report = _check_report(diagnose(model, batch))
    # The forward is finite (sqrt(0) = 0); only backward goes wrong: the
    # sqrt node makes Inf, and the pow node behind it turns it into NaN,
    # which is what anomaly mode would name.
    assert math.isfinite(report['losses']['loss_toy'])
    assert report['kind'] == 'backward'
    assert is_op(report['op'], 'SqrtBackward')
    assert report['backward']['inf'] > 0 and report['backward']['nan'] == 0
    assert report['module'] == 'loss_fn'
    assert report['location'] == _line_of('sqrt')
    assert [s['index'] for s in report['samples']] == [1]
    assert any('clamp' in hint for hint in report['hints'])
    _assert_untouched(model, before)


class _DivideBy(nn.Module):

    def __init__(self):
        super(_DivideBy, self).__init__()
        self.register_buffer('scale', torch.zeros(1))

    def forward(self, x):
        return x / self.scale  # MARK divide


class _Block(nn.Module):
    """A parent that only propagates its child's Inf."""

    def __init__(self):
        super(_Block, self).__init__()
        self.pre = nn.Linear(8, 8)
        self.div = _DivideBy()
        self.post = nn.Linear(8, 8)

    def forward(self, x):
        return self.post(self.div(self.pre(x)) + 1)


def test_forward_division_by_zero_names_the_child_not_its_parents():
    model = _Toy()
    model.body = nn.Sequential(nn.Linear(4, 8), _Block(), nn.Linear(8, 2))
    report = _check_report(diagnose(model, _batch()))
    assert report['kind'] == 'forward'
    assert report['module'] == 'body.1.div'
    assert report['forward']['module'] == 'body.1.div'
    assert is_op(report['op'], 'DivBackward')
    assert report['location'] == _line_of('divide')
    assert report['code'].startswith('return x / self.scale')
    assert report['params'] == []
    # Every sample fails alone: all are named, none has a data problem.
    assert [s['index'] for s in report['samples']] == [0, 1, 2]


def test_nan_weight_is_a_params_finding_naming_that_weight():
    model = _Toy()
    with torch.no_grad():
        model.body[2].weight[1, 3] = float('nan')
    before = _state(model)
    report = _check_report(diagnose(model, _batch()))
    assert report['kind'] == 'params'
    assert report['params'] == ['body.2.weight']
    assert report['module'] == 'body.2'
    assert report['sample_replays'] is None
    assert any('exploding' in hint for hint in report['hints'])
    _assert_untouched(model, before)


def test_nonfinite_optimizer_state_is_named_by_parameter():
    model = _Toy()
    optimizer = torch.optim.Adam(model.parameters())
    _loss(model, _batch()).backward()
    optimizer.step()
    optimizer.state[model.body[0].bias]['exp_avg_sq'][2] = float('inf')
    model.zero_grad()
    report = _check_report(diagnose(model, _batch(),
                                    optimizer_state=optimizer))
    assert report['kind'] == 'optimizer_state'
    assert report['optimizer_state'] == ['state.body.0.bias.exp_avg_sq']
    # The state dict alone has no parameter names, only indices.
    report = diagnose(model, _batch(), optimizer_state=optimizer.state_dict())
    assert report.optimizer_state == ['state.1.exp_avg_sq']


class _InplaceAfterSigmoid(BaseModel):

    def __init__(self):
        super(_InplaceAfterSigmoid, self).__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, inputs, data_samples=None, mode='loss'):
        gate = self.fc(torch.stack(inputs)).sigmoid()  # MARK sigmoid
        gate.mul_(2)  # sigmoid's backward needs its unmodified output
        return {'loss_gate': gate.mean()}


def test_inplace_error_is_an_exception_with_the_user_code_line():
    model = _InplaceAfterSigmoid()
    report = _check_report(diagnose(model, _batch()))
    assert report['kind'] == 'exception'
    assert report['exception']['type'] == 'RuntimeError'
    assert report['exception']['phase'] == 'backward'
    assert 'inplace operation' in report['exception']['message']
    assert is_op(report['op'], 'SigmoidBackward')
    assert report['location'] == _line_of('sigmoid')
    assert report['module'] is None  # the model itself, not a submodule
    assert 'Forward traceback of' in report['traceback']
    assert any('out-of-place' in hint for hint in report['hints'])


class _RandomGate(BaseModel):
    """Divides by zero when its random draw is below 0.5."""

    def __init__(self):
        super(_RandomGate, self).__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, inputs, data_samples=None, mode='loss'):
        keep = (torch.rand(()) > 0.5).float()
        out = self.fc(torch.stack(inputs)) / keep  # MARK gate
        return {'loss_gate': out.abs().mean()}


def _seed_where_first_draw(predicate):
    for seed in range(100):
        torch.manual_seed(seed)
        if predicate(float(torch.rand(()))):
            torch.manual_seed(seed)
            return torch.get_rng_state()
    raise AssertionError('no seed found')


def test_rng_dependent_fault_reproduces_only_with_restore_rng():
    model = _RandomGate()
    failing = _seed_where_first_draw(lambda u: u <= 0.5)
    torch.set_rng_state(failing)
    assert not math.isfinite(float(_loss(model, _batch()).detach()))

    # Later, the generator has moved on to a state whose draw is harmless.
    torch.set_rng_state(_seed_where_first_draw(lambda u: u > 0.5))
    current = torch.get_rng_state()
    report = _check_report(diagnose(model, _batch()))
    assert report['kind'] == 'not_reproduced'
    assert torch.equal(torch.get_rng_state(), current)

    report = _check_report(diagnose(
        model, _batch(), restore_rng=lambda: torch.set_rng_state(failing)))
    assert report['kind'] == 'forward'
    assert report['location'] == _line_of('gate')
    assert torch.equal(torch.get_rng_state(), current)


class _BoxRegressor(BaseModel):
    """Regresses ``log(gt_w / anchor_w)`` like mmdet's delta box coder."""

    def __init__(self):
        super(_BoxRegressor, self).__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, inputs, data_samples=None, mode='loss'):
        pred = self.head(torch.stack(inputs))
        targets = []
        for sample in data_samples:
            boxes = sample.gt_instances.bboxes
            boxes = getattr(boxes, 'tensor', boxes)
            wh = boxes[:, 2:] - boxes[:, :2]
            targets.append(torch.log(wh / 8.0).mean(0))  # MARK log
        return {'loss_bbox': (pred - torch.stack(targets)).abs().mean()}


def _det_batch(bboxes, box_type=None):
    samples = []
    for i, boxes in enumerate(bboxes):
        sample = BaseDataElement(metainfo=dict(
            img_path='img_{}.jpg'.format(i), img_shape=(32, 32)))
        boxes = torch.tensor(boxes, dtype=torch.float32)
        sample.gt_instances = InstanceData(
            bboxes=boxes if box_type is None else box_type(boxes),
            labels=torch.zeros(len(boxes), dtype=torch.long))
        samples.append(sample)
    gen = torch.Generator().manual_seed(0)
    return {'inputs': [torch.rand(4, generator=gen) for _ in bboxes],
            'data_samples': samples}


# Sample 1 has a zero-height box; sample 0's half-pixel box is small but fine.
BOXES = [[[2., 2., 2.5, 2.5]], [[4., 4., 12., 12.], [5., 6., 9., 6.]],
         [[1., 1., 9., 9.]]]


def assert_zero_height_sample_named(box_type=None):
    report = _check_report(diagnose(_BoxRegressor(),
                                    _det_batch(BOXES, box_type)))
    assert report['kind'] == 'data'
    assert report['nonfinite_losses'] == ['loss_bbox']
    assert report['samples'] == [{
        'index': 1, 'img_path': 'img_1.jpg',
        'problems': ['gt box 1 has zero height (h=0)']}]
    assert [r['result'] for r in report['sample_replays']] == [
        'finite', 'nonfinite', 'finite']
    assert report['location'] == _line_of('log')
    assert 'img_1.jpg' in report['summary']
    assert 'zero height' in report['summary']
    assert any('FilterAnnotations' in hint for hint in report['hints'])
    # Proven advice: the batch without sample 1 is finite; the pipeline
    # fixes need the run's train pipeline, which a bare diagnosis lacks.
    fixes = dict((f['kind'], f) for f in report['fixes'])
    assert fixes['drop_samples']['status'] == 'verified'
    assert fixes['drop_samples']['samples'] == [1]
    assert math.isfinite(fixes['drop_samples']['loss'])
    assert fixes['filter']['status'] == 'untested'
    assert 'the train pipeline is unknown' in fixes['filter']['detail']
    return report


def test_zero_size_gt_box_names_only_that_sample_plain_tensors():
    assert_zero_height_sample_named()


def test_finite_replay_is_not_reproduced():
    model = _Toy()
    report = _check_report(diagnose(model, _batch()))
    assert report['kind'] == 'not_reproduced'
    assert report['module'] is None and report['op'] is None
    assert report['samples'] == []
    assert all(math.isfinite(v) for v in report['losses'].values())
    # Tried once more, finite again; nothing to verify a fix against.
    assert report['replays_agree'] is True
    assert [(f['kind'], f['status']) for f in report['fixes']] == [
        ('none', 'untested')]
    assert 'no failure to replay a fix against' in report['fixes'][0][
        'detail']


class _Flaky(_Toy):
    """Non-finite on every second forward: a fault that comes and goes."""

    calls = 0

    def forward(self, inputs, data_samples=None, mode='loss'):
        self.calls += 1
        losses = super(_Flaky, self).forward(inputs, data_samples, mode)
        if self.calls % 2 == 0:
            losses['loss_toy'] = losses['loss_toy'] * float('nan')
        return losses


def test_a_fault_that_comes_and_goes_is_told_by_a_second_replay():
    report = _check_report(diagnose(_Flaky(), _batch()))
    assert report['kind'] == 'not_reproduced'
    assert report['replays_agree'] is False
    assert any('comes and goes' in note for note in report['notes'])


class _Interrupt(BaseException):
    """Not an Exception: diagnose must let it through."""


class _Interrupting(BaseModel):

    def __init__(self):
        super(_Interrupting, self).__init__()
        self.body = nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))

    def forward(self, inputs, data_samples=None, mode='loss'):
        out = self.body(torch.stack(inputs))
        if torch.is_anomaly_enabled():  # inside the instrumented replay
            raise _Interrupt()
        return {'loss_x': out.sum()}


@pytest.mark.parametrize('raises', [False, True])
def test_everything_is_restored_after_diagnose(raises):
    model = _Interrupting() if raises else _Toy()
    if not raises:
        model.body.add_module('norm', nn.BatchNorm1d(2))
    grads = {}
    for name, param in model.named_parameters():
        param.grad = torch.full_like(param, 7.0)
        grads[name] = param.grad
    before = _state(model)
    compat.set_detect_anomaly(False)
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    tracer = sys.gettrace()
    try:
        if raises:
            with pytest.raises(_Interrupt):
                diagnose(model, _batch())
        else:
            diagnose(model, _batch())
    finally:
        anomaly = torch.is_anomaly_enabled()
    assert not anomaly
    assert sys.gettrace() is tracer
    assert torch.equal(torch.get_rng_state(), rng)
    _assert_untouched(model, before)  # BN running stats included
    for name, param in model.named_parameters():
        assert param.grad is grads[name]


def test_anomaly_mode_left_on_by_the_caller_stays_on():
    compat.set_detect_anomaly(True, check_nan=True)
    try:
        before = compat.anomaly_state()
        diagnose(_Toy(), _batch())
        assert compat.anomaly_state() == before == (True, True)
    finally:
        compat.set_detect_anomaly(False)


class _AnomalyProbe(nn.Module):
    """An L1 loss that notes whether anomaly mode was on in its forward."""

    def __init__(self):
        super(_AnomalyProbe, self).__init__()
        self.seen = []

    def forward(self, pred, target):
        self.seen.append(torch.is_anomaly_enabled())
        return (pred - target).abs().mean() * float('nan')


@pytest.mark.parametrize('anomaly', [True, False])
def test_main_replay_uses_anomaly_mode_unless_turned_off(anomaly):
    probe = _AnomalyProbe()
    report = diagnose(_Toy(loss_fn=probe), _batch(), check_samples=False,
                      anomaly=anomaly)
    assert report.kind != 'not_reproduced'
    # The first replay is the main, instrumented one.
    assert probe.seen[0] is anomaly
    assert not torch.is_anomaly_enabled()


class _Amplifier(BaseModel):

    def __init__(self):
        super(_Amplifier, self).__init__()
        self.big = nn.Linear(4, 2)
        with torch.no_grad():
            # Inputs in [1, 2): outputs of 1.2e5..2.4e5, over fp16's 65504.
            self.big.weight.fill_(3e4)
        self.head = nn.Linear(2, 1)

    def forward(self, inputs, data_samples=None, mode='loss'):
        x = torch.stack(inputs) + 1.0
        return {'loss_amp': self.head(self.big(x)).float().mean() * 1e-5}


class _RootAmplifier(BaseModel):
    """The out-of-range product is made in the model's own forward, outside
    any submodule (as ``h = h * 1e5`` in a detector's ``forward``)."""

    def __init__(self):
        super(_RootAmplifier, self).__init__()
        self.body = nn.Linear(4, 2)
        self.head = nn.Linear(2, 1)

    def forward(self, inputs, data_samples=None, mode='loss'):
        y = self.head(self.body(torch.stack(inputs))) * 1e6
        return {'loss_amp': y.float().pow(2).mean()}


def test_fp16_range_overflow_outside_any_submodule_is_worded_so():
    if compat.autocast('cpu', torch.float16) is None:
        pytest.skip('this torch cannot autocast to float16 on CPU')
    report = diagnose(_RootAmplifier(), _batch(), amp_dtype=torch.float16)
    assert report.kind == 'overflow', report.summary
    assert 'None' not in report.summary, report.summary
    assert "the model's own outputs" in report.summary, report.summary


def test_fp16_range_overflow_vs_float32():
    report = _check_report(diagnose(_Amplifier(), _batch(),
                                    amp_dtype=torch.float16))
    assert report['amp_dtype'] == 'float16'
    if compat.autocast('cpu', torch.float16) is None:
        # torch < 1.10 cannot autocast on CPU: the replay says so, in fp32.
        assert report['kind'] == 'not_reproduced'
        assert any('autocast(float16) is not available' in n
                   for n in report['notes'])
        return
    assert report['kind'] == 'overflow'
    assert report['module'] == 'big'
    assert report['overflow']['max_abs'] > 65504
    assert any('float32' in hint for hint in report['hints'])
    (fix, ) = report['fixes']
    assert fix['kind'] == 'fp32' and fix['status'] == 'verified'
    assert math.isfinite(fix['loss']) and fix['hint'] is not None
    assert 'float32' in report['hints'][fix['hint']]
    # Without AMP the same model is fine.
    assert diagnose(_Amplifier(), _batch()).kind == 'not_reproduced'


@pytest.mark.mmdet
def test_zero_size_gt_box_names_only_that_sample_mmdet_boxes():
    from mmdet.structures.bbox import HorizontalBoxes
    assert_zero_height_sample_named(HorizontalBoxes)


@pytest.mark.mmrotate
def test_rotated_gt_boxes_checked_by_their_mmrotate_type():
    from mmrotate.structures.bbox import RotatedBoxes
    from mmnanhook.diagnosis._data import ANGLE_RANGES, check_batch
    batch = _det_batch([[[8., 8., 4., 2., 0.2]],
                        [[8., 8., 0., 2., 0.2], [8., 8., 4., 2., 2.5]]],
                       RotatedBoxes)
    found = check_batch(batch, angle_range=ANGLE_RANGES['le90'])
    assert [s.to_dict() for s in found] == [
        {'index': 0, 'img_path': 'img_0.jpg', 'problems': []},
        {'index': 1, 'img_path': 'img_1.jpg', 'problems': [
            'gt box 0 has zero width (w=0)',
            'gt box 1 has angle 2.5 rad outside the configured range '
            '[-1.5708, 1.5708]']},
    ]


class _Exploding(BaseModel):
    """Finite gradients whose float32 norm overflows (squares > 3e38)."""

    def __init__(self):
        super(_Exploding, self).__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, inputs, data_samples=None, mode='loss'):
        return {'loss_big': (self.fc(torch.stack(inputs)) * 1e25).mean()}


def test_finite_gradients_with_overflowing_norm_hint_at_exploding_updates():
    report = _check_report(diagnose(_Exploding(), _batch()))
    assert report['kind'] == 'backward'
    assert report['nonfinite_grad_count'] == 0
    assert math.isinf(report['grad_norm'])
    assert report['backward'] is None
    assert 'gradient norm inf from finite gradients' in report['summary']
    assert any('exploding' in hint and 'clip_grad' in hint
               for hint in report['hints'])


class _Raising(nn.Module):

    def forward(self, x):
        raise ValueError('no boxes left after filtering')  # MARK raise


def test_exception_in_forward_names_the_module_and_line():
    model = _Toy()
    model.body = nn.Sequential(nn.Linear(4, 8), _Raising())
    report = _check_report(diagnose(model, _batch()))
    assert report['kind'] == 'exception'
    assert report['exception'] == {'phase': 'forward', 'type': 'ValueError',
                                   'message': 'no boxes left after filtering'}
    assert report['module'] == 'body.1'
    assert report['location'] == _line_of('raise')
    assert 'ValueError: no boxes left after filtering' in report['traceback']


class _BatchDependent(BaseModel):
    """Divides by zero for a batch of exactly three samples."""

    def __init__(self):
        super(_BatchDependent, self).__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, inputs, data_samples=None, mode='loss'):
        out = self.fc(torch.stack(inputs)).mean()
        return {'loss_batch': out / (len(inputs) - 3)}  # MARK batch


def test_failure_of_the_whole_batch_only_blames_no_sample():
    report = _check_report(diagnose(_BatchDependent(), _batch()))
    assert report['kind'] == 'forward'
    assert report['module'] is None  # the model's own forward
    assert report['location'] == _line_of('batch')
    assert report['samples'] == []
    assert [r['result'] for r in report['sample_replays']] == ['finite'] * 3
    assert any('on its own' in note for note in report['notes'])
    assert any('batch as a whole' in hint for hint in report['hints'])


def test_partial_report_formats():
    # A report built by the caller when the replay itself failed.
    text = format_report(dict(kind='not_reproduced', summary='it failed'))
    assert text.splitlines()[:2] == ['mmnanhook diagnosis: not_reproduced',
                                     'summary: it failed']


def test_node_hooks_are_removed_also_when_the_block_raises():
    x = torch.zeros(3, requires_grad=True)
    loss = torch.sqrt(x * 1.0).sum()  # d sqrt(x) / dx = inf at 0
    watch = BackwardWatch([loss])
    with pytest.raises(_Interrupt):
        with watch:
            raise _Interrupt()
    loss.backward(retain_graph=True)
    assert watch.producer is None
    with watch:
        loss.backward()
    assert is_op(watch.producer['op'], 'SqrtBackward')
    assert watch.producer['inf'] == 3


def test_forward_patches_restore_a_forward_set_on_the_instance():
    model = _Toy()
    own = model.body[0].forward
    model.body[0].forward = own  # e.g. set by another tool
    for patch in (ForwardWatch(model), LineLocator(model.body[0], 0)):
        with pytest.raises(_Interrupt):
            with patch:
                assert model.body[0].__dict__['forward'] is not own
                raise _Interrupt()
        assert model.body[0].__dict__['forward'] is own
        assert 'forward' not in model.body[2].__dict__


def test_nan_input_is_data_naming_the_sample_without_a_location():
    batch = _batch()
    batch['inputs'][2][1] = float('nan')
    report = _check_report(diagnose(_Toy(), batch))
    assert report['kind'] == 'data'
    assert report['samples'] == [{'index': 2, 'img_path': None,
                                  'problems': [
                                      'input has 1 NaN and 0 Inf values']}]
    assert report['forward'] is None
    assert report['location'] is None and report['module'] is None
    assert any('NaN/Inf' in hint for hint in report['hints'])


def test_without_sample_replays_the_checks_name_the_suspects():
    report = _check_report(diagnose(_BoxRegressor(), _det_batch(BOXES),
                                    check_samples=False))
    assert report['kind'] == 'data'
    assert report['sample_replays'] is None
    assert [s['index'] for s in report['samples']] == [1]


class _KeepsGraph(BaseModel):
    """Adds the previous iteration's output, graph and all."""

    def __init__(self):
        super(_KeepsGraph, self).__init__()
        self.fc = nn.Linear(4, 2)
        self.previous = None

    def forward(self, inputs, data_samples=None, mode='loss'):
        out = self.fc(torch.stack(inputs)).sigmoid()
        if self.previous is not None:
            out = out + self.previous
        self.previous = out * 2
        return {'loss_kept': out.sum()}


def test_backward_through_an_earlier_iterations_graph_is_an_exception():
    model = _KeepsGraph()
    _loss(model, _batch()).backward()  # the iteration before the failure
    report = _check_report(diagnose(model, _batch()))
    assert report['kind'] == 'exception'
    assert 'second time' in report['exception']['message']
    assert is_op(report['op'], 'SigmoidBackward')
    assert report['location'] is None
    assert any('earlier iteration' in note for note in report['notes'])
    assert any('retain_graph' in hint for hint in report['hints'])
