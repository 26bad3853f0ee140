"""mmdet's zoo RetinaNet R50 on a GPU: AMP, ``torch.compile`` (inductor)
and a clean AMP epoch. Run by ``make device-check`` on a device machine
(``scripts/device_check.sh``); skipped elsewhere, unless dry-run on the CPU
(``MMNAN_DEVICE_DRYRUN=cpu``: the same tests at 64 px, AMP as float16
autocast on the CPU, ``compile`` with ``aot_eager``; see
:mod:`mmnan_testing.cuda_zoo`).

The shipped config's child (:mod:`mmnan_testing.zoo`: synthetic COCO data,
``init_cfg=None``, 320 px, nothing downloaded) with one substitution: the
device machine's mmcv has its CPU ops only, and mmdet's ``FocalLoss`` calls
mmcv's CUDA ``sigmoid_focal_loss`` for CUDA tensors, so where that kernel
does not run, mmdet's ``py_sigmoid_focal_loss`` stands in for it
(``PyFocalLoss``: ``FocalLoss``'s own one-hot path, the one it takes on a
CPU). Each test records which loss ran (``focal_loss`` in the JUnit
properties) beside its results.

When ``MMNAN_DEVICE_OUT`` is set, the AMP test's bundle is copied there:
``tests/zoo/test_zoo_cuda_replay.py`` replays it on the CPU.
"""
import glob
import json
import math
import os
import os.path as osp
import shutil

import pytest
import torch
from mmengine.runner import Runner

from mmnanhook import NonFiniteError, compat
from mmnan_testing import cuda_zoo, faults, zoo

DEVICE = cuda_zoo.target()

pytestmark = [
    pytest.mark.cuda, pytest.mark.zoo, pytest.mark.mmdet,
    pytest.mark.skipif(DEVICE is None, reason=cuda_zoo.SKIP_REASON),
]

# A float16 autocast on the CPU (the dry run) needs torch >= 2.3.
needs_amp = pytest.mark.skipif(
    DEVICE is not None and cuda_zoo.amp_wrapper(DEVICE) is None,
    reason='no float16 autocast and GradScaler on this torch\'s CPU (torch '
    '>= 2.3): the AMP tests dry-run on the modern leg only')


@pytest.fixture(autouse=True)
def _said(record_property):
    record_property('device', DEVICE)
    record_property('focal_loss', cuda_zoo.focal_loss(DEVICE)[1])
    if DEVICE == 'cuda':
        record_property('gpu', torch.cuda.get_device_name(0))


def _finite(runner):
    return all(bool(torch.isfinite(v).all())
               for v in zoo.weights(runner).values())


@needs_amp
def test_amp_fp16_range_fault_is_an_overflow_and_float32_is_verified(
        tmp_path, record_property):
    data = zoo.make_zoo_dataset(cuda_zoo.NAME, str(tmp_path / 'data'),
                                num_images=4)
    planted = data['images'][2]
    bad = osp.join(data['img_dir'], planted)
    cfg = cuda_zoo.config(data, tmp_path / 'amp', DEVICE, amp=True,
                          fp16_range=[planted],
                          hook=dict(dump_dir=str(tmp_path / 'dumps')))
    runner, probe = zoo.runner_with_files(cfg)
    with pytest.raises(NonFiniteError) as info:
        runner.train()
    error = info.value
    report = error.report
    record_property('summary', report['summary'])
    # The iteration of the planted sample, and none before it.
    at = [i for i, files in enumerate(probe.files) if bad in files][0]
    assert error.iter == at == probe.before[0]
    assert error.trigger == 'loss'
    # Tier 1 under AMP: weights and optimizer state (the scaler's included)
    # bitwise those before that iteration.
    zoo.assert_equal(zoo.weights(runner), probe.before[1], 'weights')
    zoo.assert_equal(runner.optim_wrapper.state_dict(), probe.before[2],
                     'optimizer')
    assert 'loss_scaler' in probe.before[2]
    # Named an overflow of float16, at the planted line, in that sample.
    assert report['amp_dtype'] == 'float16'
    assert report['kind'] == 'overflow', report['summary']
    assert report['overflow']['dtype'] == 'float16'
    assert report['overflow']['limit'] == torch.finfo(torch.float16).max
    assert faults.is_op(report['op'], 'MulBackward'), report['op']
    from mmnan_testing.cuda_zoo_modules import line_of
    assert report['location'] == line_of('fp16_range')
    assert 'only under autocast(float16), finite in float32' in \
        report['summary']
    assert [s['img_path'] for s in report['samples']] == [bad]
    replays = dict((r['index'], r['result'])
                   for r in report['sample_replays'])
    (index, ) = [s['index'] for s in report['samples']]
    assert replays[index] == 'nonfinite'
    assert set(replays.values()) == {'finite', 'nonfinite'}
    # The fix, proven: the same iteration in float32 is finite.
    (fix, ) = [f for f in report['fixes'] if f['kind'] == 'fp32']
    assert fix['status'] == 'verified' and math.isfinite(fix['loss'])
    assert 'verified fix: ' + fix['fix'] in str(error)
    assert osp.isfile(osp.join(error.bundle, 'model.pth'))
    out = os.environ.get('MMNAN_DEVICE_OUT')
    if out:
        shutil.copytree(error.bundle, osp.join(out, 'zoo_amp_bundle'))


