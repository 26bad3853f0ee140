"""The quarantine wherever samples are drawn: ``IterBasedTrainLoop`` with a
shuffling ``InfiniteSampler`` (its dataloader iterator is built before any
hook runs), batches in flight (sampled before the quarantine), dataset
wrappers that load a file at several indices, an edited annotation file.

The tiny RetinaNet on synthetic VOC data whose image 3 holds a zero-width
box (``loss_bbox`` is ``inf``): 8 images, batches of 2.
"""
import glob
import os
import os.path as osp

import pytest
from mmengine.registry import init_default_scope

from mmnanhook.quarantine import (Quarantine, QuarantinedSample,
                                  read_quarantine, write_quarantine)
from mmnanhook.demo import synthetic
from mmnan_testing import testbed, zoo

BAD = 3
IMAGES = 8
ITERS = 12


def _data(tmp_path, num_images=IMAGES):
    data = testbed.make_dataset('retinanet_voc', str(tmp_path / 'data'),
                                num_images=num_images,
                                defects={BAD: 'zero_size'})
    data['bad'] = osp.join(data['img_dir'], data['defect_images'][0])
    return data


def _runner(tmp_path, work, hook, data, workers=0, iters=ITERS, **loader):
    cfg = testbed.tiny_config('retinanet_voc', data, str(tmp_path / work),
                              max_iters=iters, log_level='INFO')
    # As mmdet's and mmseg's iteration-based zoo configs load: an endless
    # shuffling sampler, worker processes that live across passes.
    cfg.train_dataloader.update(
        num_workers=workers, persistent_workers=workers > 0,
        sampler=dict(type='InfiniteSampler', shuffle=True), **loader)
    return zoo.runner_with_files(cfg, hook)


def _bundles(runner):
    dumps = osp.join(runner.work_dir, 'nan_dumps')
    return [d for d in os.listdir(dumps) if not d.startswith('.')] \
        if osp.isdir(dumps) else []


def _removed(runner):
    buffer = runner.message_hub.log_scalars.get('train/quarantine_removed')
    return 0 if buffer is None else buffer.current()


def _log(runner):
    return open(glob.glob(osp.join(runner.log_dir, '*.log'))[0]).read()


def _reviewed(tmp_path, files):
    path = str(tmp_path / 'reviewed.json')
    write_quarantine(path, [QuarantinedSample([BAD], f, 'reviewed',
                                              source='scan') for f in files])
    return path


@pytest.mark.mmdet
@pytest.mark.parametrize('workers,batch_sampler', [
    (0, 'BatchSampler'), (2, 'BatchSampler'), (2, 'AspectRatioBatchSampler')])
def test_iteration_based_drop_keeps_the_sample_out_of_later_batches(
        tmp_path, workers, batch_sampler):
    data = _data(tmp_path)
    bad = data['bad']
    loader = {} if batch_sampler == 'BatchSampler' else dict(
        batch_sampler=dict(type=batch_sampler))
    runner, files = _runner(tmp_path, 'drop', dict(policy='drop'), data,
                            workers=workers, **loader)
    runner.train()
    assert runner.iter == ITERS and len(files.files) == ITERS
    assert type(runner.train_dataloader.batch_sampler).__name__ == \
        batch_sampler
    (sample, ) = read_quarantine(
        osp.join(runner.work_dir, 'nan_quarantine.json'))
    assert sample.file == bad and sample.indices == [BAD]
    seen = [i for i, batch in enumerate(files.files) if bad in batch]
    assert seen[0] == sample.iter
    # After the drop it is only in batches sampled before it: none without
    # workers, within the prefetch window (2 workers x 2 batches) with them;
    # each of those lost it before the forward.
    later = seen[1:]
    assert all(i <= sample.iter + 2 * workers for i in later), seen
    assert _removed(runner) == len(later)
    hub = runner.message_hub
    assert hub.get_scalar('train/samples_dropped').current() == 1
    assert hub.get_scalar('train/nan_skipped').current() == 0
    assert len(_bundles(runner)) == 1


