"""``mmnan inspect WORK_DIR`` on a work dir made by hand (no training: the
journal written by the run's own :class:`~mmnanhook.run._journal.Journal`,
bundles' JSON, a quarantine list, logged scalars, a pending crash record):
the story in order, ``--json`` read back, a corrupt or missing journal named
and the rest told, a quiet work dir in one line, and the page rendered in
real headless Chromium. The same on real runs: ``test_story_runs.py``."""
import base64
import html
import json
import os
import os.path as osp
import re
import types

import cv2
import numpy as np
import pytest

from mmnanhook.bundle import MANIFEST
from mmnanhook.cli import main
from mmnanhook.cli._story import Story
from mmnanhook.cli._story_page import MARK_COLOURS
from mmnanhook.quarantine import (FlightRecorder, QuarantinedSample,
                                  flight_dir, write_quarantine)
from mmnanhook.records import NonFiniteEvent, Report, SampleFinding, Trigger
from mmnanhook.recovery import Answer
from mmnanhook.run._journal import Journal
from mmnan_testing import browser

needs_chromium = pytest.mark.skipif(browser.chromium() is None,
                                    reason=browser.SKIP_REASON)

RUN1, RUN2, RUN3 = '20261207_100000', '20261207_110000', '20261207_120000'


def _png(path, colour, size=48):
    image = np.zeros((size, size, 3), np.uint8)
    image[:] = (40, 40, 40)
    image[8:-8, 8:-8] = colour
    cv2.imwrite(path, image)


def _bundle(dump_dir, run, iter, sample):
    """A bundle's JSON, one picture of ``sample`` and its report.html."""
    path = osp.join(dump_dir, '20261207T10%04d_iter%06d_rank0' % (iter,
                                                                  iter))
    os.makedirs(path)
    _png(osp.join(path, 'sample1_input.png'), (0, 0, 255))
    with open(osp.join(path, 'report.html'), 'w') as f:
        f.write('<html><body>report of iter %d</body></html>' % iter)
    report = dict(kind='data', summary='loss_bbox=inf caused by sample 1 '
                  '(%s): gt box 0 has zero width (w=0)' % sample,
                  samples=[dict(index=1, img_path=sample, problems=[])])
    with open(osp.join(path, 'report.json'), 'w') as f:
        json.dump(report, f)
    files = [dict(name=name, size=os.path.getsize(osp.join(path, name)),
                  sha256='0' * 64)
             for name in sorted(os.listdir(path))]
    with open(osp.join(path, MANIFEST), 'w') as f:
        json.dump(dict(run=run, iter=iter, rank=0, epoch=0, trigger='loss',
                       format_version=1, files=files), f)
    return path, Report(summary=report['summary'],
                        samples=[SampleFinding(1, sample)])


def _scalars(work_dir, run, iters, spike=None):
    vis = osp.join(work_dir, run, 'vis_data')
    os.makedirs(vis)
    with open(osp.join(vis, 'scalars.json'), 'w') as f:
        for i in iters:
            f.write(json.dumps(dict(lr=0.01, loss=2.0 - 0.05 * i + (
                20.0 if i == spike else 0.0), grad_norm=5.0 + i,
                iter=i + 1, step=i + 1)) + '\n')
        # A validation line: no loss.
        f.write(json.dumps(dict(step=1, coco_bbox_mAP=0.1)) + '\n')


def _runner(work_dir, run, iter, resume):
    return types.SimpleNamespace(iter=iter, epoch=0, _resume=resume,
                                 log_dir=osp.join(work_dir, run),
                                 work_dir=work_dir)


def _event(iter, trigger=Trigger.LOSS):
    return NonFiniteEvent(trigger, 'at iter %d' % iter, iter=iter, epoch=0,
                          bad_ranks=[0])


def _sample(file, iter, source, reason):
    return QuarantinedSample([0], file, reason, iter=iter, epoch=0, rank=0,
                             source=source)


