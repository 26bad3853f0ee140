"""Training processes that may die inside a step, each in its own process
(a crash must take down the script, never the test session).

Usage::

    python -m mmnan_testing.crash die WORK_DIR SIGNAL
    python -m mmnan_testing.crash resume WORK_DIR
    python -m mmnan_testing.crash tile NAME WORK_DIR POLICY
    python -m mmnan_testing.crash plain die|resume WORK_DIR SIGNAL

``die``: the tiny RetinaNet under ``NanDetectHook(policy='drop')``, a
checkpoint after every iteration; in iteration :data:`DIES_AT` its backbone's
forward kills the process with ``SIGNAL`` (``KILL``: as the OOM killer;
``SEGV``: a read of address 0, as a C++ op's crash). Before that it prints
one JSON line with the files of that iteration's batch.
``resume``: the same config, ``resume=True``, trained to its end; prints
the files of each iteration's batch.
``tile``: the zoo config ``NAME`` (:mod:`mmnan_testing.zoo`), one epoch on
four images, image :data:`TILE` loaded as float pixels, all NaN
(:mod:`mmnan_testing.nodata`), ``NanDetectHook(policy=POLICY)`` (``default``:
the hook's own); prints what came of it.
``plain``: a plain torch ``Dataset`` (:mod:`mmnan_testing.plain`: no data
infos, the file in each sample's metainfo), ``IterBasedTrainLoop`` in
order, batches of 2, a checkpoint after every iteration,
``NanDetectHook(policy='drop')``; sample :data:`PLAIN_DEADLY` (in iteration
:data:`DIES_AT`, beside an innocent one) kills the process in the forward
with ``SIGNAL``. ``die`` trains until it dies; ``resume`` resumes in the
same work dir and prints the indices of each iteration's batch (by the
samples' own inputs) and the loads of each process (``log_file``).
"""
import ctypes
import json
import os
import signal
import sys

import torch
from mmengine.hooks import Hook
from mmengine.runner import Runner

from mmnanhook._mmengine import unwrap_model
from mmnan_testing import plain as plain_bed
from mmnan_testing import testbed, zoo
from mmnan_testing.nodata import nodata_pipeline, register_nodata_transforms

DIES_AT = 2
ITERS = 4
TILE = 3
IMAGES = 4
# The plain dataset's sample that kills the process: iteration DIES_AT's
# second (its first, 2 * DIES_AT, is innocent).
PLAIN_DEADLY = 2 * DIES_AT + 1
PLAIN_SAMPLES = 8


def _print(**values):
    print(json.dumps(values))
    sys.stdout.flush()


class _Dies(Hook):
    """Arms the backbone's forward to kill the process in ``at``."""

    def __init__(self, at, signal_name):
        self.at = at
        self.signal_name = signal_name
        self.armed = False

    def before_train(self, runner):
        unwrap_model(runner.model).backbone.register_forward_pre_hook(
            self._in_forward)

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.armed = runner.iter == self.at
        if self.armed:
            _print(iter=runner.iter, files=[
                s.metainfo['img_path'] for s in data_batch['data_samples']])

    def _in_forward(self, module, args):
        if not self.armed:
            return
        if self.signal_name == 'SEGV':
            ctypes.string_at(0)
        os.kill(os.getpid(), signal.SIGKILL)


def _tiny(work_dir, resume):
    torch.set_num_threads(1)
    data = testbed.make_dataset('retinanet', work_dir + '/data',
                                num_images=IMAGES)
    cfg = testbed.tiny_config('retinanet', data, work_dir + '/work',
                              max_iters=ITERS, log_level='WARNING')
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=1,
                                        by_epoch=False)
    cfg.resume = resume
    cfg.custom_imports = dict(imports=['mmnanhook'],
                              allow_failed_imports=False)
    cfg.custom_hooks = [dict(type='NanDetectHook', policy='drop')]
    return Runner.from_cfg(cfg)


def die(work_dir, signal_name):
    runner = _tiny(work_dir, False)
    runner.register_hook(_Dies(DIES_AT, signal_name))
    runner.train()
    _print(survived=True)


def resume(work_dir):
    runner, files = _tiny(work_dir, True), zoo.BatchFiles()
    runner.register_hook(files)
    runner.train()
    _print(files=files.files)


def tile(name, work_dir, policy):
    torch.set_num_threads(1)
    register_nodata_transforms()
    data = zoo.make_zoo_dataset(name, work_dir + '/data', num_images=IMAGES)
    options = {} if policy == 'default' else dict(policy=policy)
    cfg = zoo.child_config(name, data, work_dir + '/work', length=1,
                           hook='line', hook_options=options)
    bad = data['images'][TILE]
    dataset = cfg.train_dataloader.dataset
    dataset.pipeline = nodata_pipeline(dataset.pipeline, bad)
    runner, files, error = zoo.train_with_files(cfg)
    hub = runner.message_hub
    scalars = dict((key, float(hub.get_scalar('train/' + key).current()))
                   for key in ('samples_dropped', 'nan_skipped')
                   if 'train/' + key in hub.log_scalars)
    _print(bad=bad, files=files.files, done=len(files.loss), scalars=scalars,
           error=None if error is None else dict(
               message=str(error), trigger=error.trigger, iter=error.iter,
               bundle=error.bundle, report=error.report),
           finite=all(bool(torch.isfinite(p).all())
                      for p in unwrap_model(runner.model).parameters()))


class _Batches(Hook):
    """The index of each sample of every iteration's batch, read from the
    samples' own inputs (their first value)."""

    priority = 'VERY_LOW'

    def __init__(self):
        self.batches = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.batches.append([int(x[0]) for x in data_batch['inputs']])


def plain(what, work_dir, signal_name):
    torch.set_num_threads(1)
    log_file = os.path.join(work_dir, 'loads.log')
    dataset = plain_bed.PlainDataset(PLAIN_SAMPLES, deadly=[PLAIN_DEADLY],
                                     log_file=log_file)
    batches = _Batches()
    runner = plain_bed.plain_runner(
        os.path.join(work_dir, 'work'), dataset, dict(policy='drop'),
        max_iters=ITERS, resume=what == 'resume', how=signal_name,
        checkpoint=True, custom_hooks=[batches])
    if what == 'die':
        # Each load before the fatal step's: what that step held is known.
        open(log_file, 'w').close()
    started = os.path.getsize(log_file) if os.path.exists(log_file) else 0
    runner.train()
    with open(log_file) as f:
        f.seek(started)
        loaded = [tuple(int(v) for v in line.split()) for line in f]
    _print(pid=os.getpid(), batches=batches.batches, loads=loaded,
           iter=runner.iter)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0)
    {'die': die, 'resume': resume, 'tile': tile,
     'plain': plain}[command](*argv)


if __name__ == '__main__':
    main()
