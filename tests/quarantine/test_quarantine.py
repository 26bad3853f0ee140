"""The quarantine on a real detector: a dropped sample is never loaded again
(2 persistent worker processes, a shuffling sampler), the list is written
and read back, a reviewed list starts a run, bad lists fail before training.

The tiny RetinaNet on VOC data with one zero-width box (``loss_bbox`` is
``inf``): 8 images, batches of 2, 4 iterations an epoch.
"""
import json
import math
import os
import os.path as osp
import stat
import time

import pytest

from mmnanhook.quarantine import (FILE_NAME, QuarantinedSample,
                                  QuarantineError, read_quarantine,
                                  write_quarantine)
from mmnan_testing import testbed, zoo
from mmnan_testing.toy import log_text, make_runner

BAD = 3
EPOCHS = 3


def _by_epoch(files):
    """``(epoch, batch files)`` of every iteration a probe saw."""
    return list(zip(files.epochs, files.files))


def _runner(tmp_path, work, hook, defects=None, epochs=EPOCHS, **cfg_extra):
    data = testbed.make_dataset('retinanet_voc', str(tmp_path / 'data'),
                                num_images=8,
                                defects={BAD: 'zero_size'}
                                if defects is None else defects)
    cfg = testbed.tiny_config('retinanet_voc', data, str(tmp_path / work),
                              log_level='INFO')
    cfg.train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=epochs)
    # As the zoo configs load: worker processes that live across epochs,
    # a shuffling sampler.
    cfg.train_dataloader.update(num_workers=2, persistent_workers=True,
                                sampler=dict(type='DefaultSampler',
                                             shuffle=True))
    cfg.log_processor = dict(type='LogProcessor', window_size=50,
                             by_epoch=True)
    cfg.merge_from_dict(cfg_extra)
    return zoo.runner_with_files(cfg, hook) + (data, )


def _bad_file(data):
    return osp.join(data['img_dir'], data['defect_images'][0])


@pytest.mark.mmdet
def test_a_dropped_sample_is_quarantined_and_never_loaded_again(tmp_path):
    runner, files, data = _runner(tmp_path, 'drop', dict(policy='drop'))
    runner.train()
    bad = _bad_file(data)
    assert runner.epoch == EPOCHS and runner.iter == 4 * EPOCHS
    seen = [(epoch, batch) for epoch, batch in _by_epoch(files)
            if bad in batch]
    # Loaded once, in the first epoch, then never again; every batch full.
    assert [epoch for epoch, _ in seen] == [0]
    assert all(len(batch) == 2 for _, batch in _by_epoch(files))
    assert files.epochs == sorted(
        [e for e in range(EPOCHS)] * 4)
    hub = runner.message_hub
    assert hub.get_scalar('train/samples_dropped').current() == 1
    assert hub.get_scalar('train/nan_skipped').current() == 0
    for name in ('train/loss', 'train/loss_bbox', 'train/grad_norm'):
        values = list(hub.get_scalar(name).data[0])
        assert len(values) == 4 * EPOCHS, name
        assert all(math.isfinite(v) for v in values), name
    # The list names the bad image alone, with its dataset index.
    path = osp.join(runner.work_dir, 'nan_quarantine.json')
    (sample, ) = read_quarantine(path, 8)
    assert sample.file == bad and sample.source == 'drop'
    assert sample.indices == [BAD]
    assert 'zero width' in sample.reason
    assert sample.iter == _by_epoch(files).index(seen[0])
    # One cause, one bundle.
    dumps = osp.join(runner.work_dir, 'nan_dumps')
    assert len([d for d in os.listdir(dumps) if not d.startswith('.')]) == 1


@pytest.mark.mmdet
def test_a_reviewed_list_keeps_its_samples_out_from_the_start(tmp_path):
    reviewed = tmp_path / 'reviewed.json'
    reviewed.write_text(json.dumps(dict(
        format='mmnanhook-quarantine', version=1, samples=[dict(
            indices=[BAD], file=str(tmp_path / 'data' / 'JPEGImages' /
                                    '000003.jpg'),
            reason='reviewed by hand',
            source='scan')])))
    runner, files, data = _runner(
        tmp_path, 'reviewed', dict(policy='raise', quarantine=str(reviewed)),
        epochs=2)
    runner.train()  # the bad image is never loaded: nothing triggers
    bad = _bad_file(data)
    assert not [b for b in files.files if bad in b]
    assert runner.iter == 8 and all(len(b) == 2 for b in files.files)


@pytest.mark.mmdet
@pytest.mark.parametrize('case', ['outside', 'unwritable'])
def test_a_bad_quarantine_stops_before_the_first_iteration(tmp_path, case):
    reviewed = tmp_path / 'reviewed.json'
    reviewed.write_text(json.dumps(dict(
        format='mmnanhook-quarantine', version=1,
        # Keyed by its index alone (a sample with a file is keyed by it).
        samples=[dict(indices=[8])])))
    hook = dict(policy='drop')
    if case == 'outside':
        hook['quarantine'] = str(reviewed)
        message = 'names index 8, outside the train dataset'
    else:
        # A file where the directory should be: unwritable even for root.
        blocker = tmp_path / 'blocker'
        blocker.write_text('')
        hook['quarantine_file'] = str(blocker / 'q.json')
        message = 'cannot be written'
    runner, files, _ = _runner(tmp_path, case, hook, epochs=1)
    with pytest.raises(QuarantineError, match=message):
        runner.train()
    assert files.files == []


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_the_list_is_written_readable_as_the_work_dir(tmp_path):
    path = str(tmp_path / FILE_NAME)
    write_quarantine(path, [QuarantinedSample([3], 'a.jpg', 'NaN input')])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~_umask()
    (sample, ) = read_quarantine(path)
    assert (sample.file, sample.indices) == ('a.jpg', [3])
    # Nothing of the atomic write is left behind.
    assert os.listdir(str(tmp_path)) == [FILE_NAME]


@pytest.mark.parametrize('resume', [False, True])
def test_a_fresh_run_keeps_the_list_of_an_earlier_one(tmp_path, resume):
    # A Runner of the toy model (no image files: it quarantines nothing),
    # started in a work dir an earlier run left its list in (keyed by index:
    # the toy samples have no file).
    path = tmp_path / FILE_NAME
    write_quarantine(str(path), [QuarantinedSample([3], reason='NaN')])
    old = path.read_text()
    written = time.mktime((2026, 1, 2, 3, 4, 5, 0, 0, -1))
    os.utime(str(path), (written, written))
    runner = make_runner(tmp_path, log_level='INFO',
                         hook=dict(type='NanDetectHook', policy='drop'))
    if resume:
        # What Runner(resume=True) sets; nothing to resume from here.
        runner._resume = True
    runner.train()
    kept = tmp_path / 'nan_quarantine.20260102_030405.json'
    if resume:
        assert path.read_text() == old and not kept.exists()
        return
    assert kept.read_text() == old and not path.exists()
    assert 'is the list of an earlier run (this one does not resume it): ' \
        'kept as %s' % kept in log_text(runner)
    # A second fresh run keeps the same name free of clobbering.
    path.write_text(old)
    os.utime(str(path), (written, written))
    make_runner(tmp_path, hook=dict(type='NanDetectHook',
                                    policy='drop')).train()
    again = tmp_path / 'nan_quarantine.20260102_030405_1.json'
    assert again.read_text() == old and kept.read_text() == old
