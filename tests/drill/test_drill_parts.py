"""The drill's parts without training: the shortened config, its data (the
synthetic stand-in in the config's classes, format and sizes, one for every
rank; why a dataset is empty), the sampler, the bitwise comparison and the
verdicts' reading of a run's outcome."""
import json
import os.path as osp
import threading

import pytest
import torch

from mmnanhook.demo import synthetic
from mmnanhook.drill._config import hook_config, prepare, without_hook
from mmnanhook.drill._data import (StandIn, data_format, empty_reason,
                                   write_stand_in)
from mmnanhook.drill._runs import first_difference
from mmnanhook.drill._verdict import judge_clean, judge_fault
from mmnanhook.errors import DatasetError
from mmnan_testing import families, testbed, zoo

SPEC = dict(iter=1, rank=0, length=3)


def _outcome(**values):
    outcome = dict(iters=3, error=None, error_type=None, finite=True,
                   scalars=dict(nan_skipped=0, samples_dropped=0, rewinds=0),
                   bundles=[], quarantined=[], planted=dict(
                       kind='loss', iter=1, rank=0, name='loss_cls',
                       hit=True, finite_after=True))
    outcome.update(values)
    return outcome


def _bundle(**values):
    bundle = dict(iter=1, trigger='loss', nonfinite_losses=['loss_cls'],
                  nonfinite_grads=[], samples=[], sample_indices=[],
                  module=None, kind='loss', summary='')
    bundle.update(values)
    return bundle


def test_a_skipped_step_holds():
    verdict = judge_fault('loss', _outcome(
        bundles=[_bundle()], scalars=dict(nan_skipped=1, samples_dropped=0,
                                          rewinds=0)), SPEC, 'skip', 0)
    assert verdict.ok, [c.to_dict() for c in verdict.checks]
    assert [c.name for c in verdict.checks] == ['caught', 'named', 'policy',
                                                'finite']


def test_a_fault_let_through_fails_even_when_a_later_step_raises():
    # The blind check: iteration 1 stepped with the fault, iteration 2 raised.
    outcome = _outcome(iters=2, error='NonFiniteError: ... iter 2',
                       error_type='NonFiniteError', finite=False,
                       bundles=[_bundle(iter=2)])
    outcome['planted']['finite_after'] = False
    verdict = judge_fault('loss', outcome, SPEC, 'raise', 0)
    assert not verdict.ok
    assert verdict.failed.name == 'caught'
    assert verdict.failed.detail == \
        'no trigger in iteration 1; weights NOT finite after iteration 1'


def test_another_name_is_not_named():
    verdict = judge_fault('grad', _outcome(
        planted=dict(kind='grad', iter=1, rank=0, name='head.weight',
                     hit=True, finite_after=None),
        iters=1, error='NonFiniteError: x', error_type='NonFiniteError',
        bundles=[_bundle(trigger='grad', nonfinite_grads=['neck.weight'],
                         module='neck')]), SPEC, 'raise', 0)
    checks = {c.name: c for c in verdict.checks}
    assert checks['caught'].ok and checks['policy'].ok
    assert not checks['named'].ok
    # Its module named as the origin is a name of it.
    verdict = judge_fault('grad', _outcome(
        planted=dict(kind='grad', iter=1, rank=0, name='head.weight',
                     hit=True, finite_after=None),
        iters=1, error='NonFiniteError: x', error_type='NonFiniteError',
        bundles=[_bundle(trigger='grad', module='head')]), SPEC, 'raise', 0)
    assert verdict.ok


def test_a_died_run_and_a_changed_clean_run_fail():
    died = judge_fault('data', dict(died='the process died of SIGSEGV'),
                       SPEC, 'raise', 0)
    assert not died.ok and died.failed.detail == 'the process died of SIGSEGV'
    clean = judge_clean(_outcome(), _outcome(difference='state.model.w'), 3,
                        0)
    assert clean.failed.name == 'unchanged'
    assert clean.failed.detail.endswith('at state.model.w')


def test_a_config_whose_clean_run_goes_nan_is_not_clean():
    # TridentNet at 320 px from random weights: NaN at iteration 2 without
    # the hook (trained on), caught with it.
    clean = judge_clean(
        _outcome(nonfinite_loss_at=2), _outcome(
            iters=2, error='NonFiniteError: Non-finite loss at iter 2',
            error_type='NonFiniteError'), 3, 0)
    assert [(c.ok, c.detail) for c in clean.checks] == [
        (False, 'without mmnanhook: the loss is not finite at iteration 2'),
        (False, 'with mmnanhook: NonFiniteError: Non-finite loss at iter 2')]


