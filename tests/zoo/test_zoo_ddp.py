"""Recovery under DDP on the zoo's own configs, two CPU ranks over gloo (see
:mod:`mmnan_testing.ddp_zoo`): mmdet's RTMDet-tiny with its SyncBN (a CPU
stand-in) and a nodata tile on rank 1, and mmdet's RetinaNet R50 with an
image whose annotation declares twice its width. A hang fails the test (each
run is bounded)."""
import os
import os.path as osp

import pytest
import torch

from mmnan_testing import zoo
from mmnan_testing.ddp import run_ranks
from mmnan_testing.ddp_zoo import IMAGES, moving_index

pytestmark = [pytest.mark.zoo, pytest.mark.ddp, pytest.mark.mmdet,
              pytest.mark.skipif(not zoo.available('rtmdet_tiny'),
                                 reason='mmdet is not installed')]

MODULE = 'mmnan_testing.ddp_zoo'


def _run(name, tmp_path):
    results, log = run_ranks(name, tmp_path, module=MODULE, timeout=600)
    # Both ranks finish every iteration with the same finite weights.
    assert [r['iter'] for r in results] == [4, 4], log[-3000:]
    assert results[0]['digest'] == results[1]['digest']
    assert all(r['finite'] for r in results)
    return results, results[0]['bundles']


@pytest.mark.parametrize('policy', [
    pytest.param('skip', marks=pytest.mark.zoo_full), 'drop'])
def test_rtmdet_syncbn_one_rank_nodata_tile(tmp_path, policy):
    """RTMDet-tiny as shipped but its SyncBN (a CPU stand-in, every norm
    layer), 2 epochs; the nodata tile in rank 1's batch makes both ranks'
    losses NaN through the shared statistics. 'skip' with
    ``quarantine_skips=True``, 'drop': one trigger, the step left out or
    taken again without the tile, which every rank quarantines. 'drop' is
    make test's zoo DDP run, on both legs; 'skip' is in the full tier."""
    results, bundles = _run('rtmdet_' + policy, tmp_path)
    tile = results[0]['tile']
    for result in results:
        assert result['syncbn'] > 0
        # Every diagnosis put the running statistics back as they were.
        assert result['replays'] and all(result['replays'])
    # Every bundle (both ranks, every trigger) blames rank 1's tile; rank
    # 0's says the NaN came through the statistics, its batch being clean.
    assert len(bundles) == 2
    for bundle in bundles:
        culprits = [(f['rank'], [s['img_path'] for s in f['samples']])
                    for f in bundle['ranks'] if f['samples']]
        assert culprits == [(1, [tile])], bundle['summary']
        assert tile in bundle['summary']
        assert any('CpuSyncBatchNorm' in m for m in bundle['local'])
    clean = [b for b in bundles if b['kind'] == 'not_reproduced']
    assert len(clean) == len(bundles) // 2
    assert all('statistics' in b['summary'] and 'replays finite alone' in
               b['summary'] for b in clean)
    skipped = 1 if policy == 'skip' else 0
    assert [r['skipped'] for r in results] == [skipped] * 2
    assert [r['samples_dropped'] for r in results] == [1 - skipped] * 2
    # Quarantined alone, never loaded again (epoch 2).
    assert results[0]['quarantine'] == [[tile, [5]]]
    seen = [i for i, files in enumerate(results[1]['files']) if tile in files]
    assert seen == [1]


@pytest.mark.everyday_leg('dota')
def test_retinanet_drop_under_ddp(tmp_path):
    """RetinaNet R50 as shipped (shuffling sampler, aspect-ratio batches),
    2 epochs, 'drop': the bad image is on rank 1 in epoch 1, and the
    sampler gives it to rank 0 in epoch 2. In make test on the DOTA leg;
    the modern leg's run is in the full tier."""
    results, bundles = _run('retinanet_drop', tmp_path)
    bad, bad_index = results[0]['bad'], moving_index()
    assert results[0]['bad_index'] == bad_index
    for result in results:
        # The applied step is the plain DDP step by hand, rank 1 without
        # the image, bitwise; one sample dropped over both ranks.
        assert result['by_hand']
        assert result['samples_dropped'] == 1 and result['skipped'] == 0
        # One list, the image alone, for every rank.
        assert result['quarantine'] == [[bad, [bad_index]]]
    # Loaded once (rank 1, epoch 1), never again on either rank: in epoch
    # 2 the sampler's slot for it is on rank 0, which loaded another.
    per_epoch = IMAGES // 4
    assert results[1]['drops'] and results[1]['drops'][0] < per_epoch
    assert results[0]['drops'] == []
    second = [f for batch in results[0]['files'][per_epoch:] for f in batch]
    order = torch.randperm(IMAGES, generator=torch.Generator().manual_seed(
        1)).tolist()
    assert order.index(bad_index) % 2 == 0 and bad not in second
    assert len(os.listdir(osp.join(str(tmp_path), 'work'))) and [
        f for f in os.listdir(osp.join(str(tmp_path), 'work'))
        if f.startswith('nan_quarantine')] == ['nan_quarantine.json']
    assert len(bundles) == 1 and bundles[0]['files'] == [bad]
