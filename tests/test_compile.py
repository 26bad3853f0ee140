"""MMEngine's ``compile`` under NanDetectHook, on the tiny RetinaNet.

``compile`` in a config makes ``Runner._maybe_compile`` compile the model's
bound ``train_step`` (``update_params`` and so every binding of ours
included) before the hook's ``before_train``. Here: the tiny RetinaNet
under ``'drop'``, the recompilations of a clean run, FlexibleRunner, and on
the toy ``'warn'`` and a fault of the compiled code alone; the zoo R50 under
every policy and inductor are in ``tests/zoo/test_zoo_compile.py``. All in
the full tier but the DOTA leg's refusal: make test's compiled run is the
toy's (``tests/sentinel/test_schedulers_and_guard.py``).
"""
import glob
import math
import os.path as osp

import pytest
import torch
from mmengine.runner import FlexibleRunner, Runner

from mmnanhook import NonFiniteError, compat
from mmnanhook.diagnosis._incident import COMPILED_NOTE
from mmnan_testing import compiled, testbed, zoo
from mmnan_testing.toy import make_runner

IMAGES = 8
# Image 3 holds a box of zero width: with batches of 2 (no shuffling), the
# batch of iteration 1.
BAD = 3


def _config(tmp_path, compile_cfg, hook=True):
    data = testbed.make_dataset('retinanet_voc', str(tmp_path / 'data'),
                                num_images=IMAGES, defects={BAD: 'zero_size'})
    cfg = testbed.tiny_config('retinanet_voc', data, str(tmp_path / 'work'),
                              max_iters=2, log_level='WARNING')
    cfg.compile = compile_cfg
    if hook:
        cfg.default_hooks.nan_detect = dict(
            type='mmnanhook.NanDetectHook', policy='drop')
    return cfg, osp.join(data['img_dir'], data['defect_images'][0])


@pytest.mark.mmdet
@pytest.mark.zoo_full
@pytest.mark.skipif(not compat.HAS_DYNAMO,
                    reason='torch.compile needs torch >= 2.0 (the DOTA leg '
                    'refuses `compile`: the test below)')
def test_compiled_train_step_keeps_the_diagnosis_drop_and_quarantine(
        tmp_path):
    """Full tier (25 CPU-s, the compile): make test's one compiled run is
    the toy's (tests/sentinel/test_schedulers_and_guard.py: the check, the
    listener and its bundle under a compiled train_step)."""
    cfg, bad = _config(tmp_path, dict(backend='aot_eager'))
    runner = Runner.from_cfg(cfg)
    files = zoo.BatchFiles()
    runner.register_hook(files)
    with compiled.dynamo_record() as record:
        runner.train()
    # The compiled step ran (and is back on the instance, the hook gone).
    assert compat.compiled_original(
        vars(runner.model)['train_step']) is not None
    assert runner.iter == 2 and [bad in f for f in files.files] == [False,
                                                                    True]
    # The listener ran, replayed eagerly, named the sample: dropped and
    # quarantined, one bundle.
    sample = zoo.dropped_alone(runner, bad, IMAGES)
    assert 'zero width' in sample.reason
    log = zoo_log(runner)
    assert 'the NaN listener failed' not in log
    # Dynamo traced none of mmnanhook: no recompilation names it, and the
    # one graph break it adds is a call to a not_traced function.
    assert not [m for m in record['recompiles'] if 'mmnanhook' in m]
    assert [n for r, n in record['graph_breaks'].items()
            if compiled.DISABLED_BREAK in r] == [1]


def zoo_log(runner):
    (path, ) = glob.glob(osp.join(runner.log_dir, '*.log'))
    with open(path) as f:
        return f.read()


@pytest.mark.mmdet
@pytest.mark.skipif(compat.HAS_DYNAMO,
                    reason='torch >= 2.0 compiles: the test above')
def test_compile_is_refused_alike_with_the_hook_on_torch_1_7(tmp_path):
    """The DOTA leg's torch 1.7.1: mmengine refuses ``compile`` before the
    first iteration; with the hook, the same error and nothing else."""
    errors = {}
    for hook in (False, True):
        cfg, _ = _config(tmp_path / str(hook), True, hook=hook)
        runner = Runner.from_cfg(cfg)
        files = zoo.BatchFiles()
        runner.register_hook(files)
        with pytest.raises(AssertionError) as info:
            runner.train()
        errors[hook] = str(info.value)
        assert files.files == [] and runner.iter == 0
        assert not osp.exists(osp.join(runner.work_dir, 'nan_dumps'))
        # Nothing of the hook is left on the model or the optim wrapper.
        assert 'train_step' not in vars(runner.model)
        assert 'update_params' not in vars(runner.optim_wrapper)
    assert errors[True] == errors[False]
    assert 'PyTorch >= 2.0.0 is required' in errors[True]


@pytest.mark.zoo_full
@pytest.mark.skipif(not compat.HAS_DYNAMO or not hasattr(
    torch.compiler, 'is_compiling'), reason='needs torch.compile (and '
    'torch.compiler.is_compiling, torch >= 2.3) for a compiled-only fault')