def test_first_difference_is_bitwise_with_nan_equal():
    a = dict(w=torch.tensor([1.0, float('nan')]), lrs=[[0.1]])
    assert first_difference(a, dict(w=a['w'].clone(), lrs=[[0.1]])) is None
    b = dict(w=torch.tensor([1.0 + 2**-20, float('nan')]), lrs=[[0.1]])
    assert first_difference(a, b) == 'state.w'
    assert first_difference(a, dict(w=a['w'], lrs=[[0.2]])) == \
        'state.lrs[0][0]'


@pytest.mark.mmdet
def test_the_zoo_retinanet_is_shortened_on_synthetic_data(tmp_path):
    if not zoo.available('retinanet_r50'):
        pytest.skip('mmdet is not installed here')
    prepared = prepare(zoo.shipped_config('retinanet_r50'),
                       str(tmp_path / 'data'), 3, policy='drop')
    cfg = prepared.cfg
    assert prepared.data == 'coco'
    loader = cfg.train_dataloader
    assert loader.sampler.type == 'DrillSampler'
    assert loader.sampler.sampler.type == 'DefaultSampler'
    assert loader.sampler.length == 6 and loader.batch_size == 2
    assert cfg.train_cfg.max_epochs == 1
    assert cfg.model.backbone.init_cfg is None
    assert osp.isfile(osp.join(loader.dataset.data_root,
                               loader.dataset.ann_file))
    # 800 px scaled to 320.
    resize = [s for s in loader.dataset.pipeline if s.type == 'Resize'][0]
    assert tuple(resize.scale) == (533, 320)
    assert hook_config(cfg).policy == 'drop'
    assert hook_config(without_hook(cfg)) is None
    assert hook_config(cfg) is not None  # the copy, not the config


@pytest.mark.mmdet
def test_data_formats():
    from mmengine.config import Config
    if not zoo.available('retinanet_r50'):
        pytest.skip('mmdet is not installed here')
    assert data_format(Config.fromfile(
        zoo.shipped_config('mask_rcnn_r50'))) == 'coco_masks'
    assert data_format(Config.fromfile(
        zoo.shipped_config('retinanet_r50_voc'))) == 'voc'
    assert data_format(Config.fromfile(
        osp.join(testbed.config_dir(), 'tiny_retinanet.py'))) == 'coco'


@pytest.mark.mmdet
def test_the_sampler_is_the_users_cut(tmp_path):
    from mmengine.registry import DATA_SAMPLERS

    from mmnanhook.drill import _sampler  # noqa: F401 - registration
    dataset = list(range(40))
    user = dict(type='DefaultSampler', shuffle=True)
    sampler = DATA_SAMPLERS.build(
        dict(type='DrillSampler', sampler=user, length=6),
        default_args=dict(dataset=dataset, seed=3))
    full = DATA_SAMPLERS.build(user, default_args=dict(dataset=dataset,
                                                       seed=3))
    assert list(sampler) == list(full)[:6] and len(sampler) == 6
    sampler.set_epoch(1)
    full.set_epoch(1)
    assert list(sampler) == list(full)[:6]
    assert sampler.dataset is dataset


@pytest.mark.parametrize('samples, indices, ok, detail', [
    (['/d/a.png'], [0], True, 'sample /d/a.png planted; named: /d/a.png'),
    # Another file blamed: wrong, even at the planted place.
    (['/d/b.png'], [0], False, 'sample /d/a.png planted; named: /d/b.png'),
    # A Mosaic sample whose file loads finite: its place, no file blamed.
    ([None], [0], True, 'sample 0 planted; named: sample 0'),
    ([None], [1], False, 'sample 0 planted; named: sample 1'),
])
def test_a_data_fault_is_named_by_its_file_or_by_its_place(samples, indices,
                                                           ok, detail):
    planted = dict(kind='data', iter=1, rank=0, name='/d/a.png', hit=True,
                   finite_after=None)
    verdict = judge_fault('data', _outcome(
        planted=planted, iters=1, error='NonFiniteError: x',
        error_type='NonFiniteError', bundles=[_bundle(
            trigger='exception', samples=samples,
            sample_indices=indices)]), SPEC, 'raise', 0)
    named = [c for c in verdict.checks if c.name == 'named'][0]
    assert (named.ok, named.detail) == (ok, detail)


TINY = osp.join(testbed.config_dir(), 'tiny_retinanet.py')


def _built(cfg):
    from mmengine.registry import DATASETS
    return DATASETS.build(cfg.train_dataloader.dataset)


def _labels(dataset):
    return {int(instance['bbox_label']) for index in range(len(dataset))
            for instance in dataset.get_data_info(index)['instances']}


