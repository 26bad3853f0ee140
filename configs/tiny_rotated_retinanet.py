# Tiny rotated RetinaNet for mmrotate 1.x on DOTA-format data, as written by
# mmnanhook.demo.synthetic.make_dota_dataset (64x64 images). The stock
# rotated-retinanet-rbox-le90_r50_fpn_1x_dota model at tiny width: training
# assigns anchors with RBboxOverlaps2D, i.e. compiled mmcv box_iou_rotated,
# and encodes targets with the rotated delta coder. No pretrained weights.
_base_ = ['./_base_/tiny_runtime.py', './_base_/tiny_model.py']
default_scope = 'mmrotate'
angle_version = 'le90'

data_root = 'data/synthetic_dota/'
train_pipeline = [
    dict(type='mmdet.LoadImageFromFile', backend_args=None),
    dict(type='mmdet.LoadAnnotations', with_bbox=True, box_type='qbox'),
    dict(type='ConvertBoxType', box_type_mapping=dict(gt_bboxes='rbox')),
    dict(type='mmdet.Resize', scale=(64, 64), keep_ratio=True),
    dict(
        type='mmdet.RandomFlip',
        prob=0.75,
        direction=['horizontal', 'vertical', 'diagonal']),
    dict(type='mmdet.PackDetInputs')
]
train_dataloader = dict(
    dataset=dict(
        type='DOTADataset',
        data_root=data_root,
        ann_file='labelTxt/',
        data_prefix=dict(img_path='images/'),
        img_shape=(64, 64),
        filter_cfg=dict(filter_empty_gt=True),
        pipeline=train_pipeline))

# As in mmrotate's schedule_1x.
optim_wrapper = dict(
    optimizer=dict(lr=0.0025), clip_grad=dict(max_norm=35, norm_type=2))

model = dict(
    type='mmdet.RetinaNet',
    data_preprocessor=dict(boxtype2tensor=False),
    bbox_head=dict(
        type='mmdet.RetinaHead',
        num_classes=15,
        in_channels=32,
        stacked_convs=1,
        feat_channels=32,
        anchor_generator=dict(
            type='FakeRotatedAnchorGenerator',
            angle_version=angle_version,
            octave_base_scale=4,
            scales_per_octave=1,
            ratios=[1.0, 0.5, 2.0],
            strides=[8, 16, 32]),
        bbox_coder=dict(
            type='DeltaXYWHTRBBoxCoder',
            angle_version=angle_version,
            norm_factor=None,
            edge_swap=True,
            proj_xy=True,
            target_means=(.0, .0, .0, .0, .0),
            target_stds=(1.0, 1.0, 1.0, 1.0, 1.0)),
        loss_cls=dict(
            type='mmdet.FocalLoss',
            use_sigmoid=True,
            gamma=2.0,
            alpha=0.25,
            loss_weight=1.0),
        loss_bbox=dict(type='mmdet.L1Loss', loss_weight=1.0)),
    train_cfg=dict(
        assigner=dict(
            type='mmdet.MaxIoUAssigner',
            pos_iou_thr=0.5,
            neg_iou_thr=0.4,
            min_pos_iou=0,
            ignore_iof_thr=-1,
            iou_calculator=dict(type='RBboxOverlaps2D')),
        sampler=dict(type='mmdet.PseudoSampler'),
        allowed_border=-1,
        pos_weight=-1,
        debug=False),
    test_cfg=dict(
        nms_pre=100,
        min_bbox_size=0,
        score_thr=0.05,
        nms=dict(type='nms_rotated', iou_threshold=0.1),
        max_per_img=10))
