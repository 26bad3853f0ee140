"""What was in flight when a training process died inside a step
(:mod:`mmnanhook.quarantine._flight`): the record itself, then real runs of
the tiny RetinaNet killed in the middle of a step (SIGKILL, as the OOM
killer; SIGSEGV, as a C++ op), each in its own process
(:mod:`mmnan_testing.crash`): ``mmnan inspect WORK_DIR`` says what was in
flight, and the run resumed under ``policy='drop'`` names and quarantines
the samples of that step, which are never loaded again. The crash there is
no sample's (a hook kills the step): tried alone, neither sample dies, so
both are quarantined, the log saying why. On a plain torch ``Dataset`` (no
data infos) one sample of the batch kills the process: tried alone, it
alone dies, and it alone is quarantined, by its dataset index.
"""
import json
import os
import os.path as osp
import re
import signal
import subprocess
import sys
import zlib

import pytest

from mmnanhook.quarantine import (FlightRecorder, flight_dir,
                                  read_flights, read_quarantine)
from mmnanhook.quarantine._flight import _HEADER, _MAGIC, _SLOT
from mmnan_testing.cli import mmnan
from mmnan_testing.crash import (DIES_AT, IMAGES, ITERS, PLAIN_DEADLY,
                                 PLAIN_SAMPLES)
from mmnan_testing.plain import file_of


def test_a_step_not_marked_done_is_in_flight(tmp_path):
    directory = flight_dir(str(tmp_path))
    recorder = FlightRecorder(directory, 'run1', 3)
    recorder.begin(7, 1, ['a.png', None], [4, 9])
    (flight, ) = read_flights(directory)
    assert (flight.run, flight.rank, flight.pid, flight.iter, flight.epoch,
            flight.files, flight.indices) == (
                'run1', 3, os.getpid(), 7, 1, ['a.png', None], [4, 9])
    assert 'died in train iteration 7 (epoch 1)' in flight.describe()
    assert 'a.png (dataset index 4), dataset index 9' in flight.describe()
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


def test_a_record_without_indices_still_reads(tmp_path):
    """A record written before the samples' dataset indices were (a run
    of an earlier mmnanhook that died) names its files as then."""
    directory = flight_dir(str(tmp_path))
    os.makedirs(directory)
    body = json.dumps(dict(run='old', rank=0, pid=1, iter=3, epoch=0,
                           time=1.0, files=['a.png', None])).encode()
    with open(osp.join(directory, 'old.rank0.rec'), 'wb') as f:
        f.write(_HEADER.pack(_MAGIC, 1, 0, len(body), zlib.crc32(body)) +
                body)
    (flight, ) = read_flights(directory)
    assert (flight.files, flight.indices) == (['a.png', None], None)
    assert 'a.png, (no file name)' in flight.describe()


def test_the_record_is_bounded(tmp_path):
    directory = flight_dir(str(tmp_path))
    recorder = FlightRecorder(directory, 'run1', 0)
    files = ['/data/%s/%05d.tif' % ('x' * 200, i) for i in range(500)]
    recorder.begin(1, 0, files, list(range(500)))
    assert os.path.getsize(recorder.path) <= 2 * _SLOT
    (flight, ) = read_flights(directory)
    assert 0 < len(flight.files) < 500 and flight.files == files[
        :len(flight.files)]
    assert flight.indices == list(range(len(flight.files)))
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
    # Each was tried alone first; neither died (the crash was the step's).
    assert 'none of the 2 samples in flight died alone' in process.stdout
    (resumed, ) = lines
    assert len(resumed['files']) == ITERS - DIES_AT
    for batch in resumed['files']:
        assert not set(batch) & set(died['files']), batch
    # A run that ended alive leaves no record: nothing is in flight.
    shown = mmnan('inspect', run_dir)
    assert 'no run with mmnanhook died inside a train step' in shown.stdout
    # The journal keeps the crash (issue 68): the died run's step and what
    # it held, found by the resumed run, which quarantined them and ended.
    assert re.search(r'^  iter %d +rank 0 died inside the step: %s' % (
        DIES_AT, 'a fatal signal' if how == 'SEGV' else 'killed without'),
        shown.stdout, re.M), shown.stdout
    assert re.search(r'^run \S+: resumed at iter %d, continuing run ' %
                     DIES_AT, shown.stdout, re.M), shown.stdout
    for file in died['files']:
        assert 'quarantined %s (crash, rank 0)' % file in shown.stdout
    assert 'ended at iter %d: finished' % ITERS in shown.stdout


@pytest.mark.parametrize('how', [
    'KILL', pytest.param('SEGV', marks=pytest.mark.everyday_leg('dota'))])
def test_a_crash_costs_only_its_culprit_on_a_plain_dataset(tmp_path, how):
    """A plain torch ``Dataset`` without data infos, its samples' files in
    their metainfo; in iteration :data:`DIES_AT` one of the batch's two
    samples kills the process in the forward. Before issue 63 the next run
    under ``'drop'`` quarantined nothing (no index of the dataset could be
    found by file), said nothing of why, and died again at the same step.
    SIGSEGV's run is in the DOTA leg's everyday tier (the modern leg's zoo
    tier): one signal a leg is enough for ``make test``."""
    work_dir = str(tmp_path)
    process, _ = _crash('plain', 'die', work_dir, how)
    assert process.returncode == -getattr(signal, 'SIG' + how), \
        process.stderr[-3000:]
    run_dir = work_dir + '/work'
    (died, ) = read_flights(flight_dir(run_dir))
    process, lines = _crash('plain', 'resume', work_dir, how)
    # Before: it died again, at the same step.
    assert process.returncode == 0, process.stderr[-3000:]
    innocent = PLAIN_DEADLY - 1
    assert (died.iter, died.indices, died.files) == (
        DIES_AT, [innocent, PLAIN_DEADLY],
        [file_of(innocent), file_of(PLAIN_DEADLY)])
    (resumed, ) = lines
    assert resumed['iter'] == ITERS
    listed = read_quarantine(osp.join(run_dir, 'nan_quarantine.json'),
                             PLAIN_SAMPLES)
    assert [(s.indices, s.file, s.source, s.iter) for s in listed] == [
        ([PLAIN_DEADLY], file_of(PLAIN_DEADLY), 'crash', DIES_AT)]
    assert 'its child process died of SIG%s: quarantined' % how in \
        process.stdout
    # Each tried alone in a child of its own; the innocent one trains on,
    # in the very step that died; the culprit is never loaded by the run.
    tried = sorted(i for pid, i in resumed['loads'] if pid != resumed['pid'])
    assert tried == [innocent, PLAIN_DEADLY]
    trained = [i for pid, i in resumed['loads'] if pid == resumed['pid']]
    assert PLAIN_DEADLY not in trained
    assert resumed['batches'][0][0] == innocent
    assert not any(PLAIN_DEADLY in batch for batch in resumed['batches'])
