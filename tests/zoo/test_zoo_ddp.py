"""Recovery under DDP on the zoo's own configs, two CPU ranks over gloo (see
:mod:`mmnan_testing.ddp_zoo`): mmdet's RTMDet-tiny with its SyncBN (a CPU
stand-in) and nodata tiles on rank 1, mmdet's YOLOX-tiny with its
``BatchSyncRandomResize`` and nodata tiles on rank 1 at the iteration that
synchronises, the one after and the first (``broadcast_buffers`` off and
on, ``find_unused_parameters``), mmdet's VFNet (modern leg) and mmrotate's
rotated RetinaNet (DOTA leg) with a nodata tile on rank 1 under each policy,
and mmdet's RetinaNet R50 with an image whose annotation declares twice its
width. A hang fails the test (each run
is bounded); every diagnosis must leave the run as it found it (the
before/after picture of :mod:`mmnan_testing.runstate`)."""
import json
import os
import os.path as osp
import re

import pytest
import torch

from mmnan_testing import zoo
from mmnan_testing.ddp import run_ranks, run_scenarios
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


def _story(work_dir, capsys):
    """``mmnan inspect --json WORK_DIR`` of the run, read back, and the
    plain ``mmnan inspect WORK_DIR``'s text (issue 68)."""
    from mmnanhook.cli import main
    from mmnanhook.cli._story import Story
    assert main(['inspect', '--json', work_dir]) == 0
    data = json.loads(capsys.readouterr().out)
    assert Story.from_dict(data).to_dict() == data
    assert main(['inspect', work_dir]) == 0
    out, err = capsys.readouterr()
    assert err == '', err
    return Story.from_dict(data), out


def _nothing_changed(results, diagnoses):
    """Every diagnosis left the run as it found it: the picture of
    :mod:`mmnan_testing.runstate` (weights, buffers, grads, optimizer, RNG,
    every module's Python attributes, the batch augments', the hooks',
    runtime info, log scalars, sampler and pipeline) the same right before
    and right after it, on every rank; ``diagnoses``: how many each rank
    ran."""
    assert [len(r['pictures']) for r in results] == diagnoses, [
        [p['iter'] for p in r['pictures']] for r in results]
    changed = [(r['rank'], p['iter'], p['diff'], p['more'])
               for r in results for p in r['pictures'] if p['diff']]
    assert changed == [], '\n'.join(
        'rank %d, diagnosis of iter %d changed (%d more not shown):\n  %s'
        % (rank, it, more, '\n  '.join(diff))
        for rank, it, diff, more in changed)


@pytest.mark.parametrize('policy', [
    pytest.param('skip', marks=pytest.mark.zoo_full), 'drop'])
