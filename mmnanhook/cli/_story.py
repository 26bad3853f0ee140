"""What happened to a work dir's runs: ``mmnan inspect WORK_DIR``.

:func:`read_story` reads a work dir's files, and only its files: the
incident journal (``nan_journal.jsonl``, :mod:`mmnanhook.records._journal`),
the bundles' ``manifest.json`` and ``report.json``, the quarantine lists,
the crash records (``nan_flight/``) and each timestamped log dir's scalars
(MMEngine's ``vis_data/scalars.json``, else ``vis_data/{run}.json``). It
executes nothing and unpickles nothing. A file that cannot be read is one
line of :attr:`Story.problems` naming it, and the rest is read.

The result is a :class:`Story`: every run (by its timestamp; a resumed run
names the run it continues), each with its incidents in order (the triggers
and what became of each step, spikes, the crashes found, the samples
quarantined), the quarantine, the bundles and the totals.
:meth:`Story.to_dict` is ``--json``'s output, which :meth:`Story.from_dict`
reads back. The scalars for the page's plot are kept apart
(:class:`Scalars`): a long run logs too many of them for a script's JSON.

Over 500 lines because it is one concern, the story's records and how each
file of a work dir becomes one of them (journal, bundles, quarantine, crash
records, logs' scalars), every reader tolerant of a file cut short or
foreign; the page that draws it is :mod:`._story_page`.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import os.path as osp
import re
from typing import Any, Dict, List, Optional, Tuple

from ..bundle import MANIFEST, REPORT, REPORT_HTML
from ..quarantine import (FILE_NAME, QuarantineError, flight_dir,
                          read_flights, read_quarantine)
from ..records import (JOURNAL_FILE, Incident, IncidentKind, crash_reason,
                       in_flight, quarantined_name)

STORY_FORMAT = 'mmnanhook-story'
STORY_VERSION = 1
# mmengine's run timestamp (``%Y%m%d_%H%M%S``): the name of a run's log dir.
_RUN_NAME = re.compile(r'^\d{8}_\d{6}$')
# Lines of a journal that cannot be read, named in its problem line.
_NAMED_LINES = 5


def _plain(value):
    """``value`` as strict JSON holds it."""
    if hasattr(value, 'to_dict'):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return dict((str(k), _plain(v)) for k, v in value.items())
    if isinstance(value, float) and not math.isfinite(value):
        return 'nan' if math.isnan(value) else (
            'inf' if value > 0 else '-inf')
    return value


def _of(record, default=None):
    """A field holding :class:`_Record` s (or one) of type ``record``."""
    if default is None:
        return dataclasses.field(default=None, metadata=dict(of=record))
    return dataclasses.field(default_factory=default,
                             metadata=dict(of=record))


class _Record(object):
    """``to_dict`` / ``from_dict`` from the dataclass's fields (one source
    of truth for them)."""

    def to_dict(self) -> Dict[str, Any]:
        return dict((f.name, _plain(getattr(self, f.name)))
                    for f in dataclasses.fields(self))

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> Any:
        """Read back :meth:`to_dict`.

        Raises:
            ValueError: Not such a record.
        """
        if not isinstance(data, dict):
            raise ValueError('not a %s: %r' % (cls.__name__, data))
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            value, record = data[f.name], f.metadata.get('of')
            if record is not None and isinstance(value, list):
                value = [record.from_dict(v) for v in value]
            elif record is not None and value is not None:
                value = record.from_dict(value)
            values[f.name] = value
        return cls(**values)


@dataclasses.dataclass
class BundleRef(_Record):
    """A bundle of the work dir's runs, as its ``manifest.json`` and
    ``report.json`` say.

    Args:
        path (str): Its directory.
        run (str, optional): The run that wrote it.
        iter (int, optional): The trigger's iteration.
        rank (int, optional): The rank that wrote it.
        trigger (str, optional): What triggered.
        kind (str, optional): The diagnosis' kind.
        summary (str, optional): The diagnosis' summary.
        bytes (int): Its files' bytes.
        report_html (bool): It holds ``report.html``.
        pictures (dict): Image file of an implicated sample -> the bundle's
            pictures of it (``sample<i>_input.png``, ``sample<i>_file.png``).
    """

    path: str
    run: Optional[str] = None
    iter: Optional[int] = None
    rank: Optional[int] = None
    trigger: Optional[str] = None
    kind: Optional[str] = None
    summary: Optional[str] = None
    bytes: int = 0
    report_html: bool = False
    pictures: Dict[str, List[str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Entry(_Record):
    """One incident of a run's story.

    Args:
        incident (Incident): What the journal says (or, where it says
            nothing, what a bundle or a crash record does).
        bundles (list[str]): A trigger's bundles that are in the work dir's
            bundle directories (every rank's).
        found_by (str, optional): A crash's: the run that found its record
            at its start; ``None``: the record is still in ``nan_flight/``.
        journaled (bool): Whether the journal holds it.
    """

    incident: Incident = _of(Incident)
    bundles: List[str] = dataclasses.field(default_factory=list)
    found_by: Optional[str] = None
    journaled: bool = True


@dataclasses.dataclass
class QuarantineEntry(_Record):
    """A quarantined sample.

    Args:
        file (str, optional): Its image file.
        indices (list[int]): Its dataset indices.
        reason (str): Why.
        iter, epoch, rank (int, optional): Where it failed.
        source (str): Who quarantined it (``drop``, ``skip``, ``crash``,
            ``scan``...).
        run (str, optional): The run that quarantined it (from the journal).
        list_file (str): The quarantine list that holds it.
        bundle (str, optional): A bundle with pictures of it.
    """

    file: Optional[str] = None
    indices: List[int] = dataclasses.field(default_factory=list)
    reason: str = ''
    iter: Optional[int] = None
    epoch: Optional[int] = None
    rank: Optional[int] = None
    source: str = ''
    run: Optional[str] = None
    list_file: str = ''
    bundle: Optional[str] = None


@dataclasses.dataclass
class RunStory(_Record):
    """One run of the work dir (one ``Runner.train()``, one log dir).

    Args:
        run (str): Its timestamp (its log dir's name).
        journaled (bool): The journal has its start.
        log_dir (str, optional): Its log dir.
        start_iter (int, optional): The iteration it began or resumed at.
        world_size (int, optional): Its ranks.
        policy (str, optional): The hook's policy.
        resumed (bool, optional): It resumed from a checkpoint.
        continues (str, optional): The run before it, which it resumed.
        ended (str, optional): How it ended: ``finished`` or its error;
            ``None``: not recorded (it died, or still runs).
        end_iter (int, optional): The iteration it ended at.
        scalars (str, optional): The scalars file read for it.
        logged (int): Iterations of it in that file.
        last_logged (int, optional): Its last logged iteration (0-based).
        entries (list[Entry]): Its incidents, in order.
        omitted (dict): Journal lines it left out (its share was full),
            by kind.
    """

    run: str = ''
    journaled: bool = False
    log_dir: Optional[str] = None
    start_iter: Optional[int] = None
    world_size: Optional[int] = None
    policy: Optional[str] = None
    resumed: Optional[bool] = None
    continues: Optional[str] = None
    ended: Optional[str] = None
    end_iter: Optional[int] = None
    scalars: Optional[str] = None
    logged: int = 0
    last_logged: Optional[int] = None
    entries: List[Entry] = _of(Entry, list)
    omitted: Dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Totals(_Record):
    """What the runs came to.

    Args:
        triggers (int): Triggers.
        skipped (int): Steps left out (``skip``).
        dropped (int): Steps taken again without samples (``drop``).
        rewinds (int): Rewinds.
        rewound_steps (int): Steps a rewind undid, its own included.
        steps_left_out (int): ``skipped + rewound_steps``.
        raised (int): Triggers that stopped their run.
        warned (int): Triggers whose step was applied (``warn``).
        spikes (int): Spikes.
        crashes (int): Ranks of runs that died inside a step.
        quarantined (int): Samples in the quarantine lists (by file).
        bundles (int): Bundles in the bundle directories.
        bundle_bytes (int): Their bytes.
        omitted (int): Journal lines the runs left out.
    """

    triggers: int = 0
    skipped: int = 0
    dropped: int = 0
    rewinds: int = 0
    rewound_steps: int = 0
    steps_left_out: int = 0
    raised: int = 0
    warned: int = 0
    spikes: int = 0
    crashes: int = 0
    quarantined: int = 0
    bundles: int = 0
    bundle_bytes: int = 0
    omitted: int = 0


@dataclasses.dataclass
class Story(_Record):
    """What happened to a work dir's runs.

    Args:
        work_dir (str): The work dir.
        journal (str, optional): The journal read; ``None``: none.
        runs (list[RunStory]): Its runs, oldest first.
        quarantine (list[QuarantineEntry]): Every quarantined sample.
        bundles (list[BundleRef]): Every bundle of its bundle directories.
        totals (Totals): What it came to.
        problems (list[str]): One line per file that could not be read.
        format (str): :data:`STORY_FORMAT`.
        version (int): :data:`STORY_VERSION`.
    """

    work_dir: str = ''
    journal: Optional[str] = None
    runs: List[RunStory] = _of(RunStory, list)
    quarantine: List[QuarantineEntry] = _of(QuarantineEntry, list)
    bundles: List[BundleRef] = _of(BundleRef, list)
    totals: Totals = _of(Totals, Totals)
    problems: List[str] = dataclasses.field(default_factory=list)
    format: str = STORY_FORMAT
    version: int = STORY_VERSION

    @property
    def quiet(self) -> bool:
        """Nothing happened: no incident, quarantined sample or bundle."""
        return not (any(r.entries for r in self.runs) or self.quarantine
                    or self.bundles)

    def bundle(self, path: str) -> Optional[BundleRef]:
        """The bundle at ``path``, if it is there."""
        return next((b for b in self.bundles if b.path == path), None)


@dataclasses.dataclass
class Scalars(object):
    """A run's logged scalars (the page's plot).

    Args:
        run (str): The run.
        iters (list[int]): 0-based iterations (MMEngine logs them 1-based).
        loss (list[float | None]): ``loss`` there.
        grad_norm (list[float | None]): ``grad_norm`` there.
    """

    run: str
    iters: List[int] = dataclasses.field(default_factory=list)
    loss: List[Optional[float]] = dataclasses.field(default_factory=list)
    grad_norm: List[Optional[float]] = dataclasses.field(
        default_factory=list)


def is_work_dir(path: str) -> bool:
    """Whether ``path`` is a training work dir (not a bundle): no
    ``manifest.json``, and a journal, a crash record, a quarantine list, a
    bundle directory or a run's log dir in it."""
    if not osp.isdir(path) or osp.exists(osp.join(path, MANIFEST)):
        return False
    if any(osp.exists(osp.join(path, name)) for name in (
            JOURNAL_FILE, FILE_NAME, 'nan_dumps', flight_dir(''))):
        return True
    return bool(_log_dirs(path))


def _log_dirs(work_dir):
    """``{run: log dir}`` of the timestamped log dirs in ``work_dir``."""
    try:
        names = os.listdir(work_dir)
    except OSError:
        return {}
    return dict((name, osp.join(work_dir, name)) for name in names
                if _RUN_NAME.match(name) and osp.isdir(osp.join(work_dir,
                                                                name)))


def read_journal(path: str) -> Tuple[List[Incident], Optional[str]]:
    """The incidents of a journal file, and one line naming it when some of
    its lines could not be read (``None`` when all could).

    Raises:
        OSError: It cannot be read at all.
    """
    incidents, bad, total = [], [], 0
    with open(path, 'rb') as f:
        for number, raw in enumerate(f, 1):
            total = number
            try:
                if not raw.endswith(b'\n'):
                    # A line a killed process left unfinished.
                    raise ValueError('cut short')
                incidents.append(Incident.from_line(raw.decode('utf-8')))
            except (ValueError, TypeError, UnicodeDecodeError):
                bad.append(number)
    if not bad:
        return incidents, None
    return incidents, ('%s: %d of its %d lines are not incidents of this '
                       'mmnanhook (corrupt, cut short, or of another '
                       'version): line%s %s%s left out' % (
                           path, len(bad), total, 's' if len(bad) > 1 else '',
                           ', '.join(map(str, bad[:_NAMED_LINES])),
                           ', ...' if len(bad) > _NAMED_LINES else ''))


def read_scalars(log_dir: str, run: str
                 ) -> Tuple[Optional[str], Optional[Scalars], Optional[str]]:
    """The train scalars a run's log dir holds: MMEngine's
    ``vis_data/scalars.json`` (LocalVisBackend), else the logger's
    ``vis_data/{run}.json``.

    Returns:
        tuple: ``(file, scalars, problem)``: ``(None, None, None)`` when
        neither is there (the config has no ``LocalVisBackend``).
    """
    for name in ('scalars.json', run + '.json'):
        path = osp.join(log_dir, 'vis_data', name)
        if osp.isfile(path):
            break
    else:
        return None, None, None
    scalars, bad = Scalars(run), 0
    try:
        with open(path, 'rb') as f:
            for raw in f:
                try:
                    line = json.loads(raw.decode('utf-8'))
                    step = line.get('step', line.get('iter'))
                except (ValueError, UnicodeDecodeError, AttributeError):
                    bad += 1
                    continue
                if not isinstance(step, int) or (
                        'loss' not in line and 'grad_norm' not in line):
                    # A validation line, or another tag's.
                    continue
                scalars.iters.append(step - 1)
                scalars.loss.append(_number(line.get('loss')))
                scalars.grad_norm.append(_number(line.get('grad_norm')))
    except OSError as error:
        return path, None, '%s cannot be read: %s' % (path, error)
    problem = '%s: %d lines are not JSON: left out' % (path, bad) \
        if bad else None
    return path, scalars, problem


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def read_bundle_ref(path: str) -> BundleRef:
    """What a bundle's ``manifest.json`` and ``report.json`` say (JSON
    only: nothing of it is unpickled, executed, or checked against its
    sha256: that is ``mmnan inspect BUNDLE``'s).

    Raises:
        ValueError: Its manifest is not a bundle's.
        OSError: It cannot be read.
    """
    with open(osp.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or not isinstance(
            manifest.get('files'), list):
        raise ValueError('not a bundle\'s manifest')
    names = dict((f.get('name'), f.get('size') or 0)
                 for f in manifest['files'] if isinstance(f, dict))
    report = {}
    if REPORT in names:
        try:
            with open(osp.join(path, REPORT)) as f:
                report = json.load(f)
        except (OSError, ValueError):
            report = {}
    report = report if isinstance(report, dict) else {}
    pictures = {}
    for sample in report.get('samples') or []:
        if not isinstance(sample, dict) or not sample.get('img_path'):
            continue
        found = ['sample%s_%s.png' % (sample.get('index'), view)
                 for view in ('input', 'file')]
        found = [n for n in found if n in names]
        if found:
            pictures[str(sample['img_path'])] = found
    return BundleRef(
        path=osp.abspath(path), run=_str(manifest.get('run')),
        iter=_int(manifest.get('iter')), rank=_int(manifest.get('rank')),
        trigger=_str(manifest.get('trigger')), kind=_str(report.get('kind')),
        summary=_str(report.get('summary')),
        bytes=sum(int(s) for s in names.values() if isinstance(s, int)),
        report_html=REPORT_HTML in names, pictures=pictures)


def _str(value):
    return None if value is None else str(value)


def _int(value):
    return value if isinstance(value, int) and not isinstance(
        value, bool) else None


def read_story(work_dir: str) -> Tuple[Story, List[Scalars]]:
    """The story of ``work_dir``'s runs, and each run's scalars.

    Args:
        work_dir (str): A training work dir.

    Returns:
        tuple: ``(story, scalars)``.
    """
    work_dir = osp.abspath(work_dir)
    story = Story(work_dir=work_dir)
    journal_path = osp.join(work_dir, JOURNAL_FILE)
    incidents = []
    if osp.exists(journal_path):
        try:
            incidents, problem = read_journal(journal_path)
            story.journal = journal_path
            if problem:
                story.problems.append(problem)
        except OSError as error:
            story.problems.append('%s cannot be read (%s): the runs are told '
                                  'from their bundles, the quarantine and '
                                  'the crash records alone' % (
                                      journal_path, error))
    else:
        story.problems.append(
            'no journal (%s): the runs are told from their bundles, the '
            'quarantine and the crash records alone' % journal_path)
    starts = [i for i in incidents if i.kind == IncidentKind.START]
    runs = dict((r, RunStory(run=r, log_dir=d))
                for r, d in _log_dirs(work_dir).items())
    for start in starts:
        run = runs.setdefault(start.run, RunStory(run=start.run))
        run.journaled = True
        run.log_dir = start.log_dir or run.log_dir
        run.start_iter, run.world_size = start.iter, start.world_size
        run.policy, run.resumed = start.policy, start.resume
    story.bundles = _bundles(work_dir, starts, story.problems)
    _tell(story, runs, incidents)
    _crashes_in_flight(story, runs, work_dir)
    _bundles_untold(story, runs)
    story.runs = [runs[r] for r in sorted(runs)]
    previous = None
    for run in story.runs:
        if run.resumed and previous is not None:
            run.continues = previous.run
        run.entries.sort(key=lambda e: (e.incident.iter is None,
                                        e.incident.iter or 0))
        previous = run
    story.quarantine = _quarantine(work_dir, starts, incidents, story)
    scalars = []
    for run in story.runs:
        if run.log_dir is None or not osp.isdir(run.log_dir):
            continue
        path, series, problem = read_scalars(run.log_dir, run.run)
        if problem:
            story.problems.append(problem)
        if series is not None:
            run.scalars, run.logged = path, len(series.iters)
            run.last_logged = series.iters[-1] if series.iters else None
            scalars.append(series)
    story.totals = _totals(story)
    return story, scalars


def _bundles(work_dir, starts, problems):
    """Every bundle of the runs' bundle directories."""
    dirs = [osp.join(work_dir, 'nan_dumps')] + [
        s.dump_dir for s in starts if s.dump_dir]
    found, seen = [], set()
    for directory in dirs:
        directory = osp.abspath(directory)
        if directory in seen or not osp.isdir(directory):
            continue
        seen.add(directory)
        for path in sorted(glob.glob(osp.join(glob.escape(directory), '*',
                                              MANIFEST))):
            path = osp.dirname(path)
            try:
                found.append(read_bundle_ref(path))
            except (OSError, ValueError, TypeError, AttributeError) as error:
                problems.append('%s is not a readable bundle (%s): left '
                                'out' % (path, error))
    return found


def _tell(story, runs, incidents):
    """Each journaled incident into its run's entries: a crash into the
    run that died (found by the run that journaled it); a trigger with its
    bundles."""
    for incident in incidents:
        if incident.kind == IncidentKind.START:
            continue
        if incident.kind == IncidentKind.END:
            run = runs.setdefault(incident.run, RunStory(run=incident.run))
            run.ended, run.end_iter = incident.reason, incident.iter
            continue
        if incident.kind == IncidentKind.OMITTED:
            # The last summary holds the run's total.
            runs.setdefault(incident.run, RunStory(
                run=incident.run)).omitted = dict(incident.counts)
            continue
        entry = Entry(incident)
        owner = incident.run
        if incident.kind == IncidentKind.CRASH and incident.died_run:
            owner, entry.found_by = incident.died_run, incident.run
        elif incident.kind == IncidentKind.TRIGGER:
            entry.bundles = _trigger_bundles(story, incident)
        runs.setdefault(owner, RunStory(run=owner)).entries.append(entry)


def _trigger_bundles(story, incident):
    """The bundles of a trigger: its run's at its iteration (every rank's),
    and the one the journal names."""
    paths = [b.path for b in story.bundles
             if b.run == incident.run and b.iter == incident.iter]
    if incident.bundle and incident.bundle not in paths and \
            story.bundle(osp.abspath(incident.bundle)) is not None:
        paths.insert(0, osp.abspath(incident.bundle))
    return paths


def _crashes_in_flight(story, runs, work_dir):
    """The crash records still in ``nan_flight/`` (no run started since
    to find them), unless the journal has them."""
    told = set((e.incident.died_run, e.incident.rank) for r in runs.values()
               for e in r.entries if e.incident.kind == IncidentKind.CRASH)
    for flight in read_flights(flight_dir(work_dir)):
        if (flight.run, flight.rank) in told:
            continue
        how = crash_reason(flight.stack)
        incident = Incident(
            IncidentKind.CRASH, flight.run, time=flight.time,
            iter=flight.iter, epoch=flight.epoch, rank=flight.rank,
            died_run=flight.run, reason=how, samples=in_flight(flight))
        runs.setdefault(flight.run, RunStory(run=flight.run)).entries.append(
            Entry(incident, journaled=False))


def _bundles_untold(story, runs):
    """A trigger for each incident whose bundles no journaled trigger
    names (a run without a journal, or past its share of it)."""
    named = set(p for r in runs.values() for e in r.entries
                for p in e.bundles)
    groups = {}
    for bundle in story.bundles:
        if bundle.path not in named:
            groups.setdefault((bundle.run, bundle.iter), []).append(bundle)
    for (run, iter), bundles in groups.items():
        first = sorted(bundles, key=lambda b: (b.summary is None, b.rank))[0]
        incident = Incident(
            IncidentKind.TRIGGER, run or '?', iter=iter,
            trigger=first.trigger, diagnosis=first.kind, cause=first.summary,
            bundle=first.path)
        runs.setdefault(run or '?', RunStory(run=run or '?')).entries.append(
            Entry(incident, [b.path for b in bundles], journaled=False))


def _quarantine(work_dir, starts, incidents, story):
    """Every sample of the quarantine lists (the run's, those earlier fresh
    runs kept aside), with the run that quarantined it and a bundle with
    its pictures."""
    lists = [osp.join(work_dir, FILE_NAME)] + [
        s.quarantine_file for s in starts if s.quarantine_file]
    stem = osp.splitext(FILE_NAME)[0]
    lists += sorted(glob.glob(osp.join(glob.escape(work_dir),
                                       stem + '.*.json')))
    by_name = dict((i.samples[0], i) for i in incidents
                   if i.kind == IncidentKind.QUARANTINE and i.samples)
    entries, seen, names = [], set(), set()
    for path in lists:
        path = osp.abspath(path)
        if path in seen or not osp.exists(path):
            continue
        seen.add(path)
        try:
            samples = read_quarantine(path)
        except QuarantineError as error:
            story.problems.append('%s: left out' % error)
            continue
        for sample in samples:
            name = quarantined_name(sample.file, sample.indices)
            if name in names:
                continue
            names.add(name)
            told = by_name.get(name)
            entry = QuarantineEntry(
                file=sample.file, indices=list(sample.indices),
                reason=sample.reason or '', iter=sample.iter,
                epoch=sample.epoch, rank=sample.rank,
                source=sample.source or '', list_file=path,
                run=told.run if told is not None else None)
            entry.bundle = next(
                (b.path for b in story.bundles if sample.file in b.pictures
                 and (entry.run is None or b.run == entry.run)), None)
            entries.append(entry)
    return entries


def _totals(story):
    totals = Totals(bundles=len(story.bundles),
                    bundle_bytes=sum(b.bytes for b in story.bundles),
                    quarantined=len(story.quarantine))
    for run in story.runs:
        totals.omitted += sum(run.omitted.values())
        for entry in run.entries:
            incident = entry.incident
            if incident.kind == IncidentKind.SPIKE:
                totals.spikes += 1
            elif incident.kind == IncidentKind.CRASH:
                totals.crashes += 1
            elif incident.kind == IncidentKind.TRIGGER:
                totals.triggers += 1
                act = incident.act
                totals.skipped += act == 'skip'
                totals.dropped += act == 'drop'
                totals.raised += act == 'raise'
                totals.warned += act == 'apply'
                if act == 'rewind':
                    totals.rewinds += 1
                    if incident.iter is not None and \
                            incident.rewind_to is not None:
                        totals.rewound_steps += incident.iter - \
                            incident.rewind_to
    totals.steps_left_out = totals.skipped + totals.rewound_steps
    return totals


# -- the story in the terminal ------------------------------------------------

_ACTS = {
    'apply': 'the step applied (warn)',
    'skip': 'the step skipped',
    'drop': 'the step taken again without the named samples',
    'rewind': 'rewound',
    'raise': 'training stopped',
    'propagate': 'the exception propagated',
    None: 'what became of the step is not journaled',
}


def _size(n):
    for unit in ('B', 'KB', 'MB', 'GB'):
        if n < 1000 or unit == 'GB':
            return ('%d %s' if unit == 'B' else '%.1f %s') % (n, unit)
        n /= 1000.0


def _iter(value):
    return ('iter %s' % ('?' if value is None else value)).ljust(11)


def _files(files, more=None):
    return ', '.join(files) + (' and %d more' % more if more else '') \
        if files else 'no samples recorded'


def entry_lines(story: Story, entry: Entry, at: bool = True) -> List[str]:
    """One incident in the terminal: its first line, then what it holds.

    Args:
        story (Story): The story it is in.
        entry (Entry): The incident.
        at (bool): Whether its first line starts with its iteration.
    """
    i = entry.incident
    at = _iter(i.iter) + ' ' if at else ''
    pad = ' ' * len(at)
    if i.kind == IncidentKind.TRIGGER:
        head = '%s%s trigger -> %s: %s%s' % (
            at, i.trigger or '?', _ACTS.get(i.act, i.act),
            i.cause or 'no diagnosis journaled',
            ' [%s]' % i.diagnosis if i.diagnosis else '')
        lines = [head]
        if i.act == 'rewind':
            lines.append(pad + 'back to %s, LR x %g%s' % (
                'the state training started from' if i.rewind_to == -1 else
                'the state after iter %s' % i.rewind_to, i.lr_factor or 0,
                ' = %.4g' % i.lr if i.lr is not None else ''))
        if i.samples and i.act in ('drop', 'skip', 'raise', 'rewind'):
            lines.append(pad + 'named: ' + _files(i.samples, i.more))
        for path in entry.bundles:
            bundle = story.bundle(path)
            lines.append(pad + 'bundle: %s (%s)' % (path, _size(
                bundle.bytes)) if bundle is not None else pad + 'bundle: ' +
                path)
        if i.bundle and osp.abspath(i.bundle) not in entry.bundles:
            lines.append(pad + 'bundle: %s (no longer there: max_dumps '
                         'pruned it, or it was moved)' % i.bundle)
        return lines
    if i.kind == IncidentKind.SPIKE:
        return ['%s%s spike: %.6g, %.3gx the median (spike_policy=%r)' % (
            at, i.series, i.value if i.value is not None
            else float('nan'), i.factor if i.factor is not None
            else float('nan'), i.policy)]
    if i.kind == IncidentKind.QUARANTINE:
        return ['%squarantined %s (%s%s): %s' % (
            at, _files(i.samples), i.source or '?',
            ', rank %d' % i.rank if i.rank is not None else '',
            i.reason or 'no reason given')]
    if i.kind == IncidentKind.CRASH:
        return ['%srank %s died inside the step: %s' % (
            at, '?' if i.rank is None else i.rank, i.reason),
            pad + 'in flight: ' + _files(i.samples, i.more),
            pad + ('found by run %s at its start' % entry.found_by
                   if entry.found_by else 'its record is in nan_flight/: the '
                   'next run in this work dir says it (and quarantines '
                   "those samples under policy='drop')")]
    return ['%s%s' % (at, i.kind)]


def story_lines(story: Story) -> List[str]:
    """The story in the terminal: one line when nothing happened."""
    runs = story.runs
    if story.quiet:
        return ['%s: no incident in %s: nothing triggered, spiked or was '
                'quarantined, and no run with mmnanhook died inside a train '
                'step here' % (
                    story.work_dir, '%d run%s (%s)' % (
                        len(runs), 's' if len(runs) > 1 else '',
                        ', '.join(r.run for r in runs))
                    if runs else 'any run')]
    lines = ['work dir: %s' % story.work_dir]
    for run in runs:
        lines.append('')
        lines.extend(_run_lines(story, run))
    if story.quarantine:
        lines.append('')
        lines.append('quarantine: %d sample%s' % (
            len(story.quarantine), 's' if len(story.quarantine) > 1 else ''))
        for q in story.quarantine:
            lines.append('  %s: %s (%s, iter %s%s%s)' % (
                q.file or 'indices %s' % q.indices, q.reason or '?',
                q.source or '?', '?' if q.iter is None else q.iter,
                ', rank %d' % q.rank if q.rank is not None else '',
                ', run %s' % q.run if q.run else ''))
    t = story.totals
    lines.append('')
    lines.append(
        'totals: %d trigger%s (%d skipped, %d taken again without samples, '
        '%d rewound, %d warned, %d stopped the run); %d step%s left out; '
        '%d spike%s; %d crash%s; %d sample%s quarantined; %d bundle%s, %s%s'
        % (t.triggers, 's' if t.triggers != 1 else '', t.skipped, t.dropped,
           t.rewinds, t.warned, t.raised, t.steps_left_out,
           's' if t.steps_left_out != 1 else '', t.spikes,
           's' if t.spikes != 1 else '', t.crashes,
           'es' if t.crashes != 1 else '', t.quarantined,
           's' if t.quarantined != 1 else '', t.bundles,
           's' if t.bundles != 1 else '', _size(t.bundle_bytes),
           '; %d journal lines left out (bounded)' % t.omitted
           if t.omitted else ''))
    return lines


def _run_lines(story, run):
    head = 'run %s' % run.run
    if run.journaled:
        head += ': %s at iter %s' % (
            'resumed' if run.resumed else 'began', run.start_iter)
        if run.continues:
            head += ', continuing run %s' % run.continues
        head += ', %s, policy %r' % (
            'world size %s' % run.world_size, run.policy)
    else:
        head += ': not in the journal (no mmnanhook, an older one, or the ' \
            'journal was not written)'
    lines = [head]
    if run.log_dir:
        lines.append('  log dir: %s%s' % (run.log_dir, (
            ' (%d logged iteration%s, the last %s)' % (
                run.logged, 's' if run.logged != 1 else '',
                run.last_logged)) if run.scalars else ''))
    for entry in run.entries:
        lines.extend('  ' + line for line in entry_lines(story, entry))
    if run.omitted:
        lines.append('  left out of the journal (its share was full): ' +
                     ', '.join('%d %s' % (n, k) for k, n in
                               sorted(run.omitted.items())))
    if run.ended is not None:
        lines.append('  ended at iter %s: %s' % (run.end_iter, run.ended))
    elif run.journaled:
        died = [e for e in run.entries
                if e.incident.kind == IncidentKind.CRASH]
        lines.append('  its end is not journaled: %s' % (
            'it died inside a step (above)' if died else
            'it was killed between steps, ended outside a train step, or '
            'still runs'))
    return lines
