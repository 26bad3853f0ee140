"""mmdet's zoo RetinaNet R50 on a GPU: the configs of the device checks
(``tests/zoo/test_zoo_cuda.py``, ``benchmarks/cuda_zoo_overhead.py``) and
their dry run on the CPU.

A child of the shipped config as :mod:`mmnan_testing.zoo` makes it
(synthetic COCO data, ``init_cfg=None``, nothing downloaded), with what the
device machine needs:

* **the focal loss.** That machine's mmcv is built with its CPU ops only,
  and mmdet's ``FocalLoss`` calls mmcv's CUDA ``sigmoid_focal_loss`` for
  CUDA tensors. Where that kernel does not run (:func:`mmcv_focal_kernel`),
  the config names :class:`~mmnan_testing.cuda_zoo_modules.PyFocalLoss`:
  mmdet's ``py_sigmoid_focal_loss`` stands in, and :func:`focal_loss` gives
  the sentence every test and figure says beside it.
* **AMP as ``tools/train.py --amp`` sets it** (``AmpOptimWrapper``, dynamic
  loss scale; float16 autocast on CUDA), ``compile=True`` (inductor).

The dry run (``MMNAN_DEVICE_DRYRUN=cpu`` where there is no CUDA device) runs
the same code on the CPU, smaller (:data:`SIDE`): AMP there is the
test-only ``CpuFp16AmpOptimWrapper`` (float16 autocast on the CPU, torch >=
2.3; the tests skip on older torch), ``compile=True`` is ``aot_eager``
(inductor compiles the R50 for minutes on two cores), and mmdet's own
``FocalLoss`` would run ``py_sigmoid_focal_loss`` there anyway.
"""
import importlib
import os

import torch

from mmnanhook import compat
from mmnanhook.drill._config import rescale
from mmnan_testing import zoo

NAME = 'retinanet_r50'
DRYRUN_ENV = 'MMNAN_DEVICE_DRYRUN'
# The image's short side: the zoo tests' on a GPU; the dry run's (an R50
# iteration under float16 autocast takes 12 s at 128 px on one CPU core).
SIDE = {'cuda': zoo.SMALL_SIDE, 'cpu': 64}
SKIP_REASON = ('no CUDA device: run on a device machine by make '
               'device-check (scripts/device_check.sh); %s=cpu dry-runs it '
               'on the CPU' % DRYRUN_ENV)
MODULES = 'mmnan_testing.cuda_zoo_modules'


def target():
    """``'cuda'`` where a CUDA device is, ``'cpu'`` for the dry run
    (``MMNAN_DEVICE_DRYRUN=cpu``), else ``None``."""
    if torch.cuda.is_available():
        return 'cuda'
    if os.environ.get(DRYRUN_ENV) == 'cpu':
        return 'cpu'
    return None


def mmcv_focal_kernel():
    """Whether mmcv's ``sigmoid_focal_loss`` runs on the CUDA device (an
    mmcv built with its CPU ops only has no such kernel)."""
    from mmcv.ops import sigmoid_focal_loss
    try:
        pred = torch.zeros(2, 3, device='cuda')
        labels = torch.zeros(2, dtype=torch.long, device='cuda')
        sigmoid_focal_loss(pred, labels, 2.0, 0.25, None, 'mean')
        torch.cuda.synchronize()
    except (RuntimeError, AttributeError):
        # 'implementation for device cuda:0 not found'
        return False
    return True


def focal_loss(device):
    """The focal loss the configs use on ``device``.

    Args:
        device (str): ``'cuda'`` or ``'cpu'``.

    Returns:
        tuple: ``(type, said)``: the ``loss_cls`` type, and the sentence
        said beside every result and figure.
    """
    if device == 'cuda' and mmcv_focal_kernel():
        return 'FocalLoss', ("mmdet's FocalLoss as shipped (mmcv's CUDA "
                             'sigmoid_focal_loss)')
    if device == 'cuda':
        return 'PyFocalLoss', (
            "mmdet's py_sigmoid_focal_loss standing in for mmcv's CUDA "
            'sigmoid_focal_loss, which this mmcv (CPU ops only) lacks')
    return 'PyFocalLoss', ("mmdet's py_sigmoid_focal_loss (what FocalLoss "
                           'runs on a CPU itself)')


