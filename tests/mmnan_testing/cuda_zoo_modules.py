"""The two modules the zoo R50's device checks name in its config
(:mod:`mmnan_testing.cuda_zoo`), registered in mmdet's ``MODELS`` when this
module is imported (the configs import it by ``custom_imports``, so that a
bundle rebuilds them in ``mmnan replay`` on another machine).

* :class:`PyFocalLoss`: mmdet's ``FocalLoss`` that computes with mmdet's
  ``py_sigmoid_focal_loss`` on every device. ``FocalLoss.forward`` calls
  mmcv's ``sigmoid_focal_loss`` (a CUDA kernel) for CUDA predictions with
  class-index targets, and ``py_sigmoid_focal_loss`` on one-hot targets (what
  it does itself on a CPU). The device machine's mmcv is built with its CPU
  ops only, so there the kernel is missing: this loss one-hots the targets
  as ``FocalLoss`` does on a CPU and lets ``FocalLoss`` take its own
  one-hot path. The same loss and gradients up to rounding, not the same
  kernel.
* :class:`PlantedRetinaNet`: mmdet's ``RetinaNet`` with an fp16-range fault
  for the samples whose image file is named: their finest FPN level times
  :data:`FP16_FACTOR`, finite in float32, beyond float16's 65504 under fp16
  autocast (:mod:`mmnan_testing.cuda_toy`'s ``fp16_range``, in a zoo
  detector, keyed by the sample so that a replay of its batch plants it
  again).
"""
import inspect
import os.path as osp

import torch
import torch.nn.functional as F
from mmdet.models.detectors import RetinaNet
from mmdet.models.losses import FocalLoss
from mmdet.registry import MODELS

FP16_FACTOR = 1e5


@MODELS.register_module(force=True)
class PyFocalLoss(FocalLoss):
    """mmdet's ``FocalLoss`` on its ``py_sigmoid_focal_loss`` path on every
    device (its arguments)."""

    def forward(self, pred, target, weight=None, avg_factor=None,
                reduction_override=None):
        if self.use_sigmoid and not self.activated and \
                pred.dim() != target.dim():
            # FocalLoss's own CPU branch: one-hot, the background column
            # dropped; equal dims then select py_sigmoid_focal_loss.
            num_classes = pred.size(1)
            target = F.one_hot(target, num_classes=num_classes + 1)
            target = target[:, :num_classes]
        return super(PyFocalLoss, self).forward(
            pred, target, weight=weight, avg_factor=avg_factor,
            reduction_override=reduction_override)


@MODELS.register_module(force=True)
class PlantedRetinaNet(RetinaNet):
    """mmdet's ``RetinaNet``, with an fp16-range fault for some samples.

    Args:
        fp16_range (list[str]): Image file names (basenames) whose samples
            have their finest FPN level multiplied by :data:`FP16_FACTOR`.
        **kwargs: ``RetinaNet``'s.
    """

    def __init__(self, fp16_range=(), **kwargs):
        super(PlantedRetinaNet, self).__init__(**kwargs)
        self.fp16_range = frozenset(fp16_range)

    def loss(self, batch_inputs, batch_data_samples):
        x = self.extract_feat(batch_inputs)
        hit = [osp.basename(s.metainfo.get('img_path') or '')
               in self.fp16_range for s in batch_data_samples]
        if any(hit):
            # The planted sample's features alone: its batch mates stay
            # finite, so a diagnosis can tell it apart.
            levels = list(x[0])
            for i in [i for i, h in enumerate(hit) if h]:
                levels[i] = levels[i] * FP16_FACTOR  # MARK fp16_range
            x = (torch.stack(levels), ) + tuple(x[1:])
        return self.bbox_head.loss(x, batch_data_samples)


def line_of(marker):
    """``file:line`` of the line of this module ending in ``# MARK marker``.

    Args:
        marker (str): The marker's name.
    """
    lines, _ = inspect.findsource(inspect.getmodule(line_of))
    (hit, ) = [i + 1 for i, text in enumerate(lines)
               if text.rstrip().endswith('# MARK ' + marker)]
    return '{}:{}'.format(inspect.getsourcefile(line_of), hit)