@pytest.fixture
def work_dir(tmp_path):
    """Two runs: the first drops a sample at 3, spikes at 4, skips 5 and
    dies in 6; the second resumes at 6, quarantines what was in flight,
    drops a sample at 8 and finishes. A third run died in 2 and nothing has
    read its crash record yet."""
    work = str(tmp_path / 'work')
    data = str(tmp_path / 'data')
    os.makedirs(data)
    images = dict((name, osp.join(data, name + '.png'))
                  for name in ('a', 'c', 'd', 'e', 'f'))
    for name, path in images.items():
        _png(path, (0, 200, 0))
    dumps = osp.join(work, 'nan_dumps')
    first, first_report = _bundle(dumps, RUN1, 3, images['a'])
    second, second_report = _bundle(dumps, RUN2, 8, images['e'])
    _scalars(work, RUN1, range(0, 6), spike=4)
    _scalars(work, RUN2, range(6, 10))
    os.makedirs(osp.join(work, RUN3))
    path = osp.join(work, 'nan_journal.jsonl')
    quarantine = osp.join(work, 'nan_quarantine.json')
    spike = types.SimpleNamespace(series='loss', iter=4, value=22.0,
                                  factor=11.0)
    journal = Journal(path, RUN1)
    journal.started(_runner(work, RUN1, 0, False), 'drop', dumps)
    journal.triggered(_event(3), 'drop', Answer(bundle=first,
                                                report=first_report), 'drop')
    samples = [_sample(images['a'], 3, 'drop', 'gt box 0 has zero width')]
    journal.quarantined(samples)
    journal.spiked([spike], 'warn')
    journal.triggered(_event(5, Trigger.GRAD), 'drop', Answer(), 'skip')
    journal.close()
    journal = Journal(path, RUN2)
    # Resumed: the list it reads back was journaled by the first run.
    journal.started(_runner(work, RUN2, 6, True), 'drop', dumps,
                    types.SimpleNamespace(path=quarantine,
                                          samples=list(samples)))
    journal.crashed([types.SimpleNamespace(
        run=RUN1, rank=0, iter=6, epoch=0, files=[images['c'],
                                                  images['d']], stack='')])
    samples += [_sample(images[n], 6, 'crash', 'in flight when run %s died'
                        % RUN1) for n in 'cd']
    journal.quarantined(samples)
    journal.triggered(_event(8), 'drop', Answer(bundle=second,
                                                report=second_report), 'drop')
    samples.append(_sample(images['e'], 8, 'drop', 'gt box 0 has zero '
                           'width'))
    journal.quarantined(samples)
    journal.ended(10, 0, 'finished')
    journal.close()
    write_quarantine(quarantine, samples)
    # The third run's record of a step it never finished.
    FlightRecorder(flight_dir(work), RUN3, 0).begin(2, 0, [images['f']])
    return dict(work=work, images=images, bundles=[first, second])


