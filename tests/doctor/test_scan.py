"""The dataset pass at scale, on real mmdet datasets over synthetic data: the
quarantine list written while the scan runs, a scan interrupted and resumed
ending as one that was not, and the fast mode (annotations and image headers
only: no decoding, no pipeline)."""
import gc
import io
import json
import os.path as osp
import random
import time
import xml.etree.ElementTree as ET

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from mmnanhook.doctor import DatasetError, scan_config
from mmnanhook.quarantine import read_quarantine
from mmnanhook.records import ProblemCategory
from mmnan_testing.scan import image_paths, probe, probed_config

# The defects of the 40-image VOC set, by image index: one in each chunk of
# 16 samples, two in the second.
DEFECTS = {3: 'zero_size', 17: 'outside', 20: 'inverted', 38: 'zero_size'}


def _listed(path):
    return [(s.indices, s.file, s.reason) for s in read_quarantine(path)]


def _progress(path):
    with open(path + '.progress') as f:
        return json.load(f)


@pytest.mark.mmdet
def test_the_list_holds_findings_before_the_scan_ends(tmp_path):
    scan_probe = probe()
    path, _ = probed_config(tmp_path, 'retinanet_voc', 40, DEFECTS)
    listed = str(tmp_path / 'quarantine.json')
    on_disk = {}

    def look(finding, paths):
        if finding.index == 3:
            # A second passes: the end of this chunk saves what it found.
            time.sleep(1.1)
        elif finding.index == 17:
            on_disk['list'] = _listed(listed)
            on_disk['progress'] = _progress(listed)
            on_disk['seen'] = len(scan_probe.SEEN)

    del scan_probe.SEEN[:]
    total, bad, _ = scan_config(path, progress=False, on_finding=look,
                                quarantine=listed)
    assert total == 40 and [b.index for b in bad] == [3, 17, 20, 38]
    # Read while the scan was at sample 32 of 40: sample 3 is listed, 17
    # (in the chunk just done) not yet; the record is as far as the list.
    assert on_disk['seen'] == 32
    assert [entry[0] for entry in on_disk['list']] == [[3]]
    assert on_disk['progress']['next'] == 16
    assert [f['index'] for f in on_disk['progress']['findings']] == [3]
    # At the end: the whole list, and no progress record.
    assert [entry[0] for entry in _listed(listed)] == [[3], [17], [20], [38]]
    assert not osp.exists(listed + '.progress')


@pytest.mark.mmdet
@pytest.mark.parametrize('workers', [1, 2])
def test_an_interrupted_scan_resumed_ends_as_one_that_was_not(tmp_path,
                                                              workers):
    scan_probe = probe()
    path, _ = probed_config(tmp_path, 'retinanet_voc', 40, DEFECTS)
    whole = str(tmp_path / 'whole.json')
    streamed = {'whole': [], 'resumed': []}
    _, bad, _ = scan_config(
        path, progress=False, quarantine=whole,
        on_finding=lambda f, p: streamed['whole'].append(
            (f.index, [(q.category, q.text, q.box) for q in f.problems])))

    listed = str(tmp_path / 'quarantine.json')

    def interrupt(finding, paths):
        # Ctrl-C while the second chunk's findings are reported.
        if finding.index == 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scan_config(path, progress=False, quarantine=listed,
                    on_finding=interrupt, workers=workers)
    # What was done is saved: the first chunk, its finding; the second
    # chunk, reported in part, is not counted as done.
    assert _progress(listed)['next'] == 16
    assert [entry[0] for entry in _listed(listed)] == [[3]]

    del scan_probe.SEEN[:]
    total, resumed, _ = scan_config(
        path, progress=False, quarantine=listed, resume=True,
        workers=workers,
        on_finding=lambda f, p: streamed['resumed'].append(
            (f.index, [(q.category, q.text, q.box) for q in f.problems])))
    if workers == 1:
        # The pipeline ran on the samples not done only (workers record in
        # their own processes).
        assert sorted(scan_probe.SEEN) == list(range(16, 40))
    assert total == 40
    assert streamed['resumed'] == streamed['whole']
    assert [b.index for b in resumed] == [b.index for b in bad] == [
        3, 17, 20, 38]
    assert _listed(listed) == _listed(whole)
    assert not osp.exists(listed + '.progress')


