"""The faults a drill plants, one a run, in one iteration on one rank.

* ``data``: the first sample of the batch becomes a float image of NaN
  pixels (a corrupt file, a nodata tile) before the train step sees it;
* ``loss``: the model's first loss term is multiplied by NaN in its forward
  (a loss that divides by an empty count);
* ``grad``: the gradient of the first parameter backward reaches is made
  infinite (an exploding gradient).

The fault stays planted for the whole iteration, so a replay of it by the
diagnosis meets the same fault, as it would meet a real one.
"""
from typing import Any, Dict, Optional

import torch
from mmengine.hooks import Hook

from .._mmengine import unwrap_model

FAULTS = ('data', 'loss', 'grad')


class Planted(object):
    """What a fault hit, to compare with what the hook named.

    Args:
        kind (str): One of :data:`FAULTS`.
        iter (int): The iteration.
        rank (int): The rank.
        name (str, optional): The sample's file, the loss term or the
            parameter (``None`` until hit; a sample without a file name).
        hit (bool): Whether the fault was planted (the iteration ran).
        finite_after (bool, optional): Whether this rank's weights were
            finite when the iteration ended (``None``: it did not end).
    """

    def __init__(self, kind: str, iter: int, rank: int) -> None:
        self.kind = kind
        self.iter = iter
        self.rank = rank
        self.name = None
        self.hit = False
        self.finite_after = None

    def to_dict(self) -> Dict[str, Any]:
        """As the drill's results file holds it."""
        return dict(vars(self))


def _first_term(losses):
    """The name of the first loss term of a loss dict."""
    return next((k for k in losses if 'loss' in k), None)


def _poisoned(value):
    """``value`` (a tensor, or a list / tuple of them) times NaN."""
    if torch.is_tensor(value):
        return value * float('nan')
    return type(value)([_poisoned(value[0])] + list(value[1:]))


class FaultInjector(Hook):
    """Plants one fault (see the module docstring).

    Runs before every other hook, so that NanDetectHook's input check and
    flight record see the planted batch.

    Args:
        kind (str): One of :data:`FAULTS`.
        iter (int): The global iteration (``runner.iter``).
        rank (int): The rank it is planted on.
    """

    priority = 'HIGHEST'

    def __init__(self, kind: str, iter: int, rank: int) -> None:
        self.planted = Planted(kind, iter, rank)
        # In the fault's iteration, on every rank / on the planted rank.
        self._at = self._armed = False
        self._handles = []

    def before_train(self, runner: Any) -> None:
        model = unwrap_model(runner.model)
        if self.planted.kind == 'loss':
            self._handles.append(model.register_forward_hook(self._loss))
        elif self.planted.kind == 'grad':
            self._handles.extend(
                p.register_hook(self._grad(name))
                for name, p in model.named_parameters() if p.requires_grad)

    def before_train_iter(self, runner: Any, batch_idx: int,
                          data_batch: Optional[dict] = None) -> None:
        self._at = runner.iter == self.planted.iter
        self._armed = self._at and runner.rank == self.planted.rank
        if self._armed:
            self.planted.hit = True
            if self.planted.kind == 'data':
                self._poison_batch(data_batch)

    def after_train_iter(self, runner: Any, batch_idx: int,
                         data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        if self._at:
            self.planted.finite_after = all(
                bool(torch.isfinite(p).all())
                for p in unwrap_model(runner.model).parameters())
        self._at = self._armed = False

    def after_train(self, runner: Any) -> None:
        self.remove()

    def remove(self) -> None:
        """Take the model's hooks off (also when training raised)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._armed = False

    def _poison_batch(self, data_batch):
        inputs = data_batch['inputs']
        if torch.is_tensor(inputs):  # one stacked batch (mmyolo)
            inputs = data_batch['inputs'] = inputs.float()
            inputs[0] = float('nan')
        else:
            inputs[0] = torch.full(inputs[0].shape, float('nan'))
        samples = data_batch.get('data_samples')
        if isinstance(samples, (list, tuple)) and samples:
            self.planted.name = samples[0].metainfo.get('img_path')

    def _loss(self, module, args, output):
        if not self._armed or not isinstance(output, dict):
            return None
        term = _first_term(output)
        if term is None:
            return None
        self.planted.name = term
        return dict(output, **{term: _poisoned(output[term])})

    def _grad(self, name):

        def explode(grad):
            if not self._armed or self.planted.name not in (None, name):
                return None
            self.planted.name = name
            return torch.full_like(grad, float('inf'))

        return explode
