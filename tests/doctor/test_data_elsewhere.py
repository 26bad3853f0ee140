"""``mmnan doctor`` where the data is not: the zoo's configs as a user
checks them on a laptop before sending them to the cluster that holds the
data. The config rules run and decide the exit code; the dataset and the
headroom parts each say in one line that they were not checked, and why.

In process (``mmnan``'s ``main``): the fresh-process runs are
``tests/cli/test_doctor_cli.py``'s.
"""
import os.path as osp
import re

import pytest

from mmnanhook.cli._main import main
from mmnan_testing import zoo

# mmdet's COCO configs read data/coco/ under the working directory.
COCO_TRAIN = "'data/coco/annotations/instances_train2017.json'"
# mmengine < 0.8 names the class between the two (class `CocoDataset` in
# mmdet/datasets/coco.py: ...).
WHY = re.escape('FileNotFoundError: ') + '(class .*: )?' + re.escape(
    '[Errno 2] No such file or directory: ' + COCO_TRAIN)
DATASET_LINE = ('dataset: not checked: the train dataset cannot be built '
                'here ({}')
WHAT_TO_DO = '); run where the data is, or pass --no-data'
HEADROOM_LINE = ('fp16 headroom: skipped: no batch to train on, the train '
                 'dataset cannot be built here (as above)')


def _doctor(capsys, *args):
    code = main(['doctor'] + list(args))
    lines = capsys.readouterr().out.splitlines()
    # pycocotools prints its own lines before the report.
    starts = [i for i, line in enumerate(lines) if line.startswith('config: ')]
    return code, lines[starts[0] if starts else 0:]


def _dataset_line():
    return re.escape(DATASET_LINE.format('')) + WHY + re.escape(
        WHAT_TO_DO) + '$'


def _line(lines, start):
    (line, ) = [each for each in lines if each.startswith(start)]
    return line


@pytest.mark.mmdet
def test_a_rule_on_a_config_whose_data_is_elsewhere(tmp_path, monkeypatch,
                                                    capsys):
    # mmdet's Faster R-CNN with GIoU, edited as in issue 46: its box loss on
    # encoded deltas.
    monkeypatch.chdir(tmp_path)
    giou = osp.join(osp.dirname(zoo.shipped_config('faster_rcnn_r50')),
                    'faster-rcnn_r50_fpn_giou_1x_coco.py')
    child = tmp_path / 'giou_on_deltas.py'
    child.write_text(
        '_base_ = [%r]\nmodel = dict(roi_head=dict(bbox_head=dict('
        'reg_decoded_bbox=False)))\n' % giou)
    html = str(tmp_path / 'doctor.html')
    code, lines = _doctor(capsys, str(child), '--html', html)
    assert code == 1, lines
    assert lines[0] == 'config: 1 finding(s)'
    assert lines[1].startswith(
        '  - [iou_loss_on_deltas] model.roi_head.bbox_head.loss_bbox: ')
    assert re.match(_dataset_line(), _line(lines, 'dataset: '))
    assert _line(lines, 'fp16 headroom: ') == HEADROOM_LINE
    with open(html) as f:
        page = f.read()
    assert 'iou_loss_on_deltas' in page
    assert 'not checked: the train dataset cannot be built here' in page


@pytest.mark.mmdet
def test_a_clean_config_whose_data_is_elsewhere(tmp_path, monkeypatch,
                                                capsys):
    monkeypatch.chdir(tmp_path)
    config = zoo.shipped_config('retinanet_r50')
    code, lines = _doctor(capsys, config)
    assert code == 0, lines
    assert lines[0] == 'config: 0 finding(s)'
    assert re.match(_dataset_line(), _line(lines, 'dataset: '))
    assert _line(lines, 'fp16 headroom: ') == HEADROOM_LINE
    # --no-data: no dataset part; the headroom says why in its own line.
    code, lines = _doctor(capsys, config, '--no-data')
    assert code == 0, lines
    assert not [line for line in lines if line.startswith('dataset')]
    (before, after) = HEADROOM_LINE.split('as above')
    assert re.match(re.escape(before) + WHY + re.escape(after) + '$',
                    _line(lines, 'fp16 headroom: '))


def test_a_config_that_does_not_load_is_still_bad_input(tmp_path, capsys):
    missing = str(tmp_path / 'missing.py')
    assert main(['doctor', missing]) == 2
    assert capsys.readouterr().err.startswith(
        'mmnan doctor: error: cannot load {}: FileNotFoundError'.format(
            missing))


@pytest.mark.mmdet
def test_a_scan_where_the_data_is_not_checks_nothing_and_says_so(
        tmp_path, monkeypatch, capsys):
    # The scan has no data-free part: nothing checked is no clean bill.
    monkeypatch.chdir(tmp_path)
    config = zoo.shipped_config('retinanet_r50')
    assert main(['scan', config, '--no-progress']) == 2
    assert re.match(re.escape(
        'mmnan scan: error: cannot build the train dataset of {}: '.format(
            config)) + WHY + re.escape(
                '; nothing checked: run where the data is\n') + '$',
        capsys.readouterr().err)
