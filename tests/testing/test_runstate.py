"""The before/after checker of the replays (:mod:`mmnan_testing.runstate`)
on a real runner: the tiny RetinaNet with mmdet's ``BatchSyncRandomResize``
among its data preprocessor's batch augments, trained one iteration. The
checker finds nothing when nothing changed, and finds each change made the
way a replay would make it: the preprocessor run again at a synchronising
iteration (its ``_input_size`` and Python's RNG), a train-mode forward (BN
running statistics), a runtime-info key, a pipeline transform's attribute, a
``CachedMosaic``'s cache, a hook left on a module, a sampler's epoch, a
gradient, a collective function left replaced, anomaly mode left on."""
import copy
import random

import pytest
import torch

from mmnan_testing import runstate, testbed

pytestmark = [pytest.mark.mmdet]


@pytest.fixture(scope='module')
def runner(tmp_path_factory):
    from mmengine.runner import Runner
    root = tmp_path_factory.mktemp('runstate')
    data = testbed.make_dataset('coco', str(root / 'data'), num_images=4)
    cfg = testbed.tiny_config('retinanet', data, str(root / 'work'),
                              max_iters=1)
    # Sizes 96 or 128 px at every synchronisation: never the 64 px batches.
    cfg.model.data_preprocessor.batch_augments = [dict(
        type='BatchSyncRandomResize', random_size_range=(96, 128),
        size_divisor=32, interval=1)]
    cfg.train_dataloader.num_workers = 0
    cfg.train_dataloader.persistent_workers = False
    runner = Runner.from_cfg(cfg)
    runner.train()
    return runner


def _batch(runner):
    return copy.deepcopy(next(iter(runner.train_dataloader)))


def _changes(runner, change):
    before = runstate.take(runner)
    change()
    return runstate.diff(before, runstate.take(runner))


def test_nothing_changed_nothing_found(runner):
    first = runstate.take(runner)
    assert runstate.diff(first, runstate.take(runner)) == []
    assert runstate.diff(first, first) == []
    # The parts the checker promises are there.
    for part in ('params', 'buffers', 'grads', 'optimizer', 'rng', 'modules',
                 'message_hub', 'data', 'hooks'):
        assert first[part], part
    augments = [name for name in first['modules']
                if name.endswith('batch_augments.0')]
    assert augments, sorted(first['modules'])[:20]
    assert '_input_size' in first['modules'][augments[0]]


def test_a_preprocessor_run_again_is_seen(runner):
    """The preprocessor at an iteration whose ``(iter + 1) % interval`` is
    0 draws a new input size (Python's ``random`` on rank 0) and keeps it
    in ``self._input_size``, as a replay running it again does."""
    preprocessor = runner.model.data_preprocessor
    batch = _batch(runner)
    augment = preprocessor.batch_augments[0]
    size = augment._input_size
    # A seed whose draw is the other size (96 or 128 px).
    seed = [s for s in range(100) if _draw(s) * 32 != size[0]][0]
    random.seed(seed)
    found = _changes(runner, lambda: preprocessor(batch, training=True))
    assert augment._input_size != size
    assert any('batch_augments.0' in d and '_input_size' in d
               for d in found), found
    assert any(d.startswith('rng') and 'python' in d for d in found), found
    # The parameters and optimizer did not change: not reported.
    assert not [d for d in found if d.startswith(('params', 'optimizer'))]


def _draw(seed):
    state = random.getstate()
    random.seed(seed)
    try:
        return random.randint(3, 4)
    finally:
        random.setstate(state)


def test_the_input_size_set_back_by_hand_is_seen_as_restored(runner):
    augment = runner.model.data_preprocessor.batch_augments[0]
    before = runstate.take(runner)
    size = augment._input_size
    augment._input_size = (size[0] + 32, size[1])
    changed = runstate.diff(before, runstate.take(runner))
    assert [d for d in changed if '_input_size' in d] == [
        "modules['data_preprocessor.batch_augments.0']['_input_size']: "
        "(%d, %d) -> (%d, %d)" % (size[0], size[1], size[0] + 32, size[1])]
    augment._input_size = size
    assert runstate.diff(before, runstate.take(runner)) == []


def test_a_train_forward_changes_the_running_statistics(runner):
    model = runner.model
    batch = model.data_preprocessor(_batch(runner), training=True)
    random.seed(0)  # whatever the preprocessor drew
    found = _changes(runner, lambda: model(**batch, mode='loss'))
    running = [d for d in found if d.startswith('buffers')]
    assert any('running_mean' in d for d in running), found
    assert any('num_batches_tracked' in d for d in running), found
    assert not [d for d in found if d.startswith('params')]


def test_one_buffer_element_changed_bitwise_is_seen(runner):
    name, buffer = [(n, b) for n, b in runner.model.named_buffers()
                    if n.endswith('running_var')][0]
    old = buffer.clone()

    def nudge():
        buffer.view(-1)[0] = torch.nextafter(buffer.view(-1)[0],
                                             torch.tensor(2.0)) \
            if hasattr(torch, 'nextafter') else buffer.view(-1)[0] * (
                1 + 1e-6)

    found = _changes(runner, nudge)
    assert len(found) == 1 and found[0].startswith(
        "buffers[%r]" % name), found
    buffer.copy_(old)


