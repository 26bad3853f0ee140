"""The test bed: synthetic datasets and tiny real detectors trained on them."""
import contextlib
import json
import os
import os.path as osp
import sys
from xml.etree import ElementTree

import cv2
import numpy as np
import pytest

from mmnanhook.demo import synthetic

from mmnan_testing import testbed

SIZE = 64


def _tree_bytes(root):
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = osp.join(dirpath, name)
            with open(path, 'rb') as f:
                files[osp.relpath(path, root)] = f.read()
    return files


@pytest.mark.parametrize('kind', ['coco', 'voc', 'dota'])
def test_same_seed_same_bytes(tmp_path, kind):
    defects = {2: 'zero_size', 5: 'outside'}
    testbed.make_dataset(kind, str(tmp_path / 'a'), seed=3, defects=defects)
    testbed.make_dataset(kind, str(tmp_path / 'b'), seed=3, defects=defects)
    testbed.make_dataset(kind, str(tmp_path / 'c'), seed=4, defects=defects)
    a, b, c = (_tree_bytes(str(tmp_path / n)) for n in 'abc')
    assert len(a) > 8
    assert a == b
    assert a.keys() == c.keys() and a != c


def _coco_boxes(info):
    with open(info['ann_file']) as f:
        coco = json.load(f)
    names = {img['id']: img['file_name'] for img in coco['images']}
    boxes = {name: [] for name in names.values()}
    for ann in coco['annotations']:
        x, y, w, h = ann['bbox']
        boxes[names[ann['image_id']]].append((x, y, x + w, y + h))
    return boxes


def _voc_boxes(info):
    boxes = {}
    for name in info['images']:
        xml = osp.join(info['ann_dir'], osp.splitext(name)[0] + '.xml')
        boxes[name] = [
            tuple(int(obj.find('bndbox/' + tag).text)
                  for tag in ('xmin', 'ymin', 'xmax', 'ymax'))
            for obj in ElementTree.parse(xml).getroot().findall('object')
        ]
    return boxes


def _assert_hbox_defect(kind, box):
    x1, y1, x2, y2 = box
    if kind == 'zero_size':
        assert x2 - x1 == 0 and y2 - y1 > 0
    elif kind == 'outside':
        assert x1 >= SIZE and y1 >= SIZE
    elif kind == 'tiny':
        assert x2 - x1 == 1 and y2 - y1 == 1
    else:
        assert x2 < x1 and y2 < y1


@pytest.mark.parametrize('kind,read', [('coco', _coco_boxes),
                                       ('voc', _voc_boxes)])
def test_hbox_defects_planted_where_asked(tmp_path, kind, read):
    defects = {1: 'zero_size', 3: 'outside', 4: 'tiny', 6: 'inverted'}
    info = testbed.make_dataset(kind, str(tmp_path / 'bad'), defects=defects)
    clean = read(testbed.make_dataset(kind, str(tmp_path / 'clean')))
    boxes = read(info)

    assert info['defect_images'] == [
        info['images'][i] for i in sorted(defects)]
    for i, name in enumerate(info['images']):
        if i in defects:
            planted = info['defects'][sorted(defects).index(i)]
            assert planted['image'] == name and planted['kind'] == defects[i]
            assert planted['index'] == len(boxes[name]) - 1
            assert tuple(planted['box']) == boxes[name][-1]
            _assert_hbox_defect(defects[i], boxes[name][-1])
            # The rest of the image's annotation is the clean dataset's.
            assert boxes[name][:-1] == clean[name]
        else:
            assert boxes[name] == clean[name]
        for x1, y1, x2, y2 in clean[name]:
            assert 0 <= x1 < x2 <= SIZE and 0 <= y1 < y2 <= SIZE


def _dota_polygons(info):
    polys = {}
    for name in info['images']:
        txt = osp.join(info['ann_file'], osp.splitext(name)[0] + '.txt')
        with open(txt) as f:
            rows = [line.split() for line in f if line.strip()]
        for row in rows:
            assert len(row) == 10 and row[8] in info['classes']
        polys[name] = [[float(v) for v in row[:8]] for row in rows]
    return polys


def _rect_size(poly):
    return cv2.minAreaRect(np.array(poly, np.float32).reshape(4, 2))[1]


def test_dota_defects_planted_where_asked(tmp_path):
    defects = {0: 'collinear', 2: 'zero_size', 5: 'outside', 7: 'tiny'}
    info = testbed.make_dataset(
        'dota', str(tmp_path / 'bad'), defects=defects)
    clean = _dota_polygons(testbed.make_dataset('dota', str(tmp_path / 'ok')))
    polys = _dota_polygons(info)

    assert info['defect_images'] == [
        info['images'][i] for i in sorted(defects)]
    for i, name in enumerate(info['images']):
        for poly in clean[name]:
            assert min(_rect_size(poly)) > 1
            assert all(0 <= v <= SIZE for v in poly)
        if i not in defects:
            assert polys[name] == clean[name]
            continue
        assert polys[name][:-1] == clean[name]
        poly = polys[name][-1]
        assert np.isfinite(poly).all()
        w, h = sorted(_rect_size(poly))
        kind = defects[i]
        if kind == 'collinear':
            assert w == 0 and h > 1
            assert len(set(zip(poly[::2], poly[1::2]))) == 4
        elif kind == 'zero_size':
            assert w == h == 0
        elif kind == 'outside':
            assert min(poly) >= SIZE
        else:
            assert w == h == 1