def test_rtmdet_syncbn_one_rank_nodata_tile(tmp_path, policy, capsys):
    """RTMDet-tiny as shipped but its SyncBN (a CPU stand-in, every norm
    layer), DDP's default ``broadcast_buffers=True``, 2 epochs; the nodata
    tiles in rank 1's batches of the first iteration (nothing recorded yet)
    and the second. The input check stops rank 1 on entry to its forward,
    whose every norm layer all-reduces statistics that rank 0's forward
    then calls (issue 65: before, the check was off under DDP and the tile's
    NaN reached every rank through those statistics; with the check on and
    the guard as it was, rank 0 waited in the first for ever). 'skip' with
    ``quarantine_skips=True``, 'drop': two triggers, each step left out or
    taken again without its tile, which every rank quarantines; rank 1's
    diagnoses leave the run as it was, rank 0 (whose forward went fine)
    runs none. 'drop' is make test's zoo DDP run, on both legs; 'skip' is
    in the full tier."""
    results, bundles = _run('rtmdet_' + policy, tmp_path)
    tiles = results[0]['tiles']
    assert 'EMAHook' in results[0]['hooks'] and \
        'PipelineSwitchHook' in results[0]['hooks']
    for result in results:
        assert result['syncbn'] > 0
    # Every diagnosis (rank 1's) put the running statistics back as they
    # were, and nothing of either stays.
    assert results[0]['replays'] == [] and results[1]['replays'] == [
        True, True]
    _nothing_changed(results, [0, 2])
    # Rank 1's bundle of each trigger names its tile, as the input; its
    # replays kept the shared statistics on rank 1.
    assert sorted(b['iter'] for b in bundles) == [0, 1]
    for bundle in bundles:
        tile = tiles[bundle['iter']]
        culprits = [(f['rank'], [s['img_path'] for s in f['samples']])
                    for f in bundle['ranks'] if f['samples']]
        assert culprits == [(1, [tile])], bundle['summary']
        assert bundle['kind'] == 'data' and bundle['summary'].startswith(
            'rank 1 of 2: the input is not finite: sample 0 (%s)' % tile)
        assert any('CpuSyncBatchNorm' in m for m in bundle['local'])
    skipped = 2 if policy == 'skip' else 0
    assert [r['skipped'] for r in results] == [skipped] * 2
    assert [r['samples_dropped'] for r in results] == [2 - skipped] * 2
    # Quarantined alone, never loaded again by rank 1 (epoch 2). (A
    # pipeline that returns None makes mmengine's dataset draw another
    # index at random: rank 0 may draw a tile so, which the quarantine
    # then takes out of the batch in flight.)
    assert sorted(results[0]['quarantine']) == [[tiles[0], [1]],
                                                [tiles[1], [5]]]
    for tile, first in zip(tiles, (0, 1)):
        seen = [i for i, files in enumerate(results[1]['files'])
                if tile in files]
        assert seen == [first]
    # The story of the run (rank 0's journal, with rank 1's findings and
    # bundles): both triggers, rank 1's tile named, what became of each
    # step, the tiles quarantined, the run finished.
    story, text = _story(osp.join(str(tmp_path), 'work'), capsys)
    (run, ) = story.runs
    assert (run.world_size, run.policy, run.ended) == (2, policy, 'finished')
    triggers = [e for e in run.entries if e.incident.kind == 'trigger']
    assert [(e.incident.iter, e.incident.act, e.incident.samples)
            for e in triggers] == [(0, policy, [tiles[0]]),
                                   (1, policy, [tiles[1]])]
    for entry in triggers:
        assert entry.incident.cause.startswith(
            'rank 1: sample 0 (%s)' % tiles[entry.incident.iter])
        assert [b['path'] for b in bundles
                if b['iter'] == entry.incident.iter] == [
            osp.join(p, 'report.json') for p in entry.bundles]
    assert sorted((q.file, q.rank, q.run) for q in story.quarantine) == [
        (tiles[0], 1, run.run), (tiles[1], 1, run.run)]
    act = dict(drop='the step taken again without the named samples',
               skip='the step skipped')[policy]
    for it, tile in enumerate(tiles):
        assert re.search(r'^  iter %d +\w+ trigger -> %s: rank 1: sample 0 '
                         r'\(%s\)' % (it, act, re.escape(tile)), text,
                         re.M), text


@pytest.mark.zoo_full
def test_rtmdet_syncbn_nodata_tile_under_raise_stops_every_rank(tmp_path):
    """The same run under the default policy, ``'raise'``: both ranks stop
    in the first iteration, before any update, with the same weights; rank
    1 with its report (the tile, as the input), rank 0 naming rank 1's
    sample. In the full tier."""
    results, _ = run_ranks('rtmdet_raise', tmp_path, module=MODULE,
                           timeout=600)
    _stopped_naming(results, results[0]['tiles'][0], 0)


def _stopped_naming(results, tile, iter):
    """Both ranks stopped in ``iter`` under ``'raise'`` with the same finite
    weights, before any update of it: rank 1 naming ``tile`` as its input
    in its report and bundle, rank 0 naming rank 1's sample."""
    errors = [r['error'] for r in results]
    assert all(e is not None for e in errors), results
    assert [(e['iter'], e['bad_ranks']) for e in errors] == [(iter, [1])] * 2
    assert [r['iter'] for r in results] == [iter] * 2
    assert results[0]['digest'] == results[1]['digest']
    assert all(r['finite'] for r in results)
    assert errors[1]['kind'] == 'data' and 'input check at iter %d' % iter \
        in errors[1]['message'] and tile in errors[1]['message']
    assert re.search(r'^rank 1: sample \d \(%s\): input has \d+ NaN' %
                     re.escape(tile), errors[0]['message'], re.M)
    # Read by rank 1, which wrote it before it raised (rank 0 may be done
    # before).
    (bundle, ) = results[1]['bundles']
    assert bundle['files'] == [tile] and bundle['iter'] == iter


# Iterations of the nodata tile's runs (one epoch, mmnan_testing.ddp_zoo).
TILE_ITERS = 2


@pytest.fixture(scope='module')
def tile_runs(tmp_path_factory):
    """The nodata tile on rank 1 under each policy, with the zoo config of
    this leg: VFNet on the modern leg (its head's deformable convolution:
    without the check the NaN kills rank 1's process, SIGSEGV), the rotated
    RetinaNet on the DOTA leg; in one launch (the ranks' start paid once)."""
    dota = os.environ.get('MMNANHOOK_LEG') == 'dota'
    name = 'rotated_retinanet' if dota else 'vfnet_r50'
    if not zoo.available(name):
        pytest.skip('%s is not installed here' % zoo.ZOO[name].package)
    prefix = 'rotated_tile_' if dota else 'vfnet_tile_'
    runs, log = run_scenarios(
        [prefix + p for p in ('drop', 'skip', 'raise')],
        str(tmp_path_factory.mktemp('tiles')), module=MODULE, timeout=900)
    return dict((k[len(prefix):], v) for k, v in runs.items())


