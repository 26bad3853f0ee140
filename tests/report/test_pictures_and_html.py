"""Tests that look: the pictures of a data bundle, ``report.html`` rendered
in real headless Chromium, and the pictures arriving in the MMEngine
visualizer's backends (a real TensorBoard event file, read back).

Bundles come from real tiny detectors trained by a real Runner, each with
one planted fault: a zero-width GT box (a data bundle) and a sqrt at 0 in a
custom loss (a backward-op bundle). VOC data for the zero-width box: COCO's
loader drops it.
"""
import base64
import glob
import html
import json
import os.path as osp
import re

import cv2
import numpy as np
import pytest
from mmengine.runner import Runner

from mmnanhook import NonFiniteError
from mmnanhook.bundle import load_bundle
from mmnan_testing import browser, faults, testbed

BAD_INDEX = 1  # the zero-width box lies in image 1: batch 0, position 1

needs_chromium = pytest.mark.skipif(browser.chromium() is None,
                                    reason=browser.SKIP_REASON)


def _config(root, name='retinanet_voc', defects=None, max_iters=1, hook=None,
            **overrides):
    data = testbed.make_dataset(name, str(root / 'data'), num_images=4,
                                defects=defects or {BAD_INDEX: 'zero_size'})
    cfg = testbed.tiny_config(name, data, str(root / 'work'),
                              max_iters=max_iters, log_level='WARNING',
                              **overrides)
    cfg.custom_imports = dict(imports=['mmnanhook'],
                              allow_failed_imports=False)
    cfg.custom_hooks = [dict(hook or {}, type='NanDetectHook',
                             dump_dir=str(root / 'dumps'))]
    return cfg, data


def _bundle_of_failing_run(cfg):
    with pytest.raises(NonFiniteError) as info:
        Runner.from_cfg(cfg).train()
    assert info.value.bundle is not None
    return load_bundle(info.value.bundle)


@pytest.fixture(scope='module')
def data_bundle(tmp_path_factory):
    cfg, data = _config(tmp_path_factory.mktemp('data_bundle'))
    return _bundle_of_failing_run(cfg), data


@pytest.fixture(scope='module')
def backward_bundle(tmp_path_factory):
    faults.register_mmdet_modules()
    # Clean data: the sqrt fails on the first batch.
    cfg, _ = _config(tmp_path_factory.mktemp('backward_bundle'), 'retinanet',
                     defects={},
                     **{'model.bbox_head.loss_bbox': dict(type='SqrtL1Loss')})
    return _bundle_of_failing_run(cfg)


def _read_png(path):
    image = cv2.imread(path, cv2.IMREAD_COLOR)
    assert image is not None, path
    return image


def _reddish(image):
    b, g, r = (image[..., c].astype(int) for c in range(3))
    return (r > 150) & (g < 110) & (b < 110)


def _zero_width_box(sample):
    boxes = sample.gt_instances.bboxes
    boxes = getattr(boxes, 'tensor', boxes)
    hits = [b.tolist() for b in boxes if float(b[2] - b[0]) <= 1e-3]
    assert len(hits) == 1, boxes
    return hits[0]


# -- pictures ----------------------------------------------------------------


@pytest.mark.mmdet
def test_data_bundle_has_both_pictures_of_the_bad_sample_only(data_bundle):
    bundle, data = data_bundle
    kept = sorted(n for n in bundle.files if n.startswith('sample')
                  and not n.endswith('.png'))
    # The bad sample's data info and a copy of its file, for the fixes.
    image = osp.join(data['img_dir'], data['images'][BAD_INDEX])
    assert kept == ['sample{}_image{}'.format(BAD_INDEX,
                                              osp.splitext(image)[1]),
                    'sample{}_info.json'.format(BAD_INDEX)]
    with open(image, 'rb') as a, open(osp.join(bundle.path, kept[0]),
                                      'rb') as b:
        assert a.read() == b.read()
    names = sorted(n for n in bundle.files if n.startswith('sample')
                   and n.endswith('.png'))
    assert names == ['sample{}_file.png'.format(BAD_INDEX),
                     'sample{}_input.png'.format(BAD_INDEX)]
    # The file picture is the file itself: its aspect, its pixels.
    raw = _read_png(osp.join(data['img_dir'], data['images'][BAD_INDEX]))
    picture = _read_png(osp.join(bundle.path, names[0]))
    h, w = raw.shape[:2]
    assert abs(picture.shape[1] / picture.shape[0] - w / h) < 0.02


