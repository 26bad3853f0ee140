"""A train step that is not quiet, on two CPU ranks over gloo (the toy
model; started by :func:`mmnan_testing.ddp.run_ranks` with
``module='mmnan_testing.ddp_hidden'``).

Scenarios:

* ``buffers_preprocess``: DDP's default ``broadcast_buffers=True`` (the
  forward first broadcasts the BatchNorm's buffers, a collective called
  from C++) and a data preprocessor that raises on rank 1's NaN sample in
  iteration :data:`PRE_ITER`, before DDP's forward: rank 0 must not wait
  in that broadcast for a rank that votes; ``'skip'``.
* ``raise_before_reduce``: rank 1's loss raises (``raise_in_loss``) before
  its ``reduce_mean`` in a step whose DDP forward made no collective.
* ``code_fault``: the same preprocessor raises on rank 1's finite data
  (a fault of the code): every rank ends at once, with that error named.
* ``sync_skip`` / ``sync_drop``: a data preprocessor that, like mmdet's
  ``BatchSyncRandomResize``, takes a random scale from rank 0 (``barrier``
  and ``broadcast``) every second iteration and keeps it in an attribute
  for the next ones; rank 1's NaN input stops its forward on entry (the
  input check, after that preprocessor) in iteration :data:`SYNC_ITER`,
  one that synchronises. The replays of the diagnosis run that
  preprocessor again: the scale every rank keeps must stay rank 0's.
"""
import os.path as osp
import random

import torch

from .ddp import _drop_run, main as _main

# Rank 1's sample 9 is in its iteration 2 (DefaultSampler, 2 ranks, batch 2).
PRE_SAMPLE, PRE_ITER = 9, 2
# Iteration 1 synchronises ((iter + 1) % 2 == 0); rank 1's sample 5 is in
# it.
SYNC_SAMPLE, SYNC_ITER = 5, 1


def _preprocessor_type():
    from mmengine.dist import barrier, broadcast, get_dist_info
    from mmengine.logging import MessageHub
    from mmengine.model import BaseDataPreprocessor

    class SyncScale(BaseDataPreprocessor):
        """Scales the inputs by the scale it keeps; every second iteration
        rank 0 draws the next one and broadcasts it (as
        ``BatchSyncRandomResize`` does its next input size).

        Args:
            interval (int): Iterations between two draws.
            check (bool): Raise on a non-finite input (its NaN sample makes
                the preprocessor raise, before DDP's forward).
        """

        def __init__(self, interval=2, check=False):
            super(SyncScale, self).__init__()
            self.interval = interval
            self.check = check
            self._scale = 1.0
            # Rebound, as _input_size is: a step undone forgets its draw.
            self.draws = 0

        def forward(self, data, training=False):
            data = super(SyncScale, self).forward(data, training)
            if 'preprocess_bug' in (data.get('fault') or []):
                raise KeyError('preprocess_bug: a fault of the code')
            if self.check and not all(bool(torch.isfinite(x).all())
                                      for x in data['inputs']):
                raise ValueError('non-finite input')
            data['inputs'] = [x * self._scale for x in data['inputs']]
            if not training:
                return data
            iter = MessageHub.get_current_instance().get_info('iter')
            if (iter + 1) % self.interval == 0:
                tensor = torch.empty(1)
                if get_dist_info()[0] == 0:
                    tensor[0] = 0.5 + random.random()
                barrier()
                broadcast(tensor, 0)
                self._scale = float(tensor[0])
                self.draws += 1
            return data

    return SyncScale


def _sync_model():
    from .toy import ToyBNModel

    class SyncScaleModel(ToyBNModel):

        def __init__(self):
            super(SyncScaleModel, self).__init__()
            self.data_preprocessor = _preprocessor_type()()

    return SyncScaleModel


def _buffers_preprocess(out_dir):
    from .toy import ToyBNModel

    class Raising(ToyBNModel):

        def __init__(self):
            super(Raising, self).__init__()
            self.data_preprocessor = _preprocessor_type()(interval=1000,
                                                          check=True)

    result = _drop_run(out_dir, {PRE_SAMPLE: 'nan_input'}, Raising,
                       policy='skip', ddp=dict(broadcast_buffers=True),
                       check_by_hand=False)
    return result


def _code_fault(out_dir):
    """Rank 1's preprocessor raises on finite data (a fault of the code, no
    policy's to handle): both ranks end at once, rank 1 with its error, rank
    0 naming it."""
    import time

    from .toy import ToyBNModel, make_runner

    class Buggy(ToyBNModel):

        def __init__(self):
            super(Buggy, self).__init__()
            self.data_preprocessor = _preprocessor_type()(interval=1000)

    runner = make_runner(
        out_dir, faults={PRE_SAMPLE: 'preprocess_bug'}, model=Buggy(),
        max_iters=4, hook=dict(type='NanDetectHook', policy='skip',
                               dump_dir=osp.join(out_dir, 'dumps')),
        launcher='pytorch', env_cfg=dict(dist_cfg=dict(backend='gloo')),
        cfg=dict(model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                        device_ids=None,
                                        broadcast_buffers=True)))
    start = time.time()
    try:
        runner.train()
    except Exception as exc:  # noqa: BLE001 - what the run ends with
        notes = getattr(exc, '__notes__', None) or []
        return dict(raised=type(exc).__name__,
                    message='\n'.join([str(exc)] + list(notes)),
                    iter=runner.iter, seconds=time.time() - start)
    return dict(raised=None, iter=runner.iter)


def _sync(policy):

    def scenario(out_dir):
        import torch.distributed as dist
        from mmengine.logging import MessageHub
        holder = {}
        model_type = _sync_model()

        def made():
            holder['model'] = model_type()
            return holder['model']

        result = _drop_run(out_dir, {SYNC_SAMPLE: 'nan_input'}, made,
                           policy=policy, check_by_hand=False)
        preprocessor = holder['model'].data_preprocessor
        scale = torch.tensor([preprocessor._scale])
        scales = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(scales, scale)
        result.update(scale=preprocessor._scale, draws=preprocessor.draws,
                      every_rank=[float(s) for s in scales],
                      iter_info=MessageHub.get_current_instance().get_info(
                          'iter'))
        return result

    return scenario


def _raise_before_reduce(out_dir):
    """Rank 1's loss raises in iteration :data:`PRE_ITER` before the
    ``reduce_mean`` that rank 0 then calls, the first collective of the
    step that waits (DDP's forward, recorded before it, does not: no
    buffers, the buckets rebuilt): rank 0 votes there, so rank 1 must not
    call it; 'skip'."""
    from .toy import ToyNormalizedModel
    return _drop_run(out_dir, {PRE_SAMPLE: 'raise_in_loss'},
                     ToyNormalizedModel, policy='skip', check_by_hand=False)


SCENARIOS = dict(buffers_preprocess=_buffers_preprocess,
                 raise_before_reduce=_raise_before_reduce,
                 code_fault=_code_fault,
                 sync_skip=_sync('skip'), sync_drop=_sync('drop'))

if __name__ == '__main__':
    _main(scenarios=SCENARIOS)
