"""The dataset pass of ``mmnan doctor`` on synthetic datasets: labels outside
the model's classes, segmentation maps stored as 0/255, maps that are all
ignore under ``avg_non_ignore``; each with the clean dataset passing."""
import cv2
import numpy as np
import pytest

from mmnanhook.doctor import scan_config
from mmnanhook.records import ProblemCategory
from mmnan_testing import testbed, zoo


def _categories(bad):
    return sorted(set(str(p.category) for item in bad
                      for p in item.problems))


@pytest.mark.mmdet
def test_labels_outside_the_models_classes(tmp_path):
    # 8 images: some hold a dog (label 1), the others only cats.
    data = testbed.make_dataset('retinanet', str(tmp_path / 'data'),
                                num_images=8)
    clean = testbed.tiny_config('retinanet', data, str(tmp_path / 'run'))
    clean.dump(str(tmp_path / 'clean.py'))
    assert scan_config(str(tmp_path / 'clean.py'), progress=False)[1] == []
    # The dataset has two classes (cat, dog); a head for one of them.
    one = testbed.tiny_config('retinanet', data, str(tmp_path / 'run'),
                              **{'model.bbox_head.num_classes': 1})
    one.dump(str(tmp_path / 'one.py'))
    total, bad, _ = scan_config(str(tmp_path / 'one.py'), progress=False)
    assert total == 8 and 0 < len(bad) < 8
    assert _categories(bad) == [ProblemCategory.LABEL]
    assert 'GT label(s) [1] outside 0..0' in bad[0].problems[0].text


def _ade(tmp_path, rewrite=None):
    """The zoo SegFormer's config on a synthetic ADE20K, its maps rewritten
    by ``rewrite(map) -> map`` (``None``: as written)."""
    import glob
    data = zoo.make_zoo_dataset('segformer_b0_ade', str(tmp_path / 'data'))
    for path in glob.glob(str(tmp_path / 'data' / '**' / '*.png'),
                          recursive=True):
        if rewrite is not None and 'annotations' in path:
            seg = cv2.imread(path, cv2.IMREAD_UNCHANGED)
            cv2.imwrite(path, rewrite(seg).astype(np.uint8))
    return data


@pytest.mark.mmseg
def test_binary_masks_stored_as_0_255(tmp_path):
    data = _ade(tmp_path)
    clean = zoo.child_config('segformer_b0_ade', data, str(tmp_path / 'c'))
    clean.dump(str(tmp_path / 'clean.py'))
    assert scan_config(str(tmp_path / 'clean.py'), progress=False)[1] == []
    _ade(tmp_path, lambda seg: np.where(seg > 0, 255, 0))
    binary = zoo.child_config(
        'segformer_b0_ade', data, str(tmp_path / 'b'),
        extra='model = dict(decode_head=dict(num_classes=2))')
    # A binary dataset: no reduce_zero_label (0 is background).
    dataset = binary.train_dataloader.dataset
    dataset.reduce_zero_label = False
    for step in dataset.pipeline:
        if step['type'] == 'LoadAnnotations':
            step['reduce_zero_label'] = False
    binary.dump(str(tmp_path / 'binary.py'))
    _, bad, _ = scan_config(str(tmp_path / 'binary.py'), progress=False)
    assert bad and _categories(bad) == [ProblemCategory.MASK]
    assert 'stored as 0/255' in bad[0].problems[0].text


@pytest.mark.mmseg
def test_all_ignore_maps_under_avg_non_ignore(tmp_path):
    # ADE20K's reduce_zero_label: a map of zeros is all ignore (255).
    data = _ade(tmp_path, lambda seg: np.zeros_like(seg))
    plain = zoo.child_config('segformer_b0_ade', data, str(tmp_path / 'p'))
    plain.dump(str(tmp_path / 'plain.py'))
    # Without avg_non_ignore the loss averages over every pixel: finite.
    assert scan_config(str(tmp_path / 'plain.py'), progress=False)[1] == []
    avg = zoo.child_config(
        'segformer_b0_ade', data, str(tmp_path / 'a'),
        extra='model = dict(decode_head=dict(loss_decode=dict('
        'avg_non_ignore=True)))')
    avg.dump(str(tmp_path / 'avg.py'))
    _, bad, _ = scan_config(str(tmp_path / 'avg.py'), progress=False)
    assert len(bad) == 4
    assert _categories(bad) == [ProblemCategory.ALL_IGNORE]


@pytest.mark.mmdet
def test_workers_find_the_same_samples_and_stream_them_in_order(tmp_path):
    data = testbed.make_dataset(
        'retinanet_voc', str(tmp_path / 'data'), num_images=40,
        defects={3: 'zero_size', 17: 'outside', 38: 'zero_size'})
    cfg = testbed.tiny_config('retinanet_voc', data, str(tmp_path / 'run'))
    cfg.dump(str(tmp_path / 'config.py'))
    runs = {}
    for workers in (1, 2):
        streamed = []
        total, bad, _ = scan_config(
            str(tmp_path / 'config.py'), progress=False, workers=workers,
            on_finding=lambda finding, paths: streamed.append(finding.index))
        assert total == 40 and streamed == [b.index for b in bad]
        # Categories, not texts: the pipeline's RandomFlip moves a box.
        runs[workers] = [(b.index, b.img_path, sorted(map(str, b.categories)))
                         for b in bad]
    assert runs[2] == runs[1]
    assert [index for index, _, _ in runs[1]] == sorted(
        index for index, _, _ in runs[1]) and len(runs[1]) == 3