@pytest.mark.parametrize('kind,bad', [('coco', 'collinear'),
                                      ('dota', 'inverted'),
                                      ('voc', 'nan')])
def test_unknown_defect_kind_rejected(tmp_path, kind, bad):
    with pytest.raises(ValueError, match=bad):
        testbed.make_dataset(kind, str(tmp_path), defects={0: bad})


def test_defect_index_out_of_range(tmp_path):
    with pytest.raises(ValueError, match='outside'):
        synthetic.make_coco_dataset(
            str(tmp_path), num_images=2, defects={2: 'tiny'})


def test_tiny_config_points_at_data_and_work_dir(tmp_path):
    cfg = testbed.tiny_config(
        'retinanet', str(tmp_path / 'data'), str(tmp_path / 'work'),
        max_iters=5, **{'optim_wrapper.optimizer.lr': 0.5})
    assert cfg.train_dataloader.dataset.data_root == str(tmp_path / 'data')
    assert cfg.work_dir == str(tmp_path / 'work')
    assert cfg.train_cfg.max_iters == 5
    assert cfg.optim_wrapper.optimizer.lr == 0.5
    assert cfg.val_cfg is None and 'val_dataloader' not in cfg
    assert cfg.default_hooks.checkpoint is None
    assert 'custom_hooks' not in cfg


def test_tiny_config_unknown_name(tmp_path):
    with pytest.raises(KeyError, match='retinanet'):
        testbed.tiny_config('yolo', str(tmp_path), str(tmp_path))


@contextlib.contextmanager
def _compiled_mmcv_calls():
    """Names of the compiled ``mmcv._ext`` functions called in the block."""
    seen = set()

    def profile(frame, event, arg):
        if event == 'c_call' and getattr(arg, '__module__',
                                         None) == 'mmcv._ext':
            seen.add(arg.__name__)

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


def _train(name, tmp_path):
    from mmengine.runner import Runner

    data = testbed.make_dataset(name, str(tmp_path / 'data'))
    cfg = testbed.tiny_config(name, data, str(tmp_path / 'work'), max_iters=3)
    runner = Runner.from_cfg(cfg)
    with _compiled_mmcv_calls() as ops:
        runner.train()
    assert runner.iter == 3
    losses = {
        key: buf.data[0]
        for key, buf in runner.message_hub.log_scalars.items()
        if key.startswith('train/loss')
    }
    assert 'train/loss' in losses and len(losses) > 2
    for key, history in losses.items():
        assert len(history) == 3, key
        assert np.isfinite(history).all(), (key, history)
    return ops


@pytest.mark.mmdet
@pytest.mark.parametrize('name', ['retinanet', 'retinanet_voc'])
def test_tiny_retinanet_trains(tmp_path, name):
    _train(name, tmp_path)


@pytest.mark.mmdet
def test_tiny_faster_rcnn_trains_through_compiled_ops(tmp_path):
    ops = _train('faster_rcnn', tmp_path)
    assert {'nms', 'roi_align_forward', 'roi_align_backward'} <= ops


@pytest.mark.mmrotate
def test_tiny_rotated_retinanet_trains_through_compiled_ops(tmp_path):
    ops = _train('rotated_retinanet', tmp_path)
    assert 'box_iou_rotated' in ops


def _defect_sample(name, data, scope):
    """Data info and pipeline output of the first defective image, as the
    config's real dataset class and pipeline give them."""
    from mmengine.registry import DATASETS, DefaultScope

    cfg = testbed.tiny_config(name, data, '')
    image = data['defect_images'][0]
    with DefaultScope.overwrite_default_scope(scope):
        dataset = DATASETS.build(cfg.train_dataloader.dataset)
        for i in range(len(dataset)):
            info = dataset.get_data_info(i)
            if osp.basename(info['img_path']) == image:
                return info, dataset[i]
    raise AssertionError('%s not in the dataset' % image)


@pytest.mark.mmdet
def test_voc_config_keeps_zero_size_box_coco_drops_it(tmp_path):
    # What tiny_retinanet_voc.py says, and what the mmdet demo builds on.
    planted = {1: 'zero_size'}
    voc = testbed.make_dataset('voc', str(tmp_path / 'voc'), defects=planted)
    info, sample = _defect_sample('retinanet_voc', voc, 'mmdet')
    box = info['instances'][voc['defects'][0]['index']]
    assert box['ignore_flag'] == 0
    assert box['bbox'][2] == box['bbox'][0]
    gt = sample['data_samples'].gt_instances.bboxes.tensor
    assert len(gt) == len(info['instances'])
    assert (gt[:, 2] - gt[:, 0] == 0).any()

    coco = testbed.make_dataset('coco', str(tmp_path / 'coco'),
                                defects=planted)
    info, _ = _defect_sample('retinanet', coco, 'mmdet')
    assert len(info['instances']) == coco['defects'][0]['index']


@pytest.mark.mmrotate
def test_collinear_polygon_becomes_zero_height_rbox(tmp_path):
    dota = testbed.make_dataset(
        'dota', str(tmp_path), defects={3: 'collinear'})
    info, sample = _defect_sample('rotated_retinanet', dota, 'mmrotate')
    rboxes = sample['data_samples'].gt_instances.bboxes.tensor
    assert rboxes.shape == (len(info['instances']), 5)
    index = dota['defects'][0]['index']
    w, h = rboxes[index, 2:4].tolist()
    assert min(w, h) == 0 and max(w, h) > 1
    assert (rboxes[:index, 2:4] > 1).all()
