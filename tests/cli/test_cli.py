"""The ``mmnan`` command line, run the way a user runs it: a fresh process
(``python -m mmnanhook``) on bundles written by real training runs and on
real datasets.

Bundles come from a real Runner training the toy models of
:mod:`replay_toys`; their configs import that module by ``custom_imports``,
which the fresh process finds on its PYTHONPATH as it would a user's project.
The demos have tests of their own in ``test_demo.py``.
"""
import inspect
import io
import json
import os
import os.path as osp
import re
import subprocess
import sys
import sysconfig

import cv2
import numpy as np
import pytest
import torch

from mmnanhook import compat
from mmnanhook.bundle import load_bundle
from mmnanhook.quarantine import read_quarantine
from mmnanhook.memory import capture_rng, restore_rng
from mmnan_testing import cpu_amp  # noqa: F401 - registers its wrappers
from mmnan_testing import testbed
from mmnan_testing.bundles import (CORRUPTIONS, copy_bundle,
                                       drop_listed_file, replace_listed_file)
from mmnan_testing.cli import (BATCH, PROJECT_DIR, assert_bad_input,
                                   assert_same_report, mmnan, replay_json,
                                   run_report, toy_config, train_to_bundle)

if PROJECT_DIR not in sys.path:
    sys.path.insert(0, PROJECT_DIR)
import replay_toys  # noqa: E402 - the project module, found on that path


def _line_of(module, marker):
    """``file:line`` of the line of ``module`` ending in ``# MARK marker``."""
    lines, _ = inspect.findsource(module)
    hits = [i + 1 for i, text in enumerate(lines)
            if text.rstrip().endswith('# MARK ' + marker)]
    assert len(hits) == 1, marker
    return '{}:{}'.format(inspect.getsourcefile(module), hits[0])


# -- bundles of real runs ----------------------------------------------------


def _first_keep(rng_state):
    """Which samples the first draw of RandomSubsetRegressor keeps when the
    RNGs are in ``rng_state``."""
    saved = capture_rng()
    try:
        restore_rng(rng_state)
        return (torch.rand(BATCH) < replay_toys.KEEP_PROB).tolist()
    finally:
        restore_rng(saved)


@pytest.fixture(scope='module')
def subset_bundle(tmp_path_factory):
    """Bundle of a run whose fault depends only on the RNG in the forward."""
    work_dir = str(tmp_path_factory.mktemp('subset'))
    error = train_to_bundle(toy_config(work_dir, 'RandomSubsetRegressor'))
    # Earlier iterations were finite: data and weights are not the cause.
    assert error.iter > 0
    return error.bundle


# -- replay ------------------------------------------------------------------


@pytest.mark.parametrize('flags', [[], ['--fp32']], ids=['default', 'fp32'])
def test_replay_reproduces_an_rng_dependent_fault_in_a_fresh_process(
        subset_bundle, flags):
    # The saved RNG state is what failed: from it the draw keeps no sample.
    assert not any(_first_keep(load_bundle(subset_bundle).load('rng')))
    code, report = replay_json(subset_bundle, *flags)
    assert code == 0
    assert_same_report(report, run_report(subset_bundle))
    assert report['kind'] == 'forward'
    assert report['location'] == _line_of(replay_toys, 'empty-mean')
    assert report['nonfinite_losses'] == ['loss_subset']


def test_replay_that_comes_out_finite_exits_3(subset_bundle, tmp_path):
    # The same weights and batch with another RNG state, from which the draw
    # keeps a sample (a correctly re-hashed bundle, so it loads).
    bundle = copy_bundle(subset_bundle, tmp_path)
    saved = capture_rng()
    torch.manual_seed(0)
    other = capture_rng()
    restore_rng(saved)
    assert any(_first_keep(other))
    data = io.BytesIO()
    torch.save(other, data)
    replace_listed_file(bundle, 'rng.pth', data.getvalue())

    result = mmnan('replay', bundle)
    assert result.returncode == 3, result.stderr
    assert 'not_reproduced' in result.stdout
    assert 'bundle: {}'.format(bundle) in result.stdout


@pytest.mark.skipif(
    compat.cpu_grad_scaler() is None
    or compat.autocast('cpu', torch.bfloat16) is None,
    reason='needs bfloat16 autocast and a GradScaler on CPU (torch >= 2.3) '
    'to train under AMP without a GPU')