@pytest.mark.mmdet
def test_the_red_box_of_the_input_picture_is_where_the_bad_box_is(
        data_bundle):
    bundle, _ = data_bundle
    batch = bundle.load('data_batch')
    sample = batch['data_samples'][BAD_INDEX]
    seen = batch['inputs'][BAD_INDEX].permute(1, 2, 0).numpy()  # BGR uint8
    ih, iw = (int(v) for v in sample.metainfo['img_shape'][:2])
    picture = _read_png(osp.join(bundle.path,
                                 'sample{}_input.png'.format(BAD_INDEX)))
    scale = picture.shape[1] / float(iw)
    assert abs(picture.shape[0] - ih * scale) <= 1
    x1, y1, _, y2 = _zero_width_box(sample)

    # What was drawn: where the picture differs from the model's input,
    # blown up the way the picture was.
    base = cv2.resize(np.ascontiguousarray(seen[:ih, :iw]),
                      (picture.shape[1], picture.shape[0]),
                      interpolation=cv2.INTER_NEAREST)
    drawn = np.abs(picture.astype(int) - base.astype(int)).max(axis=2) > 40
    # Away from the drawings, the picture is the model's input
    # de-normalized: the pixels the pipeline produced.
    assert drawn.mean() < 0.1
    red = drawn & _reddish(picture)
    x = int(round(x1 * scale))
    rows = range(int(y1 * scale) + 2, int(y2 * scale) - 2)
    on_line = [red[y, max(x - 3, 0):x + 4].any() for y in rows]
    assert len(on_line) > 10 and np.mean(on_line) > 0.8
    # Red only there (the line, its ring and its label); the good boxes
    # are drawn too, in green.
    ys, xs = np.nonzero(red)
    assert np.percentile(np.abs(xs - x), 90) < 0.2 * picture.shape[1]
    b, g, r = (picture[..., c].astype(int) for c in range(3))
    assert (drawn & (g > 150) & (r < 110) & (b < 110)).sum() > 100


# -- report.html in Chromium -------------------------------------------------


def _report_json(bundle):
    with open(osp.join(bundle.path, 'report.json')) as f:
        return json.load(f)


def _inline_images(dom):
    return {m.group(1): cv2.imdecode(np.frombuffer(
        base64.b64decode(m.group(2)), np.uint8), cv2.IMREAD_COLOR)
        for m in re.finditer(
            r'<figure id="([^"]+)"><img alt="[^"]*" '
            r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)}


def _assert_renders(bundle, tmp_path):
    page = osp.join(bundle.path, 'report.html')
    with open(page, encoding='utf-8') as f:
        source = f.read()
    # Self-contained: nothing to fetch.
    assert not re.search(r'(src|href)="(https?:)?//', source)
    dom = browser.dump_dom(page, str(tmp_path))
    report = _report_json(bundle)
    text = re.sub(r'\s+', ' ', re.sub(r'<[^>]+>', ' ', dom))
    text = html.unescape(text)
    assert ' '.join(report['summary'].split()) in text
    shot = _read_png(browser.screenshot(page, str(tmp_path)))
    assert shot.std() > 10  # not a blank page
    return dom, text, report


@needs_chromium
@pytest.mark.mmdet
def test_report_html_of_a_data_bundle_renders_with_the_pictures(
        data_bundle, tmp_path):
    bundle, data = data_bundle
    dom, text, report = _assert_renders(bundle, tmp_path)
    assert report['kind'] == 'data'
    assert osp.basename(data['images'][BAD_INDEX]) in text
    images = _inline_images(dom)
    assert set(images) == {'sample1_input.png', 'sample1_file.png'}
    for name, image in images.items():
        assert image is not None and image.std() > 10, name
        assert (image == _read_png(osp.join(bundle.path, name))).all()
    assert 'alt="history"' in dom
    # The hint a replayed fix verified is marked so, and every fix is listed
    # with its outcome as rendered.
    verified = [f for f in report['fixes'] if f['status'] == 'verified']
    assert verified and 'Fixes, replayed' in text
    for fix in verified:
        assert ' '.join(html.escape(fix['fix'], quote=False).split()) in \
            ' '.join(dom.split())
        if fix['hint'] is not None:
            assert re.search(r'<li><span class="verified">verified</span> ' +
                             re.escape(html.escape(
                                 report['hints'][fix['hint']][:40],
                                 quote=False)), dom)


