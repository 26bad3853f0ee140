"""Each sample of a batch known by the dataset index its sampler gave it
(:mod:`mmnanhook.quarantine._identity`), on a plain torch ``Dataset``
(:mod:`mmnan_testing.plain`: each sample's first input value is its own
index): through worker processes and their prefetch, persistent workers
over epochs, ``InfiniteSampler`` under ``IterBasedTrainLoop`` (whose
iterator starts before any hook), and a dataset wrapper. Never a wrong
index: a batch drawn before the hook started is said unknown. Then what
goes by it: a quarantined index never loaded again, and left out of a
batch in flight, on a dataset without data infos or file names; and
quarantine lists of the earlier format read as before.
"""
import json
import os.path as osp

import pytest
from mmengine.dataset import BaseDataset
from mmengine.hooks import Hook
from torch.utils.data import ConcatDataset

from mmnanhook import NanDetectHook
from mmnanhook.quarantine import (Quarantine, QuarantinedSample,
                                  read_quarantine, write_quarantine)
from mmnan_testing.plain import (InOrder, PlainDataset, file_of, loads,
                                 plain_runner)


class _Seen(Hook):
    """Per train step: the indices the hook knows, and the samples' own."""

    priority = 'VERY_LOW'

    def __init__(self, hook):
        self.hook = hook
        self.seen = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        known = self.hook._run.samples.indices(data_batch)
        self.seen.append((known, [int(x[0]) for x in data_batch['inputs']]))


# Batches a worker iterator started before the hook has drawn: num_workers
# x prefetch_factor (torch's default 2).
_PREFETCHED = 2 * 2


@pytest.mark.parametrize('case', ['iter', 'iter_workers', 'epoch_workers',
                                  'concat'])
def test_each_sample_is_known_by_its_sampler_index(tmp_path, case):
    hook = NanDetectHook()
    seen = _Seen(hook)
    dataset = PlainDataset(8)
    if case == 'concat':
        dataset = ConcatDataset([PlainDataset(3), PlainDataset(5, first=3)])
    kwargs = dict(max_iters=10, shuffle=True)
    if case == 'epoch_workers':
        kwargs = dict(epochs=2, shuffle=True, sampler='DefaultSampler')
    runner = plain_runner(tmp_path, dataset, hook, custom_hooks=[seen],
                          workers=2 if 'workers' in case else 0, **kwargs)
    runner.train()
    assert len(seen.seen) == (8 if case == 'epoch_workers' else 10)
    unknown = _PREFETCHED if case == 'iter_workers' else 0
    for known, actual in seen.seen[:unknown]:
        assert known is None
    for known, actual in seen.seen[unknown:]:
        assert known == actual
    if case == 'epoch_workers':
        # Two epochs of the same persistent workers, each sample once in
        # each.
        assert sorted(i for _, a in seen.seen for i in a) == sorted(
            list(range(8)) * 2)


def test_a_reviewed_index_is_never_loaded_on_a_plain_dataset(tmp_path):
    """A list entry with the file a sample's metainfo names and its index:
    the dataset has no data infos, so the index is what is blocked
    (before issue 63 the file was looked up in data infos there were
    not, and the sample was loaded)."""
    reviewed = str(tmp_path / 'reviewed.json')
    write_quarantine(reviewed, [QuarantinedSample([3], file_of(3))])
    log_file = str(tmp_path / 'loads.log')
    runner = plain_runner(tmp_path / 'work', PlainDataset(
        8, log_file=log_file), dict(quarantine=reviewed), max_iters=8)
    runner.train()
    loaded = [i for _, i in loads(log_file)]
    assert len(loaded) == 16 and 3 not in loaded


def test_a_dropped_index_in_flight_is_left_out(tmp_path):
    """No file names at all (no metainfo), 2 worker processes: the NaN
    sample 5 is dropped in iteration 2 and quarantined by its index;
    iteration 4's batch holds it again, drawn (and sent to a worker) before
    the decision: it is left out there by its index, with no second
    trigger."""
    batches = []

    class _Batches(Hook):
        priority = 'VERY_LOW'

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            batches.append([int(x[0]) for x in data_batch['inputs']])

    runner = plain_runner(
        tmp_path / 'work', PlainDataset(8, nan=[5], files=False),
        dict(policy='drop'), epochs=1, workers=2,
        sampler=InOrder([0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 0, 1]),
        custom_hooks=[_Batches()])
    runner.train()
    hub = runner.message_hub
    assert hub.get_scalar('train/samples_dropped').current() == 1
    assert hub.get_scalar('train/quarantine_removed').current() == 1
    listed = read_quarantine(str(tmp_path / 'work' / 'nan_quarantine.json'))
    assert [(s.indices, s.file, s.source) for s in listed] == [
        ([5], None, 'drop')]
    # Iteration 4's batch, drawn before the decision, came with it (and
    # trained on its other sample alone: one removed, no second drop).
    assert batches[4] == [4, 5] and len(batches) == 6


class _Infos(BaseDataset):
    """Data infos of four files (a dataset that names files)."""

    def load_data_list(self):
        return [dict(img_path='img/%d.png' % i) for i in range(4)]


def test_a_list_of_the_earlier_format_still_loads(tmp_path):
    """The list as mmnanhook wrote it before sample identities (format
    version 1, unchanged): an entry with a file is keyed by it in a dataset
    with data infos, and by its indices in one without; an entry without a
    file keeps its indices."""
    path = str(tmp_path / 'nan_quarantine.json')
    with open(path, 'w') as f:
        json.dump({'format': 'mmnanhook-quarantine', 'version': 1,
                   'samples': [
                       {'indices': [1], 'file': 'img/2.png', 'reason': 'r',
                        'iter': 1, 'epoch': 0, 'rank': 0, 'source': 'drop'},
                       {'indices': [3], 'reason': 'scan', 'source': 'scan'}]},
                  f)
    samples = read_quarantine(path, 4)
    # The file's index now (an edited annotation file moved it).
    named = Quarantine(path, _Infos(pipeline=[]), read_quarantine(path, 4))
    assert named.blocked == {2, 3} and named.files == {'img/2.png'}
    plain = Quarantine(path, PlainDataset(4), samples)
    assert plain.blocked == {1, 3}
    # Written back in the same format.
    write_quarantine(path, plain.samples)
    with open(path) as f:
        data = json.load(f)
    assert (data['format'], data['version']) == ('mmnanhook-quarantine', 1)
    assert [s.to_dict() for s in read_quarantine(path, 4)] == [
        s.to_dict() for s in plain.samples]
    assert osp.exists(path)