@pytest.mark.mmdet
def test_a_record_of_another_scan_is_not_resumed(tmp_path):
    path, data = probed_config(tmp_path, 'retinanet_voc', 20, {3: 'outside'})
    listed = str(tmp_path / 'quarantine.json')

    def interrupt(finding, paths):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scan_config(path, progress=False, quarantine=listed,
                    on_finding=interrupt)
    with pytest.raises(DatasetError, match=r'^cannot resume from .*'
                       r'quarantine\.json\.progress: it is the progress of '
                       r'another scan \(the full mode\); start again without '
                       r'--resume$'):
        scan_config(path, progress=False, quarantine=listed, resume=True,
                    fast=True)
    # The same config file, its dataset's annotations edited since.
    ann = osp.join(data['data_root'], 'ImageSets', 'Main', 'train.txt')
    with open(ann) as f:
        names = f.read().split()
    with open(ann, 'w') as f:
        f.write('\n'.join(names[:-1]) + '\n')
    with pytest.raises(DatasetError, match=r'\(20 samples, not 19\)'):
        scan_config(path, progress=False, quarantine=listed, resume=True)


@pytest.mark.mmdet
def test_findings_depend_on_no_generator_state(tmp_path):
    # Ten boxes on the border that RandomFlip moves to one side or the other.
    path, _ = probed_config(tmp_path, 'retinanet_voc', 20,
                            dict((i, 'outside') for i in range(0, 20, 2)))
    texts = []
    for seed in (0, 1):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        _, bad, _ = scan_config(path, progress=False)
        # The caller's generators are left as they were.
        assert torch.equal(torch.get_rng_state(), before)
        texts.append([(b.index, [p.text for p in b.problems]) for b in bad])
    assert len(texts[0]) == 10 and texts[0] == texts[1]


# -- the fast mode -----------------------------------------------------------


def _declare(data, index, width, height):
    """Make VOC's XML of image ``index`` declare ``width`` x ``height``."""
    name = osp.splitext(data['images'][index])[0] + '.xml'
    xml = osp.join(data['data_root'], 'Annotations', name)
    tree = ET.parse(xml)
    tree.find('size/width').text = str(width)
    tree.find('size/height').text = str(height)
    tree.write(xml)


