"""The hook runs the config rules at before_train: one log line per finding,
never failing the run unless asked (``doctor='raise'``), and the report of a
later trigger names the finding that explains it."""
import pytest
from mmengine.runner import Runner

from mmnanhook import NonFiniteError
from mmnan_testing import testbed
from mmnan_testing.cli import assert_same_report, replay_json, run_report

# Three trainings: in make test on the DOTA leg, whose share of the everyday
# tier has room; on the modern leg in make test-zoo.
pytestmark = pytest.mark.everyday_leg('dota')

# GIoU on RetinaNet's encoded deltas (reg_decoded_bbox=False), and an image
# with a zero-width box: its target delta is log(0), the loss non-finite.
GIOU = {'model.bbox_head.loss_bbox': dict(type='GIoULoss', loss_weight=2.0)}


def _runner(tmp_path, doctor, overrides=GIOU):
    data = testbed.make_dataset('retinanet_voc', str(tmp_path / 'data'),
                                num_images=8, defects={5: 'zero_size'})
    cfg = testbed.tiny_config(
        'retinanet_voc', data, str(tmp_path / 'run'), max_iters=12,
        custom_hooks=[dict(type='NanDetectHook', doctor=doctor)],
        **overrides)
    return Runner.from_cfg(cfg)


def _log(runner):
    with open('%s/%s.log' % (runner.log_dir, runner.timestamp)) as f:
        return f.read()


@pytest.mark.mmdet
def test_a_finding_is_logged_and_explains_the_trigger(tmp_path):
    runner = _runner(tmp_path, 'warn')
    with pytest.raises(NonFiniteError) as caught:
        runner.train()
    log = _log(runner)
    assert 'mmnanhook doctor: [iou_loss_on_deltas] model.bbox_head.loss_bbox' \
        in log
    # Logged before the first iteration.
    assert log.index('mmnanhook doctor') < log.index('Iter(train)') \
        if 'Iter(train)' in log else True
    report = caught.value.report
    assert [f['rule'] for f in report['config_findings']] == [
        'iou_loss_on_deltas']
    assert any(h.startswith('The config may explain it') and
               'reg_decoded_bbox=True' in h for h in report['hints']), \
        report['hints']
    # mmnan replay explains by the run's findings as the run did.
    code, replayed = replay_json(caught.value.bundle)
    assert code == 0
    assert_same_report(replayed, run_report(caught.value.bundle))


@pytest.mark.mmdet
def test_doctor_raise_stops_before_training(tmp_path):
    runner = _runner(tmp_path, 'raise')
    with pytest.raises(RuntimeError, match='mmnanhook doctor found 1'):
        runner.train()
    assert runner.iter == 0


@pytest.mark.mmdet
def test_doctor_off_and_a_clean_config(tmp_path):
    for doctor, overrides in ((None, GIOU), ('warn', {})):
        runner = _runner(tmp_path / str(doctor), doctor, overrides)
        with pytest.raises(NonFiniteError) as caught:
            runner.train()
        assert caught.value.report['config_findings'] == []
        assert 'mmnanhook doctor' not in _log(runner)
        assert not any(h.startswith('The config may explain it')
                       for h in caught.value.report['hints'])