def _inspect(capsys, *args):
    code = main(['inspect'] + [str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _incidents(out):
    """``(run, iter, what)`` of each incident line, in order."""
    found, run = [], None
    for line in out.splitlines():
        head = re.match(r'^run (\d{8}_\d{6})', line)
        if head:
            run = head.group(1)
        hit = re.match(r'^  iter (\d+) +(\S.*)$', line)
        if hit:
            found.append((run, int(hit.group(1)), hit.group(2)))
    return found


def test_every_incident_in_order(work_dir, capsys):
    code, out, err = _inspect(capsys, work_dir['work'])
    assert code == 0 and err == ''
    images = work_dir['images']
    told = [(run, it, what.split(':')[0]) for run, it, what in
            _incidents(out)]
    assert told == [
        (RUN1, 3, 'loss trigger -> the step taken again without the named '
         'samples'),
        (RUN1, 3, 'quarantined %s (drop, rank 0)' % images['a']),
        (RUN1, 4, 'loss spike'),
        (RUN1, 5, 'grad trigger -> the step skipped'),
        (RUN1, 6, 'rank 0 died inside the step'),
        (RUN2, 6, 'quarantined %s (crash, rank 0)' % images['c']),
        (RUN2, 6, 'quarantined %s (crash, rank 0)' % images['d']),
        (RUN2, 8, 'loss trigger -> the step taken again without the named '
         'samples'),
        (RUN2, 8, 'quarantined %s (drop, rank 0)' % images['e']),
        (RUN3, 2, 'rank 0 died inside the step')]
    # The crash record still in nan_flight/ is said as before, first.
    assert out.startswith('run %s, rank 0 (pid %d) died in train iteration '
                          '2' % (RUN3, os.getpid()))
    assert 'resumed at iter 6, continuing run %s' % RUN1 in out
    assert 'found by run %s at its start' % RUN2 in out
    assert 'ended at iter 10: finished' in out
    for bundle in work_dir['bundles']:
        assert 'bundle: %s (' % bundle in out
    assert re.search(r'^totals: 3 triggers \(1 skipped, 2 taken again '
                     r'without samples, 0 rewound, 0 warned, 0 stopped the '
                     r'run\); 1 step left out; 1 spike; 2 crashes; 4 '
                     r'samples quarantined; 2 bundles, ', out, re.M), out
    # Each quarantined sample: why, when, by which run.
    assert '%s: gt box 0 has zero width (drop, iter 8, rank 0, run %s)' % (
        images['e'], RUN2) in out


def test_json_is_the_story_read_back(work_dir, capsys):
    code, out, err = _inspect(capsys, '--json', work_dir['work'])
    assert code == 0 and err == ''
    data = json.loads(out)
    assert Story.from_dict(data).to_dict() == data
    story = Story.from_dict(data)
    assert [r.run for r in story.runs] == [RUN1, RUN2, RUN3]
    assert story.runs[1].continues == RUN1 and story.runs[1].start_iter == 6
    assert [e.incident.iter for e in story.runs[0].entries] == [
        3, 3, 4, 5, 6]
    assert (story.runs[0].logged, story.runs[0].last_logged) == (6, 5)
    assert (story.totals.triggers, story.totals.dropped, story.totals.skipped,
            story.totals.crashes, story.totals.quarantined,
            story.totals.bundles) == (3, 2, 1, 2, 4, 2)
    assert story.totals.bundle_bytes == sum(
        b.bytes for b in story.bundles) > 0


def test_a_corrupt_journal_is_named_and_the_rest_is_told(work_dir, capsys):
    path = osp.join(work_dir['work'], 'nan_journal.jsonl')
    with open(path) as f:
        lines = f.readlines()
    lines.insert(3, '{"journal": 1, "kind": "trigger"\n')
    lines.insert(5, 'garbage\n')
    with open(path, 'w') as f:
        # The last line cut short, as a process killed while writing it.
        f.write(''.join(lines) + '{"journal": 1, "kind": "sp')
    code, out, err = _inspect(capsys, work_dir['work'])
    assert code == 0
    (warning, ) = err.splitlines()
    assert warning.startswith('mmnan inspect: warning: %s: 3 of its ' % path)
    assert 'lines 4, 6, %d left out' % (len(lines) + 1) in warning
    assert 'loss spike' in out and 'ended at iter 10: finished' in out


def test_without_a_journal_the_rest_is_told(work_dir, capsys):
    path = osp.join(work_dir['work'], 'nan_journal.jsonl')
    os.remove(path)
    code, out, err = _inspect(capsys, work_dir['work'])
    assert code == 0
    (warning, ) = err.splitlines()
    assert warning.startswith('mmnan inspect: warning: no journal (%s)' %
                              path)
    # The bundles' triggers, the quarantine and the crash record remain.
    told = _incidents(out)
    assert [(run, it) for run, it, what in told if 'trigger' in what] == [
        (RUN1, 3), (RUN2, 8)]
    assert [(run, it) for run, it, what in told if 'died' in what] == [
        (RUN3, 2)]
    assert 'quarantine: 4 samples' in out


def test_a_work_dir_without_incidents_says_so_in_one_line(tmp_path, capsys):
    work = str(tmp_path / 'work')
    _scalars(work, RUN1, range(4))
    journal = Journal(osp.join(work, 'nan_journal.jsonl'), RUN1)
    journal.started(_runner(work, RUN1, 0, False), 'raise',
                    osp.join(work, 'nan_dumps'))
    journal.ended(4, 0, 'finished')
    journal.close()
    code, out, err = _inspect(capsys, work)
    assert code == 0 and err == ''
    assert out.splitlines() == [
        '%s: no incident in 1 run (%s): nothing triggered, spiked or was '
        'quarantined, and no run with mmnanhook died inside a train step '
        'here' % (work, RUN1)]


def test_out_is_for_a_work_dir_only(work_dir, capsys):
    code, out, err = _inspect(capsys, '--out', 'x.html',
                              work_dir['bundles'][0])
    assert code == 2 and out == ''
    assert 'is no work dir' in err


def _inline_pngs(dom):
    return [cv2.imdecode(np.frombuffer(base64.b64decode(data), np.uint8),
                         cv2.IMREAD_COLOR)
            for data in re.findall(r'src="data:image/png;base64,([^"]+)"',
                                   dom)]


def _colour_pixels(shot, colour):
    """How many pixels of ``shot`` (BGR) are ``colour`` (``#rrggbb``)."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    near = np.abs(shot.astype(int) - np.array(rgb[::-1])).sum(axis=2) < 40
    return int(near.sum())


@needs_chromium
def test_the_page_renders_with_the_plot_the_marks_and_the_gallery(
        work_dir, capsys, tmp_path):
    code, out, err = _inspect(capsys, '--html', work_dir['work'])
    assert code == 0
    page = out.strip()
    assert page == osp.join(work_dir['work'], 'nan_inspect.html')
    with open(page) as f:
        source = f.read()
    # Self-contained: nothing to fetch, no script.
    assert not re.search(r'(src|href)="(https?:)?//', source)
    assert '<script' not in source
    dom = browser.dump_dom(page, str(tmp_path))
    marks = re.findall(r'<g class="mark mark-(\w+)" id="mark-\d+" '
                       r'data-iter="(\d+)"', dom)
    assert sorted((int(i), k) for k, i in marks) == sorted([
        (3, 'drop'), (3, 'quarantine'), (4, 'spike'), (5, 'skip'),
        (6, 'crash'), (6, 'quarantine'), (6, 'quarantine'), (8, 'drop'),
        (8, 'quarantine'), (2, 'crash')])
    # A trigger's mark links to its bundle's report, relative to the page.
    links = re.findall(r'<a href="([^"]+)"><g class="mark mark-drop"', dom)
    assert sorted(links) == sorted(
        osp.relpath(osp.join(b, 'report.html'), work_dir['work'])
        for b in work_dir['bundles'])
    for link in links:
        assert osp.isfile(osp.join(work_dir['work'], link))
    # Both runs' lines.
    assert len(re.findall(r'<polyline stroke=', dom)) == 4
    text = html.unescape(re.sub(r'\s+', ' ', re.sub(r'<[^>]+>', ' ', dom)))
    assert 'resumed at iter 6' in text
    # The gallery: the bundles' pictures of the dropped samples, the files
    # of those in flight when the run died.
    inline = _inline_pngs(dom)
    bundle_picture = cv2.imread(osp.join(work_dir['bundles'][0],
                                         'sample1_input.png'))
    assert sum((p.shape == bundle_picture.shape and (p == bundle_picture)
                .all()) for p in inline) == 2
    assert len(inline) == 4
    shot = cv2.imread(browser.screenshot(page, str(tmp_path),
                                         size=(1200, 900)))
    assert shot.std() > 10
    # The marks are drawn: the drops' and the crashes' colours are there.
    for kind in ('drop', 'skip', 'crash', 'spike'):
        assert _colour_pixels(shot[:700], MARK_COLOURS[kind]) > 20, kind
