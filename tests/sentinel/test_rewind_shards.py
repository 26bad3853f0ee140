"""``'rewind'``'s snapshots under DDP: each rank holds its share of the
parameters and optimizer state, a restore is bitwise (two gloo ranks, see
:mod:`mmnan_testing.snapshots`)."""
import pytest

from mmnan_testing.ddp import run_ranks


@pytest.mark.ddp
def test_each_rank_holds_its_share_and_the_restore_is_bitwise(tmp_path):
    results, log = run_ranks('shares', tmp_path,
                             module='mmnan_testing.snapshots')
    for result in results:
        assert result['bitwise'], log[-3000:]
        assert result['count'][0] == result['count'][1] > 0
        assert result['count'][2] == result['count'][3] > 0
        # Half of what every rank holds alike (balanced by size, one
        # parameter at a time), and its own buffers whole.
        shared = result['full'] - result['buffers']
        assert result['held'] - result['buffers'] <= 0.6 * shared
    # Between them the ranks hold everything once.
    assert sum(r['held'] - r['buffers'] for r in results) == \
        results[0]['full'] - results[0]['buffers']
