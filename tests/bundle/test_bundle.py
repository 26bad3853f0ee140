"""The replay bundle: round trip, strict JSON, atomicity, retention, errors,
the history plot."""
import json
import logging
import os
import os.path as osp
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from mmengine.structures import BaseDataElement, InstanceData
from mmengine.utils import digit_version

from mmnanhook.bundle import (FORMAT_VERSION, bundle_name, load_bundle,
                              to_strict_json, versions, write_bundle)
from mmnanhook.compat import TORCH_VERSION
from mmnanhook.errors import BundleError
from mmnan_testing.bundles import CORRUPTIONS
from mmnanhook.bundle import plot_history
from mmnanhook.memory import History
from mmnanhook.memory import capture_rng, restore_rng

PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'
REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


def _run_script(tmp_path, source, *args):
    """Run ``source`` in a fresh python that imports this checkout."""
    script = tmp_path / 'script.py'
    script.write_text(source)
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        [REPO] + [p for p in [env.get('PYTHONPATH')] if p])
    return subprocess.run([sys.executable, str(script)] + list(args),
                          cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)


def _reject_constant(token):
    raise ValueError('non-strict JSON token {}'.format(token))


def _strict_load(path):
    with open(path) as f:
        return json.loads(f.read(), parse_constant=_reject_constant)


@pytest.fixture
def logger(caplog):
    caplog.set_level(logging.INFO, logger='test_bundle')
    return logging.getLogger('test_bundle')


def _data_batch():
    """A raw batch shaped like mmdet's: uint8 images and data samples whose
    metainfo holds numpy arrays (what torch>=2.6 refuses to load by
    default)."""
    sample = BaseDataElement(metainfo=dict(
        img_path='data/images/img_0007.jpg',
        ori_shape=(40, 48),
        scale_factor=np.array([1.5, 1.25], dtype=np.float32)))
    sample.gt_instances = InstanceData(
        bboxes=torch.tensor([[0., 0., 10., 10.], [5., 5., 5., 20.]]),
        labels=torch.tensor([1, 2]))
    return {
        'inputs': [torch.randint(0, 255, (3, 40, 48), dtype=torch.uint8)],
        'data_samples': [sample],
    }


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _history(fail_iter):
    history = History(maxlen=200)
    for it in range(max(fail_iter - 5, 0), fail_iter):
        history.append(it, loss=1.0 / (it + 1), grad_norm=2.0 + it,
                       lr=0.01, loss_scale=None)
    history.append(fail_iter, loss=float('nan'), grad_norm=float('inf'),
                   lr=0.01)
    return history.records()


def _manifest(iter=7, rank=0):
    return {
        'iter': iter,
        'epoch': 0,
        'rank': rank,
        'world_size': 1,
        'trigger': 'loss',
        'losses': {'loss_cls': np.float32('nan'), 'loss_bbox': 0.5},
        'nonfinite_losses': ['loss_cls'],
        'grad_norm': torch.tensor(float('inf')),
        'nonfinite_grads': {'names': ['0.weight'], 'total': 1},
    }


def _write(dump_dir, name='bundle', iter=7, rank=0, tensors=None,
           max_dumps=5, logger=None):
    model, optimizer = _model_and_optimizer()
    if tensors is None:
        tensors = {
            'data_batch': _data_batch(),
            'model': model.state_dict(),
            'optimizer': optimizer.state_dict(),
            'rng': capture_rng(),
        }
    return write_bundle(
        str(dump_dir), name, _manifest(iter, rank), tensors,
        texts={'config.py': "model = dict(type='RetinaNet')\n",
               'report.txt': 'kind: data\n'},
        report={'kind': 'data', 'summary': 'zero-size GT box',
                'loss': float('-inf'), 'samples': [{'index': 0}]},
        history_records=_history(iter), max_dumps=max_dumps, logger=logger)


