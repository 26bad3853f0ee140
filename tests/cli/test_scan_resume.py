"""``mmnan scan --quarantine OUT`` killed midway, then ``--resume``, in fresh
processes as a user runs them: the list on disk while it runs, and the
resumed scan listing what a whole one lists."""
import json
import re
import signal
import time

import pytest

from mmnanhook.cli import main
from mmnanhook.doctor import scan_config
from mmnanhook.quarantine import read_quarantine
from mmnan_testing.cli import message_lines, mmnan
from mmnan_testing.scan import mmnan_process, probed_config


def test_resume_needs_the_quarantine_file(tmp_path, capsys):
    # In this process: the check comes before anything is loaded.
    assert main(['scan', str(tmp_path / 'config.py'), '--resume']) == 2
    out, err = capsys.readouterr()
    assert out == '' and err == (
        'mmnan scan: error: --resume needs --quarantine OUT: the progress of '
        'a scan is kept beside its list\n')


@pytest.mark.mmdet
@pytest.mark.parametrize('workers', ['1', '2'])
def test_a_scan_in_process_puts_the_sigterm_handler_back(tmp_path, capsys,
                                                         workers):
    # A notebook's or a training script's handler (a preemption handler):
    # before issue 52 the scan's stayed, and a child forked later by the
    # process (the index walk) ran it when it was ended.
    path, _ = probed_config(tmp_path, 'retinanet_voc', 8, {3: 'outside'})

    def preempted(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, preempted)
    try:
        assert main(['scan', path, '--no-progress', '--workers',
                     workers]) == 1
        assert signal.getsignal(signal.SIGTERM) is preempted
        assert main(['scan', str(tmp_path / 'missing.py')]) == 2
        assert signal.getsignal(signal.SIGTERM) is preempted
    finally:
        signal.signal(signal.SIGTERM, before)
    assert 'scanned 8 samples: 1 with invalid ground truth' in \
        capsys.readouterr().out


def _record(listed):
    try:
        with open(listed + '.progress') as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _listed(path):
    return [(s.indices, s.file, s.reason) for s in read_quarantine(path)]


@pytest.mark.zoo_full
@pytest.mark.mmdet
@pytest.mark.parametrize('signum', [signal.SIGKILL, signal.SIGTERM],
                         ids=['SIGKILL', 'SIGTERM'])
def test_a_killed_scan_resumed_lists_what_a_whole_scan_lists(tmp_path,
                                                             signum):
    """Zoo tier: two fresh ``mmnan scan`` processes a case (their imports
    take about 5 s each); the first is held at sample 40 until it is
    killed, so a loaded machine cannot let it end first."""
    log = str(tmp_path / 'seen.txt')
    release = str(tmp_path / 'release')
    # 0.1 s a sample: the chunks of 16 end at 1.6 s and 3.2 s, and the scan
    # saves (at most once a second, or 20 times a slow save's length apart)
    # at one of them before the hold.
    path, _ = probed_config(
        tmp_path, 'retinanet_voc', 48,
        {3: 'zero_size', 20: 'outside', 40: 'inverted'}, delay=0.1, log=log,
        hold_from=40, release=release)
    listed = str(tmp_path / 'quarantine.json')
    process = mmnan_process('scan', path, '--quarantine', listed,
                            '--no-progress')
    try:
        deadline = time.time() + 300
        while (_record(listed) or {}).get('next', 0) < 16:
            assert process.poll() is None and time.time() < deadline
            time.sleep(0.05)
        # Before the scan ends, the list on disk holds what it found.
        found = [entry[0] for entry in _listed(listed)]
        assert process.poll() is None
        assert found and found == [[3], [20], [40]][:len(found)]
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    if signum == signal.SIGTERM:
        # A kill that can be handled saves what is done and says how to go
        # on.
        assert process.returncode == 130, stderr
        assert message_lines(stderr)[-1].startswith(
            'mmnan scan: interrupted; the samples found so far are in ')
    else:
        assert process.returncode == -signal.SIGKILL
    stopped = _record(listed)['next']
    assert 16 <= stopped < 48

    open(release, 'w').close()
    open(log, 'w').close()
    resumed = mmnan('scan', path, '--quarantine', listed, '--resume',
                    '--no-progress')
    assert resumed.returncode == 1, resumed.stdout + resumed.stderr
    with open(log) as f:
        assert sorted(int(i) for i in f.read().split()) == list(
            range(stopped, 48))

    whole = str(tmp_path / 'whole.json')
    _, bad, _ = scan_config(path, progress=False, quarantine=whole)
    assert [b.index for b in bad] == [3, 20, 40]
    assert _listed(listed) == _listed(whole)
    assert re.findall(r'^sample (\d+) (.+):$', resumed.stdout,
                      re.MULTILINE) == [(str(b.index), b.img_path)
                                        for b in bad]
    assert 'scanned 48 samples: 3 with invalid ground truth' in \
        resumed.stdout