def amp_wrapper(device):
    """The optim wrapper type of ``tools/train.py --amp`` on ``device``, or
    ``None`` where this torch cannot autocast to float16 there.

    Args:
        device (str): ``'cuda'`` or ``'cpu'``.
    """
    if device == 'cuda':
        return 'AmpOptimWrapper'
    if compat.cpu_grad_scaler() is None or \
            compat.autocast('cpu', torch.float16) is None:
        return None
    return 'CpuFp16AmpOptimWrapper'


def compile_option(device):
    """``compile``: ``True`` (inductor) on CUDA; ``aot_eager`` in the dry
    run."""
    return True if device == 'cuda' else dict(backend='aot_eager')


def config(data, work_dir, device, length=1, hook=None, amp=False,
           fp16_range=(), compiled=False, batch=2, float_inputs=False):
    """The child config of the shipped RetinaNet R50 for ``device``.

    Args:
        data (dict): What :func:`zoo.make_zoo_dataset` returned.
        work_dir (str): The run's work dir.
        device (str): ``'cuda'``, or ``'cpu'`` (the dry run).
        length (int): Epochs.
        hook (dict, optional): NanDetectHook's options (its one-line form);
            ``None`` trains without it.
        amp (bool): AMP as ``tools/train.py --amp`` sets it.
        fp16_range (list[str]): Image file names whose samples carry the
            planted fp16-range fault (``PlantedRetinaNet``).
        compiled (bool): ``compile`` as :func:`compile_option` sets it.
        batch (int): Samples a batch.
        float_inputs (bool): Images loaded as float32 (tier 1's input check
            then runs every iteration).

    Returns:
        mmengine.Config: Ready for ``Runner.from_cfg``.
    """
    # Registered here for this process; a replay imports them from
    # custom_imports.
    imports = [MODULES]
    cfg = zoo.child_config(NAME, data, str(work_dir), length=length,
                           hook=None if hook is None else 'line',
                           hook_options=hook)
    cfg.log_level = 'WARNING'
    if SIDE[device] != zoo.SMALL_SIDE:
        rescale(cfg, float(SIDE[device]) / zoo.SMALL_SIDE)
    cfg.model.bbox_head.loss_cls.type = focal_loss(device)[0]
    if fp16_range:
        cfg.model.type = 'PlantedRetinaNet'
        cfg.model.fp16_range = list(fp16_range)
    if amp:
        wrapper = amp_wrapper(device)
        assert wrapper is not None, 'no float16 autocast on this CPU'
        cfg.optim_wrapper.type = wrapper
        cfg.optim_wrapper.loss_scale = 'dynamic'
        if device == 'cpu':
            imports.append('mmnan_testing.cpu_amp')
    if compiled:
        cfg.compile = compile_option(device)
    if float_inputs:
        for step in cfg.train_dataloader.dataset.pipeline:
            if step['type'] == 'LoadImageFromFile':
                step['to_float32'] = True
    cfg.train_dataloader.batch_size = batch
    # A 300 MB checkpoint each epoch: seconds of a device's few minutes.
    cfg.default_hooks.checkpoint = None
    cfg.custom_imports = dict(imports=imports, allow_failed_imports=False)
    for name in imports:
        importlib.import_module(name)
    return cfg


class AmpProbe(zoo.BatchFiles):
    """Also records the loss scale after each iteration.

    Attributes:
        scales (list[float]): ``GradScaler.get_scale()`` per iteration.
    """

    def __init__(self):
        super(AmpProbe, self).__init__()
        self.scales = []

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        super(AmpProbe, self).after_train_iter(runner, batch_idx,
                                               data_batch, outputs)
        self.scales.append(float(runner.optim_wrapper.loss_scaler.get_scale()))
