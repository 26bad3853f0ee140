"""What a bundle's ``.pth`` files may hold: the real batches of the tiny and
zoo configs load through the allowlist; a file that would run code is
refused without running it, on every torch."""
import io
import os.path as osp
import re
import sys
import types

import numpy as np
import pytest
import torch
from mmengine.structures import BaseDataElement

from mmnanhook import compat
from mmnanhook.bundle import ALLOWLIST_FALLBACK
from mmnanhook.bundle import load_bundle, write_bundle
from mmnanhook.errors import BundleError
from mmnanhook.memory import capture_rng
from mmnan_testing import testbed, zoo
from mmnan_testing.bundles import hostile_torch_file, replace_listed_file


def _first_batch(cfg):
    """The first batch the train dataloader of ``cfg`` yields, as the hook
    keeps it."""
    from mmengine.registry import init_default_scope
    from mmengine.runner import Runner
    init_default_scope(cfg.get('default_scope', 'mmengine'))
    loader = dict(cfg.train_dataloader, num_workers=0,
                  persistent_workers=False)
    return next(iter(Runner.build_dataloader(loader, seed=0)))


def _shown(obj):
    """What a batch holds, as plain comparable values.

    Not its ``str``: a data element keeps its field names in a set, whose
    order (and so the printed order) varies with the string hash seed.
    """
    if isinstance(obj, (list, tuple)):
        return [_shown(item) for item in obj]
    if isinstance(obj, dict):
        return sorted((key, _shown(value)) for key, value in obj.items())
    if hasattr(obj, 'metainfo_items') and hasattr(obj, 'items'):
        return (type(obj).__name__, _shown(dict(obj.metainfo_items())),
                _shown(dict(obj.items())))
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return (type(obj).__name__, str(obj.dtype), obj.tolist())
    for inner in ('tensor', 'masks'):  # box structures, BitmapMasks
        value = getattr(obj, inner, None)
        if isinstance(value, (torch.Tensor, np.ndarray)):
            return (type(obj).__name__, _shown(value))
    return re.sub(r' at 0x[0-9a-f]+', '', repr(obj))


def _bundle(tmp_path, tensors):
    return write_bundle(str(tmp_path / 'dumps'), 'b', {'iter': 0, 'rank': 0},
                        tensors, texts={}, report={'kind': 'data'},
                        history_records=[])


@pytest.mark.parametrize('config', [
    pytest.param('retinanet_voc', marks=pytest.mark.mmdet),
    pytest.param('faster_rcnn', marks=pytest.mark.mmdet),
    pytest.param('rotated_retinanet', marks=pytest.mark.mmrotate),
])
def test_batch_of_a_tiny_config_loads(tmp_path, config):
    data = testbed.make_dataset(config, str(tmp_path / 'data'), num_images=2)
    batch = _first_batch(testbed.tiny_config(config, data,
                                             str(tmp_path / 'work')))
    loaded = load_bundle(_bundle(tmp_path, {'data_batch': batch}),
                         load=['data_batch']).load('data_batch')
    assert torch.equal(loaded['inputs'][0], batch['inputs'][0])
    assert _shown(loaded['data_samples']) == _shown(batch['data_samples'])


@pytest.mark.parametrize('name', [
    pytest.param('mask_rcnn_r50', marks=pytest.mark.mmdet),
    pytest.param('oriented_rcnn', marks=pytest.mark.mmrotate),
    pytest.param('segformer_b0_ade', marks=pytest.mark.mmseg),
])
def test_batch_of_a_zoo_config_loads(tmp_path, name):
    data = zoo.make_zoo_dataset(name, str(tmp_path / 'data'), num_images=2)
    batch = _first_batch(zoo.child_config(name, data, str(tmp_path / 'work')))
    loaded = load_bundle(_bundle(tmp_path, {'data_batch': batch}),
                         load=['data_batch']).load('data_batch')
    assert _shown(loaded['data_samples']) == _shown(batch['data_samples'])


@pytest.mark.parametrize('stem', ['data_batch', 'model', 'optimizer', 'rng'])
def test_a_file_that_would_run_code_is_refused_unrun(tmp_path, stem):
    path = _bundle(tmp_path, {
        'data_batch': {'inputs': [torch.zeros(3, 4, 4)]},
        'model': torch.nn.Linear(2, 2).state_dict(),
        'optimizer': {'state': {}, 'param_groups': []},
        'rng': capture_rng()})
    marker = str(tmp_path / 'ran')
    replace_listed_file(path, stem + '.pth', hostile_torch_file(marker))
    with pytest.raises(BundleError) as info:
        load_bundle(path).load(stem)
    assert str(info.value) == (
        'refused {}: it names builtins.exec, which no bundle holds (nothing '
        'of it was run)'.format(osp.join(path, stem + '.pth')))
    assert not osp.exists(marker)
    # What loads it where torch has no allowlist, said where it applies.
    assert (ALLOWLIST_FALLBACK is None) == (
        compat.TORCH_VERSION >= compat.digit_version('2.6.0'))


