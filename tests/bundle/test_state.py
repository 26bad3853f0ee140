"""Which bundles hold the state: the ledger's plans, alike on every rank, and
the writer's checksums taken while writing."""
import hashlib
import os.path as osp

import torch

from mmnanhook.bundle import (StateLedger, StateRef, bundle_name, load_bundle,
                              write_bundle)
from mmnanhook.records import NonFiniteEvent, RankFinding, SampleFinding, \
    Trigger


def _event(rank=0, world_size=1, trigger=Trigger.LOSS):
    return NonFiniteEvent(trigger, 'loss', iter=5, rank=rank,
                          world_size=world_size)


def _finding(rank, kind=None, culprit=False):
    return RankFinding(rank, kind, samples=[SampleFinding(0)]
                       if culprit else [])


def test_alone_the_first_of_each_kind_holds_the_state():
    ledger = StateLedger()
    first = ledger.plan(_event(), 5, None, 'data', [0])
    assert first.write and first.ref is None
    ledger.record(_event(), 5, None, 'data', [0])
    again = ledger.plan(_event(), 9, None, 'data', [0])
    assert not again.write and again.ref == StateRef(5, 0)
    # Another kind of incident, or another trigger: a state of its own.
    assert ledger.plan(_event(), 9, None, 'model', [0]).write
    assert ledger.plan(_event(trigger=Trigger.GRAD), 9, None, 'data',
                       [0]).write
    assert ledger.kept() == {StateRef(5, 0)}


def test_under_ddp_only_the_culprit_rank_writes_and_every_rank_agrees():
    findings = [_finding(0, 'not_reproduced'), _finding(1, 'data', True),
                _finding(2, 'not_reproduced'), _finding(3)]
    ledgers = [StateLedger() for _ in range(4)]
    plans = [ledger.plan(_event(rank, 4), 5, findings, None, [0, 1, 2, 3])
             for rank, ledger in enumerate(ledgers)]
    assert [p.write for p in plans] == [False, True, False, False]
    assert all(p.ref == StateRef(5, 1) for p in plans if not p.write)
    for rank, ledger in enumerate(ledgers):
        # What each rank's own diagnosis found does not matter: the
        # exchanged findings decide.
        ledger.record(_event(rank, 4), 5, findings, 'whatever', [0, 1, 2, 3])
    later = [ledger.plan(_event(rank, 4), 8, findings, None, [0, 1, 2, 3])
             for rank, ledger in enumerate(ledgers)]
    assert all(not p.write and p.ref == StateRef(5, 1) for p in later)


def test_without_a_culprit_the_first_rank_that_diagnosed_writes():
    findings = [_finding(0), _finding(1, 'model'), _finding(2, 'model')]
    plans = [StateLedger().plan(_event(rank, 3), 5, findings, None, [1, 2])
             for rank in range(3)]
    assert [p.write for p in plans] == [False, True, False]


def test_every_writes_each_time():
    ledger = StateLedger(every=True)
    ledger.record(_event(), 5, None, 'data', [0])
    assert ledger.plan(_event(), 9, None, 'data', [0]).write


def test_checksums_taken_while_writing_match_the_files(tmp_path):
    # Large enough for torch's zip writer to hand over storage views.
    state = {'w': torch.randn(1 << 18), 'b': torch.arange(10)}
    path = write_bundle(
        str(tmp_path), 'b', dict(iter=3, rank=0), {'model': state},
        {'config.py': 'x = 1\n'}, {'kind': 'data'}, None,
        blobs={'sample0_image.png': b'\x89PNG' + bytes(range(256))})
    bundle = load_bundle(path)
    for entry in bundle.manifest['files']:
        with open(osp.join(path, entry['name']), 'rb') as f:
            data = f.read()
        assert entry['size'] == len(data)
        assert entry['sha256'] == hashlib.sha256(data).hexdigest()
    assert torch.equal(bundle.load('model')['w'], state['w'])


def test_max_dumps_keeps_a_named_state_and_counts_it(tmp_path):
    def write(iter, model=True):
        tensors = {'model': {'w': torch.zeros(2)}} if model else {}
        manifest = dict(iter=iter, rank=0)
        if not model:
            manifest['state_from'] = dict(iter=0, rank=0)
        return write_bundle(str(tmp_path), bundle_name(iter, 0), manifest,
                            tensors, {}, {}, None, max_dumps=3,
                            keep={StateRef(0, 0)})

    written = [write(0)] + [write(i, model=False) for i in range(1, 6)]
    left = [load_bundle(p).manifest['iter'] for p in written if osp.isdir(p)]
    assert left == [0, 4, 5]
    assert load_bundle(written[-1]).state_bundle().path == written[0]


def test_a_trigger_one_rank_saw_alone_is_its_own():
    # A backward that raised on rank 3 only: no exchange, rank 3 diagnoses.
    plan = StateLedger().plan(_event(3, 4), 5, None, 'model', [3])
    assert plan.write


def test_every_keeps_nothing_for_later_bundles():
    ledger = StateLedger(every=True)
    ledger.record(_event(), 5, None, 'data', [0])
    assert ledger.kept() == set()


def test_the_bundle_just_written_is_never_pruned(tmp_path):
    def write(iter, model):
        manifest = dict(iter=iter, rank=0, run='r1')
        if not model:
            manifest['state_from'] = dict(iter=0, rank=0, run='r1')
        return write_bundle(
            str(tmp_path), bundle_name(iter, 0), manifest,
            {'model': {'w': torch.zeros(2)}} if model else {}, {}, {}, None,
            max_dumps=1, keep={StateRef(0, 0, 'r1')})

    first, second = write(0, True), write(1, False)
    assert osp.isdir(first) and osp.isdir(second)
    third = write(2, False)
    assert not osp.isdir(second) and osp.isdir(third)
    assert load_bundle(third).state_bundle().path == first


def test_a_state_of_another_run_is_not_taken(tmp_path):
    # A resumed run writes the same iterations into the same dump dir.
    old = write_bundle(str(tmp_path), bundle_name(0, 0) + '_old',
                       dict(iter=0, rank=0, run='r0'),
                       {'model': {'w': torch.ones(2)}}, {}, {}, None)
    new = write_bundle(str(tmp_path), bundle_name(0, 0),
                       dict(iter=0, rank=0, run='r1'),
                       {'model': {'w': torch.zeros(2)}}, {}, {}, None)
    later = write_bundle(str(tmp_path), bundle_name(3, 0),
                         dict(iter=3, rank=0, run='r1',
                              state_from=dict(iter=0, rank=0, run='r1')),
                         {}, {}, {}, None)
    assert load_bundle(later).state_bundle().path == new != old
