"""Tier 1 and recovery under DDP: two CPU processes over gloo, started by a
real launcher (see :mod:`mmnan_testing.ddp`), the toy model: one rank's
bad sample stops, skips or drops on every rank alike, with and without
SyncBN statistics, and with a forward that raises on that rank alone or a
NaN input that the input check stops on entry to it; a rank that stops
answering is named by the others within the group's timeout. A hang fails
the test (each run is bounded)."""
import datetime
import inspect

import pytest
import torch
from mmengine.config import Config
from torch.distributed.constants import default_pg_timeout

from mmnan_testing.ddp import (BAD_ITER, BAD_RANK, HUNG_TIMEOUT,
                               SPIKE_ITERS, run_nodes, run_ranks,
                               run_scenarios)
from mmnanhook.distributed._ranks import run_timeout

pytestmark = pytest.mark.ddp

STATIC_GRAPH = 'static_graph' in inspect.signature(
    torch.nn.parallel.DistributedDataParallel).parameters

SCENARIOS = ['nan_loss', 'rewind', 'drop', 'drop_whole', 'drop_whole_unused',
             'raise_skip', 'raise_drop', 'raise_reduce', 'raise_late',
             'syncbn_skip', 'syncbn_drop', 'input_skip', 'input_drop',
             'input_raise', 'input_unbroadcast_drop',
             'input_first_skip'] + (
                 ['drop_whole_static'] if STATIC_GRAPH else []) + [
                     # Last: it leaves mmnanhook's groups broken.
                     'hung']
# The votes' timeout where env_cfg.dist_cfg.timeout is unset, and the
# exchange's (a diagnosis's allowance), in seconds.
DEFAULT_TIMEOUT = default_pg_timeout.total_seconds()
EXCHANGE_TIMEOUT = 7200.0


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
    # env_cfg.dist_cfg of the runner's config has no timeout: torch's.
    for result in results:
        assert result['timeouts'] == [[DEFAULT_TIMEOUT, EXCHANGE_TIMEOUT]]


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
    # Rank 1's NaN input stops its forward on entry (the input check); rank
    # 0's goes fine and would wait in DDP's gradient all-reduce: it learns
    # it in its vote before backward, and both skip, or both take the step
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
    # Rank 1's forward raises in its loss (NaN scores the model made) before
    # the loss's reduce_mean,
    # which rank 0 then calls: rank 0 votes before that collective and
    # learns it there, instead of waiting in it for rank 1.
    results, log = run(runs, 'raise_reduce')
    _same_weights(results)
    assert [r['skipped'] for r in results] == [1, 1]
    assert 'forward of rank(s) %d raised' % BAD_RANK in results[0]['log']


def test_a_forward_raising_between_collectives_of_its_loss_hangs_no_rank(
        runs):
    # The loss averages its normalizer 20 times (DINO's reduce_mean per
    # loss term and decoder layer); rank 1's raises in iteration 2 after the
    # 5th. Rank 0, which voted before the 1st alone, goes on to the 6th:
    # rank 1 calls the 15 it would have with zeros, then votes, and both
    # skip.
    results, log = run(runs, 'raise_late')
    _same_weights(results)
    assert [r['skipped'] for r in results] == [1, 1]
    assert 'forward of rank(s) %d raised' % BAD_RANK in results[0]['log']
    for result in results:
        # The first step votes before each collective and before backward
        # (nothing recorded yet); then before the first and backward alone,
        # the failing step too (rank 1 votes from its handler).
        assert result['votes'] == [21, 2, 2, 2], log[-3000:]


@pytest.mark.parametrize('policy', ['skip', 'drop'])
def test_syncbn_statistics_carry_one_rank_nan_to_all_and_the_replays_stay_local(
        runs, policy):
    # CpuSyncBatchNorm shares the batch statistics: the NaN rank 1's forward
    # makes of its sample before them makes both ranks' losses NaN. Each replays its batch alone (the SyncBN made
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


@pytest.mark.parametrize('name', ['input_skip', 'input_drop',
                                  'input_unbroadcast_drop',
                                  'input_first_skip'])
