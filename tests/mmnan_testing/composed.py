"""mmdet datasets whose samples are composed (``Mosaic`` under
``MultiImageMixDataset``, ``CachedMosaic``) over synthetic COCO images
(:func:`make_data`), one of them a nodata tile (:mod:`.nodata`).
"""
import os.path as osp

from mmnanhook.demo import synthetic

# The nodata tile of :func:`load_steps`.
TILE = '000005.png'
IMAGES = 8

# mmdet 3.1 asserts every meta key is there: no Resize, no scale_factor.
PACK = dict(type='PackDetInputs',
            meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape'))


def load_steps(log_file=None):
    """Loading steps that load :data:`TILE` as all NaN (its loads, in any
    process, appended to ``log_file``)."""
    return [dict(type='LoadNodataImage', nodata=[TILE], log_file=log_file),
            dict(type='LoadAnnotations', with_bbox=True)]


def make_data(directory):
    """:data:`IMAGES` synthetic COCO images of 64 px in ``directory``."""
    return synthetic.make_coco_dataset(directory, num_images=IMAGES,
                                       image_size=64)


def coco(data, pipeline):
    """A ``CocoDataset`` config of :func:`synthetic.make_coco_dataset`'s
    ``data``."""
    return dict(type='CocoDataset', data_root=data['data_root'],
                ann_file=synthetic.COCO_ANN_FILE,
                data_prefix=dict(img=synthetic.COCO_IMG_DIR + '/'),
                filter_cfg=dict(filter_empty_gt=False), pipeline=pipeline)


def build(cfg):
    """A dataset of mmdet's registry, the nodata transforms registered."""
    from mmengine.registry import init_default_scope
    from mmdet.registry import DATASETS
    from mmnan_testing.nodata import register_nodata_transforms
    init_default_scope('mmdet')
    register_nodata_transforms()
    return DATASETS.build(cfg)


def mosaic(data, log_file=None):
    """Mosaic samples under ``MultiImageMixDataset``; with ``log_file``,
    each one holding the tile as a part is logged (``serve``)."""
    # RepeatDataset(times=1): Mosaic draws randint(0, len) bounds included.
    steps = [dict(type='Mosaic', img_scale=(64, 64), pad_val=114.0)]
    if log_file:
        steps.append(dict(type='LogComposedParts', watch=[TILE],
                          log_file=log_file, where='Mosaic'))
    return build(dict(
        type='MultiImageMixDataset',
        dataset=dict(type='RepeatDataset', times=1,
                     dataset=coco(data, load_steps(log_file))),
        pipeline=steps + [PACK]))


def cached(data):
    """``CachedMosaic`` samples of a ``CocoDataset``."""
    return build(coco(data, load_steps() + [
        dict(type='CachedMosaic', img_scale=(64, 64), pad_val=114.0,
             max_cached_images=6, random_pop=False),
        PACK]))


def tile_path(data):
    """The tile's ``img_path``."""
    return osp.join(data['img_dir'], TILE)
