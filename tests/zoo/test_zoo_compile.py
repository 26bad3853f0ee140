"""``torch.compile`` on zoo configs: MMEngine's ``compile`` under
NanDetectHook.

A child config with ``compile = dict(backend='aot_eager')`` (or ``True``:
inductor) makes ``Runner._maybe_compile`` compile the model's bound
``train_step``, ``update_params`` included, before the hook's
``before_train``; every check, the listener and the whole trigger path are
reached from inside the compiled frame. The faults are those of
``test_zoo.py`` (an annotation that declares the image twice as wide as its
file; an LR blow-up), trained by a real Runner on synthetic data.

All in the full tier (``zoo_full``): compiling the R50 costs a minute or two
on two cores. The recompilations of a clean run, FlexibleRunner and the
toy's are in ``tests/test_compile.py``. torch 1.7 (the DOTA leg) has no
``torch.compile``: there these tests skip, and ``tests/test_compile.py``
shows that mmengine refuses the key alike with the hook and without it.
"""
import glob
import math
import os
import os.path as osp

import pytest
import torch
from mmengine.runner import Runner

from mmnanhook import NonFiniteError, compat
from mmnanhook.quarantine import read_quarantine
from mmnan_testing import testbed, zoo

pytestmark = [
    pytest.mark.zoo, pytest.mark.zoo_full, pytest.mark.mmdet,
    pytest.mark.skipif(
        not compat.HAS_DYNAMO,
        reason='torch.compile needs torch >= 2.0; on torch 1.7 (DOTA leg) '
        'mmengine refuses `compile`, with or without the hook '
        '(tests/test_compile.py)')
]

NAME = 'retinanet_r50'
IMAGES = 4
# The backend the issue asks for: fast to compile on a CPU, and what it runs
# is the AOT-traced forward and backward graphs.
AOT = "compile = dict(backend='aot_eager')"
THREADS = 2


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get('MMNANHOOK_TEST_THREADS',
                                             THREADS)))
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each run compiles from nothing: no cache entry of an earlier test's
    # model (the code objects are the same) is reused or counted.
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _bad_data(tmp_path, images=IMAGES):
    data = zoo.make_zoo_dataset(NAME, str(tmp_path / 'data'),
                                num_images=images,
                                defects={1: 'size_mismatch'})
    bad = osp.join(data['img_dir'], data['defect_images'][0])
    return data, bad


def _runner(data, work_dir, options=None, extra=AOT, length=1, hook=True,
            probe=None):
    cfg = zoo.child_config(NAME, data, str(work_dir), length=length,
                           hook='line' if hook else None,
                           hook_options=options, extra=extra)
    cfg.log_level = 'WARNING'
    runner = Runner.from_cfg(cfg)
    probe = probe if probe is not None else zoo.BatchFiles()
    runner.register_hook(probe)
    return runner, probe


def _train_into_error(runner):
    with pytest.raises(NonFiniteError) as info:
        runner.train()
    return info.value


# What a diagnosis says of the fault: compiled or not, the same.
def _findings(report):
    return dict(
        kind=report['kind'], module=report['module'], op=report['op'],
        location=report['location'], code=report['code'],
        samples=[(s['index'], s['img_path'], s['problems'])
                 for s in report['samples']],
        fixes=[(f['kind'], f['fix'], f['status']) for f in report['fixes']],
        summary=report['summary'])


def test_raise_under_compile_diagnoses_as_without_it(tmp_path):
    data, bad = _bad_data(tmp_path)
    runner, probe = _runner(data, tmp_path / 'compiled')
    assert runner.cfg.compile == dict(backend='aot_eager')
    error = _train_into_error(runner)
    # The runner did compile the step the hook wrapped.
    assert compat.compiled_original(
        vars(runner.model).get('train_step')) is not None
    bad_iter = [i for i, files in enumerate(probe.files) if bad in files][0]
    assert error.iter == bad_iter == probe.before[0]
    # Tier 1 under compile: the weights and optimizer state bitwise those
    # before the bad step.
    for name, value in zoo.weights(runner).items():
        assert torch.equal(value, probe.before[1][name]), name
    # Tier 2: a bundle, and the report of the eager run.
    assert error.bundle and osp.isdir(error.bundle)
    assert osp.isfile(osp.join(error.bundle, 'report.html'))
    found = _findings(error.report)
    assert [s[1] for s in found['samples']] == [bad]
    assert 'delta_xywh_bbox_coder.py' in found['location']
    assert 'has zero width' in found['summary']
    assert ('the annotation declares the image 640x320 (width x height) '
            'but the file is 320x320') in found['summary']
    assert dict((f[0], f[2]) for f in found['fixes'])['drop_samples'] == \
        'verified'
    eager, _ = _runner(data, tmp_path / 'eager', extra=None)
    assert _findings(_train_into_error(eager).report) == found


