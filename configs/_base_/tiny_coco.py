# A synthetic COCO-format dataset as written by
# mmnanhook.demo.synthetic.make_coco_dataset (64x64 images, classes cat and dog).
# Point it elsewhere with train_dataloader.dataset.data_root=...
_base_ = ['./tiny_runtime.py']

data_root = 'data/synthetic_coco/'
classes = ('cat', 'dog')

train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='Resize', scale=(64, 64), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
train_dataloader = dict(
    dataset=dict(
        type='CocoDataset',
        data_root=data_root,
        metainfo=dict(classes=classes),
        ann_file='annotations/train.json',
        data_prefix=dict(img='images/'),
        filter_cfg=dict(filter_empty_gt=True, min_size=32),
        pipeline=train_pipeline,
        backend_args=None))
