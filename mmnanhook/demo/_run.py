"""``mmnan demo``: the whole tool on a real tiny detector, end to end.

A synthetic dataset gets one planted defect that reaches the loss through
the real dataset class and pipeline; a tiny detector trains with
NanDetectHook until the hook stops it.  Everything printed comes from what
the hook found; nothing here knows the expected answer.

The console tells the story (training lines, the stop, the diagnosis, where
the bundle is); MMEngine's config dump and hook table go to the full log in
the work directory only.
"""
from __future__ import annotations

import contextlib
import glob
import io
import logging
import os.path as osp
import sys
import tempfile
from typing import Any, Dict, Optional

from ..errors import NonFiniteError
from ..records import Report
from ._tiny import make_dataset, tiny_config

# dota? -> (tiny config, defect planted, how that defect reaches the loss)
_SETUPS = {
    False: ('retinanet_voc', 'zero_size',
            'a custom VOC-style XML dataset (mmdet XMLDataset keeps zero-size '
            'boxes unless filter_cfg.bbox_min_size is set)'),
    True: ('rotated_retinanet', 'collinear',
           'DOTA-format labelTxt (DOTA polygons are not size-filtered; a '
           'collinear polygon becomes a degenerate rotated box)'),
}

NUM_IMAGES = 8
DEFECT_IMAGE = 5
MAX_ITERS = 12


def _say(text=''):
    print(text, flush=True)


def demo_dataset(dota: bool, root: str) -> Dict[str, Any]:
    """Write the synthetic dataset of a demo, with its one planted defect.

    Args:
        dota (bool): The DOTA demo's dataset instead of the mmdet one's.
        root (str): Directory to write into.

    Returns:
        dict: The generator's description of what it wrote (see
        :mod:`mmnanhook.demo.synthetic`), ``defects`` and ``defect_images``
        included.
    """
    config, defect, _ = _SETUPS[bool(dota)]
    return make_dataset(config, root, num_images=NUM_IMAGES,
                                defects={DEFECT_IMAGE: defect})


class _Story(logging.Filter):
    """Lets through the training lines, mmnanhook's lines and warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return (record.levelno >= logging.WARNING
                or message.startswith(('Iter(', 'Epoch('))
                or message.startswith('mmnanhook'))


def _quiet_runner(cfg):
    """A Runner whose console shows only :class:`_Story`'s lines.

    MMLogger's console handler takes ``sys.stdout`` when it is made, in the
    Runner's constructor, which also logs the config and the environment:
    made against a buffer, then pointed back at the console.
    """
    from mmengine.runner import Runner
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        runner = Runner.from_cfg(cfg)
    for handler in runner.logger.handlers:
        if getattr(handler, 'stream', None) is buffer:
            handler.setStream(sys.stdout)
            handler.addFilter(_Story())
            handler.setFormatter(logging.Formatter('%(message)s'))
    return runner


def _where_it_is(error, runner):
    bundle = error.bundle
    _say('== bundle:   {}'.format(bundle))
    _say('   report:   {}'.format(osp.join(bundle, 'report.html')))
    for picture in sorted(glob.glob(osp.join(bundle, 'sample*.png'))):
        _say('   picture:  {}'.format(picture))
    _say('   plot:     {}'.format(osp.join(bundle, 'history.png')))
    _say('   replay:   mmnan replay {}'.format(bundle))
    _say('   inspect:  mmnan inspect {}  (--open: the report in a '
         'browser)'.format(bundle))
    _say('   full log: {}'.format(
        osp.join(runner.log_dir, runner.timestamp + '.log')))


def run_demo(dota: bool = False, work_dir: Optional[str] = None) -> int:
    """Run the demo; returns the exit code (0 when the hook caught it).

    Args:
        dota (bool): mmrotate rotated RetinaNet on DOTA data instead of mmdet
            RetinaNet on VOC-style data.
        work_dir (str, optional): Where data, logs and bundles go; a new
            temporary directory by default.
    """
    config, defect, why = _SETUPS[bool(dota)]
    work_dir = work_dir or tempfile.mkdtemp(prefix='mmnan_demo_')
    data = demo_dataset(dota, osp.join(work_dir, 'data'))
    dump_dir = osp.join(work_dir, 'nan_dumps')
    cfg = tiny_config(
        config, data, osp.join(work_dir, 'run'), max_iters=MAX_ITERS,
        custom_hooks=[dict(type='NanDetectHook', dump_dir=dump_dir)])
    _say('== mmnanhook demo: tiny {} on {}'.format(config, why))
    _say('   data:     {}'.format(data['data_root']))
    _say('   planted:  a {!r} defect in one of {} images (the tool is not '
         'told which)'.format(defect, NUM_IMAGES))
    _say('   training up to {} iterations with NanDetectHook ...'.format(
        MAX_ITERS))
    _say()
    runner = _quiet_runner(cfg)
    try:
        runner.train()
    except NonFiniteError as error:
        _say()
        _say('== NanDetectHook stopped training at iter {}, before the '
             'optimizer step:'.format(error.iter))
        report = error.report or {}
        _say('   ' + (report.get('summary') or str(error).splitlines()[-1]))
        fix = Report.from_dict(report).verified_fix()
        if fix is not None:
            _say('   verified fix (the failing iteration replayed with it is '
                 'finite): ' + fix.fix)
        if error.bundle:
            _where_it_is(error, runner)
        return 0
    _say('== training finished without a trigger: the planted defect never '
         'reached the loss in {} iterations'.format(MAX_ITERS))
    return 1
