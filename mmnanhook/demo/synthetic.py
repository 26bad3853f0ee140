"""Deterministic synthetic detection datasets, with optional planted defects.

Three on-disk formats are written, each in the layout the matching real
dataset class reads:

* COCO (mmdet ``CocoDataset``): ``images/*.png`` + ``annotations/train.json``.
* VOC-style XML (mmdet ``XMLDataset``): ``JPEGImages/*.jpg``,
  ``Annotations/*.xml`` and ``ImageSets/Main/train.txt``.
* DOTA (mmrotate ``DOTADataset``): ``images/*.png`` + ``labelTxt/*.txt`` with
  ``x1 y1 x2 y2 x3 y3 x4 y4 class difficulty`` lines.

Images are random textures with 1-3 filled objects. Everything depends only on
``seed``: the same arguments give byte-identical files. A planted defect is one
extra object appended after the image's clean objects, so a clean dataset and
a defective one with the same seed differ only by that object.

Defect kinds (``defects`` maps an image index to one of them):

* ``'zero_size'``: a degenerate box with zero width (COCO/VOC) or a DOTA
  polygon whose four points coincide.
* ``'outside'``: a box lying entirely outside the image.
* ``'tiny'``: a 1x1 pixel box; valid, but below common minimum-size filters.
* ``'inverted'`` (COCO/VOC): a box whose max corner is left of / above its min
  corner (negative width and height), as swapped annotation fields give.
* ``'size_mismatch'`` (COCO/VOC): the annotation declares the image twice as
  wide as the file, and a valid box lies right of the file's border but
  inside the declared width, as a wrong export or an EXIF rotation the
  loader applies give. The loader keeps the box (it checks the declared
  size); ``Resize`` clips it to the real border, to zero width.
* ``'collinear'`` (DOTA): a NaN-free polygon whose four points lie on one
  line; its minimum-area rotated box has zero height.

The generators only write data; which of these a loader drops and which reach
the loss is for the tools under test to find out.
"""
from __future__ import annotations

import json
import os
import os.path as osp
from typing import Any, Dict, Optional, Sequence
from xml.etree import ElementTree

import cv2
import numpy as np

HBOX_DEFECTS = ('zero_size', 'outside', 'tiny', 'inverted', 'size_mismatch')
DOTA_DEFECTS = ('zero_size', 'outside', 'tiny', 'collinear')

# Relative layout of each format; the tiny configs under configs/ use the same.
COCO_IMG_DIR = 'images'
COCO_ANN_FILE = 'annotations/train.json'
VOC_IMG_DIR = 'JPEGImages'
VOC_ANN_DIR = 'Annotations'
VOC_SPLIT_FILE = 'ImageSets/Main/train.txt'
DOTA_IMG_DIR = 'images'
DOTA_ANN_DIR = 'labelTxt'

_MIN_OBJ, _MAX_OBJ = 3, 8  # object size range, in 1/16ths of the image side


def _image_rng(seed, index):
    # RandomState's streams are frozen across numpy versions, unlike
    # Generator's, so a seed means the same dataset in every environment.
    return np.random.RandomState([seed, index])