@pytest.mark.zoo_full
@pytest.mark.parametrize('policy', ['drop', 'skip', 'raise'])
def test_a_nodata_tile_on_one_rank_takes_every_rank_the_policys_way(
        tile_runs, policy):
    """Issue 65: a float nodata tile on rank 1, DDP's default
    ``broadcast_buffers=True`` (the forward's only collective: these
    configs' norms are frozen). The input check stops rank 1 on entry to
    its forward, both ranks take the policy's path in the tile's iteration:
    'drop' completes with identical finite weights, the step taken again
    without the tile on rank 1, the tile alone quarantined; 'skip' leaves
    the step out on both; 'raise' stops both with the report. In the full
    tier (both legs: VFNet / the rotated RetinaNet)."""
    results = tile_runs[policy]
    tile = results[0]['tile']
    # Rank 1 alone held it, once (iteration 1 of VFNet's COCO order, 0 of
    # the DOTA dataset's).
    held = [[i for i, files in enumerate(r['files']) if tile in files]
            for r in results]
    assert held[0] == [] and len(held[1]) == 1, held
    if policy == 'raise':
        _stopped_naming(results, tile, held[1][0])
        return
    assert [r['iter'] for r in results] == [TILE_ITERS] * 2
    assert results[0]['digest'] == results[1]['digest']
    assert all(r['finite'] and r['error'] is None for r in results)
    dropped = policy == 'drop'
    assert [(r['samples_dropped'], r['skipped']) for r in results] == [
        (int(dropped), int(not dropped))] * 2
    (bundle, ) = results[0]['bundles']
    assert bundle['files'] == [tile] and bundle['kind'] == 'data'
    # The tile alone, at its one index of the dataset (its place in the
    # DOTA dataset's order is not its name's).
    assert [[(f, len(i)) for f, i in r['quarantine'] or []]
            for r in results] == [[(tile, 1)] if dropped else []] * 2


# The YOLOX scenarios: BatchSyncRandomResize synchronises in iteration 9.
YOLOX_SYNC = 9


def _yolox(name, tmp_path, policy):
    """Run a YOLOX-tiny scenario (see :mod:`mmnan_testing.ddp_zoo`) and
    check what every one of them must: both ranks finish every iteration
    with the same finite weights, each nodata tile was in rank 1's batch
    of its iteration alone, rank 1's bundle of each names it, every
    diagnosis left the run as it found it, and the batch augment trained
    both ranks at the size rank 0 drew."""
    from mmnan_testing.ddp_zoo import YOLOX_ITERS, YOLOX_TILES
    results, log = run_ranks(name, tmp_path, module=MODULE, timeout=600)
    assert [r['iter'] for r in results] == [YOLOX_ITERS] * 2, log[-3000:]
    assert results[0]['digest'] == results[1]['digest']
    assert all(r['finite'] for r in results)
    hooks = results[0]['hooks']
    for hook in ('YOLOXModeSwitchHook', 'SyncNormHook', 'EMAHook',
                 'NanDetectHook'):
        assert hook in hooks, hooks
    tiles = dict((int(k), v) for k, v in results[0]['tiles'].items())
    assert sorted(tiles) == sorted(YOLOX_TILES) and YOLOX_SYNC in tiles \
        and YOLOX_SYNC + 1 in tiles and 0 in tiles
    # Where the tiles were: rank 1, their iteration, nowhere else.
    for rank, result in enumerate(results):
        for it, files in enumerate(result['files']):
            held = [t for t in tiles.values() if t in files]
            assert held == ([tiles[it]] if rank == 1 and it in tiles
                            else []), (rank, it, files)
    # The input check stopped rank 1 on entry to its forward in each tile's
    # iteration, after the preprocessor's collectives (before issue 65 the
    # check was off under DDP, and SimOTA's binary_cross_entropy raised on
    # the tile's NaN scores there): no loss ran on a tile, none raised.
    assert [r['raised'] for r in results] == [[], []]
    # The size each iteration left for the next: the same on both ranks
    # (rank 0 draws it, the other receives it); from the synchronising
    # iteration on, a multiple of 32 in the (rescaled) range.
    sizes = [r['input_sizes'] for r in results]
    assert sizes[0] == sizes[1], sizes
    assert len(sizes[0]) == YOLOX_ITERS
    assert all(160 <= s[0] <= 320 and s[0] % 32 == 0 and s[0] == s[1]
               for s in sizes[0][YOLOX_SYNC:]), sizes[0]
    # Rank 1 diagnosed each trigger (its forward raised); nothing stays.
    _nothing_changed(results, [0, len(tiles)])
    bundles = results[0]['bundles']
    assert sorted(b['iter'] for b in bundles) == sorted(tiles), [
        (b['iter'], b['summary']) for b in bundles]
    for bundle in bundles:
        tile = tiles[bundle['iter']]
        assert bundle['files'] == [tile], bundle['summary']
        culprits = [(f['rank'], [s['img_path'] for s in f['samples']])
                    for f in bundle['ranks'] if f['samples']]
        assert culprits == [(1, [tile])], bundle['summary']
        assert bundle['summary'].startswith(
            'rank 1 of 2: the input is not finite: sample 0 (%s)' % tile)
    if policy == 'skip':
        assert [r['skipped'] for r in results] == [len(tiles)] * 2
        assert [r['samples_dropped'] for r in results] == [0, 0]
    else:
        assert [r['skipped'] for r in results] == [0, 0]
        assert [r['samples_dropped'] for r in results] == [len(tiles)] * 2
        assert sorted(f for f, _ in results[0]['quarantine']) == sorted(
            tiles.values())
    return results


