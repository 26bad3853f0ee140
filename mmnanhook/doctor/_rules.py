"""Config rules: causes of NaN/Inf that a config shows before training.

Each rule reads the loaded config (no data, no model built) and returns
:class:`~mmnanhook.records.ConfigFinding` s: what, why (the upstream thread
that reported it), the fix as a config edit. The table of rules is
:data:`RULES`; ``mmnan doctor`` and the hook's ``before_train`` run the same
ones. A rule that needs a fact the config does not give (a world size, a
head class that does not import) stays silent rather than guess.
"""
from __future__ import annotations

import inspect
import os.path as osp
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..records import ConfigFinding

# Box losses computed on box corners, not on the regression deltas: given
# encoded deltas they take IoUs of non-boxes (negative widths, NaN).
IOU_LOSSES = ('IoULoss', 'BoundedIoULoss', 'GIoULoss', 'DIoULoss', 'CIoULoss',
              'EIoULoss', 'SIoULoss', 'RotatedIoULoss')
# mmrotate losses whose Gaussian terms take a sqrt / log of an unclamped
# determinant: GDLoss_v1 (KLD/GWD v1: `clamp(0).sqrt()`, `log(det/det)`) and
# KFLoss (`Sigma.det().sqrt()` of the prediction).
UNCLAMPED_GAUSSIAN = {
    'GDLoss_v1': ('mmrotate #240 (KLD/GWD v1 NaN; the clamped GDLoss came '
                  'with PR #183)',
                  "type='GDLoss' (same loss_type; its terms are clamped)"),
    'KFLoss': ('mmrotate #238, #326 (KFIoU: det < 0 of the predicted '
               'covariance, NaN)',
               "type='GDLoss', loss_type='kld' (clamped), or clip_grad "
               'and a lower LR if KFIoU is wanted'),
}
AMP_WRAPPERS = ('AmpOptimWrapper', 'NanDetectAmpOptimWrapper')
# OpenMMLab's config names say the setup they were tuned on: 8xb2 = 8 GPUs,
# 2 images each.
_SETUP_IN_NAME = re.compile(r'(?:^|[_-])(\d+)xb(\d+)(?:[_-]|$)')


def _base(type_name):
    """``'mmdet.GIoULoss'`` -> ``'GIoULoss'`` (a class object: its name)."""
    if not isinstance(type_name, str):
        type_name = getattr(type_name, '__name__', str(type_name))
    return type_name.rsplit('.', 1)[-1]


def config_dicts(node: Any,
                 path: str = '') -> Iterator[Tuple[str, Dict[str, Any]]]:
    """Every dict of a config with its dotted path, depth first."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            for found in config_dicts(value, '%s.%s' % (path, key) if path
                                      else str(key)):
                yield found
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            for found in config_dicts(value, '%s.%d' % (path, i)):
                yield found


def _model_class(type_name, scope):
    """The registered model class of a config's ``type``, or ``None``."""
    from mmengine.registry import MODELS
    if not isinstance(type_name, str):
        return type_name if inspect.isclass(type_name) else None
    if '.' not in type_name and scope:
        type_name = '%s.%s' % (scope, type_name)
    try:
        cls = MODELS.get(type_name)
    except Exception:  # noqa: BLE001 - a head we cannot import: silent
        return None
    return cls if inspect.isclass(cls) else None


# The methods in which a head computes its box loss: a dense head's per
# level, an RoI head's for the batch.
_LOSS_METHODS = ('loss_by_feat_single', 'loss')


def _source(function):
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return None


