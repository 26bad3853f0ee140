"""The synthetic COCO person-keypoints writer (``mmnan drill``'s stand-in for
mmpose, the zoo's pose data): deterministic, and in the fields mmpose's
``CocoDataset`` reads (tests/zoo/test_zoo_pose.py trains on it)."""
import filecmp
import json
import os
import os.path as osp

import pytest

from mmnanhook.demo import (KEYPOINTS_ANN_FILE, make_coco_keypoints_dataset,
                            synthetic)


def _files(root):
    return sorted(osp.relpath(osp.join(d, f), root)
                  for d, _, files in os.walk(root) for f in files)


def test_equal_arguments_give_equal_bytes(tmp_path):
    a = make_coco_keypoints_dataset(str(tmp_path / 'a'), num_images=3)
    b = make_coco_keypoints_dataset(str(tmp_path / 'b'), num_images=3)
    c = make_coco_keypoints_dataset(str(tmp_path / 'c'), num_images=3,
                                    seed=1)
    names = _files(a['data_root'])
    assert names == _files(b['data_root']) == _files(c['data_root'])
    assert len(names) == 4
    assert all(filecmp.cmp(osp.join(a['data_root'], n),
                           osp.join(b['data_root'], n), shallow=False)
               for n in names)
    assert not filecmp.cmp(a['ann_file'], c['ann_file'], shallow=False)


@pytest.mark.parametrize('persons', [1, 2])
def test_every_person_is_one_mmpose_reads(tmp_path, persons):
    size = 96
    data = make_coco_keypoints_dataset(str(tmp_path), num_images=4,
                                       image_size=size, persons=persons)
    assert data['ann_file'] == osp.join(data['data_root'],
                                        KEYPOINTS_ANN_FILE)
    assert data['img_dir'] == osp.join(data['data_root'],
                                       synthetic.COCO_IMG_DIR)
    with open(data['ann_file']) as f:
        coco = json.load(f)
    (category, ) = coco['categories']
    assert category['name'] == 'person' and len(category['keypoints']) == 17
    assert [i['file_name'] for i in coco['images']] == data['images']
    assert all(osp.isfile(osp.join(data['img_dir'], n))
               for n in data['images'])
    people = coco['annotations']
    assert len(people) == data['instances'] == 4 * persons
    assert len(set(p['id'] for p in people)) == len(people)
    for person in people:
        x, y, w, h = person['bbox']
        assert 0 <= x and 0 <= y and x + w <= size and y + h <= size
        assert w > 0 and h > 0 and person['area'] == w * h
        assert person['iscrowd'] == 0 and person['category_id'] == 1
        points = person['keypoints']
        assert len(points) == 3 * 17
        labelled = [(px, py) for px, py, v in zip(points[0::3], points[1::3],
                                                 points[2::3]) if v > 0]
        # CocoDataset skips a person with no labelled keypoint.
        assert person['num_keypoints'] == len(labelled) > 0
        assert all(x <= px <= x + w and y <= py <= y + h
                   for px, py in labelled)
        assert all(v in (0, 1, 2) for v in points[2::3])
        assert all(p == 0 for p, v in zip(points, [
            v for v in points[2::3] for _ in range(3)]) if v == 0)


def test_persons_below_one_refused(tmp_path):
    with pytest.raises(ValueError):
        make_coco_keypoints_dataset(str(tmp_path), persons=0)
