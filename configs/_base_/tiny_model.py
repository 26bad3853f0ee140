# The part the tiny detectors share: data preprocessor, a ResNet-18 layout at
# a quarter of its width (base_channels=16) and a 3-level FPN of 32 channels.
# No pretrained weights (init_cfg=None downloads nothing). Types carry the
# mmdet scope so the mmrotate config can use them too.
model = dict(
    data_preprocessor=dict(
        type='mmdet.DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=32),
    backbone=dict(
        type='mmdet.ResNet',
        depth=18,
        base_channels=16,
        num_stages=4,
        out_indices=(1, 2, 3),
        frozen_stages=-1,
        norm_cfg=dict(type='BN', requires_grad=True),
        norm_eval=False,
        style='pytorch',
        init_cfg=None),
    neck=dict(
        type='mmdet.FPN',
        in_channels=[32, 64, 128],
        out_channels=32,
        start_level=0,
        add_extra_convs='on_input',
        num_outs=3))
