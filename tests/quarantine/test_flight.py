"""What was in flight when a training process died inside a step
(:mod:`mmnanhook.quarantine._flight`): the record itself, then real runs of
the tiny RetinaNet killed in the middle of a step (SIGKILL, as the OOM
killer; SIGSEGV, as a C++ op), each in its own process
(:mod:`mmnan_testing.crash`): ``mmnan inspect WORK_DIR`` says what was in
flight, and the run resumed under ``policy='drop'`` names and quarantines
the samples of that step, which are never loaded again.
"""
import json
import os
import os.path as osp
import signal
import subprocess
import sys

import pytest

from mmnanhook.quarantine import (FlightRecorder, flight_dir,
                                  read_flights, read_quarantine)
from mmnanhook.quarantine._flight import _SLOT
from mmnan_testing.cli import mmnan
from mmnan_testing.crash import DIES_AT, IMAGES, ITERS


def test_a_step_not_marked_done_is_in_flight(tmp_path):
    directory = flight_dir(str(tmp_path))
    recorder = FlightRecorder(directory, 'run1', 3)
    recorder.begin(7, 1, ['a.png', None])
    (flight, ) = read_flights(directory)
    assert (flight.run, flight.rank, flight.pid, flight.iter, flight.epoch,
            flight.files) == ('run1', 3, os.getpid(), 7, 1, ['a.png', None])
    assert 'died in train iteration 7 (epoch 1)' in flight.describe()
    assert 'a.png, (no file name)' in flight.describe()
    # The run starting now does not read its own record.
    assert read_flights(directory, but='run1') == []
    recorder.end()
    assert read_flights(directory) == []
    recorder.begin(8, 1, ['b.png'])
    assert [f.iter for f in read_flights(directory)] == [8]
    recorder.remove()
    assert os.listdir(directory) == []
    recorder.remove()


def test_a_torn_write_leaves_the_step_before_readable(tmp_path):
    directory = flight_dir(str(tmp_path))
    recorder = FlightRecorder(directory, 'run1', 0)
    recorder.begin(4, 0, ['four.png'])
    recorder.begin(5, 0, ['five.png'])
    # The process died in the middle of writing iteration 5's slot.
    with open(recorder.path, 'r+b') as f:
        f.seek(recorder._slot * _SLOT + 40)
        f.write(b'\xff' * 8)
    assert [(f.iter, f.files) for f in read_flights(directory)] == [
        (4, ['four.png'])]
    # A foreign file in the directory is no record.
    with open(osp.join(directory, 'other.rank0.rec'), 'wb') as f:
        f.write(b'not a record' * 10)
    assert [f.iter for f in read_flights(directory)] == [4]
    recorder.remove()


def test_the_record_is_bounded(tmp_path):
    directory = flight_dir(str(tmp_path))
    recorder = FlightRecorder(directory, 'run1', 0)
    files = ['/data/%s/%05d.tif' % ('x' * 200, i) for i in range(500)]
    recorder.begin(1, 0, files)
    assert os.path.getsize(recorder.path) <= 2 * _SLOT
    (flight, ) = read_flights(directory)
    assert 0 < len(flight.files) < 500 and flight.files == files[
        :len(flight.files)]
    recorder.remove()


def _crash(*args, timeout=300):
    # mmengine 0.10.7 resumes with torch.load's default weights_only, True
    # since torch 2.6 (legs.RESUME_BROKEN): torch's own switch back.
    env = dict(os.environ, OMP_NUM_THREADS='1',
               TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD='1')
    process = subprocess.run(
        [sys.executable, '-m', 'mmnan_testing.crash'] + list(args),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, env=env, timeout=timeout)
    lines = [json.loads(line) for line in process.stdout.splitlines()
             if line.startswith('{')]
    return process, lines


@pytest.mark.mmdet
@pytest.mark.parametrize('how', ['KILL', 'SEGV'])
def test_a_run_that_dies_in_a_step_leaves_its_samples_named(tmp_path, how):
    work_dir = str(tmp_path)
    process, lines = _crash('die', work_dir, how)
    assert process.returncode == -getattr(signal, 'SIG' + how), \
        process.stderr[-3000:]
    (died, ) = lines
    assert died['iter'] == DIES_AT and len(died['files']) == 2
    run_dir = work_dir + '/work'
    shown = mmnan('inspect', run_dir)
    assert shown.returncode == 0, shown.stderr
    assert 'died in train iteration %d' % DIES_AT in shown.stdout
    for file in died['files']:
        assert file in shown.stdout
    if how == 'SEGV':
        # faulthandler's Python stack of the fatal signal, down to the
        # frame that crashed.
        assert 'Segmentation fault' in shown.stdout
        assert '_in_forward' in shown.stdout
    # Resumed under 'drop': the samples of that step are quarantined, the
    # run ends, neither is loaded again.
    process, lines = _crash('resume', work_dir)
    assert process.returncode == 0, process.stderr[-3000:]
    assert 'died in train iteration %d' % DIES_AT in process.stdout
    listed = read_quarantine(osp.join(run_dir, 'nan_quarantine.json'),
                             IMAGES)
    assert sorted(s.file for s in listed) == sorted(died['files'])
    assert set(s.source for s in listed) == {'crash'}
    assert set(s.iter for s in listed) == {DIES_AT}
    (resumed, ) = lines
    assert len(resumed['files']) == ITERS - DIES_AT
    for batch in resumed['files']:
        assert not set(batch) & set(died['files']), batch
    # A run that ended alive leaves no record: nothing is in flight.
    shown = mmnan('inspect', run_dir)
    assert 'no run with mmnanhook died inside a train step' in shown.stdout
