"""The samples of a step a process died in, tried one at a time.

A process that died inside a step (SIGSEGV in an op, SIGKILL) left the
samples of that step named (:mod:`._flight`), not which of them killed it.
Quarantining them all costs every innocent batch-mate for ever (15 good
samples of a batch of 16, per crash). At the next start under
``policy='drop'`` each is tried alone in a child process of ours
(:class:`mmnanhook._child.Child`: a stranger to the training process's
signal handlers and exit functions, killed with it, waited for with a
bound): loaded through the train pipeline (``dataset[index]``), collated
alone, its input checked after the data preprocessor, then the forward and
backward of the run's model on it alone. A child that dies names its
sample. The child is a fork: it reads the model and the dataset as the
training process holds them (resumed weights included), copy-on-write, and
nothing it does reaches the training process.

Not tried (every sample is then quarantined, as before, the log saying
why): under DDP (a forked rank cannot take part in its group's
collectives, SyncBN's), a model with a tensor outside the CPU (a forked
child cannot use CUDA), a platform without fork.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from collections.abc import Mapping
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from .._child import Child, can_fork
from .._inputs import nonfinite_samples
from .._mmengine import unwrap_model
from ..records import SampleId

# Seconds one sample's trial may take (its load, forward and backward on the
# CPU, one thread) before it is killed and said inconclusive.
TRY_WITHIN = 300.0
# Seconds all the trials of one start may take: the samples not tried by
# then are not (a start never waits more, whatever the batch size).
TRIALS_WITHIN = 900.0

# Bytes of a child's answer read back (one JSON line).
_ANSWER = 65536


class TrialResult(NamedTuple):
    """What one sample's trial alone came to.

    Args:
        sample (SampleId): The sample.
        outcome (str): ``'died'`` (its child died of a signal),
            ``'nonfinite'`` (its input is not finite after the data
            preprocessor: not run further), ``'trained'`` (forward and
            backward ran), ``'raised'`` (an exception: inconclusive),
            ``'timeout'`` (killed after :data:`TRY_WITHIN` s: inconclusive),
            ``'untried'`` (no dataset index, or no fork).
        detail (str): What happened, in words.
    """

    sample: SampleId
    outcome: str
    detail: str

    @property
    def culprit(self) -> bool:
        """Whether the trial names this sample: its child died, or its
        input is not finite."""
        return self.outcome in ('died', 'nonfinite')


def _cannot_try(runner: Any, module: Any) -> Optional[str]:
    """Why the samples cannot be tried in a forked child, or ``None``."""
    from mmengine.dist import get_world_size
    if not can_fork():
        return 'this platform does not fork'
    if get_world_size() > 1:
        return ('under DDP a forked child cannot take part in the ranks\' '
                'collectives')
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.device.type != 'cpu':
            return ('the model is on %s, which a forked child cannot use' %
                    tensor.device)
    if getattr(runner.train_dataloader, 'dataset', None) is None:
        return 'the train dataloader has no dataset'
    return None


def _forward_loss(module, data):
    """What ``BaseModel.train_step`` does up to the loss it backwards."""
    if isinstance(data, Mapping):
        losses = module(**data, mode='loss')
    elif isinstance(data, (list, tuple)):
        losses = module(*data, mode='loss')
    else:
        losses = module(data, mode='loss')
    loss, _ = module.parse_losses(losses)
    return loss


def _try(dataset: Any, collate: Any, module: Any, index: int,
         fd: int) -> None:
    """In the child: the sample alone, then one JSON line into ``fd``."""
    import torch
    # A crash here is what is looked for: its stack is not the run's.
    if faulthandler.is_enabled():
        faulthandler.disable()
    # A forked process's OpenMP pool is the parent's; one thread needs none.
    torch.set_num_threads(1)
    answer = dict(outcome='trained')
    try:
        batch = collate([dataset[index]])
        module.train()
        data = module.data_preprocessor(batch, True)
        bad = nonfinite_samples(data)
        if bad:
            answer = dict(outcome='nonfinite')
        else:
            with torch.enable_grad():
                _forward_loss(module, data).backward()
    except Exception as error:  # noqa: BLE001 - said, inconclusive
        answer = dict(outcome='raised', error='%s: %s' % (
            type(error).__name__, str(error).split('\n')[0][:500]))
    os.write(fd, (json.dumps(answer) + '\n').encode()[:_ANSWER])


def _read(fd):
    chunks = []
    while True:
        chunk = os.read(fd, _ANSWER)
        if not chunk:
            return b''.join(chunks)
        chunks.append(chunk)


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return 'signal %d' % number


def _one(dataset, collate, module, sample, within=TRY_WITHIN):
    if sample.index is None:
        return TrialResult(sample, 'untried',
                           'not tried: its dataset index is unknown')
    if within <= 0:
        return TrialResult(sample, 'untried', 'not tried: the trials took '
                           'their %g s' % TRIALS_WITHIN)
    ours, theirs = os.pipe()
    try:
        try:
            child = Child(_try, (dataset, collate, module, sample.index,
                                 theirs))
        except OSError as error:
            return TrialResult(sample, 'untried',
                               'not tried: no fork (%s)' % error)
        finally:
            os.close(theirs)
        code = child.wait(within)
        if code is None:
            child.stop()
            return TrialResult(
                sample, 'timeout', 'its trial did not end within %g s '
                '(killed): inconclusive, not quarantined' % within)
        raw = _read(ours)
    finally:
        os.close(ours)
    if code < -1:
        return TrialResult(sample, 'died', 'its child process died of %s: '
                           'quarantined' % _signal_name(-code))
    try:
        answer = json.loads(raw.decode() or '{}')
    except ValueError:
        answer = {}
    outcome = answer.get('outcome')
    if outcome == 'nonfinite':
        return TrialResult(sample, 'nonfinite', 'its input is not finite '
                           'after the data preprocessor: quarantined')
    if outcome == 'trained':
        return TrialResult(sample, 'trained', 'its forward and backward ran '
                           'alone: not quarantined, it trains on')
    if outcome == 'raised':
        return TrialResult(sample, 'raised', 'it raised %s alone: '
                           'inconclusive, not quarantined' % answer['error'])
    return TrialResult(sample, 'raised', 'its child exited with code %s '
                       'and no answer: inconclusive, not quarantined' % code)


def try_alone(runner: Any, samples: Sequence[SampleId]
              ) -> Tuple[Optional[List[TrialResult]], Optional[str]]:
    """Try each of ``samples`` alone, one child process at a time, each
    within :data:`TRY_WITHIN` s and all within :data:`TRIALS_WITHIN` s.

    Args:
        runner (Runner): In ``before_train`` (its model, its weights
            resumed; its train dataloader's dataset and collate function).
        samples (list[SampleId]): The samples of the step a process died
            in.

    Returns:
        tuple: ``(results, None)``, one :class:`TrialResult` per sample in
        order; or ``(None, why)`` when they cannot be tried.
    """
    module = unwrap_model(runner.model)
    why = _cannot_try(runner, module)
    if why is not None:
        return None, why
    loader = runner.train_dataloader
    end = time.monotonic() + TRIALS_WITHIN
    return [_one(loader.dataset, loader.collate_fn, module, sample,
                 min(TRY_WITHIN, end - time.monotonic()))
            for sample in samples], None
