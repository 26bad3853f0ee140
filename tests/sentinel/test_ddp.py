"""Tier 1 under DDP: two CPU processes over gloo, started by a real launcher
(see :mod:`mmnanhook.testing.ddp`): rank 1 alone sees an infinite loss whose
gradients are finite, and both ranks stop in the same iteration."""
import pytest

from mmnanhook.testing.ddp import BAD_ITER, BAD_RANK, SPIKE_ITERS, run_ranks


@pytest.mark.ddp
def test_one_rank_nan_loss_stops_every_rank_in_the_same_iteration(tmp_path):
    results, log = run_ranks('nan_loss', tmp_path)
    for rank, result in enumerate(results):
        assert result['raised'], (rank, log[-5000:])
        assert result['trigger'] == 'loss'
        assert result['iter'] == BAD_ITER
        assert result['rank'] == rank
        assert result['bad_ranks'] == [BAD_RANK]
        assert 'on rank %d' % BAD_RANK in result['message']
        assert 'rank %d of 2' % rank in result['message']
    assert 'loss_aux=inf' in results[BAD_RANK]['message']


@pytest.mark.ddp
def test_every_rank_rewinds_to_the_same_snapshot(tmp_path):
    results, log = run_ranks('rewind', tmp_path)
    for result in results:
        assert result['iter'] == 14, log[-5000:]
        assert result['rewinds'] == 1
        # Rewound in the second spike's iteration, to before the first.
        (rewound, ) = result['rewound']
        assert rewound[0] == SPIKE_ITERS[1] and rewound[1] < SPIKE_ITERS[0]
    assert results[0]['rewound'] == results[1]['rewound']
    assert results[0]['weights'] == results[1]['weights']


@pytest.mark.ddp
def test_drop_under_ddp_skips_on_every_rank_alike(tmp_path):
    # Not implemented under DDP yet: both ranks skip the same step, say why,
    # and train on with the same weights (no rank left in a collective).
    results, log = run_ranks('drop', tmp_path)
    for result in results:
        assert result['iter'] == 4, log[-5000:]
        assert result['skipped'] == 1 and result['said']
    assert results[0]['weights'] == results[1]['weights']