@pytest.mark.mmdet
def test_the_stand_in_is_in_the_configs_own_classes(tmp_path):
    """Issue 64: a child config with its own ``metainfo`` classes trained
    nothing (``need at least one array to concatenate``): its stand-in was
    written in other classes, which its metainfo filtered out."""
    child = families.own_classes_child(tmp_path, TINY)
    prepared = prepare(child, str(tmp_path / 'data'), 3)
    assert prepared.changes[0] == (
        'a synthetic coco dataset of 48 images of 320 px in its 3 classes '
        '(balloon, kangaroo, fish)')
    dataset = _built(prepared.cfg)
    assert len(dataset) == 48
    assert dataset.metainfo['classes'] == families.OWN_CLASSES
    assert _labels(dataset) == {0, 1, 2}
    leaf = prepared.cfg.train_dataloader.dataset
    with open(osp.join(leaf.data_root, leaf.ann_file)) as f:
        categories = json.load(f)['categories']
    assert tuple(c['name'] for c in categories) == families.OWN_CLASSES


@pytest.mark.mmdet
def test_the_stand_in_keeps_what_the_filter_keeps(tmp_path):
    # Images at least the filter's min_size, else it would keep none.
    child = families.own_classes_child(tmp_path, TINY)
    with open(child, 'a') as f:
        f.write('train_dataloader.update(dataset=dict(filter_cfg=dict('
                'filter_empty_gt=True, min_size=400)))\n')
    prepared = prepare(child, str(tmp_path / 'data'), 1)
    assert 'of 400 px' in prepared.changes[0]
    assert len(_built(prepared.cfg)) == 16


@pytest.mark.mmdet
def test_the_stand_in_of_a_voc_config_is_in_its_classes(tmp_path):
    child = families.own_classes_child(
        tmp_path, osp.join(testbed.config_dir(), 'tiny_retinanet_voc.py'))
    prepared = prepare(child, str(tmp_path / 'data'), 1)
    assert prepared.data == 'voc'
    dataset = _built(prepared.cfg)
    assert len(dataset) == 16 and _labels(dataset) == {0, 1, 2}


@pytest.mark.mmdet
def test_a_zoo_stand_in_is_in_the_dataset_classes_the_model_has(tmp_path):
    if not zoo.available('retinanet_r50'):
        pytest.skip('mmdet is not installed here')
    # No metainfo: CocoDataset's own 80 classes.
    prepared = prepare(zoo.shipped_config('retinanet_r50'),
                       str(tmp_path / 'shipped'), 1)
    assert prepared.changes[0].endswith(
        'in its 80 classes (person, bicycle, car, motorcycle, airplane, ... '
        '(80 in all))')
    # A head of 3 classes and no metainfo: labels past 2 no head has.
    child = tmp_path / 'child.py'
    child.write_text('_base_ = {!r}\nmodel = dict(bbox_head=dict('
                     'num_classes=3))\n'.format(
                         zoo.shipped_config('retinanet_r50')))
    prepared = prepare(str(child), str(tmp_path / 'child'), 1)
    assert prepared.changes[0].endswith(
        'in the first 3 of its 80 classes (the model has num_classes=3): '
        'person, bicycle, car')
    assert _labels(_built(prepared.cfg)) == {0, 1, 2}


def test_the_fewest_classes_of_a_head_but_an_rpns():
    from mmnanhook.drill._data import num_classes
    assert num_classes(dict(
        rpn_head=dict(num_classes=1),
        roi_head=dict(bbox_head=dict(num_classes=3),
                      mask_head=dict(num_classes=80)))) == 3
    assert num_classes(dict(backbone=dict(depth=50))) is None


@pytest.mark.mmrotate
def test_the_dota_stand_in_is_in_its_classes_and_declared_shape(tmp_path):
    child = families.own_classes_child(
        tmp_path, osp.join(testbed.config_dir(), 'tiny_rotated_retinanet.py'))
    prepared = prepare(child, str(tmp_path / 'child'), 1)
    # DOTADataset declares every image (64, 64).
    assert prepared.changes[0] == (
        'a synthetic dota dataset of 16 images of 64 px in its 3 classes '
        '(balloon, kangaroo, fish)')
    dataset = _built(prepared.cfg)
    assert len(dataset) == 16 and _labels(dataset) == {0, 1, 2}
    if not zoo.available('rotated_retinanet'):
        return
    # 1024 px declared, scaled as the pipeline is: 320 px written.
    prepared = prepare(zoo.shipped_config('rotated_retinanet'),
                       str(tmp_path / 'zoo'), 1)
    leaf = prepared.cfg.train_dataloader.dataset
    assert tuple(leaf.img_shape) == (320, 320)
    assert 'of 320 px in its 15 classes (plane, ' in prepared.changes[0]
    image = synthetic.cv2.imread(_built(prepared.cfg).get_data_info(0)[
        'img_path'])
    assert image.shape[:2] == (320, 320)


