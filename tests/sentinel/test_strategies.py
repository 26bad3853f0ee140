"""MMEngine's FlexibleRunner strategies and sharded gradients on two CPU
ranks over gloo (see :mod:`mmnan_testing.strategies`).

FSDP1 (what MMEngine's ``FSDPStrategy`` wraps with) refuses a CPU on torch
2.13, so the global norm is tested on the layouts it produces: plain tensors
split as its shards are (both legs), and FSDP2 ``fully_shard``'s DTensor
gradients (torch >= 2.4, the modern leg). DeepSpeed and ColossalAI are
refused (``test_toy_runner.py`` and below), without the packages installed.
"""
import os.path as osp

import pytest

from mmnan_testing import zoo
from mmnan_testing.ddp import run_ranks
from mmnan_testing.strategies import (BAD_ITER, BAD_RANK,
                                          fsdp2_available,
                                          toy_flexible_runner)

MODULE = 'mmnan_testing.strategies'


@pytest.mark.ddp
def test_sharded_norm_is_the_global_one_on_every_rank(tmp_path):
    results, log = run_ranks('shards', tmp_path, module=MODULE)
    for result in results:
        for p in ('2.0', '1.0', 'inf'):
            assert result['norm_' + p] == pytest.approx(
                result['expected_' + p], rel=1e-6), (p, log[-3000:])
        # Both ranks decide on the NaN only rank 1's shard holds.
        assert result['nan_trigger'] == 'grad'
        assert result['nan_norm'] != result['nan_norm']
    # What a norm of the local shards would have been: not the same number.
    assert results[0]['local_2.0'] != results[1]['local_2.0']
    assert [r['nan_grads'] for r in results] == [0, 1]
    for result in results:
        # Each rank's shards are finite, with a finite norm; the global norm
        # overflows fp32 (which would make the clip zero every gradient).
        assert result['big_local'] < 1.5e19 and result['big_norm'] == float(
            'inf')
        assert 'norm overflows' in result['big_message']


@pytest.mark.ddp
@pytest.mark.skipif(not fsdp2_available(),
                    reason='FSDP2 fully_shard needs torch >= 2.4 '
                    '(torch.distributed.fsdp / _composable.fsdp)')
def test_fsdp2_dtensor_grads_are_checked_and_clipped_by_the_global_norm(
        tmp_path):
    results, log = run_ranks('fsdp2', tmp_path, module=MODULE)
    for rank, result in enumerate(results):
        assert result['dtensor_grads'] == [
            'body.0.bias', 'body.0.weight', 'body.2.bias', 'body.2.weight'
        ], log[-3000:]
        # Logged and clipped by the unsharded model's norm, not the local
        # shards' one MMEngine's FSDP clip would use.
        assert result['logged_norm'] == pytest.approx(result['ref_norm'],
                                                      rel=1e-6)
        assert result['local_norm'] < 0.95 * result['ref_norm']
        assert result['max_weight_diff'] < 1e-6
        # A NaN in rank 1's shard: both ranks stop, weights untouched.
        assert result['raised'] and result['trigger'] == 'grad'
        assert result['unchanged']
        assert 'rank %d of 2' % rank in result['message']
    assert 'body.2.weight' in results[1]['message']
    assert 'those of rank 1 are not' in results[0]['message']


@pytest.mark.ddp
@pytest.mark.zoo
@pytest.mark.zoo_full
@pytest.mark.mmdet
@pytest.mark.skipif(not zoo.available('retinanet_r50'),
                    reason='mmdet with compiled mmcv ops not installed')
def test_flexible_runner_ddp_strategy_stops_every_rank_on_the_zoo_retinanet(
        tmp_path):
    """Full tier: make test's zoo DDP run is RTMDet's (tests/zoo/
    test_zoo_ddp.py); FlexibleRunner's wrapping is checked on the toy in
    make test."""
    results, log = run_ranks('flexible_ddp', tmp_path, module=MODULE)
    for rank, result in enumerate(results):
        assert result['runner'] == 'FlexibleRunner', log[-5000:]
        assert result['strategy'] == 'DDPStrategy'
        assert result['raised'], (rank, log[-5000:])
        assert result['iter'] == BAD_ITER == result['probe_iter']
        assert result['rank'] == rank and result['bad_ranks'] == [BAD_RANK]
        assert result['weights_unchanged'] and result['optimizer_unchanged']
        assert result['wrapper'] == 'OptimWrapper'
    bad = results[BAD_RANK]
    assert bad['bad_file'] in bad['files'][BAD_ITER]
    assert not any(bad['bad_file'] in files
                   for files in results[1 - BAD_RANK]['files'])
    # The bundle of the rank that saw the image names it, alone.
    assert bad['bundle_exists'] and bad['samples'] == [bad['bad_file']]
    assert osp.basename(bad['bad_file']) in bad['message']


@pytest.mark.parametrize('wrapper, strategy', [
    ('DeepSpeedOptimWrapper', 'DeepSpeedStrategy'),
    ('ColossalAIOptimWrapper', 'ColossalAIStrategy'),
])
def test_engine_strategies_are_refused_before_the_first_step(
        tmp_path, wrapper, strategy):
    # The wrappers those strategies build, as mmengine defines them (the
    # engine packages, not installable in either leg, are not needed to
    # build one): the hook refuses at before_train, naming the strategy and
    # what would not be checked. Without the engine the runner's strategy is
    # its default one; the wrapper is what the hook sees either way.
    import torch

    runner = toy_flexible_runner(
        tmp_path, hook=dict(type='NanDetectHook'),
        optim_wrapper=dict(type=wrapper, optimizer=dict(type='SGD', lr=0.1)))
    with pytest.raises(RuntimeError) as info:
        runner.train()
    assert type(runner.optim_wrapper).__name__ == wrapper
    message = str(info.value)
    assert strategy in message and wrapper in message
    assert 'gradient norm' in message and 'unprotected' in message
    assert runner.iter == 0
    assert all(torch.isfinite(p).all() for p in runner.model.parameters())