@needs_amp
def test_clean_amp_epoch_triggers_nothing(tmp_path, record_property):
    # Two iterations in the dry run: a float16 R50 iteration takes seconds
    # on one CPU core.
    images = 8 if DEVICE == 'cuda' else 4
    data = zoo.make_zoo_dataset(cuda_zoo.NAME, str(tmp_path / 'data'),
                                num_images=images)
    runs = {}
    for name, hook in (('plain', None), ('hooked', {})):
        cfg = cuda_zoo.config(data, tmp_path / name, DEVICE, amp=True,
                              hook=hook)
        runner = Runner.from_cfg(cfg)
        probe = cuda_zoo.AmpProbe()
        runner.register_hook(probe)
        runner.train()
        runs[name] = (runner, probe)
    runner, probe = runs['hooked']
    plain = runs['plain'][1]
    record_property('loss_scales', json.dumps(probe.scales))
    record_property('losses', json.dumps(probe.loss))
    iters = images // 2
    assert runner.epoch == 1 and runner.iter == len(probe.loss) == iters
    assert probe.hooks.count('NanDetectHook') == 1
    # No trigger, no skip, no spike, nothing written.
    hub = runner.message_hub
    assert hub.get_scalar('train/nan_skipped').current() == 0
    assert hub.get_scalar('train/spikes').current() == 0
    assert len(hub.get_scalar('train/loss_scale').data[0]) == iters
    assert not osp.exists(osp.join(runner.work_dir, 'nan_dumps'))
    assert all(math.isfinite(v) for v in probe.loss) and _finite(runner)
    # The run is the run without the hook: the same loss scales (so the
    # same steps skipped by the scaler), the same losses (on a GPU, up to
    # its nondeterministic kernels' rounding).
    assert probe.files == plain.files
    assert probe.scales == plain.scales
    if DEVICE == 'cpu':
        assert probe.loss == plain.loss
    else:
        assert probe.loss == pytest.approx(plain.loss, rel=1e-3)


@pytest.fixture
def _fresh_dynamo():
    # Nothing compiled by an earlier test of the session is reused.
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.skipif(not compat.HAS_DYNAMO,
                    reason='torch.compile needs torch >= 2.0')
def test_compile_drop_leaves_out_the_bad_sample(tmp_path, _fresh_dynamo,
                                                record_property):
    if DEVICE == 'cuda':
        pytest.importorskip('triton', reason='inductor compiles CUDA '
                            'kernels with triton, not installed here')
    images = 4
    # Image 1's annotation declares it twice as wide as its file: Resize
    # clips a box to zero width, the box coder takes log(0).
    data = zoo.make_zoo_dataset(cuda_zoo.NAME, str(tmp_path / 'data'),
                                num_images=images,
                                defects={1: 'size_mismatch'})
    bad = osp.join(data['img_dir'], data['defect_images'][0])
    cfg = cuda_zoo.config(data, tmp_path / 'drop', DEVICE, compiled=True,
                          hook=dict(policy='drop'))
    record_property('compile', repr(cfg.compile))
    runner = Runner.from_cfg(cfg)
    probe = zoo.DropProbe(bad)
    runner.register_hook(probe)
    runner.train()
    # The runner compiled the step the hook wrapped.
    assert compat.compiled_original(
        vars(runner.model).get('train_step')) is not None
    assert runner.epoch == 1 and runner.iter == len(probe.files) == 2
    assert probe.at is not None
    # The bad sample dropped, no step skipped, quarantined with its cause.
    sample = zoo.dropped_alone(runner, bad, images)
    assert 'declares the image 640x320' in sample.reason
    (bundle, ) = glob.glob(osp.join(runner.work_dir, 'nan_dumps', '*'))
    with open(osp.join(bundle, 'report.json')) as f:
        report = json.load(f)
    record_property('summary', report['summary'])
    assert [s['img_path'] for s in report['samples']] == [bad]
    assert 'has zero width' in report['summary']
    assert _finite(runner)
    # The step applied is the eager step on the other sample alone, from
    # the same state (bitwise on the CPU; on a GPU up to its
    # nondeterministic kernels' rounding).
    after = zoo.step_by_hand(runner, probe, bad)
    for name, value in probe.at['after'].items():
        if DEVICE == 'cpu' or not value.is_floating_point():
            assert torch.equal(after[name], value), name
        else:
            assert torch.allclose(after[name], value, rtol=1e-4,
                                  atol=1e-6), name