@pytest.mark.mmdet
def test_an_empty_dataset_is_said_in_the_configs_terms(tmp_path):
    """Its own data is here, and its classes and filter leave none of it:
    said as such (numpy's ``need at least one array to concatenate``
    before), and no stand-in is trained instead."""
    own = str(tmp_path / 'own')
    synthetic.make_coco_dataset(own, num_images=4)  # cat and dog
    child = families.own_classes_child(tmp_path, TINY, data_root=own + '/')
    prepared = prepare(child, str(tmp_path / 'data'), 3)
    assert prepared.data == 'own'
    assert empty_reason(prepared.cfg) == (
        'the train dataset is empty: CocoDataset of {}/annotations/train.json'
        ': none of its classes (balloon, kangaroo, fish) is a category of its '
        'annotation file, and filter_cfg=dict(filter_empty_gt=True, '
        'min_size=32) left none of its 4 images'.format(own))
    # Its classes right, its filter keeps no image of 64 px.
    prepared.cfg.train_dataloader.dataset.update(
        metainfo=dict(classes=('cat', 'dog')),
        filter_cfg=dict(filter_empty_gt=True, min_size=100))
    assert empty_reason(prepared.cfg) == (
        'the train dataset is empty: CocoDataset of {}/annotations/train.json'
        ': filter_cfg=dict(filter_empty_gt=True, min_size=100) left none of '
        'its 4 images'.format(own))
    prepared.cfg.train_dataloader.dataset.filter_cfg.min_size = 32
    assert empty_reason(prepared.cfg) is None


def test_every_rank_reads_the_stand_in_rank_0_wrote(tmp_path):
    stand = StandIn('coco', ('a', 'b'), 64)
    root = str(tmp_path / 'data')
    waited = {}
    waiter = threading.Thread(target=lambda: waited.update(
        root=write_stand_in(stand, root, 4, writes=False, timeout=60)))
    waiter.start()
    assert write_stand_in(stand, root, 4) == root
    waiter.join(60)
    assert waited['root'] == root
    assert osp.isfile(osp.join(root, synthetic.COCO_ANN_FILE))
    with pytest.raises(DatasetError, match='rank 0 did not write the '
                       'synthetic dataset in .* within 0.3 s'):
        write_stand_in(stand, str(tmp_path / 'never'), 4, writes=False,
                       timeout=0.3)
    # A failed write is said to the ranks that wait for it.
    broken = StandIn('coco', (), 64)  # no class to draw a label from
    with pytest.raises(DatasetError) as written:
        write_stand_in(broken, str(tmp_path / 'broken'), 4)
    with pytest.raises(DatasetError) as waiting:
        write_stand_in(broken, str(tmp_path / 'broken'), 4, writes=False,
                       timeout=60)
    assert str(written.value).startswith(
        'cannot write the synthetic dataset in ')
    assert str(waiting.value) == 'rank 0 ' + str(written.value)


def _counters(*skipped):
    return [dict(nan_skipped=s, samples_dropped=0, rewinds=0)
            for s in skipped]


def test_a_rank_without_the_fault_is_judged_by_the_path_it_took():
    """DDP: rank 1's loss fault, its bundle on rank 1 alone; rank 0 left
    the step out with it. Before, rank 0 was judged as if it had the fault
    itself: 'no trigger in iteration 1'."""
    spec = dict(iter=1, rank=1, length=3)
    planted = dict(kind='loss', iter=1, rank=1, name=None, hit=False,
                   finite_after=True)
    outcome = _outcome(planted=planted, counters=_counters(0, 1, 1),
                       scalars=dict(nan_skipped=1, samples_dropped=0,
                                    rewinds=0))
    verdict = judge_fault('loss', outcome, spec, 'drop', 0)
    assert verdict.ok, [c.to_dict() for c in verdict.checks]
    assert [c.name for c in verdict.checks] == ['caught', 'policy', 'finite']
    assert verdict.checks[0].detail == (
        "rank 1's trigger at iteration 1, followed here: the step left out; "
        'weights finite after iteration 1')
    # A rank that stepped on (its counters still) took no part in it.
    outcome.update(counters=_counters(0, 0, 0), scalars=dict(
        nan_skipped=0, samples_dropped=0, rewinds=0))
    verdict = judge_fault('loss', outcome, spec, 'drop', 0)
    assert verdict.failed.detail == ('no trigger in iteration 1; weights '
                                     'finite after iteration 1')
    # The rank that had it must have written its bundle.
    outcome.update(counters=_counters(0, 1, 1), planted=dict(
        planted, name='loss_cls', hit=True))
    assert judge_fault('loss', outcome, spec, 'drop', 1).failed.name == \
        'caught'