def test_fp32_replay_of_an_autocast_only_failure_is_finite(tmp_path):
    error = train_to_bundle(toy_config(
        str(tmp_path), 'MinMaxScaledRegressor',
        optim_wrapper=dict(type='CpuAmpOptimWrapper',
                           optimizer=dict(type='SGD', lr=0.01))))
    original = run_report(error.bundle)
    assert original['amp_dtype'] == 'bfloat16'

    code, report = replay_json(error.bundle)
    assert code == 0
    assert_same_report(report, original)
    assert report['location'] == _line_of(replay_toys, 'span')

    code, report = replay_json(error.bundle, '--fp32')
    assert code == 3
    assert report['kind'] == 'not_reproduced'
    assert report['amp_dtype'] is None


# -- inspect -----------------------------------------------------------------


def test_inspect_shows_the_manifest_and_the_report(subset_bundle):
    result = mmnan('inspect', subset_bundle)
    assert result.returncode == 0, result.stderr
    with open(osp.join(subset_bundle, 'manifest.json')) as f:
        manifest = json.load(f)
    report = run_report(subset_bundle)
    lines = result.stdout.splitlines()
    for key in ('iter', 'epoch', 'rank', 'world_size', 'trigger', 'created'):
        assert '{:<11} {}'.format(key + ':', manifest[key]) in lines, key
    for name in manifest['nonfinite_losses']:
        assert name in result.stdout
    for entry in manifest['files']:
        assert '{} ({} B)'.format(entry['name'],
                                  entry['size']) in result.stdout
    assert manifest['versions']['torch'] in result.stdout
    assert report['kind'] in result.stdout
    assert report['summary'] in result.stdout


def test_inspect_html_prints_the_path_of_report_html(subset_bundle,
                                                     tmp_path):
    result = mmnan('inspect', '--html', subset_bundle)
    assert result.returncode == 0, result.stderr
    path = result.stdout.strip()
    assert path == osp.abspath(osp.join(subset_bundle, 'report.html'))
    with open(path) as f:
        assert run_report(subset_bundle)['summary'] in f.read()
    older = copy_bundle(subset_bundle, tmp_path)
    drop_listed_file(older, 'report.html')
    assert_bad_input(mmnan('inspect', '--html', older), 'inspect',
                     '{} has no report.html'.format(older))


# -- bad input: exit 2, one line, no traceback -------------------------------


def _garbage_data_batch(path):
    # Listed with the right size and sha256: only unpickling fails.
    replace_listed_file(path, 'data_batch.pth', b'not a torch file')
    return path


# case -> (command, make the bad path from a good copy, expected message
# with {bundle}, {manifest}, {model}, {report}, importable custom module)
BAD_INPUT = dict(
    (case, ('replay', ) + CORRUPTIONS[case] + (True, ))
    for case in ('missing path', 'truncated manifest', 'missing file',
                 'truncated file', 'sha256 mismatch'))
BAD_INPUT.update({
    'foreign dir': ('inspect', ) + CORRUPTIONS['foreign dir'] + (True, ),
    'unknown format_version':
    ('inspect', ) + CORRUPTIONS['unknown format_version'] + (True, ),
    'unloadable torch file': ('replay', _garbage_data_batch,
                              'cannot load {bundle}/data_batch.pth', True),
    'custom module not importable':
    ('replay', lambda p: p,
     'cannot rebuild the model of {bundle}: ImportError', False),
})


@pytest.mark.parametrize('case', sorted(BAD_INPUT))
def test_bad_input_exits_2_with_one_line(subset_bundle, tmp_path, case):
    command, corrupt, expected, importable = BAD_INPUT[case]
    good = copy_bundle(subset_bundle, tmp_path)
    result = mmnan(command, corrupt(good), importable=importable)
    assert_bad_input(result, command, expected.format(
        bundle=good, manifest=osp.join(good, 'manifest.json'),
        model=osp.join(good, 'model.pth'),
        report=osp.join(good, 'report.json')))
    if case == 'custom module not importable':
        assert 'replay_toys' in result.stderr


# -- scan --------------------------------------------------------------------


def _scan(config, data, tmp_path, *flags):
    """``mmnan scan`` of a tiny config pointed at ``data``, dumped to a file.
    """
    cfg = testbed.tiny_config(config, data, str(tmp_path / 'run'))
    path = str(tmp_path / 'config.py')
    cfg.dump(path)
    return mmnan('scan', path, *flags)


def _flagged(stdout):
    """Image file names of the samples scan listed."""
    return sorted(osp.basename(path) for path in re.findall(
        r'^sample \d+ (.+):$', stdout, re.MULTILINE))


