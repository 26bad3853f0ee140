"""mmagic's zoo configs: SRCNN (restoration: LQ/GT pairs, IterBasedTrainLoop,
InfiniteSampler, Adam under CosineRestartLR) and DCGAN (a GAN: its own
``train_step`` steps the discriminator's optim wrapper, then the
generator's, of one ``OptimWrapperDict``), two iterations of batches of two
on four synthetic images (:func:`mmnanhook.demo.make_pairs_dataset`,
:func:`mmnanhook.demo.make_image_folder`).

One sample's image loads as float pixels, all NaN
(:class:`mmnan_testing.nodata.LoadNodataEditImage`): SRCNN's LQ input (the
input check stops the step before its forward) or its GT target (the loss
turns NaN), DCGAN's real image (the discriminator's loss turns NaN). The
default policy stops the update step with that image named, the weights
and optimizer state those before the iteration, and the bundle replays in
a fresh process to the same trigger (DCGAN's through its own train_step,
up to the discriminator's update step). ``'drop'`` leaves SRCNN's sample
out of its step and quarantines it; a GAN's step cannot be recomputed
without a sample (its own train_step steps two optimizers), so ``'drop'``
skips the discriminator's update step, saying why, as documented
(docs/recovery.md), and the generator's goes on.

mmagic 1.2.0's ``DCGANDiscriminator.init_weights`` raises
``UnboundLocalError`` (its ``init_info`` is unset for the module itself:
open-mmlab/mmagic#2109): every DCGAN config fails in ``Runner.train``
before its first iteration. The runs here give the discriminator
``init_cfg=dict(type='Pretrained')`` of a file of its own freshly built
weights, which is the one path of that method that does not reach the bug.
"""
import glob
import math
import os.path as osp
import re

import pytest
import torch
from mmengine.registry import MODELS, RUNNERS, init_default_scope
from mmengine.runner import Runner

from mmnanhook import NonFiniteError
from mmnan_testing import cli, zoo
from mmnan_testing.nodata import (edit_nodata_pipeline,
                                  register_nodata_transforms)

IMAGES = 4
ITERS = 2
# The image (its index among the files) that loads as NaN.
BAD = 1


def _marks(everyday=False):
    return zoo.codebase_marks('mmagic', everyday)


@pytest.fixture(autouse=True)
def _one_thread():
    # One core each on this machine; a run and what it is compared with
    # (another run, a step by hand) sum in the same order.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _dcgan_init(cfg, root):
    """The discriminator's weights from a file of its own freshly built
    ones (seed 0): the one path of its ``init_weights`` without mmagic's
    bug (the module docstring)."""
    path = osp.join(str(root), 'dcgan_discriminator.pth')
    if not osp.exists(path):
        init_default_scope('mmagic')
        torch.manual_seed(0)
        torch.save(MODELS.build(cfg.model.discriminator).state_dict(), path)
    cfg.model.discriminator.init_cfg = dict(type='Pretrained',
                                            checkpoint=path)


def _files(name, data):
    """The file that names sample :data:`BAD` (its ``img_path``: the LQ of
    a pair; the real image of a GAN), and the file of its image of each
    pipeline key."""
    image = data['images'][BAD]
    if zoo.ZOO[name].data == 'pairs':
        lq = osp.join(data['lq_dir'], image)
        return lq, dict(img=lq, gt=osp.join(data['gt_dir'], image))
    real = osp.join(data['img_dir'], image)
    return real, dict(gt=real)


def _run(root, name, key=None, hook='line', options=None, data=None):
    """Train ``name`` for :data:`ITERS` iterations.

    Args:
        key (str, optional): The pipeline key whose image of sample
            :data:`BAD` loads as NaN (``'img'``, ``'gt'``); none.
        hook (str, optional): ``zoo.child_config``'s.
        options (dict, optional): The hook's options.
        data (dict, optional): The dataset; written under ``root``.

    Returns:
        dict: ``runner``, ``probe`` (a ``zoo.DropProbe`` of the bad
        sample), ``error``, ``bad`` (its file), ``nan`` (the file that
        loads as NaN), ``data``.
    """
    if data is None:
        data = zoo.make_zoo_dataset(name, str(root / 'data'),
                                    num_images=IMAGES)
    cfg = zoo.child_config(name, data, str(root / 'work'), length=ITERS,
                           hook=hook, hook_options=options)
    cfg.log_level = 'WARNING'
    if name == 'dcgan_64':
        _dcgan_init(cfg, root)
    bad, files = _files(name, data)
    if key is not None:
        register_nodata_transforms()
        dataset = cfg.train_dataloader.dataset
        dataset.pipeline = edit_nodata_pipeline(
            dataset.pipeline, osp.basename(files[key]), key)
    runner = RUNNERS.build(cfg) if hook == 'base' else Runner.from_cfg(cfg)
    probe = zoo.DropProbe(bad)
    runner.register_hook(probe)
    error = None
    try:
        runner.train()
    except NonFiniteError as exc:
        error = exc
    return dict(runner=runner, probe=probe, error=error, bad=bad,
                nan=files.get(key), data=data)