def test_round_trip(tmp_path):
    model, optimizer = _model_and_optimizer()
    batch = _data_batch()
    rng = capture_rng()
    expected_draws = (torch.rand(4), np.random.rand(4), random.random())
    path = write_bundle(
        str(tmp_path), 'b1', _manifest(), {
            'data_batch': batch,
            'model': model.state_dict(),
            'optimizer': optimizer.state_dict(),
            'rng': rng,
        },
        texts={'config.py': 'lr = 0.02\n'},
        report={'kind': 'data', 'summary': 'one line'},
        history_records=_history(7))
    assert path == osp.join(str(tmp_path), 'b1')

    bundle = load_bundle(path, load=('data_batch', ))
    manifest = bundle.manifest
    assert manifest['format_version'] == FORMAT_VERSION
    assert manifest['losses'] == {'loss_cls': 'nan', 'loss_bbox': 0.5}
    assert manifest['grad_norm'] == 'inf'
    assert manifest['versions']['torch'] == str(torch.__version__)
    assert sorted(bundle.files) == sorted(
        name for name in os.listdir(path) if name != 'manifest.json')
    assert {'data_batch.pth', 'model.pth', 'optimizer.pth', 'rng.pth',
            'config.py', 'report.json', 'history.json',
            'history.png'} == set(bundle.files)
    assert bundle.report == {'kind': 'data', 'summary': 'one line'}
    assert bundle.text('config.py') == 'lr = 0.02\n'

    loaded = bundle.load('data_batch')
    sample = loaded['data_samples'][0]
    assert isinstance(sample, BaseDataElement)
    assert isinstance(sample.gt_instances, InstanceData)
    assert sample.img_path == 'data/images/img_0007.jpg'
    np.testing.assert_array_equal(sample.scale_factor,
                                  batch['data_samples'][0].scale_factor)
    assert torch.equal(sample.gt_instances.bboxes,
                       batch['data_samples'][0].gt_instances.bboxes)
    assert torch.equal(loaded['inputs'][0], batch['inputs'][0])
    for key, value in model.state_dict().items():
        assert torch.equal(bundle.load('model')[key], value)
    momentum = bundle.load('optimizer')['state'][0]['momentum_buffer']
    assert torch.equal(momentum, optimizer.state_dict()['state'][0][
        'momentum_buffer'])

    restore_rng(bundle.load('rng'))
    draws = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(draws[0], expected_draws[0])
    np.testing.assert_array_equal(draws[1], expected_draws[1])
    assert draws[2] == expected_draws[2]

    with open(osp.join(path, 'history.png'), 'rb') as f:
        assert f.read(8) == PNG_SIGNATURE
    assert _strict_load(osp.join(path, 'history.json'))[-1]['loss'] == 'nan'
    for name in ('manifest.json', 'report.json'):
        _strict_load(osp.join(path, name))


def test_torch_files_are_zip_and_need_an_allowlist(tmp_path):
    import zipfile
    path = _write(tmp_path)
    data_file = osp.join(path, 'data_batch.pth')
    assert zipfile.is_zipfile(data_file)
    # Why a bundle loads with its own allowlist: the weights_only default of
    # torch>=2.6 rejects the numpy metainfo of data samples.
    if TORCH_VERSION >= digit_version('2.6.0'):
        with pytest.raises(Exception, match='(?i)weights'):
            torch.load(data_file)
    assert load_bundle(path).load('data_batch')['data_samples'][0].img_path


def test_to_strict_json():
    obj = {
        'nan': float('nan'),
        'inf': np.float32('inf'),
        'neg': torch.tensor(float('-inf')),
        'int': np.int64(3),
        'bool': np.bool_(True),
        'arr': np.array([1.0, np.nan]),
        'tensor': torch.tensor([[1.5], [float('inf')]]),
        1: ('a', None),
    }
    text = json.dumps(to_strict_json(obj), allow_nan=False)
    assert json.loads(text, parse_constant=_reject_constant) == {
        'nan': 'nan', 'inf': 'inf', 'neg': '-inf', 'int': 3, 'bool': True,
        'arr': [1.0, 'nan'], 'tensor': [[1.5], ['inf']], '1': ['a', None],
    }


def test_versions():
    found = versions()
    assert set(found) == {'python', 'torch', 'mmengine', 'mmcv', 'mmdet',
                          'mmrotate', 'mmnanhook'}
    assert found['torch'] == str(torch.__version__)
    assert found['python'] == '{}.{}.{}'.format(*sys.version_info[:3])


def test_bundle_names_sort_by_time():
    import datetime
    early = bundle_name(900, 1, datetime.datetime(2026, 1, 2, 3, 4, 5))
    late = bundle_name(12, 0, datetime.datetime(2026, 1, 2, 3, 4, 6))
    assert early == '20260102T030405_iter000900_rank1'
    assert sorted([late, early]) == [early, late]