@pytest.mark.zoo_full
@pytest.mark.parametrize('policy', ['skip', 'drop'])
def test_yolox_batch_sync_resize_without_buffer_broadcast(tmp_path, policy):
    """YOLOX-tiny as shipped (its mode switch, SyncNormHook and EMA kept,
    the hook in the one-line form) under ``MMDistributedDataParallel`` with
    ``broadcast_buffers=False`` (mmengine's own wrapping), one epoch of 12
    iterations; a nodata tile on rank 1 in iteration 0, in iteration 9
    (``BatchSyncRandomResize`` draws the next size on rank 0, ``barrier()``
    + ``broadcast()``, kept in ``self._input_size``) and in iteration 10:
    the input check stops rank 1's forward on entry each time, rank 0's goes
    on. The replays must neither answer the broadcast with
    memory never written nor leave what they drew in ``_input_size``
    (before issue 43: a size of 10^14 pixels, the run lost at the next
    iteration). In the full tier."""
    _yolox('yolox_' + policy, tmp_path, policy)


@pytest.mark.zoo_full
@pytest.mark.parametrize('policy', ['skip', 'drop'])
def test_yolox_batch_sync_resize_with_buffer_broadcast(tmp_path, policy):
    """The same with DDP's default ``broadcast_buffers=True`` (a user's
    ``model_wrapper_cfg``): DDP broadcasts rank 0's buffers at the start
    of every forward, a collective made from C++ that no Python call
    shows; a rank whose forward failed and one that went on must meet in
    the same collective or in none (before issue 43: rank 1 in
    mmnanhook's vote, rank 0 in DDP's broadcast, for ever). Bounded: the
    run's ``dist_cfg.timeout`` is 2 minutes, the launch's 10. In the full
    tier."""
    _yolox('yolox_broadcast_' + policy, tmp_path, policy)


@pytest.mark.zoo_full
def test_yolox_drop_with_find_unused_parameters(tmp_path):
    """The same without the buffer broadcast, 'drop', DDP with
    ``find_unused_parameters=True`` (its reducer searches the graph after
    every forward and all-reduces in backward: a rank that takes its step
    again and one that does not must meet there). In the full tier."""
    _yolox('yolox_unused_drop', tmp_path, 'drop')


@pytest.mark.everyday_leg('dota')
def test_retinanet_drop_under_ddp(tmp_path, capsys):
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
    # The story of the run (issue 68): rank 0's journal names the image
    # rank 1 dropped and the bundle rank 1 wrote (outside the work dir).
    story, text = _story(osp.join(str(tmp_path), 'work'), capsys)
    (run, ) = story.runs
    assert (run.world_size, run.policy, run.ended) == (2, 'drop',
                                                       'finished')
    (trigger, ) = [e for e in run.entries if e.incident.kind == 'trigger']
    assert (trigger.incident.iter, trigger.incident.act,
            trigger.incident.samples) == (results[1]['drops'][0], 'drop',
                                          [bad])
    assert [osp.join(p, 'report.json') for p in trigger.bundles] == [
        bundles[0]['path']]
    (listed, ) = story.quarantine
    assert (listed.file, listed.rank, listed.source, listed.run) == (
        bad, 1, 'drop', run.run)
    assert 'quarantined %s (drop, rank 1)' % bad in text