def _summary(stdout):
    return re.search(r'^scanned (\d+) samples: (\d+) with invalid ground '
                     r'truth$', stdout, re.MULTILINE).groups()


@pytest.mark.parametrize('config,defects', [
    pytest.param('retinanet_voc', {1: 'zero_size', 3: 'tiny', 4: 'outside',
                                   6: 'inverted'},
                 marks=pytest.mark.mmdet, id='voc'),
    pytest.param('rotated_retinanet', {1: 'zero_size', 3: 'tiny',
                                       4: 'outside', 6: 'collinear'},
                 marks=pytest.mark.mmrotate, id='dota'),
])
def test_scan_names_exactly_the_bad_images(tmp_path, config, defects):
    data = testbed.make_dataset(config, str(tmp_path / 'data'),
                                num_images=8, defects=defects)
    # A clean sample whose image file is gone: its pipeline raises, which
    # is listed too and does not stop the scan.
    assert 2 not in defects
    missing = data['images'][2]
    os.remove(osp.join(data['img_dir'], missing))
    listed = str(tmp_path / 'quarantine.json')
    result = _scan(config, data, tmp_path, '--quarantine', listed)
    assert result.returncode == 1, result.stdout + result.stderr
    # A 'tiny' box (1 px) is valid: that image must not be listed.
    bad = sorted([d['image'] for d in data['defects'] if d['kind'] != 'tiny']
                 + [missing])
    assert _flagged(result.stdout) == bad
    assert '    the pipeline failed: FileNotFoundError' in result.stdout
    assert _summary(result.stdout) == ('8', str(len(bad)))
    # The same samples as a quarantine list a run can start from.
    samples = read_quarantine(listed, 8)
    assert sorted(osp.basename(s.file) for s in samples) == bad
    assert all(s.source == 'scan' and s.reason for s in samples)
    printed = re.findall(r'^sample (\d+) (.+):$', result.stdout, re.MULTILINE)
    assert [(s.indices, s.file) for s in samples] == [
        ([int(index)], path) for index, path in printed]
    assert 'quarantine list of %d samples: %s' % (len(bad), listed) in \
        result.stdout


@pytest.mark.parametrize('config,defect', [
    pytest.param('retinanet_voc', 'zero_size', marks=pytest.mark.mmdet,
                 id='voc'),
    pytest.param('rotated_retinanet', 'collinear', marks=pytest.mark.mmrotate,
                 id='dota'),
])
def test_scan_show_writes_the_pictures_of_every_flagged_sample(
        tmp_path, config, defect):
    data = testbed.make_dataset(config, str(tmp_path / 'data'),
                                num_images=6, defects={1: defect, 4: defect})
    show = str(tmp_path / 'pictures')
    result = _scan(config, data, tmp_path, '--show', show)
    assert result.returncode == 1, result.stdout + result.stderr
    # Dataset index -> image (DOTADataset globs its files: not data's order).
    flagged = dict((int(i), path) for i, path in re.findall(
        r'^sample (\d+) (.+):$', result.stdout, re.MULTILINE))
    assert len(flagged) == 2
    expected = sorted('sample{}_{}.png'.format(i, view) for i in flagged
                      for view in ('input', 'file'))
    assert sorted(os.listdir(show)) == expected
    printed = re.findall(r'^    picture: (\S+)$', result.stdout, re.MULTILINE)
    assert sorted(osp.basename(p) for p in printed) == expected
    for name in expected:
        image = cv2.imread(osp.join(show, name), cv2.IMREAD_COLOR)
        assert image is not None and image.std() > 10, name
    # The offending box drawn on the pipeline's output in the drawing's red
    # (30, 30, 230): where the picture differs from the image file (the
    # pipeline resizes, and may flip it either way), there is that red.
    for i in flagged:
        drawn = cv2.imread(osp.join(show, 'sample{}_input.png'.format(i)))
        raw = cv2.resize(cv2.imread(flagged[i]),
                         drawn.shape[1::-1], interpolation=cv2.INTER_NEAREST)
        diff = min((np.abs(base.astype(int) - drawn.astype(int)).max(axis=2)
                    for base in (raw, raw[:, ::-1], raw[::-1],
                                 raw[::-1, ::-1])),
                   key=lambda d: d.mean())
        changed = diff > 40
        assert changed.mean() < 0.1, i
        red = changed & (np.abs(drawn.astype(int) - (30, 30, 230)) <= 25).all(
            axis=2)
        assert red.sum() > 20, i