def test_a_nan_input_stopped_before_shared_statistics_hangs_no_rank(
        runs, name):
    """Issue 65: rank 1's NaN input is stopped on entry to its forward (the
    input check), whose first op all-reduces batch statistics
    (CpuSyncBatchNorm) that rank 0's forward then calls. Before, rank 0
    waited there for rank 1 for ever. Now rank 0 votes before its first
    collective of the step (in the first step, iteration 0, before each) and
    learns it there; with DDP's buffer broadcast first (its default, as a
    user's ``model_wrapper_cfg`` keeps it) both ranks voted before that, and
    rank 1 answers the statistics with zeros up to rank 0's vote before
    backward. Both take the policy's path, with the same weights; rank 1
    names the sample, the input's."""
    results, log = run(runs, name)
    _same_weights(results)
    iter = 0 if name == 'input_first_skip' else BAD_ITER
    other = results[1 - BAD_RANK]['log']
    assert 'forward of rank(s) %d raised at iter %d' % (BAD_RANK, iter) in \
        other, log[-3000:]
    for result in results:
        if name.endswith('skip'):
            assert result['skipped'] == 1 and result['samples_dropped'] == 0
        else:
            # Rank 1 without the sample, rank 0 unchanged, the statistics
            # shared: the step by hand (summed in another order).
            assert result['by_hand_close'] and result['samples_dropped'] == 1
            assert result['skipped'] == 0
    (bundle, ) = results[0]['bundles']
    assert bundle['iter'] == iter and bundle['kind'] == 'data'
    assert bundle['summary'].startswith('rank 1 of 2: the input is not finite')
    _culprit_named(results)


def test_a_nan_input_under_raise_stops_every_rank_naming_it(runs):
    """``'raise'``: every rank stops in the iteration of rank 1's NaN input,
    before any update; rank 0, which did not diagnose (its forward went
    fine), names the sample rank 1 found."""
    results, log = run(runs, 'input_raise')
    errors = [r['error'] for r in results]
    assert all(e is not None for e in errors), log[-3000:]
    assert [e['iter'] for e in errors] == [BAD_ITER] * 2
    assert [e['bad_ranks'] for e in errors] == [[BAD_RANK]] * 2
    assert results[0]['weights'] == results[1]['weights']
    assert all(r['finite'] and r['iter'] == BAD_ITER for r in results)
    assert errors[BAD_RANK]['kind'] == 'data'
    assert 'input check at iter %d' % BAD_ITER in errors[BAD_RANK]['message']
    assert 'rank 1: sample 0 (no img_path): input has 4 NaN and 0 Inf ' \
        'values' in errors[0]['message'].splitlines()


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


def _hung_rank_named(results, log, hung):
    """Every rank but ``hung`` stopped at its vote before backward, within
    the timeout and the wait for the others' word (at most the timeout),
    naming ``hung`` in the line it logged and raised; ``hung``, woken, stops
    too."""
    line = ('mmnanhook: rank %d did not answer the vote before backward '
            'within %s (env_cfg.dist_cfg.timeout): stopping' % (
                hung, datetime.timedelta(seconds=HUNG_TIMEOUT)))
    for rank, result in enumerate(results):
        # The config's timeout, in the group Ranks.start was given.
        assert result['timeouts'] == [[HUNG_TIMEOUT, EXCHANGE_TIMEOUT]], (
            rank, log[-5000:])
        assert result['raised'] == 'RankTimeoutError', (rank, log[-5000:])
        if rank == hung:
            assert result['ranks'] == [] and 'the vote before backward ' \
                'failed' in result['message']
            continue
        assert result['message'] == line and result['ranks'] == [hung]
        assert HUNG_TIMEOUT <= result['seconds'] <= 2 * HUNG_TIMEOUT + 3
    assert len(set(r['iter'] for r in results)) == 1
    # Logged too: in rank 0's log file (MMEngine writes rank 0's alone) and
    # on the console of the launch.
    assert line in results[0]['log'] and line in log


def test_a_rank_that_stops_answering_is_named_within_the_timeout(runs):
    # Rank 1's forward sleeps past env_cfg.dist_cfg.timeout: rank 0 fails at
    # its vote before backward with one line naming rank 1 instead of
    # waiting forever, and both processes end (the launch is bounded).
    results, log = run(runs, 'hung')
    _hung_rank_named(results, log, BAD_RANK)


@pytest.mark.zoo_full
def test_two_ranks_waiting_name_the_third_that_stopped_answering(tmp_path):
    """Full tier: three ranks are a launch of their own (10 to 20 s); the
    everyday tier names a hung rank with two (above)."""
    # Sample 5 is in rank 2's first batch with three ranks.
    results, log = run_ranks('hung', tmp_path, nproc=3)
    _hung_rank_named(results, log, 2)


@pytest.mark.parametrize('dist_cfg,seconds', [
    (dict(backend='nccl', timeout=600), 600),
    (dict(backend='nccl', timeout=datetime.timedelta(seconds=90)), 90),
    (dict(backend='nccl'), DEFAULT_TIMEOUT), (None, DEFAULT_TIMEOUT)
], ids=['seconds', 'timedelta', 'unset', 'no_dist_cfg'])
def test_the_timeout_is_the_runner_configs(dist_cfg, seconds):
    # As MMEngine's init_dist reads it for the default group.
    cfg = Config(dict(env_cfg=dict(cudnn_benchmark=False)))
    if dist_cfg is not None:
        cfg.env_cfg.dist_cfg = dist_cfg
    assert run_timeout(cfg).total_seconds() == seconds
    assert run_timeout(Config(dict())).total_seconds() == DEFAULT_TIMEOUT
