"""The incident journal (:mod:`mmnanhook.run._journal`): one line per
incident, each appended whole by one ``write``, bounded per run and per
file; its record (:class:`mmnanhook.records.Incident`) read back, and
anything else refused."""
import json
import logging
import os
import signal
import time
import types

import pytest

from mmnanhook.records import (Incident, IncidentKind, NonFiniteEvent,
                               Report, SampleFinding, Trigger)
from mmnanhook.records import RankFinding
from mmnanhook.recovery import Answer
from mmnanhook.run._journal import MAX_LINE, Journal


def _lines(path):
    with open(path) as f:
        return [Incident.from_line(line) for line in f]


def _runner(tmp_path, iter=0):
    return types.SimpleNamespace(iter=iter, epoch=0, _resume=iter > 0,
                                 log_dir=str(tmp_path / '20261207_101112'),
                                 work_dir=str(tmp_path))


def _event(iter=3):
    return NonFiniteEvent(Trigger.LOSS, 'Non-finite loss at iter %d' % iter,
                          iter=iter, epoch=0, bad_ranks=[0])


def test_every_kind_reads_back_and_nothing_else_does():
    incidents = [
        Incident('start', 'r1', time=1.0, iter=0, world_size=2,
                 policy='drop', resume=False, dump_dir='/d'),
        Incident('trigger', 'r1', iter=3, trigger='loss', act='drop',
                 diagnosis='data', cause='sample 1', samples=['a.jpg'],
                 ranks=[1], bundle='/d/b'),
        Incident('spike', 'r1', iter=4, series='loss', value=23.5,
                 factor=float('inf')),
        Incident('crash', 'r2', iter=6, rank=0, died_run='r1',
                 samples=['b.jpg', 'c.jpg'], reason='SIGKILL'),
        Incident('trigger', 'r2', iter=9, act='rewind', rewind_to=-1,
                 lr=0.001, lr_factor=0.1),
        Incident('omitted', 'r2', counts=dict(spike=4)),
        Incident('end', 'r2', iter=10, reason='finished')]
    for incident in incidents:
        line = incident.to_line()
        assert line.endswith('\n') and line.count('\n') == 1
        assert Incident.from_line(line) == incident
    # What is None or empty is left out of the line.
    assert set(json.loads(incidents[-1].to_line())) == {
        'journal', 'kind', 'run', 'iter', 'reason'}
    for bad in ('not json', '[1, 2]', '{"kind": "trigger", "run": "r"}',
                '{"journal": 2, "kind": "trigger", "run": "r"}',
                '{"journal": 1, "kind": "party", "run": "r"}',
                '{"journal": 1, "kind": "trigger", "run": "r", "iter": "3"}',
                '{"journal": 1, "kind": "trigger", "run": "r", '
                '"act": "explode"}',
                '{"journal": 1, "kind": "quarantine", "run": "r", '
                '"samples": "a.jpg"}'):
        with pytest.raises(ValueError):
            Incident.from_line(bad)


def test_a_run_journals_its_incidents_in_order(tmp_path):
    path = str(tmp_path / 'nan_journal.jsonl')
    journal = Journal(path, 'r1')
    quarantine = types.SimpleNamespace(path=str(tmp_path / 'q.json'),
                                       samples=['listed before'])
    journal.started(_runner(tmp_path), 'drop', str(tmp_path / 'dumps'),
                    quarantine, world_size=2)
    report = Report(summary='loss_bbox=inf caused by sample 1 (a.jpg)\n'
                    'more', samples=[SampleFinding(1, 'a.jpg')])
    report.kind = 'data'
    journal.triggered(_event(), 'drop', Answer(bundle='/b', report=report),
                      'drop')
    sample = types.SimpleNamespace(file='a.jpg', indices=[3],
                                   reason='zero width',
                                   iter=3, epoch=0, rank=0, source='drop')
    # The samples listed before the run are not journaled again.
    journal.quarantined(['listed before', sample])
    journal.quarantined(['listed before', sample])
    journal.spiked([types.SimpleNamespace(series='loss', iter=4, value=9.0,
                                          factor=5.0)], 'warn')
    journal.crashed([types.SimpleNamespace(
        run='r0', rank=1, iter=6, epoch=0, files=['b.jpg', None],
        stack='Fatal Python error: Segmentation fault\n\nThread ...')])
    journal.ended(10, 0, 'finished')
    journal.close()
    journal.close()
    lines = _lines(path)
    assert [i.kind for i in lines] == [
        IncidentKind.START, IncidentKind.TRIGGER, IncidentKind.QUARANTINE,
        IncidentKind.SPIKE, IncidentKind.CRASH, IncidentKind.END]
    start, trigger, quarantined, spike, crash, end = lines
    assert (start.world_size, start.policy, start.resume) == (2, 'drop',
                                                              False)
    assert start.dump_dir == str(tmp_path / 'dumps')
    assert (trigger.iter, trigger.act, trigger.diagnosis, trigger.bundle,
            trigger.samples) == (3, 'drop', 'data', '/b', ['a.jpg'])
    # The named cause is one line.
    assert trigger.cause == 'loss_bbox=inf caused by sample 1 (a.jpg)'
    assert (quarantined.samples, quarantined.source) == (['a.jpg'], 'drop')
    assert (spike.series, spike.factor, spike.policy) == ('loss', 5.0,
                                                          'warn')
    assert (crash.died_run, crash.rank, crash.iter) == ('r0', 1, 6)
    assert crash.samples == ['b.jpg', '(no file name)']
    assert 'Segmentation fault' in crash.reason
    assert (end.iter, end.reason) == (10, 'finished')


