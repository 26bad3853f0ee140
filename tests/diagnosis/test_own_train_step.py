"""A model whose ``train_step`` is its own, as a GAN's: its forward in
``'loss'`` mode makes no loss, and one train step steps two optim wrappers
of an ``OptimWrapperDict``, each on its own loss.

The diagnosis replays such a step through the model's own ``train_step``,
up to the update step that failed (``BaseModel.train_step``'s forward and
``parse_losses`` would raise on it); a step left out by one wrapper is
counted once in ``train/nan_skipped`` and leaves nothing of the train step
in the values LogProcessor smooths, whatever the other wrapper did after
it. The zoo's DCGAN proves the same on mmagic (tests/zoo/test_zoo_agic.py).
"""
import math

import torch

from mmnan_testing.toy import (ToyModel, make_runner, train_error,
                               two_optimizers)


class OwnStepModel(ToyModel):
    """``head`` steps on the total loss, then ``fc`` on ``loss_main`` alone
    (finite whatever the batch's faults); ``forward(mode='loss')`` gives
    the predictions, as a GAN's forward samples images."""

    def forward(self, inputs, fault=None, mode='tensor'):
        return super().forward(inputs, fault, 'tensor')

    def train_step(self, data, optim_wrapper):
        data = self.data_preprocessor(data, True)
        # Each part trained with the other's weights frozen, as a GAN's
        # generator and discriminator are.
        self.fc.requires_grad_(False)
        with optim_wrapper['head'].optim_context(self):
            losses = ToyModel.forward(self, **data, mode='loss')
        parsed, log_vars = self.parse_losses(losses)
        optim_wrapper['head'].update_params(parsed)
        self.fc.requires_grad_(True)
        self.head.requires_grad_(False)
        with optim_wrapper['fc'].optim_context(self):
            losses = ToyModel.forward(self, **data, mode='loss')
        optim_wrapper['fc'].update_params(losses['loss_main'])
        self.head.requires_grad_(True)
        return log_vars


def test_the_replay_runs_the_models_own_train_step(tmp_path):
    runner = make_runner(tmp_path, model=OwnStepModel(),
                         optim_wrapper=two_optimizers,
                         faults={1: 'nan_term'},
                         hook=dict(type='NanDetectHook'))
    error = train_error(runner)
    assert (error.trigger, error.iter) == ('loss', 0)
    report = error.report
    # Not an exception of the replay: the head's update step replayed, its
    # NaN term found, sample 1 failing alone.
    assert report['exception'] is None
    assert report['nonfinite_losses'] == ['loss_aux']
    assert [r['result'] for r in report['sample_replays']] == [
        'finite', 'nonfinite']
    assert [s['index'] for s in report['samples']] == [1]
    # The head's update step, fc frozen for it: no gradient of fc (none at
    # all on torch 1.7, whose anomaly mode stops backward at the first NaN).
    assert all(g.startswith('head.') for g in report['nonfinite_grads'])


def test_a_step_left_out_counts_once_and_logs_nothing(tmp_path):
    runner = make_runner(tmp_path, model=OwnStepModel(),
                         optim_wrapper=two_optimizers,
                         faults={1: 'nan_term'},
                         hook=dict(type='NanDetectHook', policy='skip'))
    fc = runner.model.fc.weight.detach().clone()
    head = runner.model.head.weight.detach().clone()
    runner.train()
    hub = runner.message_hub
    # The head's step of iteration 0 left out, fc's applied after it: one
    # skip, not undone by the count of fc's wrapper.
    assert hub.get_scalar('train/nan_skipped').current() == 1
    assert not torch.equal(runner.model.fc.weight, fc)
    assert not torch.equal(runner.model.head.weight, head)
    # Iteration 0 logged nothing (its loss was NaN); the others did.
    losses = hub.get_scalar('train/loss').data[0]
    assert len(losses) == runner.iter - 1
    assert all(math.isfinite(v) for v in losses)
