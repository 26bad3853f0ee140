"""The incident journal: one line per incident of a run, in its work dir.

A run under ``NanDetectHook`` appends to ``{work_dir}/nan_journal.jsonl`` as
it goes (rank 0, with every rank's findings): when it starts (or resumes),
each trigger and what became of its step, each spike, each sample
quarantined, what an earlier run that died inside a step had in flight, and
how it ended. ``mmnan inspect WORK_DIR`` tells the runs' story from it. Each
line is one :class:`Incident` as JSON::

    {"journal": 1, "kind": "trigger", "run": "20261207_101112", "iter": 3,
     "epoch": 0, "trigger": "loss", "diagnosis": "data", "act": "drop",
     "cause": "loss_bbox=inf caused by sample 1 (...)", "bundle": "...",
     "samples": [".../000007.jpg"], "policy": "drop", "time": 1796...}

Fields that are ``None`` (or empty) are left out of the line. A line that is
not JSON, or not one of these (another version, an unknown kind), is not an
incident: :meth:`Incident.from_line` raises :class:`ValueError`, and a reader
names the file and goes on.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Sequence

from .._format import strict_float
from ._event import _StrEnum

JOURNAL_FILE = 'nan_journal.jsonl'
JOURNAL_VERSION = 1


class IncidentKind(_StrEnum):
    """What one line of the journal tells."""

    START = 'start'  #: a run began, or resumed (``resume``, from ``iter``)
    TRIGGER = 'trigger'  #: a trigger, and what became of its step (``act``)
    SPIKE = 'spike'  #: a finite spike of ``series`` (``value``, ``factor``)
    QUARANTINE = 'quarantine'  #: a sample never loaded again
    CRASH = 'crash'  #: a run (``died_run``) died inside a step: in flight
    END = 'end'  #: the run ended: ``reason`` (``finished``, or its error)
    OMITTED = 'omitted'  #: the run's share of the journal is full: ``counts``


INCIDENT_KINDS = tuple(k.value for k in IncidentKind)

# What became of a trigger's step (``Incident.act``): recovery's actions, and
# a rewind (the step left out, the state put back to a snapshot).
ACTS = ('apply', 'skip', 'drop', 'rewind', 'raise', 'propagate')


def _field(kind: Any, default: Any = None) -> Any:
    """A field of :class:`Incident` whose JSON value must be ``kind``
    (``int``, ``float``, ``str``, ``bool``, ``[int]``, ``[str]`` or
    ``{str: int}``)."""
    if isinstance(kind, (list, dict)):
        return dataclasses.field(default_factory=type(kind),
                                 metadata=dict(kind=kind))
    return dataclasses.field(default=default, metadata=dict(kind=kind))


@dataclasses.dataclass
class Incident(object):
    """One line of the journal.

    Args:
        kind (IncidentKind | str): What it tells.
        run (str): The run that wrote it (the runner's timestamp, the name
            of its log dir).
        time (float, optional): When (``time.time()``).
        iter (int, optional): The train iteration (0-based, ``runner.iter``;
            a start's: the iteration it starts or resumes at; a crash's: the
            one the died run was in).
        epoch (int, optional): Its epoch.
        rank (int, optional): The rank it concerns (a crash's, a quarantined
            sample's batch's).
        world_size (int, optional): Ranks of the run (a start's).
        policy (str, optional): The policy that handled it.
        trigger (str, optional): What triggered (``loss``, ``grad``, ...).
        diagnosis (str, optional): The diagnosis' kind (``data``, ...).
        cause (str, optional): The named cause, one line (the report's
            summary, or under DDP the culprit rank's sample).
        act (str, optional): What became of the step, one of :data:`ACTS`.
        bundle (str, optional): The bundle the writing rank wrote.
        ranks (list[int]): The ranks whose loss or forward was bad.
        samples (list[str]): Image files: those a trigger named, the one
            quarantined, those in flight when a run died.
        more (int, optional): Samples left out of ``samples`` (a line is
            bounded).
        reason (str, optional): Why (a quarantine's, a crash's, an end's).
        source (str, optional): Who quarantined (``drop``, ``skip``,
            ``rewind``, ``crash``).
        series (str, optional): A spike's series (``loss``, ``grad_norm``).
        value (float, optional): The spiked value.
        factor (float, optional): It over the band's median.
        rewind_to (int, optional): The iteration of the snapshot a rewind
            went back to (``-1``: the state training started from).
        lr (float, optional): The LR after a rewind.
        lr_factor (float, optional): The factor it was lowered by.
        died_run (str, optional): A crash's run (the one that died).
        resume (bool, optional): A start's: whether it resumed.
        log_dir (str, optional): A start's log dir.
        dump_dir (str, optional): A start's bundle directory.
        quarantine_file (str, optional): A start's quarantine list.
        counts (dict): An omission's: lines left out so far, by kind.
    """

    kind: IncidentKind
    run: str
    time: Optional[float] = _field(float)
    iter: Optional[int] = _field(int)
    epoch: Optional[int] = _field(int)
    rank: Optional[int] = _field(int)
    world_size: Optional[int] = _field(int)
    policy: Optional[str] = _field(str)
    trigger: Optional[str] = _field(str)
    diagnosis: Optional[str] = _field(str)
    cause: Optional[str] = _field(str)
    act: Optional[str] = _field(str)
    bundle: Optional[str] = _field(str)
    ranks: List[int] = _field([int])
    samples: List[str] = _field([str])
    more: Optional[int] = _field(int)
    reason: Optional[str] = _field(str)
    source: Optional[str] = _field(str)
    series: Optional[str] = _field(str)
    value: Optional[float] = _field(float)
    factor: Optional[float] = _field(float)
    rewind_to: Optional[int] = _field(int)
    lr: Optional[float] = _field(float)
    lr_factor: Optional[float] = _field(float)
    died_run: Optional[str] = _field(str)
    resume: Optional[bool] = _field(bool)
    log_dir: Optional[str] = _field(str)
    dump_dir: Optional[str] = _field(str)
    quarantine_file: Optional[str] = _field(str)
    counts: Dict[str, int] = _field({str: int})

    def __post_init__(self):
        self.kind = IncidentKind(self.kind)
        if self.act is not None and self.act not in ACTS:
            raise ValueError('unknown act %r; one of %s' %
                             (self.act, ', '.join(ACTS)))

    def to_dict(self) -> Dict[str, Any]:
        """The line's JSON object: strict JSON (a non-finite float as the
        string ``"inf"``, ``"-inf"`` or ``"nan"``), what is ``None`` or
        empty left out."""
        data = {'journal': JOURNAL_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (isinstance(value, (list, dict)) and
                                 not value):
                continue
            if f.name == 'kind':
                value = value.value
            elif f.metadata.get('kind') is float:
                value = strict_float(value)
            data[f.name] = value
        return data

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> Incident:
        """Read back :meth:`to_dict`.

        Raises:
            ValueError: Not a line of this journal: not an object, another
                version, an unknown kind or act, a field of the wrong type.
        """
        if not isinstance(data, dict) or data.get('journal') != \
                JOURNAL_VERSION:
            raise ValueError('not a line of an mmnanhook journal of version '
                             '%d' % JOURNAL_VERSION)
        if data.get('kind') not in INCIDENT_KINDS or not isinstance(
                data.get('run'), str):
            raise ValueError('no known "kind" and "run"')
        values = dict(kind=data['kind'], run=data['run'])
        for f in dataclasses.fields(cls):
            if f.name in values or f.name not in data:
                continue
            values[f.name] = _typed(f.name, f.metadata['kind'], data[f.name])
        return cls(**values)

    def to_line(self) -> str:
        """One line of the journal, ``\\n`` at its end."""
        return json.dumps(self.to_dict(), sort_keys=True,
                          allow_nan=False) + '\n'

    @classmethod
    def from_line(cls, line: str) -> Incident:
        """Read back :meth:`to_line`.

        Raises:
            ValueError: Not JSON, or not a line of this journal.
        """
        return cls.from_dict(json.loads(line))


def crash_reason(stack: str) -> str:
    """How a rank died inside a step, from what ``faulthandler`` wrote of
    it (nothing: no Python exception, a SIGKILL)."""
    if stack:
        return 'a fatal signal (%s)' % stack.strip().split('\n', 1)[0]
    return ('killed without a Python exception (SIGKILL: the OOM killer, a '
            'job scheduler; or a signal without faulthandler)')


def quarantined_name(file: Optional[str], indices: Sequence[int]) -> str:
    """How the journal names a sample: its file, else its dataset indices
    (a dataset without files, a plain torch ``Dataset``)."""
    if file:
        return file
    return 'dataset index %s' % ', '.join(str(i) for i in indices)


def in_flight(flight: Any) -> List[str]:
    """How the journal names the samples of a crash record's step."""
    samples = getattr(flight, 'samples', None)
    if samples is not None:
        return [s.name for s in samples]
    return [f or '(no file name)' for f in flight.files]


def _typed(name, kind, value):
    """``value`` as field ``name`` of kind ``kind`` holds it."""
    if isinstance(kind, list):
        if not isinstance(value, list):
            raise ValueError('"%s" is not a list' % name)
        return [_typed(name, kind[0], v) for v in value]
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            raise ValueError('"%s" is not an object' % name)
        return dict((str(k), _typed(name, int, v)) for k, v in value.items())
    if value is None:
        return None
    if kind is float:
        if value in ('inf', '-inf', 'nan'):
            return float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, kind):
        return value
    raise ValueError('"%s" is not a %s: %r' % (name, kind.__name__, value))