def _declare_size(data, image, factor):
    """Make the COCO annotation of ``image`` declare a ``factor`` times
    larger image than the file is, as annotations made at another
    resolution do."""
    with open(data['ann_file']) as f:
        coco = json.load(f)
    (info, ) = [i for i in coco['images'] if i['file_name'] == image]
    info['width'] *= factor
    info['height'] *= factor
    with open(data['ann_file'], 'w') as f:
        json.dump(coco, f)


@pytest.mark.mmdet
def test_scan_of_coco_lists_only_bad_boxes_that_survive_loading(tmp_path):
    data = testbed.make_dataset(
        'retinanet', str(tmp_path / 'data'), num_images=8,
        defects={1: 'zero_size', 3: 'tiny', 4: 'outside', 6: 'inverted'})
    # CocoDataset drops, when loading, the boxes under 1 px or without
    # overlap with the image size the annotation declares: the zero-size,
    # inverted and outside ones never reach the loss. Declared twice as
    # large as the file, the image keeps its outside box through loading.
    (outside, ) = [d['image'] for d in data['defects']
                   if d['kind'] == 'outside']
    _declare_size(data, outside, 2)
    result = _scan('retinanet', data, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert _flagged(result.stdout) == [outside]
    assert _summary(result.stdout) == ('8', '1')


@pytest.mark.parametrize('config', [
    pytest.param('retinanet', marks=pytest.mark.mmdet, id='coco'),
    pytest.param('retinanet_voc', marks=pytest.mark.mmdet, id='voc'),
])
def test_scan_lists_every_image_whose_declared_size_differs(tmp_path,
                                                           config):
    data = testbed.make_dataset(config, str(tmp_path / 'data'), num_images=8,
                                defects={2: 'size_mismatch'})
    result = _scan(config, data, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    # The image whose box lay beyond the real border, and the cause first.
    assert _flagged(result.stdout) == [data['images'][2]]
    lines = result.stdout.splitlines()
    first = lines[lines.index([l for l in lines if l.startswith('sample ')][0])
                  + 1]
    assert first.strip().startswith(
        'the annotation declares the image 128x64 (width x height) but the '
        'file is 64x64 as loaded')
    assert 'has zero width' in result.stdout
    if config == 'retinanet':
        # Declared larger, with every box inside the file: still listed.
        _declare_size(data, data['images'][5], 2)
        result = _scan(config, data, tmp_path)
        assert _flagged(result.stdout) == [data['images'][2],
                                           data['images'][5]]
        assert 'declares the image 128x128' in result.stdout


@pytest.mark.parametrize('config', [
    pytest.param('retinanet', marks=pytest.mark.mmdet, id='coco'),
    pytest.param('rotated_retinanet', marks=pytest.mark.mmrotate, id='dota'),
])
def test_scan_of_a_clean_dataset_exits_0(tmp_path, config):
    data = testbed.make_dataset(config, str(tmp_path / 'data'), num_images=8)
    result = _scan(config, data, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _flagged(result.stdout) == []
    assert _summary(result.stdout) == ('8', '0')


# case -> (config text, None: no file; the error the message names)
BAD_CONFIGS = {
    'missing': (None, 'FileNotFoundError'),
    'custom module not importable':
    ("custom_imports = dict(imports=['no_such_module'])\n", 'ImportError'),
}


@pytest.mark.parametrize('case', sorted(BAD_CONFIGS))
def test_scan_of_a_bad_config_exits_2(tmp_path, case):
    text, error = BAD_CONFIGS[case]
    path = str(tmp_path / 'config.py')
    if text is not None:
        with open(path, 'w') as f:
            f.write(text)
    result = mmnan('scan', path)
    assert_bad_input(result, 'scan', 'cannot build the train dataset of '
                     '{}: {}'.format(path, error))


# -- entry points ------------------------------------------------------------


def test_python_m_help_lists_the_commands():
    result = mmnan('--help')
    assert result.returncode == 0, result.stderr
    for command in ('replay', 'inspect', 'scan', 'demo'):
        assert command in result.stdout


def test_mmnan_console_script_is_installed():
    script = osp.join(sysconfig.get_path('scripts'), 'mmnan')
    assert osp.isfile(script), script
    result = subprocess.run([script, 'replay', '--help'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            universal_newlines=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('usage: mmnan replay')
    for flag in ('--device', '--fp32', '--json'):
        assert flag in result.stdout
