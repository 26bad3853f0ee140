# The tiny RetinaNet on a custom VOC-style XML dataset, as written by
# mmnanhook.demo.synthetic.make_voc_dataset. Like many custom configs, it sets no
# filter_cfg.bbox_min_size, so XMLDataset keeps zero-size boxes (mmdet's
# stock VOC config sets it; CocoDataset drops boxes under 1 px on loading).
_base_ = ['./tiny_retinanet.py']

data_root = 'data/synthetic_voc/'
train_dataloader = dict(
    dataset=dict(
        type='XMLDataset',
        data_root=data_root,
        ann_file='ImageSets/Main/train.txt',
        data_prefix=dict(_delete_=True, sub_data_root='')))