_KILL_SCRIPT = textwrap.dedent('''
    import os, signal, sys
    import torch
    from mmnanhook.bundle import write_bundle

    dump_dir, point = sys.argv[1], sys.argv[2]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    class KillWhenPickled(object):
        def __reduce__(self):
            die()

    tensors = {'model': {'w': torch.zeros(100000)}}
    if point == 'pickling':
        tensors['data_batch'] = {'x': KillWhenPickled()}
    else:
        # Killed at the last moment: every file and the manifest are written.
        def profile(frame, event, arg):
            if event == 'c_call' and arg is os.rename:
                die()
        sys.setprofile(profile)
    write_bundle(dump_dir, 'victim', {'iter': 1, 'rank': 0}, tensors,
                 {'config.py': 'x = 1'}, {'kind': 'data'}, [])
''')


@pytest.mark.skipif(os.name != 'posix', reason='needs SIGKILL')
@pytest.mark.parametrize('point', ['pickling', 'rename'])
def test_killed_write_leaves_no_valid_bundle(tmp_path, point, logger,
                                             caplog):
    dump_dir = tmp_path / 'dumps'
    proc = _run_script(tmp_path, _KILL_SCRIPT, str(dump_dir), point)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()

    entries = os.listdir(str(dump_dir))
    assert len(entries) == 1 and entries[0].startswith('.'), entries
    leftover = osp.join(str(dump_dir), entries[0])
    if point == 'rename':
        assert osp.isfile(osp.join(leftover, 'manifest.json'))
    with pytest.raises(BundleError) as info:
        load_bundle(leftover)
    assert '\n' not in str(info.value) and leftover in str(info.value)

    # The writer is dead: the next write on this host removes its leftover.
    path = _write(dump_dir, logger=logger)
    assert os.listdir(str(dump_dir)) == ['bundle']
    assert load_bundle(path).manifest['iter'] == 7
    assert 'interrupted bundle write' in caplog.text


_DISK_FULL_SCRIPT = textwrap.dedent('''
    import logging, resource, signal, sys
    import torch
    from mmnanhook.bundle import write_bundle

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    # Files may not grow beyond 64 KiB, which root cannot bypass either; a
    # write past it fails with EFBIG as on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    result = write_bundle(sys.argv[1], 'full', {'iter': 3, 'rank': 0},
                          {'model': {'w': torch.zeros(1 << 18)}}, {},
                          {'kind': 'data'}, None,
                          logger=logging.getLogger('disk'))
    print(repr(result))
''')


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='needs RLIMIT_FSIZE')
def test_disk_full_returns_none_and_logs(tmp_path):
    dump_dir = tmp_path / 'dumps'
    dump_dir.mkdir()
    proc = _run_script(tmp_path, _DISK_FULL_SCRIPT, str(dump_dir))
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert proc.stdout.decode().strip() == 'None'
    assert 'bundle was NOT written to {}'.format(dump_dir) in stderr
    assert 'File too large' in stderr
    assert os.listdir(str(dump_dir)) == []


def test_unwritable_dump_dir_returns_none_and_logs(tmp_path, logger,
                                                   caplog):
    # A dump_dir below a regular file cannot be created, even by root.
    blocker = tmp_path / 'not_a_dir'
    blocker.write_text('')
    dump_dir = blocker / 'nan_dumps'
    assert _write(dump_dir, logger=logger) is None
    assert 'bundle was NOT written to {}'.format(dump_dir) in caplog.text
    assert os.listdir(str(tmp_path)) == ['not_a_dir']


def test_max_dumps_keeps_newest_of_own_rank(tmp_path):
    other_rank = _write(tmp_path, name='rank1', rank=1)
    (tmp_path / 'foreign').mkdir()
    (tmp_path / 'foreign' / 'notes.txt').write_text('keep me')
    (tmp_path / 'other_tool').mkdir()
    (tmp_path / 'other_tool' / 'manifest.json').write_text('{"rank": 0}')
    written = [_write(tmp_path, name='r0_{}'.format(i), iter=i, max_dumps=3)
               for i in range(6)]
    assert all(written)
    assert sorted(os.listdir(str(tmp_path))) == sorted(
        ['foreign', 'other_tool', 'rank1', 'r0_3', 'r0_4', 'r0_5'])
    assert load_bundle(other_rank).manifest['rank'] == 1


