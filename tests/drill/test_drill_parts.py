"""The drill's parts without training: the shortened config, the sampler,
the bitwise comparison and the verdicts' reading of a run's outcome."""
import os.path as osp

import pytest
import torch

from mmnanhook.drill._config import (data_format, hook_config, prepare,
                                     without_hook)
from mmnanhook.drill._runs import first_difference
from mmnanhook.drill._verdict import judge_clean, judge_fault
from mmnan_testing import testbed, zoo

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