@pytest.mark.mmdet
@pytest.mark.parametrize('batch_size', [2, 1])
def test_a_batch_in_flight_loses_its_quarantined_sample_without_a_trigger(
        tmp_path, batch_size):
    # IterBasedTrainLoop built its iterator before the hook read the list:
    # with 2 workers and 4 batches each in flight, all of the first pass
    # over the 8 images was sampled then, the bad image included.
    data = _data(tmp_path)
    bad = data['bad']
    passes = IMAGES // batch_size
    runner, files = _runner(
        tmp_path, 'inflight', dict(policy='raise',
                                   quarantine=_reviewed(tmp_path, [bad])),
        data, workers=2, iters=passes + 2, batch_size=batch_size,
        prefetch_factor=passes // 2)
    runner.train()  # policy='raise': the bad image never reached a forward
    assert runner.iter == passes + 2
    assert [i for i, b in enumerate(files.files) if bad in b][0] < passes
    assert sum(b.count(bad) for b in files.files) == 1
    assert _removed(runner) == 1 and not _bundles(runner)
    log = _log(runner)
    assert '%s left out of the batch' % bad in log
    assert ('no sample is left: the step is not taken' in log) == (
        batch_size == 1)


def _build(dataset_cfg):
    init_default_scope('mmdet')
    from mmdet.registry import DATASETS
    return DATASETS.build(dataset_cfg)


@pytest.mark.mmdet
@pytest.mark.parametrize('wrapper', ['repeat', 'class_balanced', 'concat'])
def test_every_index_that_loads_a_quarantined_file_is_blocked(
        tmp_path, wrapper):
    data = _data(tmp_path)
    inner = testbed.tiny_config('retinanet_voc', data, str(
        tmp_path / 'work')).train_dataloader.dataset
    if wrapper == 'repeat':
        dataset = _build(dict(type='RepeatDataset', times=3, dataset=inner))
        expected = {BAD, BAD + IMAGES, BAD + 2 * IMAGES}
    elif wrapper == 'class_balanced':
        dataset = _build(dict(type='ClassBalancedDataset',
                              oversample_thr=1.0, dataset=inner))
        expected = {i for i, j in enumerate(dataset.repeat_indices)
                    if j == BAD}
    else:  # one file twice: a repeated entry
        dataset = _build(dict(type='ConcatDataset', datasets=[inner, inner]))
        expected = {BAD, BAD + IMAGES}
    assert len(expected) > 1
    # Listed at one index, as a run on the plain dataset wrote it.
    quarantine = Quarantine(str(tmp_path / 'q.json'), dataset, [
        QuarantinedSample([BAD], data['bad'], 'zero width')])
    assert quarantine.blocked == expected and not quarantine.gone


@pytest.mark.mmdet
def test_an_edited_annotation_file_blocks_no_innocent_image(tmp_path):
    data = _data(tmp_path, num_images=IMAGES + 1)
    split = osp.join(data['data_root'], synthetic.VOC_SPLIT_FILE)
    ids = ['%06d' % i for i in range(IMAGES + 1)]
    # The list a run on images 0..7 wrote: image 3 at index 3.
    listed = _reviewed(tmp_path, [data['bad']])
    # Then the annotation file loses image 3 and gains image 8: image 4 is
    # index 3 now.
    kept = [i for i in ids if i != '%06d' % BAD]
    with open(split, 'w') as f:
        f.write('\n'.join(kept) + '\n')
    runner, files = _runner(tmp_path, 'edited', dict(
        policy='raise', quarantine=listed), data, iters=IMAGES // 2)
    runner.train()  # one pass over the 8 images
    loaded = sorted(osp.basename(f) for b in files.files for f in b)
    assert loaded == [i + '.jpg' for i in kept]
    assert '%s is no longer in the train dataset' % data['bad'] in \
        _log(runner)
