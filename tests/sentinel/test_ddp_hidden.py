"""A train step that is not quiet, under DDP (two CPU ranks over gloo, the
toy model; :mod:`mmnan_testing.ddp_hidden`): a collective that DDP calls
from C++ (its buffers' broadcast) and a data preprocessor that synchronises
the ranks and keeps the result in an attribute. A hang fails the test
(the launch is bounded)."""
import math

import pytest

from mmnan_testing.ddp import run_scenarios
from mmnan_testing.ddp_hidden import SYNC_ITER

pytestmark = pytest.mark.ddp

SCENARIOS = ['buffers_preprocess', 'raise_before_reduce', 'code_fault',
             'sync_skip', 'sync_drop']


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    return run_scenarios(SCENARIOS, str(tmp_path_factory.mktemp('hidden')),
                         module='mmnan_testing.ddp_hidden', timeout=240)


def test_a_preprocessor_raising_before_ddps_buffer_broadcast_hangs_no_rank(
        runs):
    """Rank 0 would wait in DDP's broadcast of the buffers (C++) for rank
    1, whose preprocessor raised, while rank 1 waits in its vote: the
    guard votes before DDP's forward, and both skip the step."""
    results, log = runs
    ranks = results['buffers_preprocess']
    assert [r['skipped'] for r in ranks] == [1, 1], log[-3000:]
    assert ranks[0]['weights'] == ranks[1]['weights']
    assert all(r['finite'] for r in ranks)
    assert all(r['iter'] == 4 for r in ranks)


def test_a_raise_before_the_first_collective_that_waits_is_voted_on(runs):
    """DDP's forward is recorded first in every step but waits for no rank
    here: rank 0 votes before the loss's ``reduce_mean``, the step's first
    entry that waits, and rank 1, whose loss raised before it, votes with
    it instead of calling it (both would wait for ever)."""
    results, log = runs
    ranks = results['raise_before_reduce']
    assert [r['skipped'] for r in ranks] == [1, 1], log[-3000:]
    assert ranks[0]['weights'] == ranks[1]['weights']
    assert all(r['finite'] and r['iter'] == 4 for r in ranks)


def test_a_fault_of_the_code_on_one_rank_ends_every_rank_naming_it(runs):
    """No policy handles a preprocessor's own bug: every rank ends in the
    same iteration, at once (not at a timeout, not one iteration later),
    rank 1 with its error and rank 0 naming it."""
    results, log = runs
    ranks = results['code_fault']
    assert [r['raised'] for r in ranks] == ['PeerForwardFailed',
                                            'KeyError'], log[-3000:]
    assert [r['iter'] for r in ranks] == [2, 2]
    for result in ranks:
        assert "rank 1's forward raised KeyError: 'preprocess_bug" in \
            result['message']
        assert result['seconds'] < 30


@pytest.mark.parametrize('policy', ['skip', 'drop'])
def test_a_replay_keeps_the_preprocessors_synchronised_state(runs, policy):
    """Rank 1's forward raises in the iteration whose preprocessor takes the
    next scale from rank 0; its diagnosis replays that preprocessor. The
    scale every rank keeps stays rank 0's (before: the replay's broadcast,
    answered on rank 1 alone, left it uninitialised memory), and the
    replay's broadcast was answered with what the iteration got."""
    results, log = runs
    ranks = results['sync_' + policy]
    assert all(math.isfinite(r['scale']) for r in ranks), log[-3000:]
    assert ranks[0]['every_rank'][0] == ranks[0]['every_rank'][1]
    assert ranks[0]['scale'] == ranks[1]['scale']
    assert ranks[0]['weights'] == ranks[1]['weights']
    assert all(r['finite'] for r in ranks)
    if policy == 'skip':
        assert [r['skipped'] for r in ranks] == [1, 1]
    else:
        assert [r['samples_dropped'] for r in ranks] == [1, 1]
    bundles = ranks[1]['bundles']
    assert bundles, 'rank 1 wrote no bundle'
    notes = ' '.join(bundles[0]['notes'])
    assert 'answered with what the failing iteration got' in notes
    # The replays drew no scale: one per synchronising iteration, but the
    # skipped one's, whose forward (buffers and preprocessor) is undone.
    syncs = [i for i in range(ranks[1]['iter']) if (i + 1) % 2 == 0]
    assert SYNC_ITER in syncs
    assert [r['draws'] for r in ranks] == [len(syncs) - (policy == 'skip')
                                           ] * 2