@pytest.fixture(scope='module')
def raised(tmp_path_factory):
    """The default policy's run of each (config, NaN key), trained once
    (for the catch and for the replay)."""
    runs = {}

    def run(name, key):
        if (name, key) not in runs:
            runs[name, key] = _run(
                tmp_path_factory.mktemp('%s_%s' % (name, key)), name, key)
        return runs[name, key]
    return run


def _iteration_of(run):
    (at, ) = [i for i, files in enumerate(run['probe'].files)
              if run['bad'] in files]
    return at


@pytest.mark.parametrize('name', [
    pytest.param(n, marks=_marks()) for n in ('srcnn_x4', 'dcgan_64')])
def test_clean_run_is_the_run_without_the_hook(tmp_path, name):
    ref_data = zoo.make_zoo_dataset(name, str(tmp_path / 'ref' / 'data'),
                                    num_images=IMAGES)
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'hook' / 'data'),
                                num_images=IMAGES)
    # The synthetic writers are deterministic: equal arguments, equal bytes.
    for a, b in zip(*[sorted(glob.glob(osp.join(d['data_root'], '**', '*'),
                                       recursive=True))
                      for d in (ref_data, data)]):
        assert osp.relpath(a, ref_data['data_root']) == osp.relpath(
            b, data['data_root'])
        if osp.isfile(a):
            assert open(a, 'rb').read() == open(b, 'rb').read(), a
    ref = _run(tmp_path / 'ref', name, hook=None, data=ref_data)
    # The `_base_` snippet, merged next to the shipped config.
    run = _run(tmp_path / 'hook', name, hook='base', data=data)
    assert ref['error'] is None and run['error'] is None
    runner, probe, ref_probe = run['runner'], run['probe'], ref['probe']
    assert [h for h in probe.hooks if h != 'NanDetectHook'] == \
        ref_probe.hooks
    assert probe.hooks.count('NanDetectHook') == 1
    assert runner.iter == len(ref_probe.lr) == ITERS
    # Checked: every update step (a GAN's two a train step) logged its norm.
    wrappers = len(runner.optim_wrapper.optim_wrappers) if name == \
        'dcgan_64' else 1
    norms = runner.message_hub.get_scalar('train/grad_norm').data[0]
    assert len(norms) == wrappers * ITERS
    assert probe.lr == ref_probe.lr and probe.momentum == ref_probe.momentum
    assert probe.loss == ref_probe.loss
    assert all(math.isfinite(v) for v in probe.loss)
    zoo.assert_equal(zoo.model_state(runner), zoo.model_state(ref['runner']),
                     'state')
    zoo.assert_equal(runner.optim_wrapper.state_dict(),
                     ref['runner'].optim_wrapper.state_dict(), 'optimizer')
    zoo.assert_same_checkpoints(runner, ref['runner'])


# (config, the pipeline key whose image is NaN): SRCNN's GT target (the
# loss turns NaN: make test's smoke), its LQ input (the input check), and
# DCGAN's real image.
CAUGHT = [pytest.param('srcnn_x4', 'gt', marks=_marks(everyday=True)),
          pytest.param('srcnn_x4', 'img', marks=_marks()),
          pytest.param('dcgan_64', 'gt', marks=_marks())]