def test_a_runtime_info_key_is_seen(runner):
    hub = runner.message_hub
    it = hub.get_info('iter')
    found = _changes(runner, lambda: hub.update_info('iter', it + 5))
    assert found == ["message_hub['iter']: %d -> %d" % (it, it + 5)]
    hub.update_info('iter', it)
    found = _changes(runner, lambda: hub.update_info('mmnan_test_key', 1))
    assert len(found) == 1 and 'mmnan_test_key' in found[0], found
    hub.pop_info('mmnan_test_key')


def test_a_log_scalar_is_seen(runner):
    hub = runner.message_hub
    found = _changes(runner,
                     lambda: hub.update_scalar('train/loss', 12.5))
    assert found and all(d.startswith("log_scalars['train/loss']")
                         for d in found), found


def test_a_pipeline_transform_and_the_sampler_are_seen(runner):
    loader = runner.train_dataloader
    flip = [t for t in loader.dataset.pipeline.transforms
            if type(t).__name__ == 'RandomFlip'][0]
    prob = flip.prob
    found = _changes(runner, lambda: setattr(flip, 'prob', 0.25))
    assert len(found) == 1 and "['prob']" in found[0] and \
        found[0].startswith('data'), found
    flip.prob = prob
    epoch = loader.sampler.epoch
    found = _changes(runner, lambda: loader.sampler.set_epoch(epoch + 3))
    assert found and all(d.startswith('data') and "'epoch'" in d
                         for d in found), found
    loader.sampler.set_epoch(epoch)


def test_a_cached_mosaic_cache_is_seen(runner):
    """A ``CachedMosaic`` in the dataset's pipeline: a sample through it
    (as a replay loading the batch again would send one) grows its cache,
    which a later composed sample draws from."""
    from mmdet.datasets.transforms import CachedMosaic
    dataset = runner.train_dataloader.dataset
    steps = dataset.pipeline.transforms
    load = steps[:2]  # LoadImageFromFile, LoadAnnotations
    mosaic = CachedMosaic(img_scale=(64, 64), max_cached_images=4,
                          random_pop=False)
    steps.insert(2, mosaic)
    try:
        results = dataset.get_data_info(0)
        for step in load:
            results = step(results)
        found = _changes(runner, lambda: mosaic(copy.deepcopy(results)))
        assert found and all(d.startswith('data') and 'results_cache' in d
                             for d in found), found
    finally:
        steps.remove(mosaic)


def test_a_hook_left_behind_and_a_grad_are_seen(runner):
    model = runner.model
    head = model.bbox_head
    handle = head.register_forward_hook(lambda *args: None)
    try:
        found = runstate.diff(runstate.take(runner), runstate.take(runner))
        assert found == []
        before = runstate.take(runner)
        handle.remove()
        found = runstate.diff(before, runstate.take(runner))
        assert len(found) == 1 and '_forward_hooks' in found[0] and \
            "modules['bbox_head']" in found[0], found
    finally:
        handle.remove()
    param = next(model.parameters())
    grad = param.grad
    found = _changes(runner, lambda: setattr(param, 'grad', None if grad
                                             is not None else
                                             torch.zeros_like(param)))
    assert len(found) == 1 and found[0].startswith('grads'), found
    param.grad = grad


def test_a_collective_left_replaced_and_anomaly_mode_left_on_are_seen(
        runner):
    import torch.distributed as dist
    real = dist.broadcast

    def local(tensor, src=0, group=None, async_op=False):
        return None

    found = _changes(runner, lambda: setattr(dist, 'broadcast', local))
    dist.broadcast = real
    assert found == [found[0]] and found[0].startswith(
        "process['functions']['torch.distributed.broadcast']"), found
    try:
        found = _changes(runner, lambda: torch.autograd.set_detect_anomaly(
            True))
    finally:
        torch.autograd.set_detect_anomaly(False)
    assert found == ["process['anomaly']: False -> True"], found


def test_pictures_of_values():
    picture = runstate.picture
    nan = float('nan')
    assert picture([nan, 1.0]) == picture([nan, 1.0])
    assert picture(0.0) != picture(-0.0)
    a = torch.arange(4.)
    b = a.clone()
    b[3] = 3.0000002
    assert picture(a) == picture(a.clone()) and picture(a) != picture(b)
    assert picture(torch.zeros(2)) != picture(torch.zeros(2, 1))
    assert picture(torch.zeros(2)) != picture(torch.zeros(2,
                                                          dtype=torch.int32))

    class Thing(object):
        def __init__(self):
            self.size = (1, 2)
            self.cache = [dict(img=torch.ones(2))]
            self.me = self

    one, two = Thing(), Thing()
    assert picture(one) == picture(two)
    two.cache[0]['img'][1] = 0
    assert runstate.diff(dict(x=picture(one)), dict(x=picture(two))) == [
        "x['<attrs>']['cache'][0]['img']: %r -> %r" % (
            runstate.tensor_leaf(one.cache[0]['img']),
            runstate.tensor_leaf(two.cache[0]['img']))]