def _turned_jpeg(path, width, height):
    """Write ``path`` as a ``width`` x ``height`` JPEG whose EXIF orientation
    (6) says to turn it by 90 degrees when shown."""
    pixels = np.random.RandomState(0).randint(0, 255, (height, width, 3),
                                              np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(pixels).save(path, exif=exif)


def _truncated(path):
    """Rewrite ``path`` as a PNG cut halfway through its pixel data: its
    header says the size, no decoder gets a picture out of it."""
    stream = io.BytesIO()
    Image.open(path).save(stream, format='PNG')
    with open(path, 'wb') as f:
        f.write(stream.getvalue()[:len(stream.getvalue()) // 2])


@pytest.mark.mmdet
def test_fast_mode_reads_annotations_and_headers_without_decoding(tmp_path):
    scan_probe = probe()
    defects = {1: 'zero_size', 2: 'size_mismatch', 4: 'inverted'}
    path, data = probed_config(tmp_path, 'retinanet_voc', 12, defects,
                               **{'model.bbox_head.num_classes': 1})
    images = image_paths(data)
    # Image 6: stored 64x48 with EXIF orientation 6, declared so: the loader
    # turns it to 48x64. Image 7: the same, declared as it is shown.
    for index, declared in ((6, (64, 48)), (7, (48, 64))):
        _turned_jpeg(images[index], 64, 48)
        _declare(data, index, *declared)
    # Image 9: its pixel data cut off, its header intact.
    _truncated(images[9])
    assert Image.open(images[9]).size == (64, 64)
    assert cv2.imread(images[9]) is None

    del scan_probe.SEEN[:]
    _, fast, _ = scan_config(path, progress=False, fast=True)
    # Neither the pipeline ran nor an image was decoded.
    assert scan_probe.SEEN == []
    _, full, _ = scan_config(path, progress=False)
    assert sorted(scan_probe.SEEN) == list(range(12))
    found = dict((b.index, b) for b in fast)
    full = dict((b.index, b) for b in full)

    # The dog labels (1) of a one-class head, in both (image 9's too in the
    # fast mode: its annotation is read, its pipeline fails before).
    labelled = set(i for i, b in found.items()
                   if ProblemCategory.LABEL in b.categories)
    assert 9 in labelled and labelled - {9} == set(
        i for i, b in full.items() if ProblemCategory.LABEL in b.categories)
    # The zero-width and the inverted box, as annotated.
    assert 'gt box 1 has zero width (w=0)' in [
        p.text for p in found[1].problems]
    assert ProblemCategory.DEGENERATE in found[4].categories
    # The declared size against the header's, EXIF orientation applied.
    assert found[2].problems[0].text.startswith(
        'the annotation declares the image 128x64 (width x height) but the '
        'file is 64x64 by its header')
    assert found[6].problems[0].text.startswith(
        'the annotation declares the image 64x48 (width x height) but the '
        'file is 48x64 by its header')
    assert 'turned by 90 degrees' in found[6].problems[0].text
    # The full pass agrees on each size, by loading the files.
    for index in (2, 6):
        assert full[index].problems[0].category == \
            ProblemCategory.SIZE_MISMATCH
    assert all(ProblemCategory.SIZE_MISMATCH not in b.categories
               for b in (found.get(7), full.get(7)) if b is not None)
    # Only decoding shows image 9 is broken.
    assert ProblemCategory.PIPELINE in full[9].categories
    assert ProblemCategory.PIPELINE not in found[9].categories
    assert set(found) == set(full)


@pytest.mark.mmdet
def test_fast_mode_names_an_image_file_it_cannot_read(tmp_path):
    path, data = probed_config(tmp_path, 'retinanet_voc', 4, {})
    with open(image_paths(data)[2], 'wb') as f:
        f.write(b'not an image')
    _, bad, _ = scan_config(path, progress=False, fast=True)
    assert [b.index for b in bad] == [2]
    assert bad[0].problems[0].category == ProblemCategory.PIPELINE
    assert bad[0].problems[0].text.startswith(
        'the image file cannot be read: UnidentifiedImageError')


@pytest.mark.mmdet
@pytest.mark.parametrize('configured', [None, 2])
def test_the_pipeline_runs_with_the_runners_opencv_and_one_torch_thread(
        tmp_path, configured):
    # As mmengine's Runner does before its dataloader workers run the
    # pipeline (env_cfg.mp_cfg.opencv_num_threads, 0 where unset), so that
    # scan workers do not each spread OpenCV over every core; and one torch
    # thread, as in a worker.
    scan_probe = probe()
    overrides = {} if configured is None else {
        'env_cfg.mp_cfg.opencv_num_threads': configured}
    path, _ = probed_config(tmp_path, 'retinanet_voc', 4, {}, **overrides)
    before = cv2.getNumThreads(), torch.get_num_threads()
    cv2.setNumThreads(0)
    # OpenCV says 1 for 0 (no threads of its own).
    expected = cv2.getNumThreads() if configured is None else configured
    cv2.setNumThreads(3)
    torch.set_num_threads(2)
    del scan_probe.OPENCV_THREADS[:], scan_probe.TORCH_THREADS[:]
    try:
        scan_config(path, progress=False)
        assert scan_probe.OPENCV_THREADS == [expected] * 4
        assert scan_probe.TORCH_THREADS == [1] * 4
        # The caller's settings are put back.
        assert (cv2.getNumThreads(), torch.get_num_threads()) == (3, 2)
    finally:
        cv2.setNumThreads(before[0])
        torch.set_num_threads(before[1])


@pytest.mark.mmdet
@pytest.mark.parametrize('workers', [1, 2])
def test_the_garbage_collector_is_left_as_found(tmp_path, workers):
    # The scan freezes the objects that exist while it builds the dataset
    # and forks its workers; a caller's own freeze is not undone.
    path, _ = probed_config(tmp_path, 'retinanet_voc', 4, {})
    scan_config(path, progress=False, workers=workers)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        scan_config(path, progress=False, workers=workers)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