def test_the_state_of_several_optimizers_loads(tmp_path):
    from mmengine.optim import OptimWrapper, OptimWrapperDict
    model = torch.nn.Linear(2, 2)
    wrappers = OptimWrapperDict(**dict(
        (name, OptimWrapper(torch.optim.SGD([param], lr=0.1)))
        for name, param in model.named_parameters()))
    path = _bundle(tmp_path, {'optimizer': wrappers.state_dict()})
    loaded = load_bundle(path, load=['optimizer']).load('optimizer')
    assert sorted(loaded) == ['bias', 'weight']


def _structures():
    """Structures of the installed codebases a batch may hold beyond the
    tiny and zoo configs' (each codebase's data samples, data elements,
    boxes and masks), with a value each."""
    from mmengine.structures import InstanceData, LabelData
    made = [LabelData(label=torch.tensor([3]))]
    try:
        from mmdet.structures import ReIDDataSample, TrackDataSample
        from mmdet.structures.mask import PolygonMasks
    except ImportError:
        return made
    from mmdet.structures import DetDataSample
    frame = TrackDataSample(metainfo=dict(video_length=1))
    frame.video_data_samples = [DetDataSample(metainfo=dict(frame_id=0))]
    made += [frame, ReIDDataSample(metainfo=dict(img_path='a.jpg')),
             InstanceData(masks=PolygonMasks(
                 [[np.array([0., 0., 4., 0., 4., 4.])]], 8, 8))]
    try:
        from mmrotate.structures.bbox import QuadriBoxes
    except ImportError:
        return made
    return made + [QuadriBoxes(torch.tensor([[0., 0., 4., 0., 4., 4., 0.,
                                              4.]]))]


def test_every_structure_of_an_installed_codebase_loads(tmp_path):
    # Issue 53: a bundle of any OpenMMLab codebase replays offline. Its
    # batch holds that codebase's structures: allowed by what they are (a
    # data element, mmdet's boxes or masks, in an installed OpenMMLab
    # package's `structures`), not by a list of names.
    made = _structures()
    path = _bundle(tmp_path, {'data_batch': {
        'inputs': [torch.zeros(3, 4, 4)], 'data_samples': made}})
    loaded = load_bundle(path, load=['data_batch']).load('data_batch')
    assert [type(each) for each in loaded['data_samples']] == [
        type(each) for each in made]
    assert _shown(loaded['data_samples']) == _shown(made)


def _naming(module, name):
    """The bytes of a torch file whose pickle names ``module.name`` (a
    class made up for it, registered meanwhile), as a batch's sample."""
    fake = type(name, (BaseDataElement, ), {'__module__': module})
    parts = module.split('.')
    names = ['.'.join(parts[:i + 1]) for i in range(len(parts))]
    before = dict((each, sys.modules.get(each)) for each in names)
    for each in names[:-1]:
        sys.modules.setdefault(each, types.ModuleType(each))
    sys.modules[module] = types.ModuleType(module)
    setattr(sys.modules[module], name, fake)
    try:
        data = io.BytesIO()
        torch.save({'inputs': [torch.zeros(1)], 'data_samples': [fake()]},
                   data)
    finally:
        for each, old in before.items():
            if old is None:
                del sys.modules[each]
            else:
                sys.modules[each] = old
    return data.getvalue()


@pytest.mark.parametrize('module, name', [
    # Not a structure's module, or not an OpenMMLab package's.
    ('mmengine.registry', 'Registry'),
    ('mmnan_testing.elsewhere', 'Elsewhere'),
    # An OpenMMLab package that is not installed: never imported.
    ('mmfewshot.structures', 'FewShotDataSample'),
    # In a codebase's structures, but no data element, boxes or masks.
    ('mmengine.structures.base_data_element', 'copy'),
])
def test_nothing_else_of_a_codebase_loads(tmp_path, module, name):
    path = _bundle(tmp_path, {'data_batch': {'inputs': [torch.zeros(1)]}})
    replace_listed_file(path, 'data_batch.pth', _naming(module, name))
    with pytest.raises(BundleError, match='it names {}.{}, which no bundle '
                       'holds'.format(re.escape(module), name)):
        load_bundle(path).load('data_batch')
    assert 'mmfewshot' not in sys.modules
