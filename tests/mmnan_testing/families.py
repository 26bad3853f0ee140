"""One shipped config per model family (a directory of
``<package>/.mim/configs``), for the zoo-wide drill
(tests/zoo/test_zoo_drill.py; ``python -m mmnan_testing.families`` drills
them all).

A family's config is chosen by rule, not by hand: a train config on COCO or
VOC (mmdet) or DOTA (mmrotate), a ResNet-50 or tiny model and the 1x
schedule where there is one, else the shortest name. Families that cannot
be drilled here say why (:data:`NOT_HERE`); docs/compatibility.md lists
them with the results.
"""
import importlib
import os
import os.path as osp
import re

# Directories of configs that are no model family.
NOT_FAMILIES = ('_base_', 'common', 'misc', 'legacy_1.x')
# The datasets a package's drill config may train on, by file name.
_DATA = {'mmdet': re.compile(r'(coco|voc0712)(?!.*panoptic)'),
         'mmrotate': re.compile(r'dota')}
# Families no config of which trains on COCO/VOC/DOTA detection, or whose
# config does not train here without mmnanhook either (seen in the sweep of
# docs/compatibility.md): why, per package. A family missing here that
# fails the drill is a finding, not an exclusion.
NOT_HERE = {
    'mmdet': {
        'albu_example': 'albumentations is not installed in the leg',
        'boxinst': 'scikit-image is not installed in the leg (its data '
                   'preprocessor needs it)',
        'carafe': "mmcv's CARAFE op has no CPU implementation",
        'cascade_rpn': 'its config does not build in mmdet 3.3.0 '
                       '(CascadeRPNHead: num_classes missing)',
        'centripetalnet': 'too slow for a CPU here: HourglassNet-104, 4.5 '
                          'min a clean run of 3 iterations at 320 px, its '
                          "diagnosis's replays over 13 min",
        'convnext': 'needs mmpretrain, not in the leg',
        'cornernet': 'too slow for a CPU here: HourglassNet-104, as '
                     'centripetalnet',
        'dcn': "mmcv's deform_roi_pool has no CPU implementation",
        'dcnv2': "mmcv's deform_roi_pool has no CPU implementation",
        'simple_copy_paste': "mmcv's SyncBN needs a process group even on "
                             'one process (a drill under a launcher would)',
        'strong_baselines': "mmcv's SyncBN needs a process group even on "
                            'one process (a drill under a launcher would)',
        'tridentnet': 'not clean here: at 320 px from random weights its '
                      'loss goes NaN in iteration 2 without mmnanhook (which '
                      'catches it)',
        'bytetrack': 'video tracking (MOT17), no COCO train config',
        'cityscapes': 'Cityscapes only',
        'crowddet': 'CrowdHuman only',
        'deepfashion': 'DeepFashion only',
        'deepsort': 'video tracking, no train config',
        'dsdl': 'DSDL-format data only',
        'glip': 'grounding: text encoder weights (BERT) downloaded',
        'grounding_dino': 'grounding: text encoder weights (BERT) downloaded',
        'mm_grounding_dino': 'grounding: text encoder weights (BERT) '
                             'downloaded',
        'lvis': 'LVIS only',
        'lad': "its teacher's checkpoint downloaded",
        'ld': "its teacher's checkpoint downloaded",
        'mask2former_vis': 'video instance segmentation (YouTube-VIS)',
        'masktrack_rcnn': 'video instance segmentation (YouTube-VIS)',
        'objects365': 'Objects365 only',
        'ocsort': 'video tracking, no train config',
        'openimages': 'OpenImages only',
        'qdtrack': 'video tracking (MOT17)',
        'reid': 'person re-identification (MOT17 crops)',
        'sort': 'video tracking, no train config',
        'strongsort': 'video tracking, no train config',
        'timm_example': 'needs timm (not in the legs)',
        'v3det': 'V3Det only',
        'wider_face': 'WIDER FACE only',
        'selfsup_pretrain': 'self-supervised backbone weights downloaded',
        'soft_teacher': 'semi-supervised: labeled and unlabeled COCO splits',
        'panoptic_fpn': 'COCO panoptic annotations (no synthetic stand-in)',
        'pvt': 'its config by the rule (retinanet_pvt-l) is an AMP config: '
               'AmpOptimWrapper needs a GPU',
        'maskformer': 'COCO panoptic annotations (no synthetic stand-in)',
        'mask2former': 'COCO panoptic annotations (no synthetic stand-in)',
    },
    'mmrotate': {
        'cfa': "mmcv's convex_iou has no CPU implementation",
        'oriented_reppoints': "mmcv's convex_iou has no CPU implementation",
        'convnext': 'needs mmcls (mmpretrain 0.x), not in the leg',
        'csl': 'an AMP config: AmpOptimWrapper needs a GPU',
        'psc': 'uses torch.pi, which torch 1.7 lacks',
        'redet': "mmcv's riroi_align_rotated has no CPU implementation",
        'rotated_atss': "mmcv's diff_iou_rotated has no CPU implementation",
        'rotated_fcos': "mmcv's diff_iou_rotated has no CPU implementation",
        'rotated_reppoints': "mmcv's convex_iou has no CPU implementation",
        'rotated_rtmdet': "mmcv's diff_iou_rotated has no CPU "
                          'implementation',
    },
}