def _decodes_by_default(cls):
    """The default of a head's ``reg_decoded_bbox`` (``True``: ATSS), or
    ``None`` when its box loss does not read it (it decodes regardless: GFL,
    DDOD, FCOS) or this cannot be told."""
    mro = inspect.getmro(cls)
    for depth, klass in enumerate(mro):
        init = klass.__dict__.get('__init__')
        parameter = inspect.signature(init).parameters.get(
            'reg_decoded_bbox') if init is not None else None
        if parameter is not None:
            break
    else:
        return None
    if parameter.default is not False:
        return parameter.default
    # A subclass whose own loss decodes without asking (GFL's, DDOD's).
    for klass in mro[:depth]:
        for name, member in klass.__dict__.items():
            source = _source(member) if (
                name.startswith('loss') and inspect.isfunction(member)) \
                else None
            if source and 'decode(' in source and \
                    'reg_decoded_bbox' not in source:
                return None
    for name in _LOSS_METHODS:
        owner = next((k for k in mro if name in k.__dict__), None)
        if owner is not None:
            source = _source(owner.__dict__[name])
            return False if source and 'reg_decoded_bbox' in source else None
    return None


def iou_loss_on_deltas(cfg: Dict[str, Any],
                       context: RuleContext) -> Iterator[ConfigFinding]:
    """An IoU-type ``loss_bbox`` in a head that regresses encoded deltas."""
    for path, head in config_dicts(cfg):
        loss = head.get('loss_bbox')
        if not (isinstance(loss, dict) and _base(loss.get('type'))
                in IOU_LOSSES and 'type' in head):
            continue
        cls = _model_class(head['type'], context.scope)
        default = None if cls is None else _decodes_by_default(cls)
        if default is None:
            continue  # the head decodes boxes itself, or is unknown
        if not head.get('reg_decoded_bbox', default):
            yield ConfigFinding(
                'iou_loss_on_deltas', path + '.loss_bbox',
                '{} on encoded deltas: {} has reg_decoded_bbox=False, so the '
                'loss takes IoUs of regression deltas, not of boxes'.format(
                    _base(loss['type']), _base(head['type'])),
                'mmdet #4486 (GIoU), mmrotate #440 (RotatedIoULoss)',
                '{}.reg_decoded_bbox=True'.format(path))


def _named_setup(context):
    """``(GPUs, images per GPU)`` the config's name says (``8xb2``), or
    ``(None, None)``."""
    name = osp.splitext(osp.basename(context.filename or ''))[0]
    found = _SETUP_IN_NAME.search(name)
    return (int(found.group(1)), int(found.group(2))) if found else (None,
                                                                     None)


def lr_not_scaled(cfg: Dict[str, Any],
                  context: RuleContext) -> Iterator[ConfigFinding]:
    """``auto_scale_lr`` off while the real batch is smaller than the one
    the LR was tuned for (an LR too high for it); and a ``base_batch_size``
    smaller than the batch the config's own name says (``--auto-scale-lr``
    would then multiply the LR on that very setup)."""
    scale = cfg.get('auto_scale_lr')
    loader = cfg.get('train_dataloader')
    if not (isinstance(scale, dict) and isinstance(loader, dict)
            and 'base_batch_size' in scale and loader.get('batch_size')):
        return
    gpus, per_gpu = _named_setup(context)
    world = context.world_size or gpus
    if world is None:
        return
    base, real = scale['base_batch_size'], loader['batch_size'] * world
    lr = ((cfg.get('optim_wrapper') or {}).get('optimizer') or {}).get('lr')
    tuned = base
    if gpus is not None and gpus * per_gpu != base:
        tuned = gpus * per_gpu
    # The NaN side only: an LR scaled up (a smaller one trains slower).
    if tuned > base:
        yield ConfigFinding(
            'base_batch_size_mismatch', 'auto_scale_lr.base_batch_size',
            'base_batch_size={} but the config is named for {}x{} = {} '
            'images a step: --auto-scale-lr would multiply the LR by {:g} '
            'at that very batch'.format(base, gpus, per_gpu, tuned,
                                        tuned / float(base)),
            'mmdet #3240, #11893 (the LR scaled for the wrong batch)',
            'auto_scale_lr.base_batch_size={}'.format(tuned))
    if scale.get('enable') or real >= tuned:
        return
    scaled = '' if lr is None else (
        '; optim_wrapper.optimizer.lr={} is tuned for {}, linearly scaled it '
        'is {:.3g}'.format(lr, tuned, lr * real / float(tuned)))
    yield ConfigFinding(
        'lr_not_scaled', 'auto_scale_lr',
        'the batch is {} x {} = {} ({}) but the LR is for {} images a step '
        'and auto_scale_lr is off{}'.format(
            loader['batch_size'], world, real, 'the run\'s world size' if
            context.world_size else 'world size from the config name',
            tuned, scaled),
        'mmdet #3240, #1710, #3786, #11893 (LR too high for the real batch)',
        'auto_scale_lr.enable=True (or tools/train.py --auto-scale-lr)')