def _texture(rng, size):
    coarse = rng.randint(0, 256, (size // 8 + 1, size // 8 + 1, 3))
    img = cv2.resize(coarse.astype(np.uint8), (size, size),
                     interpolation=cv2.INTER_LINEAR).astype(np.int16)
    img += rng.randint(-20, 21, img.shape).astype(np.int16)
    return np.clip(img, 0, 255).astype(np.uint8)


def _class_color(label, num_classes):
    hue = int(180 * label / max(num_classes, 1))
    hsv = np.array([[[hue, 220, 230]]], dtype=np.uint8)
    return tuple(int(c) for c in cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0, 0])


def _fill(img, polygon, color):
    pts = np.round(np.asarray(polygon, dtype=np.float64).reshape(-1, 2))
    cv2.fillPoly(img, [pts.astype(np.int32)], color)


def _hbox_polygon(box):
    x1, y1, x2, y2 = box
    return [x1, y1, x2, y1, x2, y2, x1, y2]


def _clean_hboxes(rng, size, num_classes):
    """1-3 integer ``(x1, y1, x2, y2)`` boxes inside the image, with labels."""
    boxes, labels = [], []
    for _ in range(rng.randint(1, 4)):
        w, h = (rng.randint(_MIN_OBJ * size // 16, _MAX_OBJ * size // 16 + 1)
                for _ in range(2))
        x1 = rng.randint(0, size - w + 1)
        y1 = rng.randint(0, size - h + 1)
        boxes.append((x1, y1, x1 + w, y1 + h))
        labels.append(rng.randint(num_classes))
    return boxes, labels


def _defect_hbox(rng, size, kind):
    x = rng.randint(1, size - 2)
    y = rng.randint(1, size - 2)
    if kind == 'zero_size':
        return (x, y, x, min(y + size // 4, size))
    if kind == 'outside':
        return (size + 4, size + 4, size + 4 + size // 4, size + 4 + size // 4)
    if kind == 'tiny':
        return (x, y, x + 1, y + 1)
    if kind == 'size_mismatch':
        return (size + size // 8, y, size + size // 8 + size // 4,
                min(y + size // 4, size))
    # 'inverted': the corners of a valid box, written max-first.
    return (min(x + size // 4, size), min(y + size // 4, size), x, y)


def _clean_rboxes(rng, size, num_classes):
    """1-3 rotated rectangles as 8-value polygons inside the image."""
    polys, labels = [], []
    for _ in range(rng.randint(1, 4)):
        w, h = (float(rng.randint(_MIN_OBJ * size // 16,
                                  _MAX_OBJ * size // 16 + 1))
                for _ in range(2))
        theta = rng.uniform(0, np.pi)
        radius = 0.5 * np.hypot(w, h)
        cx, cy = (rng.uniform(radius, max(radius, size - radius))
                  for _ in range(2))
        cos, sin = np.cos(theta), np.sin(theta)
        corners = [(cx + dx * cos - dy * sin, cy + dx * sin + dy * cos)
                   for dx, dy in ((-w / 2, -h / 2), (w / 2, -h / 2),
                                  (w / 2, h / 2), (-w / 2, h / 2))]
        polys.append([round(v, 1) for xy in corners for v in xy])
        labels.append(rng.randint(num_classes))
    return polys, labels


def _defect_polygon(rng, size, kind):
    x = rng.randint(1, size // 2)
    y = rng.randint(1, size // 2)
    if kind == 'zero_size':
        return [float(x), float(y)] * 4
    if kind == 'outside':
        return [float(v) for v in _hbox_polygon(
            _defect_hbox(rng, size, 'outside'))]
    if kind == 'tiny':
        return [float(v) for v in _hbox_polygon((x, y, x + 1, y + 1))]
    # 'collinear': integer points on one slanted line stay exactly collinear
    # after formatting, so the minimum-area rectangle has height 0.
    dx, dy = 3, 1
    step = max(1, size // 16)
    ts = (0, 3 * step, 2 * step, step)
    return [float(v) for t in ts for v in (x + t * dx, y + t * dy)]


def _check_defects(defects, num_images, allowed):
    defects = dict(defects or {})
    for index, kind in defects.items():
        if kind not in allowed:
            raise ValueError('unknown defect kind %r; this format supports %s'
                             % (kind, ', '.join(allowed)))
        if not 0 <= int(index) < num_images:
            raise ValueError('defect index %r outside 0..%d'
                             % (index, num_images - 1))
    return {int(i): k for i, k in defects.items()}


def _generate(num_images, image_size, seed, defects, num_classes, rotated):
    """Yield ``(index, image, objects, defect)`` for each image.

    ``objects`` is a list of ``(box, label)`` where ``box`` is ``(x1, y1, x2,
    y2)`` or an 8-value polygon; ``defect`` is ``None`` or a dict describing
    the planted object (always the last in ``objects``).
    """
    for i in range(num_images):
        rng = _image_rng(seed, i)
        img = _texture(rng, image_size)
        if rotated:
            boxes, labels = _clean_rboxes(rng, image_size, num_classes)
        else:
            boxes, labels = _clean_hboxes(rng, image_size, num_classes)
        objects = list(zip(boxes, labels))
        defect = None
        if i in defects:
            kind = defects[i]
            box = (_defect_polygon if rotated else _defect_hbox)(
                rng, image_size, kind)
            objects.append((box, rng.randint(num_classes)))
            cast = float if rotated else int
            defect = dict(kind=kind, index=len(objects) - 1,
                          box=[cast(v) for v in box])
        for box, label in objects:
            poly = box if rotated else _hbox_polygon(box)
            _fill(img, poly, _class_color(label, num_classes))
        yield i, img, objects, defect


def _write_image(path, img):
    ok, buf = cv2.imencode(osp.splitext(path)[1], img)
    if not ok:
        raise IOError('could not encode %s' % path)
    with open(path, 'wb') as f:
        f.write(buf.tobytes())


def _result(root, classes, images, defect_list, **paths):
    result = dict(data_root=osp.abspath(root), classes=tuple(classes),
                  images=images, defects=defect_list,
                  defect_images=[d['image'] for d in defect_list])
    result.update({k: osp.join(osp.abspath(root), v)
                   for k, v in paths.items()})
    return result


def make_coco_dataset(root: str, num_images: int = 8, image_size: int = 64,
                      seed: int = 0,
                      defects: Optional[Dict[int, str]] = None,
                      classes: Sequence[str] = ('cat', 'dog'),
                      masks: bool = False) -> Dict[str, Any]:
    """Write a COCO-format detection dataset.

    Args:
        root (str): Directory to write into (created if missing).
        num_images (int): Number of images.
        image_size (int): Side of the square images, in pixels.
        seed (int): Seed; equal arguments give byte-identical files.
        defects (dict, optional): Image index -> defect kind, one of
            ``'zero_size'``, ``'outside'``, ``'tiny'``, ``'inverted'``,
            ``'size_mismatch'`` (see the module docstring). The box is
            written as COCO ``[x, y, w, h]``.
        classes (tuple[str]): Category names.
        masks (bool): Also write each box as a polygon ``segmentation``
            (for instance segmentation configs).

    Returns:
        dict: ``data_root``, ``ann_file``, ``img_dir`` (absolute paths),
        ``classes``, ``images`` (file names), ``defects`` (one dict per planted
        object: ``image``, ``kind``, ``index`` (annotation order within the
        image), ``box`` (``x1, y1, x2, y2``)) and ``defect_images``.
    """
    defects = _check_defects(defects, num_images, HBOX_DEFECTS)
    os.makedirs(osp.join(root, COCO_IMG_DIR), exist_ok=True)
    os.makedirs(osp.dirname(osp.join(root, COCO_ANN_FILE)), exist_ok=True)
    images, annotations, names, defect_list = [], [], [], []
    for i, img, objects, defect in _generate(
            num_images, image_size, seed, defects, len(classes), False):
        name = '%06d.png' % i
        _write_image(osp.join(root, COCO_IMG_DIR, name), img)
        names.append(name)
        images.append(dict(id=i + 1, file_name=name,
                           width=_declared_width(image_size, defect),
                           height=image_size))
        for (x1, y1, x2, y2), label in objects:
            w, h = x2 - x1, y2 - y1
            annotation = dict(
                id=len(annotations) + 1, image_id=i + 1,
                category_id=int(label) + 1, iscrowd=0, area=float(w * h),
                bbox=[float(x1), float(y1), float(w), float(h)])
            if masks:
                annotation['segmentation'] = [
                    [float(v) for v in _hbox_polygon((x1, y1, x2, y2))]]
            annotations.append(annotation)
        if defect:
            defect_list.append(dict(defect, image=name))
    coco = dict(
        images=images, annotations=annotations,
        categories=[dict(id=k + 1, name=c) for k, c in enumerate(classes)])
    with open(osp.join(root, COCO_ANN_FILE), 'w') as f:
        json.dump(coco, f, indent=1, sort_keys=True)
    return _result(root, classes, names, defect_list,
                   ann_file=COCO_ANN_FILE, img_dir=COCO_IMG_DIR)


def _declared_width(size, defect):
    # What the annotation says the image width is.
    if defect is not None and defect['kind'] == 'size_mismatch':
        return 2 * size
    return size


def _voc_xml(name, size, objects, classes, width):
    ann = ElementTree.Element('annotation')
    ElementTree.SubElement(ann, 'filename').text = name
    size_el = ElementTree.SubElement(ann, 'size')
    for tag, value in (('width', width), ('height', size), ('depth', 3)):
        ElementTree.SubElement(size_el, tag).text = str(value)
    for (x1, y1, x2, y2), label in objects:
        obj = ElementTree.SubElement(ann, 'object')
        ElementTree.SubElement(obj, 'name').text = classes[label]
        ElementTree.SubElement(obj, 'difficult').text = '0'
        bnd = ElementTree.SubElement(obj, 'bndbox')
        for tag, value in zip(('xmin', 'ymin', 'xmax', 'ymax'),
                              (x1, y1, x2, y2)):
            ElementTree.SubElement(bnd, tag).text = str(int(value))
    return ElementTree.tostring(ann)


def make_voc_dataset(root: str, num_images: int = 8, image_size: int = 64,
                     seed: int = 0,
                     defects: Optional[Dict[int, str]] = None,
                     classes: Sequence[str] = ('cat', 'dog')
                     ) -> Dict[str, Any]:
    """Write a VOC-style XML detection dataset (for mmdet ``XMLDataset``).

    Args:
        root (str): Directory to write into (created if missing).
        num_images (int): Number of images.
        image_size (int): Side of the square images, in pixels.
        seed (int): Seed; equal arguments give byte-identical files.
        defects (dict, optional): Image index -> defect kind, one of
            ``'zero_size'``, ``'outside'``, ``'tiny'``, ``'inverted'``,
            ``'size_mismatch'`` (see the module docstring). Written as
            integer ``xmin ymin xmax ymax``.
        classes (tuple[str]): Class names.

    Returns:
        dict: ``data_root``, ``ann_file`` (the split file), ``img_dir``,
        ``ann_dir`` (absolute paths), ``classes``, ``images``, ``defects``
        and ``defect_images``, as in :func:`make_coco_dataset`.
    """
    defects = _check_defects(defects, num_images, HBOX_DEFECTS)
    for sub in (VOC_IMG_DIR, VOC_ANN_DIR, osp.dirname(VOC_SPLIT_FILE)):
        os.makedirs(osp.join(root, sub), exist_ok=True)
    names, ids, defect_list = [], [], []
    for i, img, objects, defect in _generate(
            num_images, image_size, seed, defects, len(classes), False):
        img_id = '%06d' % i
        name = img_id + '.jpg'
        _write_image(osp.join(root, VOC_IMG_DIR, name), img)
        with open(osp.join(root, VOC_ANN_DIR, img_id + '.xml'), 'wb') as f:
            f.write(_voc_xml(name, image_size, objects, classes,
                             _declared_width(image_size, defect)))
        names.append(name)
        ids.append(img_id)
        if defect:
            defect_list.append(dict(defect, image=name))
    with open(osp.join(root, VOC_SPLIT_FILE), 'w') as f:
        f.write('\n'.join(ids) + '\n')
    return _result(root, classes, names, defect_list, ann_file=VOC_SPLIT_FILE,
                   img_dir=VOC_IMG_DIR, ann_dir=VOC_ANN_DIR)


def make_dota_dataset(root: str, num_images: int = 8, image_size: int = 64,
                      seed: int = 0,
                      defects: Optional[Dict[int, str]] = None,
                      classes: Sequence[str] = ('plane', 'ship')
                      ) -> Dict[str, Any]:
    """Write a DOTA-format oriented-box dataset (for mmrotate ``DOTADataset``).

    Args:
        root (str): Directory to write into (created if missing).
        num_images (int): Number of images.
        image_size (int): Side of the square images, in pixels.
        seed (int): Seed; equal arguments give byte-identical files.
        defects (dict, optional): Image index -> defect kind, one of
            ``'zero_size'``, ``'outside'``, ``'tiny'``, ``'collinear'`` (see
            the module docstring).
        classes (tuple[str]): Class names; must be DOTA class names (e.g.
            ``'plane'``, ``'ship'``) for ``DOTADataset``'s default metainfo.

    Returns:
        dict: ``data_root``, ``ann_file`` (the ``labelTxt`` directory),
        ``img_dir`` (absolute paths), ``classes``, ``images``, ``defects``
        (``box`` is the 8-value polygon) and ``defect_images``.
    """
    defects = _check_defects(defects, num_images, DOTA_DEFECTS)
    for sub in (DOTA_IMG_DIR, DOTA_ANN_DIR):
        os.makedirs(osp.join(root, sub), exist_ok=True)
    names, defect_list = [], []
    for i, img, objects, defect in _generate(
            num_images, image_size, seed, defects, len(classes), True):
        img_id = '%06d' % i
        name = img_id + '.png'
        _write_image(osp.join(root, DOTA_IMG_DIR, name), img)
        lines = ['%s %s 0' % (' '.join('%.1f' % v for v in poly),
                              classes[label])
                 for poly, label in objects]
        with open(osp.join(root, DOTA_ANN_DIR, img_id + '.txt'), 'w') as f:
            f.write('\n'.join(lines) + '\n')
        names.append(name)
        if defect:
            defect_list.append(dict(defect, image=name))
    return _result(root, classes, names, defect_list, ann_file=DOTA_ANN_DIR,
                   img_dir=DOTA_IMG_DIR)