def test_a_fault_of_the_compiled_code_alone_is_said_to_be_replayed_eagerly(
        tmp_path):
    """Full tier (make test's compiled test is the toy's check and bundle).
    The toy's loss is NaN only where dynamo traces it: the eager replay is
    finite, and the report says why it may be; the replay through the
    compiled forward is not finite, and the report says so."""
    runner = make_runner(
        tmp_path, faults={6: 'compiled_only'}, hook=dict(type='NanDetectHook'),
        cfg=dict(compile=dict(backend='eager')))
    with pytest.raises(NonFiniteError) as info:
        runner.train()
    report = info.value.report
    assert info.value.iter == 3 and report['kind'] == 'not_reproduced'
    assert COMPILED_NOTE in report['notes']
    assert report['compiled_agrees'] is False
    assert any('the fault is made by the compiled code alone' in note and
               "backend='eager'" in note for note in report['notes'])


@pytest.mark.zoo_full
@pytest.mark.skipif(not compat.HAS_DYNAMO,
                    reason='torch.compile needs torch >= 2.0')
def test_warn_under_compile_diagnoses_and_steps_as_mmengine_would(tmp_path):
    """Full tier (the other policies under compile: the zoo R50,
    tests/zoo/test_zoo_compile.py)."""
    runner = make_runner(
        tmp_path, faults={6: 'nan_term'},
        hook=dict(type='NanDetectHook', policy='warn'),
        cfg=dict(compile=dict(backend='eager')))
    runner.train()
    assert runner.iter == 4
    (bundle, ) = glob.glob(osp.join(runner.work_dir, 'nan_dumps', '*'))
    with open(osp.join(bundle, 'report.txt')) as f:
        assert 'mmnan_testing/toy.py' in f.read()
    # Applied: the NaN gradients reached the weights.
    assert not all(bool(torch.isfinite(p).all())
                   for p in runner.model.parameters())


@pytest.mark.mmdet
@pytest.mark.zoo_full
@pytest.mark.skipif(not compat.HAS_DYNAMO,
                    reason='torch.compile needs torch >= 2.0')
def test_clean_compiled_run_recompiles_no_more_with_the_hook(tmp_path):
    """Full tier (two compiled runs). 8 iterations of the tiny RetinaNet,
    whose LinearLR warmup changes the LR in the first 4."""
    data = testbed.make_dataset('retinanet', str(tmp_path / 'data'),
                                num_images=16)
    backend = compiled.counting_backend()
    counts = {}
    for hook in (False, True):
        cfg = testbed.tiny_config('retinanet', data,
                                  str(tmp_path / str(hook)), max_iters=8,
                                  log_level='WARNING')
        cfg.compile = dict(backend=backend)
        if hook:
            cfg.default_hooks.nan_detect = dict(
                type='mmnanhook.NanDetectHook')
        graphs, probe = compiled.GraphsPerIter(), zoo.ZooProbe()
        with compiled.dynamo_record() as record:
            runner = Runner.from_cfg(cfg)
            runner.register_hook(graphs)
            runner.register_hook(probe)
            runner.train()
        assert runner.iter == 8 and len(graphs.counts) == 8
        counts[hook] = dict(record, graphs=graphs.counts, loss=probe.loss)
    plain, ours = counts[False], counts[True]
    # Every recompilation with the hook is one the run without it made
    # (function and place): none is of mmnanhook's making.
    ours_fns = compiled.recompiled_functions(ours['recompiles'])
    plain_fns = compiled.recompiled_functions(plain['recompiles'])
    assert len(ours_fns) <= len(plain_fns), (ours_fns, plain_fns)
    assert not [f for f in ours_fns if f not in plain_fns], (ours_fns,
                                                             plain_fns)
    assert not [m for m in ours['recompiles'] if 'mmnanhook' in m]
    # The hook's only graph-break site is where it is entered; no more
    # compiled graphs per iteration than without it.
    added = [r for r in ours['graph_breaks'] if r not in plain['graph_breaks']]
    assert all(compiled.DISABLED_BREAK in r for r in added), added
    assert max(ours['graphs'][1:]) <= min(plain['graphs'][1:])
    # The same training.
    assert all(math.isfinite(v) for v in ours['loss'])
    assert ours['loss'] == pytest.approx(plain['loss'], rel=1e-4)


@pytest.mark.mmdet
@pytest.mark.zoo_full
@pytest.mark.skipif(not compat.HAS_DYNAMO,
                    reason='torch.compile needs torch >= 2.0')
def test_flexible_runner_compiles_and_the_hook_diagnoses(tmp_path):
    """Full tier. FlexibleRunner's strategy compiles ``train_step`` itself
    (``compile`` -> ``target='train_step'``)."""
    cfg, bad = _config(tmp_path, None)
    cfg.default_hooks.nan_detect = dict(type='mmnanhook.NanDetectHook')
    runner = FlexibleRunner.from_cfg(cfg)
    # FlexibleRunner.from_cfg (mmengine 0.10.7) does not hand the config's
    # compile on: what FlexibleRunner(compile=...) sets.
    assert runner._compile is False
    runner._compile = dict(backend='aot_eager')
    files = zoo.BatchFiles()
    runner.register_hook(files)
    with pytest.raises(NonFiniteError) as info:
        runner.train()
    error = info.value
    assert compat.compiled_original(
        vars(runner.model).get('train_step')) is not None
    assert error.bundle and osp.isdir(error.bundle)
    assert [s['img_path'] for s in error.report['samples']] == [bad]
    assert 'delta_xywh_bbox_coder.py' in error.report['location']
    for name, value in zoo.weights(runner).items():
        assert torch.equal(value, files.before[1][name]), name