@pytest.mark.parametrize('name,key', CAUGHT)
def test_the_nan_image_is_caught_before_the_update(raised, name, key):
    run = raised(name, key)
    error, probe, runner = run['error'], run['probe'], run['runner']
    assert error is not None
    at = _iteration_of(run)
    # Nothing of the iteration applied: every weight (a GAN's generator's
    # and discriminator's) and every optimizer's state.
    zoo.assert_stopped_before(runner, probe, at, error)
    report = error.report
    assert report['kind'] == 'data'
    # The one sample, not its batch mate, its problem naming the file that
    # loaded as NaN (a pair's GT is another file than the sample's LQ).
    position = probe.files[at].index(run['bad'])
    (sample, ) = report['samples']
    assert (sample['index'], sample['img_path']) == (position, run['bad'])
    assert sample['dataset_index'] == BAD
    assert any('NaN' in p and (key == 'img' or run['nan'] in p)
               for p in sample['problems'])
    if key == 'img':
        # The input check: stopped before the forward, no loss made.
        assert error.trigger == 'exception' and not report['losses']
    else:
        assert error.trigger == 'loss'
        # Replayed (a GAN through its own train_step): the bad sample
        # fails alone, its batch mate does not.
        assert [r['result'] for r in report['sample_replays']] == [
            'nonfinite' if i == position else 'finite'
            for i in range(len(probe.files[at]))]
    if name == 'dcgan_64':
        # The discriminator's update step, which the real image reaches;
        # not the generator's, which sees none.
        assert report['nonfinite_losses'] == ['loss_disc_real']
        assert report['nonfinite_grads'] and all(
            g.startswith('discriminator.') for g in report['nonfinite_grads'])
    assert error.bundle and osp.isdir(error.bundle)


@pytest.mark.parametrize('name,key', [
    pytest.param('srcnn_x4', 'gt', marks=_marks()),
    pytest.param('dcgan_64', 'gt', marks=_marks())])
def test_the_bundle_replays_to_the_same_trigger(raised, name, key):
    error = raised(name, key)['error']
    code, replayed = cli.replay_json(error.bundle)
    assert code == 0
    # A fresh process, from the bundle alone (a GAN's optim wrappers built
    # from its config): the same NaN losses and gradients, the same sample
    # failing alone and named, the same fixes with the same outcomes;
    # everything but the time it took.
    cli.assert_same_report(replayed, cli.run_report(error.bundle))
    assert replayed['kind'] == 'data' and replayed['nonfinite_losses']

@pytest.mark.parametrize('key', [pytest.param(k, marks=_marks())
                                 for k in ('gt', 'img')])
def test_drop_leaves_the_pair_out_and_quarantines_it(tmp_path, key):
    run = _run(tmp_path, 'srcnn_x4', key, options=dict(policy='drop'))
    runner, probe, bad = run['runner'], run['probe'], run['bad']
    assert run['error'] is None, run['error']
    # Every iteration, every batch full; the bad sample's step applied on
    # its batch mate alone, as that step by hand from the same state.
    assert runner.iter == len(probe.loss) == ITERS
    assert all(len(files) == 2 for files in probe.files)
    assert probe.at is not None
    zoo.assert_equal(zoo.step_by_hand(runner, probe, bad), probe.at['after'],
                     'state')
    sample = zoo.dropped_alone(runner, bad, IMAGES)
    assert sample.indices == [BAD]
    assert all(loss is not None and math.isfinite(loss)
               for loss in probe.loss)
    assert all(probe.finite)


@pytest.mark.zoo
@pytest.mark.zoo_full
@pytest.mark.mmagic
def test_drop_on_the_gan_skips_the_discriminator_step(tmp_path):
    # A GAN's train step cannot be taken again without a sample (its own
    # train_step steps two optimizers): 'drop' skips the update step that
    # failed, the discriminator's, and says so once; the generator's update
    # step of the same train step is applied (its loss has no real image).
    run = _run(tmp_path, 'dcgan_64', 'gt', options=dict(policy='drop'))
    runner, probe = run['runner'], run['probe']
    assert run['error'] is None, run['error']
    assert runner.iter == len(probe.loss) == ITERS
    hub = runner.message_hub
    assert hub.get_scalar('train/nan_skipped').current() == 1
    assert 'train/samples_dropped' not in hub.log_scalars
    (log, ) = glob.glob(osp.join(runner.log_dir, '*.log'))
    said = re.findall(r"policy 'drop'.*", open(log).read())
    assert len(said) == 1 and 'skipped' in said[0], said
    assert not osp.exists(osp.join(runner.work_dir, 'nan_quarantine.json'))
    before, after = probe.at['state'], probe.at['after']
    for key in before:
        same = torch.equal(before[key], after[key])
        if key.startswith('discriminator.') and 'running' not in key and \
                'num_batches' not in key:
            assert same, key
    assert not all(torch.equal(before[k], after[k]) for k in before
                   if k.startswith('generator.'))
    # What the iteration returns for LogProcessor is nothing of it: its
    # loss is not in the windows, which stay finite.
    assert probe.loss[probe.at['iter']] is None
    for name, buffer in hub.log_scalars.items():
        if name.startswith('train/loss'):
            assert all(math.isfinite(v) for v in buffer.data[0]), name
    assert all(probe.finite)
