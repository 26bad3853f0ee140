"""Toy models and data that the ``mmnan replay`` tests train and then replay
in a fresh process.

A bundle's config names these classes, and ``custom_imports=['replay_toys']``
registers them again when ``replay`` rebuilds the config, exactly as a user's
own project module would be (the tests put this directory on PYTHONPATH).
Registered in mmengine's root registries, with ``default_scope='mmengine'``.
"""
import torch
import torch.nn as nn
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch.utils.data import Dataset

KEEP_PROB = 0.5


@DATASETS.register_module()
class ToyRegressionDataset(Dataset):
    """``n`` random 4-vectors with a scalar target each; all finite."""

    metainfo = dict(name='toy_regression')

    def __init__(self, n=16):
        gen = torch.Generator().manual_seed(0)
        self.items = [dict(inputs=torch.randn(4, generator=gen),
                           data_samples=torch.randn((), generator=gen))
                      for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


@MODELS.register_module()
class RandomSubsetRegressor(BaseModel):
    """A linear regressor whose loss averages a random subset of the batch,
    as stochastic sample selection (dropping, hard-example mining) does.

    When the draw keeps no sample the loss is the mean of nothing: NaN. Data
    and weights are fine; only the random draw inside the forward decides.

    Args:
        keep_prob (float): Probability of keeping each sample.
    """

    def __init__(self, keep_prob=KEEP_PROB):
        super(RandomSubsetRegressor, self).__init__()
        self.fc = nn.Linear(4, 1)
        self.keep_prob = keep_prob

    def forward(self, inputs, data_samples=None, mode='tensor'):
        pred = self.fc(torch.stack(inputs)).squeeze(1)
        if mode != 'loss':
            return pred
        keep = torch.rand(pred.shape[0]) < self.keep_prob
        errors = (pred - torch.stack(data_samples)).abs()
        return {'loss_subset': errors[keep].mean()}  # MARK empty-mean


@MODELS.register_module()
class MinMaxScaledRegressor(BaseModel):
    """Predicts a low and a high bound and scores the target min-max scaled
    between them; the two bounds start almost equal.

    Their weights differ by a relative 2**-10, less than half a bfloat16
    step, so under bfloat16 autocast both bounds come out identical and the
    scaling divides by zero; in float32 they differ and the loss is finite.
    """

    def __init__(self):
        super(MinMaxScaledRegressor, self).__init__()
        self.bounds = nn.Linear(4, 2)
        with torch.no_grad():
            # Row 0 exactly representable in bfloat16, so that row 1 rounds
            # back onto it whatever the random init.
            low = self.bounds.weight[0].bfloat16().float()
            self.bounds.weight[0] = low
            self.bounds.weight[1] = low * (1 + 2.0**-10)
            self.bounds.bias.fill_(0.5)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        bounds = self.bounds(torch.stack(inputs))
        if mode != 'loss':
            return bounds
        low, high = bounds[:, 0], bounds[:, 1]
        span = high - low
        scaled = (torch.stack(data_samples) - low) / span  # MARK span
        return {'loss_scaled': scaled.abs().mean()}