@needs_chromium
@pytest.mark.mmdet
def test_report_html_of_a_backward_bundle_shows_the_code_line(
        backward_bundle, tmp_path):
    dom, text, report = _assert_renders(backward_bundle, tmp_path)
    assert report['kind'] == 'backward'
    assert report['location'] == faults.line_of('sqrt')
    assert report['location'] in text and report['op'] in text
    # The source line itself, highlighted, with lines around it.
    path, line = report['location'].rsplit(':', 1)
    with open(path) as f:
        source = f.read().splitlines()
    hit = re.search(r'<span class="hit">\s*{}\s+(.*?)</span>'.format(line),
                    dom)
    assert hit is not None
    assert html.unescape(hit.group(1)).strip() == \
        source[int(line) - 1].strip()
    assert source[int(line) - 2].strip()[:20] in text
    # Each sample fails alone: both are implicated and drawn, nothing red.
    implicated = [s['index'] for s in report['samples']]
    assert implicated
    assert set(_inline_images(dom)) == {
        'sample{}_{}.png'.format(i, view) for i in implicated
        for view in ('input', 'file')}


# -- the visualizer ----------------------------------------------------------


@pytest.mark.mmdet
def test_pictures_and_scalars_reach_tensorboard(tmp_path):
    event_accumulator = pytest.importorskip(
        'tensorboard.backend.event_processing.event_accumulator')
    cfg, _ = _config(tmp_path, max_iters=2, hook=dict(policy='skip'))
    cfg.visualizer = dict(type='Visualizer', name='tb_{}'.format(id(cfg)),
                          vis_backends=[dict(type='LocalVisBackend'),
                                        dict(type='TensorboardVisBackend')])
    runner = Runner.from_cfg(cfg)
    runner.train()
    bundles = sorted(glob.glob(str(tmp_path / 'dumps' / '*')))
    assert len(bundles) == 1  # batch 0 only holds the bad image
    events = glob.glob(osp.join(runner.log_dir, 'vis_data', '**',
                                'events.out.tfevents.*'), recursive=True)
    assert len(events) == 1
    acc = event_accumulator.EventAccumulator(
        events[0], size_guidance={event_accumulator.IMAGES: 0,
                                  event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = acc.Tags()
    name = 'mmnanhook_sample{}_input'.format(BAD_INDEX)
    assert {name, 'mmnanhook_sample{}_file'.format(BAD_INDEX),
            'mmnanhook_report'} <= set(tags['images'])
    image = acc.Images(name)[0]
    assert image.step == 0
    decoded = cv2.imdecode(np.frombuffer(image.encoded_image_string,
                                         np.uint8), cv2.IMREAD_COLOR)
    stored = _read_png(osp.join(bundles[0], 'sample1_input.png'))
    assert decoded.shape == stored.shape
    assert np.abs(decoded.astype(int) - stored.astype(int)).max() <= 1
    # Scalars keep flowing, every iteration; the skipped one (iter 0, step
    # 1) adds no loss and no gradient norm to what LogProcessor smooths.
    assert {'loss', 'grad_norm', 'lr'} <= set(tags['scalars'])
    assert [e.step for e in acc.Scalars('lr')] == [1, 2]
    for tag in ('loss', 'grad_norm'):
        assert [e.step for e in acc.Scalars(tag)] == [2], tag
        assert all(np.isfinite(e.value) for e in acc.Scalars(tag)), tag
    # The local backend got the same pictures.
    local = osp.join(runner.log_dir, 'vis_data', 'vis_image')
    assert (_read_png(osp.join(local, 'mmnanhook_sample1_input_0.png'))
            == stored).all()
    assert osp.isfile(osp.join(local, 'mmnanhook_report_0.png'))
