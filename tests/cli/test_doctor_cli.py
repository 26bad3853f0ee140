"""``mmnan doctor`` in a fresh process, as a user runs it: a clean tiny
config passes (exit 0), one defect in its data and one config rule fail it
(exit 1, both named, and the missing box filter), a config that does not load
is bad input (exit 2)."""
import pytest

from mmnan_testing import testbed
from mmnan_testing.cli import assert_bad_input, mmnan

# Fresh processes: in make test on the DOTA leg, whose share of the everyday
# tier has room; on the modern leg in make test-zoo.
pytestmark = pytest.mark.everyday_leg('dota')


def _config(tmp_path, name, defects=None, **overrides):
    data = testbed.make_dataset('retinanet_voc', str(tmp_path / 'data'),
                                num_images=4, defects=defects)
    cfg = testbed.tiny_config('retinanet_voc', data, str(tmp_path / 'run'),
                              **overrides)
    path = str(tmp_path / name)
    cfg.dump(path)
    return path


@pytest.mark.mmdet
def test_a_clean_config_passes(tmp_path):
    result = mmnan('doctor', _config(tmp_path, 'clean.py'))
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'config: 0 finding(s)' in result.stdout
    assert 'dataset: 0 of 4 samples with problems' in result.stdout
    assert "fp16 headroom: 0 module(s)" in result.stdout


@pytest.mark.mmdet
def test_a_bad_box_and_a_static_loss_scale_are_named(tmp_path):
    path = _config(tmp_path, 'bad.py', defects={1: 'zero_size'}, **{
        'optim_wrapper.type': 'AmpOptimWrapper',
        'optim_wrapper.loss_scale': 512.0})
    html = str(tmp_path / 'doctor.html')
    result = mmnan('doctor', path, '--html', html)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert 'config: 2 finding(s)' in out
    assert '[static_loss_scale] optim_wrapper.loss_scale' in out
    # The zero-width box and no FilterAnnotations in the pipeline.
    assert '[degenerate_boxes_unfiltered] train_dataloader.dataset.pipeline: ' \
        '1 sample(s) with zero-size GT boxes' in out
    assert 'dataset: 1 of 4 samples with problems' in out
    assert 'gt box 1 has zero width' in out
    with open(html) as f:
        page = f.read()
    assert 'Config findings (mmnan doctor)' in page
    assert 'static_loss_scale' in page and 'zero width' in page


def test_a_config_that_does_not_load_is_bad_input(tmp_path):
    missing = str(tmp_path / 'missing.py')
    assert_bad_input(mmnan('doctor', missing), 'doctor',
                     'cannot load {}: FileNotFoundError'.format(missing))