def test_a_rank_that_did_not_diagnose_names_the_culprit_rank(tmp_path):
    """Under DDP rank 0 writes, and its own batch may be clean: the cause
    and the samples come from every rank's findings."""
    path = str(tmp_path / 'j.jsonl')
    journal = Journal(path, 'r1')
    findings = (RankFinding(0), RankFinding(1, kind='data', samples=[
        SampleFinding(0, 'tile.tif')]))
    journal.triggered(_event(), 'drop', Answer(findings=findings), 'drop')
    (trigger, ) = _lines(path)
    assert trigger.cause == 'rank 1: sample 0 (tile.tif)'
    assert (trigger.samples, trigger.diagnosis) == (['tile.tif'], 'data')
    # No journal on the other ranks.
    other = Journal(None, 'r1')
    other.triggered(_event(), 'drop', Answer(findings=findings), 'drop')
    assert not other.writes and len(_lines(path)) == 1


def test_a_line_is_bounded(tmp_path):
    path = str(tmp_path / 'j.jsonl')
    journal = Journal(path, 'r1')
    files = ['/data/%s/%05d.tif' % ('x' * 100, i) for i in range(200)]
    report = Report(summary='y' * 10000,
                    samples=[SampleFinding(i, f) for i, f in
                             enumerate(files)])
    journal.triggered(_event(), 'skip', Answer(report=report), 'skip')
    with open(path, 'rb') as f:
        raw = f.read()
    assert len(raw) <= MAX_LINE
    (trigger, ) = _lines(path)
    assert 0 < len(trigger.samples) < 200 and trigger.samples == files[
        :len(trigger.samples)]
    assert trigger.more == 200 - len(trigger.samples)
    assert trigger.cause.endswith('...') and len(trigger.cause) < 600


def test_past_its_share_a_run_counts_what_it_leaves_out(tmp_path):
    path = str(tmp_path / 'j.jsonl')
    journal = Journal(path, 'r1', max_run_bytes=1000)
    journal.started(_runner(tmp_path), 'skip', str(tmp_path))
    spikes = [types.SimpleNamespace(series='loss', iter=i, value=9.0,
                                    factor=5.0) for i in range(40)]
    journal.spiked(spikes, 'warn')
    journal.ended(40, 0, 'finished')
    lines = _lines(path)
    spiked = [i for i in lines if i.kind == IncidentKind.SPIKE]
    omitted = [i for i in lines if i.kind == IncidentKind.OMITTED]
    assert 0 < len(spiked) < 40
    # Counted when the count reaches 1, 2, 4, 8, ... and at the end.
    counts = [i.counts['spike'] for i in omitted]
    left_out = 40 - len(spiked)
    assert counts[-1] == left_out and counts[:-1] == [
        2 ** k for k in range(len(counts) - 1)]
    assert lines[0].kind == IncidentKind.START and \
        lines[-1].kind == IncidentKind.END
    # The run's incidents take at most its share.
    assert sum(len(i.to_line()) for i in spiked) <= 1000


def test_a_full_file_takes_nothing_more(tmp_path, caplog):
    path = str(tmp_path / 'j.jsonl')
    with open(path, 'w') as f:
        f.write(Incident('end', 'r0', reason='finished').to_line() * 50)
    size = os.path.getsize(path)
    logger = logging.getLogger('mmnanhook.tests.journal')
    journal = Journal(path, 'r1', max_file_bytes=size + 100, logger=logger)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        journal.ended(1, 0, 'finished')
        journal.ended(1, 0, 'finished')
    assert os.path.getsize(path) == size and not journal.writes
    assert len([r for r in caplog.records
                if 'has reached' in r.getMessage()]) == 1


def test_an_unwritable_work_dir_is_said_and_training_goes_on(
        tmp_path, caplog):
    logger = logging.getLogger('mmnanhook.tests.journal')
    with caplog.at_level(logging.WARNING, logger=logger.name):
        journal = Journal(str(tmp_path / 'missing' / 'j.jsonl'), 'r1',
                          logger=logger)
        journal.ended(1, 0, 'finished')
    assert not journal.writes
    assert 'cannot be opened' in caplog.text


def _writer(path, run, ready):
    """A process that journals spikes until it is killed (forked: this one
    has the package imported already)."""
    pid = os.fork()
    if pid:
        return pid
    try:
        journal = Journal(path, run, max_run_bytes=1 << 40)
        spike = [types.SimpleNamespace(series='loss', iter=0,
                                       value=1.5 ** 40, factor=3.0)]
        os.write(ready, b'.')
        while True:
            journal.spiked(spike, 'warn')
    finally:
        # Never back into the test session.
        os._exit(1)


def test_a_killed_writer_leaves_whole_lines(tmp_path):
    """Two runs' processes append at once and are killed mid-stream: every
    line of the file is one whole incident (one write of one line, to a
    file opened for appending)."""
    path = str(tmp_path / 'j.jsonl')
    ready, told = os.pipe()
    writers = [_writer(path, run, told) for run in ('r1', 'r2')]
    try:
        assert os.read(ready, 1) + os.read(ready, 1) == b'..'
        time.sleep(0.3)
    finally:
        for pid in writers:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(ready)
        os.close(told)
    lines = _lines(path)
    assert {i.run for i in lines} == {'r1', 'r2'} and len(lines) > 10