def static_loss_scale(cfg: Dict[str, Any],
                      context: RuleContext) -> Iterator[ConfigFinding]:
    """An AMP optim wrapper with a fixed loss scale."""
    for path, wrapper in config_dicts(cfg):
        scale = wrapper.get('loss_scale')
        if (_base(wrapper.get('type', '')) in AMP_WRAPPERS
                and isinstance(scale, (int, float))
                and not isinstance(scale, bool)):
            yield ConfigFinding(
                'static_loss_scale', path + '.loss_scale',
                'AMP with a static loss scale of {:g}: an overflow is never '
                'scaled down, a gradient under 1/{:g} never up'.format(
                    scale, scale),
                'mmdet #8055, #3690 (fp16 NaN with a fixed loss scale)',
                "{}.loss_scale='dynamic'".format(path))


def unclamped_gaussian_loss(
        cfg: Dict[str, Any],
        context: RuleContext) -> Iterator[ConfigFinding]:
    """An mmrotate Gaussian-distance loss without clamping."""
    for path, node in config_dicts(cfg):
        name = _base(node.get('type', '')) if 'type' in node else None
        if name in UNCLAMPED_GAUSSIAN:
            why, fix = UNCLAMPED_GAUSSIAN[name]
            yield ConfigFinding(
                'unclamped_gaussian_loss', path,
                '{} takes a sqrt / log of an unclamped covariance '
                'determinant: a degenerate predicted box gives NaN'.format(
                    name), why, '{}: {}'.format(path, fix))


#: rule name -> rule, in the order they report.
RULES = {
    'iou_loss_on_deltas': iou_loss_on_deltas,
    'lr_not_scaled': lr_not_scaled,  # also base_batch_size_mismatch
    'static_loss_scale': static_loss_scale,
    'unclamped_gaussian_loss': unclamped_gaussian_loss,
}


class RuleContext(object):
    """What a rule may know beside the config.

    Args:
        filename (str, optional): The config file (its name may say the
            world size, as OpenMMLab's ``8xb2`` does).
        world_size (int, optional): The run's world size, when known.
        scope (str, optional): The config's ``default_scope``.
    """

    def __init__(self, filename: Optional[str] = None,
                 world_size: Optional[int] = None,
                 scope: Optional[str] = None) -> None:
        self.filename = filename
        self.world_size = world_size
        self.scope = scope


def config_findings(cfg: Any, filename: Optional[str] = None,
                    world_size: Optional[int] = None,
                    rules: Optional[Sequence[str]] = None
                    ) -> List[ConfigFinding]:
    """Run the config rules over one config.

    Args:
        cfg (mmengine.Config | dict): The loaded config.
        filename (str, optional): Its file (default: ``cfg.filename``).
        world_size (int, optional): The run's world size, when known; else
            the config's name says it (``8xb2``) or the LR rule is silent.
        rules (list[str], optional): Names of :data:`RULES` to run; all by
            default.

    Returns:
        list[ConfigFinding]: In the order of :data:`RULES`.
    """
    data = cfg.to_dict() if hasattr(cfg, 'to_dict') else dict(cfg)
    context = RuleContext(filename or getattr(cfg, 'filename', None),
                          world_size, data.get('default_scope'))
    found = []
    for name in rules or RULES:
        found.extend(RULES[name](data, context))
    return found
