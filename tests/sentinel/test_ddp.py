"""Tier 1 and recovery under DDP: two CPU processes over gloo, started by a
real launcher (see :mod:`mmnan_testing.ddp`), the toy model: one rank's
bad sample stops, skips or drops on every rank alike, with and without
SyncBN statistics, and with a forward that raises on that rank alone. A hang
fails the test (each run is bounded)."""
import inspect

import pytest
import torch

from mmnan_testing.ddp import (BAD_ITER, BAD_RANK, SPIKE_ITERS,
                                   run_nodes, run_scenarios)

pytestmark = pytest.mark.ddp

STATIC_GRAPH = 'static_graph' in inspect.signature(
    torch.nn.parallel.DistributedDataParallel).parameters

SCENARIOS = ['nan_loss', 'rewind', 'drop', 'drop_whole', 'drop_whole_unused',
             'raise_skip', 'raise_drop', 'raise_reduce', 'syncbn_skip',
             'syncbn_drop'] + (
                 ['drop_whole_static'] if STATIC_GRAPH else [])


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Every scenario of this module, in one launch of two ranks (their
    imports paid once; none of these tests is about a fresh process)."""
    return run_scenarios(SCENARIOS, str(tmp_path_factory.mktemp('ddp')))


def run(runs, name):
    """A scenario's results, one per rank, and the launch's log."""
    results, log = runs
    return results[name], log


def test_one_rank_nan_loss_stops_every_rank_in_the_same_iteration(runs):
    results, log = run(runs, 'nan_loss')
    for rank, result in enumerate(results):
        assert result['raised'], (rank, log[-5000:])
        assert result['trigger'] == 'loss'
        assert result['iter'] == BAD_ITER
        assert result['rank'] == rank
        assert result['bad_ranks'] == [BAD_RANK]
        assert 'on rank %d' % BAD_RANK in result['message']
        assert 'rank %d of 2' % rank in result['message']
    assert 'loss_aux=inf' in results[BAD_RANK]['message']


def test_every_rank_rewinds_to_the_same_snapshot(runs):
    results, log = run(runs, 'rewind')
    for result in results:
        assert result['iter'] == 14, log[-5000:]
        assert result['rewinds'] == 1
        # Rewound in the second spike's iteration, to before the first.
        (rewound, ) = result['rewound']
        assert rewound[0] == SPIKE_ITERS[1] and rewound[1] < SPIKE_ITERS[0]
    assert results[0]['rewound'] == results[1]['rewound']
    assert results[0]['weights'] == results[1]['weights']


def _same_weights(results):
    assert results[0]['weights'] == results[1]['weights']
    for result in results:
        assert result['iter'] == 4 and result['finite']


def _culprit_named(results, sample=0):
    """Every bundle of every rank (one dump dir) names rank 1's sample as
    the cause."""
    bundles = results[0]['bundles']
    assert bundles
    for bundle in bundles:
        culprits = [(f['rank'], [s['index'] for s in f['samples']])
                    for f in bundle['ranks'] if f['samples']]
        assert culprits == [(BAD_RANK, [sample])], bundle
        assert 'rank %d' % BAD_RANK in bundle['summary']
    return bundles


def test_drop_under_ddp_recomputes_the_step_on_every_rank(runs):
    # Rank 1 leaves its bad sample out, rank 0 takes its batch unchanged;
    # the update is DDP's mean of the two, bitwise the step by hand.
    results, log = run(runs, 'drop')
    _same_weights(results)
    for result in results:
        assert result['by_hand'], log[-3000:]
        assert result['samples_dropped'] == 1 and result['skipped'] == 0
    # (mmengine logs rank 0 alone.)
    assert 'recomputing the update step of iter 1 on its batch unchanged' \
        in results[0]['log']
    _culprit_named(results)


@pytest.mark.parametrize('ddp', [
    '', '_unused', pytest.param('_static', marks=pytest.mark.skipif(
        not STATIC_GRAPH, reason='DDP has no static_graph before torch 1.11'))
], ids=['default', 'find_unused_parameters', 'static_graph'])
def test_a_rank_whose_whole_batch_fails_takes_part_with_a_zero_loss(
        runs, ddp):
    # Both samples of rank 1's batch fail: it takes part in DDP's gradient
    # all-reduce with a zero loss, and rank 0's loss counts for both ranks.
    results, log = run(runs, 'drop_whole' + ddp)
    _same_weights(results)
    for result in results:
        assert result['by_hand'], log[-3000:]
        assert result['samples_dropped'] == 2


@pytest.mark.parametrize('policy', ['skip', 'drop'])
def test_a_forward_raising_on_one_rank_takes_every_rank_the_same_way(
        runs, policy):
    # Rank 1's forward raises on its NaN input (as SimOTA does); rank 0's
    # goes fine and would wait in DDP's gradient all-reduce: it learns it
    # in its vote before backward, and both skip, or both take the step
    # again (rank 1 without the sample).
    results, log = run(runs, 'raise_' + policy)
    _same_weights(results)
    other = results[1 - BAD_RANK]['log']
    assert 'forward of rank(s) %d raised' % BAD_RANK in other
    for result in results:
        if policy == 'skip':
            assert result['skipped'] == 1 and result['samples_dropped'] == 0
        else:
            assert result['by_hand'] and result['samples_dropped'] == 1
    bundles = _culprit_named(results)
    assert all(b['kind'] == 'data' for b in bundles)


def test_a_forward_raising_before_a_collective_of_the_loss_is_voted_on(
        runs):
    # Rank 1's forward raises in its loss before the loss's reduce_mean,
    # which rank 0 then calls: rank 0 votes before that collective and
    # learns it there, instead of waiting in it for rank 1.
    results, log = run(runs, 'raise_reduce')
    _same_weights(results)
    assert [r['skipped'] for r in results] == [1, 1]
    assert 'forward of rank(s) %d raised' % BAD_RANK in results[0]['log']


@pytest.mark.parametrize('policy', ['skip', 'drop'])
def test_syncbn_statistics_carry_one_rank_nan_to_all_and_the_replays_stay_local(
        runs, policy):
    # CpuSyncBatchNorm shares the batch statistics: rank 1's NaN input makes
    # both ranks' losses NaN. Each replays its batch alone (the SyncBN made
    # local, its running statistics put back): no hang, and rank 0's bundle
    # says the NaN came from rank 1, not from its own data.
    results, log = run(runs, 'syncbn_' + policy)
    _same_weights(results)
    for result in results:
        # Two bundles, one per rank, both from one trigger.
        assert result['replay_buffers'] == [True]
        if policy == 'drop':
            assert result['by_hand_close'] and result['samples_dropped'] == 1
        else:
            assert result['skipped'] == 1
    bundles = _culprit_named(results)
    assert all(b['local'] == ['bn (CpuSyncBatchNorm)'] for b in bundles)
    clean = [b for b in bundles if b['kind'] == 'not_reproduced']
    assert len(clean) == 1 and 'came from another rank' in clean[0][
        'summary'] and 'replays finite alone' in clean[0]['summary']


def test_every_node_writes_the_quarantine_every_rank_learned(tmp_path):
    # Two launchers (--nnodes 2), one rank each, work dirs of their own: the
    # first rank of each node writes the list, which names the sample of
    # rank 1 on both nodes.
    results, log = run_nodes('nodes', tmp_path)
    for result in results:
        assert result['iter'] == 4 and result['local_rank'] == '0', log
        assert result['samples_dropped'] == 1
        (entry, ) = result['quarantine']
        assert entry[0].endswith(result['bad']) and entry[2] == BAD_RANK