def _score(name):
    small = 'r50' in name or 'tiny' in name
    return (not small, '1x' not in name, len(name), name)


def config_root(package):
    """``<package>/.mim/configs`` of an installed package."""
    module = importlib.import_module(package)
    return osp.join(osp.dirname(module.__file__), '.mim', 'configs')


def families(package):
    """``[(family, config path or None, why not)]`` of ``package``, sorted by
    family: the config the drill trains, or why none is drilled here."""
    root = config_root(package)
    found = []
    for family in sorted(os.listdir(root)):
        where = osp.join(root, family)
        if family in NOT_FAMILIES or not osp.isdir(where):
            continue
        why = NOT_HERE[package].get(family)
        names = sorted((n for n in os.listdir(where)
                        if _DATA[package].search(n)), key=_score)
        if why is None and not names:
            why = 'no {} train config'.format(
                'COCO or VOC' if package == 'mmdet' else 'DOTA')
        found.append((family, None if why else osp.join(where, names[0]),
                      why))
    return found


def drill(config, work_dir, *args, **kwargs):
    """``mmnan drill CONFIG --work-dir WORK_DIR ARGS --json`` in a fresh
    process: ``(exit code, the drill's JSON or None, stderr)``."""
    import json

    from .cli import mmnan
    # A whole drill of an R50 family takes 1-6 min here, DETRs and
    # TridentNet 10.
    result = mmnan('drill', config, '--work-dir', work_dir, '--json', *args,
                   timeout=1800, **kwargs)
    try:
        found = json.loads(result.stdout)
    except ValueError:
        found = None
    return result.returncode, found, result.stderr


# A user's own classes, none of them COCO's, VOC's or DOTA's.
OWN_CLASSES = ('balloon', 'kangaroo', 'fish')


def own_classes_child(directory, base, head='bbox_head', classes=OWN_CLASSES,
                      policy='drop', data_root='/nonexistent/own_data/'):
    """The commonest config there is, written into ``directory``: a child of
    ``base`` (a path, or ``mmdet::...``) with its own ``classes`` on the
    train dataset, as many in the model's ``head``, a ``data_root`` that is
    not on this machine and ``policy`` in ``default_hooks``; its path."""
    path = osp.join(str(directory), 'own_classes.py')
    with open(path, 'w') as f:
        f.write('\n'.join([
            '_base_ = {!r}'.format(base),
            'classes = {!r}'.format(tuple(classes)),
            'train_dataloader = dict(dataset=dict(',
            '    data_root={!r}, metainfo=dict(classes=classes)))'.format(
                data_root),
            'model = dict({}=dict(num_classes={}))'.format(head,
                                                           len(classes)),
            'default_hooks = dict(nan_detect=dict(',
            "    type='mmnanhook.NanDetectHook', policy={!r}))".format(policy),
            '']))
    return path


def first_failure(found):
    """``'<run> <check>: <detail>'`` of a drill's first check that does not
    hold, or ``None``."""
    for verdict in (found or {}).get('verdicts', []):
        for check in verdict['checks']:
            if not check['ok']:
                return '{} {}: {}'.format(verdict['run'], check['name'],
                                          check['detail'])
    return None


def main(argv=None):
    """``python -m mmnan_testing.families PACKAGE OUT [FAMILY...]``: drill
    every family of ``PACKAGE`` (or those named), one JSON line each in
    ``OUT`` (the lines of docs/compatibility.md's table come from it)."""
    import json
    import shutil
    import sys
    import tempfile
    import time
    package, out = (argv or sys.argv[1:])[:2]
    wanted = (argv or sys.argv[1:])[2:]
    for family, config, why in families(package):
        if wanted and family not in wanted:
            continue
        line = dict(package=package, family=family, why_not=why,
                    config=config and osp.relpath(config,
                                                  config_root(package)))
        if config is not None:
            work_dir = tempfile.mkdtemp(prefix='drill_' + family)
            start = time.monotonic()
            code, found, stderr = drill(config, work_dir)
            said = (stderr.strip().splitlines() or [''])[-1]
            line.update(code=code, seconds=round(time.monotonic() - start),
                        failure=first_failure(found) or said[:300])
            shutil.rmtree(work_dir, ignore_errors=True)
        with open(out, 'a') as f:
            f.write(json.dumps(line) + '\n')


def row(line):
    """docs/compatibility.md's line of one family's drill (a JSON line of
    :func:`main`)."""
    config = '`{}`'.format(line['config']) if line['config'] else '—'
    if line['why_not']:
        result = 'not drilled here: ' + line['why_not']
    elif line['code'] == 0:
        result = 'holds ({} s)'.format(line['seconds'])
    elif (line['failure'] or '').startswith('clean trains: without'):
        result = 'does not train here: ' + line['failure'].split(
            'without mmnanhook: ', 1)[1]
    else:
        result = 'FAILS: ' + (line['failure'] or 'exit {}'.format(
            line['code']))
    return '| {} | {} | {} |'.format(
        line['family'], config, result.replace('|', '/'))


if __name__ == '__main__':
    main()
