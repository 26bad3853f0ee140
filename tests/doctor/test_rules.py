"""The config rules on the zoo's own configs: each rule with one shipped
config edited to trigger it, and the shipped config itself passing."""
import pytest

from mmnanhook.doctor import config_findings
from mmnan_testing import zoo


def _findings(tmp_path, name, edit='', **kwargs):
    """The findings of a child of the shipped config ``name``."""
    from mmengine.config import Config
    path = tmp_path / 'child.py'
    path.write_text('_base_ = [%r]\n%s\n' % (zoo.shipped_config(name), edit))
    cfg = Config.fromfile(str(path))
    return config_findings(cfg, filename=kwargs.pop(
        'filename', zoo.shipped_config(name)), **kwargs)


def _rules(findings):
    return [f.rule for f in findings]


@pytest.mark.mmdet
def test_iou_loss_on_encoded_deltas(tmp_path):
    assert _findings(tmp_path, 'retinanet_r50') == []
    giou = ("model = dict(bbox_head=dict(loss_bbox=dict(type='GIoULoss', "
            'loss_weight=2.0)))')
    (found, ) = _findings(tmp_path, 'retinanet_r50', giou)
    assert found.rule == 'iou_loss_on_deltas'
    assert found.where == 'model.bbox_head.loss_bbox'
    assert 'RetinaHead has reg_decoded_bbox=False' in found.what
    assert found.fix == 'model.bbox_head.reg_decoded_bbox=True'
    assert '#4486' in found.why
    decoded = giou.replace('loss_bbox=', 'reg_decoded_bbox=True, loss_bbox=')
    assert _findings(tmp_path, 'retinanet_r50', decoded) == []


@pytest.mark.mmdet
def test_iou_loss_in_a_head_that_decodes_itself_is_no_finding(tmp_path):
    # FCOS's head takes no reg_decoded_bbox: it always decodes (its IoU loss
    # is shipped so).
    assert _findings(tmp_path, 'fcos_r50') == []


@pytest.mark.mmdet
def test_lr_not_scaled_to_the_real_batch(tmp_path):
    # retinanet_r50_fpn_1x (no setup in its name): base_batch_size 16.
    assert _findings(tmp_path, 'retinanet_r50', world_size=8) == []
    (found, ) = _findings(tmp_path, 'retinanet_r50', world_size=1)
    assert found.rule == 'lr_not_scaled'
    assert 'the batch is 2 x 1 = 2' in found.what
    assert 'linearly scaled it is 0.00125' in found.what  # 0.01 * 2 / 16
    on = 'auto_scale_lr = dict(enable=True)'
    assert _findings(tmp_path, 'retinanet_r50', on, world_size=1) == []
    # No world size known (not in the name, not given): silent.
    assert _findings(tmp_path, 'retinanet_r50') == []


@pytest.mark.mmdet
def test_base_batch_size_that_is_not_the_named_setup(tmp_path):
    # rtmdet_tiny_8xb32 is tuned for 8 x 32 = 256 but inherits
    # base_batch_size=16 from mmdet's schedule: --auto-scale-lr would
    # multiply its LR by 16 on the very setup it names.
    (found, ) = _findings(tmp_path, 'rtmdet_tiny')
    assert found.rule == 'base_batch_size_mismatch'
    assert found.fix == 'auto_scale_lr.base_batch_size=256'
    fixed = 'auto_scale_lr = dict(base_batch_size=256)'
    assert _findings(tmp_path, 'rtmdet_tiny', fixed) == []
    # Smaller than named: the LR is tuned for 256, not for 16.
    small = fixed + '\ntrain_dataloader = dict(batch_size=4)'
    (found, ) = _findings(tmp_path, 'rtmdet_tiny', small)
    assert found.rule == 'lr_not_scaled'
    assert 'linearly scaled it is 0.0005' in found.what  # 0.004 * 32 / 256


@pytest.mark.mmdet
def test_static_loss_scale(tmp_path):
    static = "optim_wrapper = dict(type='AmpOptimWrapper', loss_scale=512.)"
    (found, ) = _findings(tmp_path, 'retinanet_r50', static)
    assert found.rule == 'static_loss_scale'
    assert found.fix == "optim_wrapper.loss_scale='dynamic'"
    dynamic = static.replace('512.', "'dynamic'")
    assert _findings(tmp_path, 'retinanet_r50', dynamic) == []


@pytest.mark.mmrotate
@pytest.mark.parametrize('loss, rule', [
    ("dict(type='GDLoss_v1', loss_type='kld', loss_weight=1.0)",
     'unclamped_gaussian_loss'),
    ("dict(type='KFLoss', fun='ln', loss_weight=5.0)",
     'unclamped_gaussian_loss'),
    ("dict(type='GDLoss', loss_type='kld', loss_weight=1.0)", None),
    ("dict(type='RotatedIoULoss', loss_weight=1.0)", 'iou_loss_on_deltas'),
])
def test_rotated_box_losses(tmp_path, loss, rule):
    assert _findings(tmp_path, 'rotated_retinanet') == []
    edit = 'model = dict(bbox_head=dict(loss_bbox=%s))' % loss
    assert _rules(_findings(tmp_path, 'rotated_retinanet', edit)) == (
        [rule] if rule else [])
