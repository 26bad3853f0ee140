"""A training process with a preemption handler, whose run ends while the
index walk forked at ``before_train`` is under way (issue 52).

Cluster launchers and job schedulers checkpoint and requeue on SIGTERM: the
process installs such a handler (it writes ``handler.<pid>`` and exits). It
trains :class:`~mmnan_testing.infos.InfoModel` for 2 iterations under
``NanDetectHook()`` on :class:`SlowManyInfos`, large enough to be walked in a
child (``BACKGROUND_FROM`` infos) and slow there (the walk would take 40 s),
then drops the runner and its dataset.

``python -m mmnan_testing.preempt SCENARIO OUT`` runs one process;
:func:`~mmnan_testing.ddp.run_ranks` with ``module='mmnan_testing.preempt'``
runs it on every rank of a gloo group. Scenarios: ``walk_ends`` (the run
ends while the walk goes on) and ``walk_stopped`` (the walk's child is
stopped, SIGSTOP, before the run ends). Each process writes
``rank<r>.json``: the walk's pid, whether it ran in the last iteration, the
seconds the runner and its dataset took to be dropped, and whether the walk
was still there after.
"""
import functools
import gc
import json
import os
import os.path as osp
import signal
import sys
import time
import uuid

from mmengine.hooks import Hook

from mmnan_testing.infos import (InfoInputs, InfoModel, ManyInfosDataset,
                                 SlowInChild)


class SlowManyInfos(SlowInChild, ManyInfosDataset):
    """A walk of it takes 40 s."""

    slow = 0.005


def alive(pid):
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open('/proc/%d/stat' % pid) as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


def install_preemption_handler(out_dir):
    """A SIGTERM handler as a cluster job's: it writes ``handler.<pid>``
    into ``out_dir`` (the checkpoint), then exits."""

    def on_sigterm(signum, frame):
        with open(osp.join(out_dir, 'handler.%d' % os.getpid()), 'w') as f:
            f.write('checkpointed')
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)


class _WalkProbe(Hook):
    """After ``NanDetectHook``'s ``before_train``: the walk's pid (and the
    walk stopped, with ``stop``); whether it still ran in the last
    iteration."""

    priority = 'NORMAL'

    def __init__(self, stop):
        self.stop = stop
        self.pid = None
        self.walking = None

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        self.walking = alive(self.pid)

    def before_train(self, runner):
        from mmnanhook.quarantine import sample_index
        index = sample_index(runner.train_dataloader.dataset)
        self.pid = index._builder.pid
        if self.stop:
            os.kill(self.pid, signal.SIGSTOP)


def train_while_walking(out_dir, stop=False, distributed=False):
    """Train 2 iterations while the index walk goes on; drop the runner and
    its dataset; say what became of the walk."""
    from mmengine.runner import Runner

    from mmnanhook.quarantine._index import BACKGROUND_FROM
    install_preemption_handler(out_dir)
    probe = _WalkProbe(stop)
    extra = dict(launcher='pytorch', cfg=dict(
        model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                               device_ids=None),
        env_cfg=dict(dist_cfg=dict(backend='gloo'))),
        env_cfg=dict(dist_cfg=dict(backend='gloo'))) if distributed else {}
    runner = Runner(
        model=InfoModel(), work_dir=out_dir,
        experiment_name='preempt_' + uuid.uuid4().hex,
        train_dataloader=dict(
            dataset=SlowManyInfos(BACKGROUND_FROM, pipeline=[InfoInputs()]),
            sampler=dict(type='DefaultSampler', shuffle=False),
            batch_size=2, num_workers=0,
            collate_fn=dict(type='pseudo_collate')),
        train_cfg=dict(by_epoch=False, max_iters=2),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        custom_hooks=[dict(type='NanDetectHook'), probe],
        default_hooks=dict(checkpoint=None), log_level='WARNING',
        default_scope='mmengine', randomness=dict(seed=0), **extra)
    runner.train()
    start = time.time()
    del runner
    gc.collect()
    return dict(pid=probe.pid, walking_at_end=probe.walking,
                dropped_in=time.time() - start, alive=alive(probe.pid))


SCENARIOS = {
    'walk_ends': functools.partial(train_while_walking, distributed=True),
    'walk_stopped': functools.partial(train_while_walking, stop=True,
                                      distributed=True),
}


def main(argv=None):
    """``SCENARIO OUT``: one process (no group) runs it, writes
    ``rank0.json``, prints ``trained`` and ends as a process does (its
    interpreter's exit)."""
    name, out_dir = (argv or sys.argv[1:])[:2]
    result = train_while_walking(out_dir, stop=name == 'walk_stopped')
    with open(osp.join(out_dir, 'rank0.json'), 'w') as f:
        json.dump(result, f)
    print('trained', time.time(), flush=True)


if __name__ == '__main__':
    if os.environ.get('LOCAL_RANK') is not None:
        from mmnan_testing.ddp import main as ddp_main
        ddp_main(scenarios=SCENARIOS)
    else:
        main()