def test_drop_under_compile_recomputes_the_step_eagerly(tmp_path):
    data, bad = _bad_data(tmp_path)
    probe = zoo.DropProbe(bad)
    runner, _ = _runner(data, tmp_path / 'drop', dict(policy='drop'),
                        probe=probe)
    runner.train()
    assert runner.iter == len(probe.files) == 2 and probe.at is not None
    sample = zoo.dropped_alone(runner, bad, IMAGES)
    assert 'declares the image 640x320' in sample.reason
    assert len(os.listdir(osp.join(runner.work_dir, 'nan_dumps'))) == 1
    # The step applied is the eager step on the other sample alone, from
    # the same state, by hand, bitwise: the recomputation ran eagerly (and
    # the compiled forward's BN statistics were put back first).
    model = runner.model
    assert 'train_step' not in vars(model) or compat.compiled_original(
        vars(model)['train_step']) is not None
    after = zoo.step_by_hand(runner, probe, bad)
    for name, value in probe.at['after'].items():
        assert torch.equal(after[name], value), name


def test_skip_under_compile_finishes_the_epoch(tmp_path):
    data, _ = _bad_data(tmp_path)
    runner, probe = _runner(data, tmp_path / 'skip',
                            dict(policy='skip', replay=False, max_dumps=0))
    runner.train()
    assert runner.epoch == 1 and runner.iter == len(probe.files) == 2
    assert runner.message_hub.get_scalar('train/nan_skipped').current() == 1
    assert all(torch.isfinite(v).all()
               for v in zoo.weights(runner).values())


def test_rewind_under_compile_goes_back_to_the_snapshot(tmp_path):
    # test_zoo.py's LR blow-up (lr=20, where the loss rises for a few
    # iterations, then is non-finite), from iteration 4: good states to
    # go back to before it.
    data = zoo.make_zoo_dataset(NAME, str(tmp_path / 'data'), num_images=8)
    extra = AOT + '\noptim_wrapper = dict(optimizer=dict(lr=0.01))\n' \
        'param_scheduler = [dict(type=\'MultiStepLR\', by_epoch=False, ' \
        'begin=0, end=1000, milestones=[4], gamma=2000.0)]'
    probe = zoo.ZooProbe()
    states = {}

    class States(zoo.ZooProbe):
        priority = 'LOWEST'

        def after_train_iter(self, runner, batch_idx, data_batch=None,
                             outputs=None):
            states[runner.iter] = zoo.weights(runner)

    runner, _ = _runner(
        data, tmp_path / 'rewind',
        # Snapshots after iterations 1, 3, 5, ..., the last three kept
        # (289 MB each): one before the divergence.
        dict(policy='rewind', snapshot_interval=2, max_snapshots=3,
             cooldown=100, lr_factor=1e-3, max_rewinds=3), extra=extra,
        probe=probe, length=2)
    runner.register_hook(States())
    runner.train()
    hub = runner.message_hub
    assert hub.get_scalar('train/rewinds').current() >= 1
    hook = [h for h in runner.hooks if type(h).__name__ == 'NanDetectHook']
    records = hook[0]._history.records()
    rewound = [(r['iter'], r['rewind']) for r in records
               if r.get('rewind') is not None]
    assert rewound
    at, to = rewound[0]
    assert 1 <= to < at and runner.iter == 8
    # The weights after the rewinding iteration are the snapshot's
    # (after iter `to`), bitwise.
    for name, value in states[at].items():
        assert torch.equal(value, states[to][name]), name
    assert all(torch.isfinite(v).all()
               for v in zoo.weights(runner).values())


# The codebases leg's torch 2.14 (its mmdet 3.3 trains this config too): the
# leg's zoo share ends long before the modern leg's, which has the other
# compiled runs (torch 2.13), so inductor's two minutes of gcc go there.
@pytest.mark.on_legs('codebases')
def test_inductor_on_the_tiny_retinanet_diagnoses_the_zero_width_box(
        tmp_path):
    """The default backend (inductor, C++ code compiled with gcc) on a
    small mmdet model, on the codebases leg (torch 2.14)."""
    # VOC keeps the zero-width box (COCO's parser drops it).
    data = testbed.make_dataset('retinanet_voc', str(tmp_path / 'data'),
                                num_images=8, defects={3: 'zero_size'})
    cfg = testbed.tiny_config(
        'retinanet_voc', data, str(tmp_path / 'work'), max_iters=4,
        log_level='WARNING')
    cfg.compile = True
    cfg.default_hooks.nan_detect = dict(type='mmnanhook.NanDetectHook',
                                        policy='drop')
    runner = Runner.from_cfg(cfg)
    files = zoo.BatchFiles()
    runner.register_hook(files)
    runner.train()
    bad = osp.join(data['img_dir'], data['defect_images'][0])
    assert runner.iter == 4
    assert runner.message_hub.get_scalar(
        'train/samples_dropped').current() == 1
    (sample, ) = read_quarantine(
        osp.join(runner.work_dir, 'nan_quarantine.json'), 8)
    assert sample.file == bad
    (bundle, ) = glob.glob(osp.join(runner.work_dir, 'nan_dumps', '*'))
    report = open(osp.join(bundle, 'report.txt')).read()
    assert 'zero width' in report and 'delta_xywh_bbox_coder.py' in report