def test_existing_name_gets_a_suffix(tmp_path):
    first = _write(tmp_path, name='same')
    second = _write(tmp_path, name='same')
    assert first != second and osp.basename(second) == 'same_2'
    assert load_bundle(first) and load_bundle(second)


@pytest.mark.parametrize('case', sorted(CORRUPTIONS))
def test_bad_bundles_raise_one_line_bundle_error(tmp_path, case):
    good = _write(tmp_path)
    corrupt, expected = CORRUPTIONS[case]
    path = corrupt(good)
    with pytest.raises(BundleError) as info:
        load_bundle(path)
    message = str(info.value)
    assert '\n' not in message
    assert expected.format(
        manifest=osp.join(good, 'manifest.json'),
        model=osp.join(good, 'model.pth'),
        report=osp.join(good, 'report.json')) in message


def test_unloadable_torch_file_raises_bundle_error(tmp_path, monkeypatch):
    # A bundle opened where the classes of its data samples are not
    # importable (e.g. without mmdet) fails to unpickle.
    module_dir = tmp_path / 'mods'
    module_dir.mkdir()
    (module_dir / 'mmnan_vanishing_sample.py').write_text(
        'class Sample(object):\n    pass\n')
    monkeypatch.syspath_prepend(str(module_dir))
    import mmnan_vanishing_sample
    tensors = {'data_batch': {'s': mmnan_vanishing_sample.Sample()}}
    path = _write(tmp_path / 'dumps', tensors=tensors)
    monkeypatch.delitem(sys.modules, 'mmnan_vanishing_sample')
    monkeypatch.setattr(sys, 'path',
                        [p for p in sys.path if p != str(module_dir)])

    bundle = load_bundle(path)
    for attempt in (bundle.load, lambda stem: load_bundle(path, load=[stem])):
        with pytest.raises(BundleError) as info:
            attempt('data_batch')
        message = str(info.value)
        assert '\n' not in message
        assert osp.join(path, 'data_batch.pth') in message
        assert 'mmnan_vanishing_sample' in message


def test_unpicklable_object_is_left_out_with_reason(tmp_path, logger,
                                                    caplog):
    import threading
    tensors = {'model': {'w': torch.ones(2)},
               'data_batch': {'lock': threading.Lock()}}
    path = _write(tmp_path, tensors=tensors, logger=logger)
    bundle = load_bundle(path, load=['model'])
    assert 'data_batch' in bundle.manifest['unsaved']
    assert not bundle.has('data_batch') and bundle.has('model')
    assert 'data_batch is left out of the bundle' in caplog.text
    with pytest.raises(BundleError, match='could not be saved'):
        bundle.load('data_batch')


@pytest.mark.parametrize('records', [
    'mixed',
    'empty',
])
def test_plot_history_writes_png(tmp_path, records):
    import matplotlib.image
    if records == 'mixed':
        history = History()
        for it in range(20):
            history.append(it, loss=-1.0 + it, grad_norm=10.0**it, lr=1e-3,
                           loss_scale=2.0**(16 - it))
        history.append(20, loss=float('nan'), grad_norm=float('inf'),
                       lr=1e-3, loss_scale=float('-inf'))
        records = history.records()
    else:
        records = []
    path = str(tmp_path / 'history.png')
    plot_history(records, path, fail_iter=20)
    with open(path, 'rb') as f:
        assert f.read(8) == PNG_SIGNATURE
    height, width = matplotlib.image.imread(path).shape[:2]
    assert height > 100 and width > 100


def test_plot_history_shows_a_lone_finite_point(tmp_path):
    # A run that failed at iteration 1 has one finite loss: a line alone
    # draws nothing of it, its marker does.
    import matplotlib.image
    path = str(tmp_path / 'history.png')
    plot_history([dict(iter=0, loss=2.3), dict(iter=1, loss=float('inf'))],
                 path, fail_iter=1)
    pixels = matplotlib.image.imread(path)[..., :3]
    # The line's colour, matplotlib's tab:blue (#1f77b4).
    blue = np.abs(pixels - np.array([0x1f, 0x77, 0xb4]) / 255.0).max(-1)
    assert int((blue < 0.1).sum()) >= 9
