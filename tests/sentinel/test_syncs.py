"""Tier 1's host syncs, counted on a real detector: one per update step, and
none for spike detection (what the hook does once per run, before the first
iteration, is not counted).

Every read of a tensor's value into Python is counted
(:func:`mmnan_testing.syncs.count_syncs`) and attributed to its caller:
mmnanhook's code, or anyone else's (mmengine's logging, mmdet's assigners).
"""
import pytest
from mmengine.runner import Runner

from mmnan_testing import testbed
from mmnan_testing.syncs import count_syncs, iteration_window

ITERS = 6
# Spikes judged from the third iteration on, so that the band is in use.
SPIKES = dict(spike_window=4, spike_warmup=2)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return testbed.make_dataset(
        'retinanet', str(tmp_path_factory.mktemp('syncs') / 'data'))


def _count(data, work_dir, hook=None, **overrides):
    cfg = testbed.tiny_config('retinanet', data, str(work_dir),
                              max_iters=ITERS, log_level='WARNING',
                              **overrides)
    if hook is not None:
        cfg.custom_imports = dict(imports=['mmnanhook'],
                                  allow_failed_imports=False)
        cfg.custom_hooks = [hook]
    runner = Runner.from_cfg(cfg)
    with count_syncs() as seen:
        iteration_window(runner, seen)
        runner.train()
    assert runner.iter == ITERS
    return seen


@pytest.mark.mmdet
@pytest.mark.parametrize('overrides,updates', [
    ({}, ITERS),
    ({'optim_wrapper.clip_grad': dict(max_norm=35, norm_type=2)}, ITERS),
    ({'optim_wrapper.accumulative_counts': 2}, ITERS // 2),
], ids=['plain', 'clip_grad', 'accumulation'])
def test_one_host_sync_per_update_step_and_none_for_spikes(
        tmp_path, data, overrides, updates):
    plain = _count(data, tmp_path / 'plain', **overrides)
    assert plain.n_ours == 0 and plain.n_theirs > 0
    runs = {}
    for spikes in ('warn', None):
        runs[spikes] = _count(
            data, tmp_path / str(spikes),
            hook=dict(type='NanDetectHook', spike_policy=spikes, **SPIKES),
            **overrides)
        seen = runs[spikes]
        # At most one sync more than the run without mmnanhook per update
        # step ...
        extra = seen.n_ours + seen.n_theirs - plain.n_theirs
        assert extra <= updates, (seen.ours, seen.theirs, plain.theirs)
        if 'optim_wrapper.clip_grad' in overrides:
            # ... with clip_grad the clip reuses our norm: MMEngine's float
            # of it and torch's own test of the clip coefficient (torch <
            # 2.0, then in our clip, which repeats torch's arithmetic) are
            # not made twice.
            assert seen.n_theirs < plain.n_theirs
            continue
        # ... and without it exactly one, ours, at one place, none added to
        # anyone else's code.
        assert extra == updates
        assert seen.n_ours == updates and len(seen.ours) == 1, seen.ours
        assert seen.theirs == plain.theirs
    # Spike detection judges host floats: the same syncs with it and
    # without it.
    assert runs['warn'].ours == runs[None].ours
    assert runs['warn'].theirs == runs[None].theirs
