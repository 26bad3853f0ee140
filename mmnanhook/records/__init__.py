"""Typed records of what mmnanhook saw: one class per fact.

One contract, three modules: :mod:`._event` (the trigger), :mod:`._findings`
(what a diagnosis finds), :mod:`._report` (``report.json``'s schema, which
reads every record back).

Tier 1 builds a :class:`NonFiniteEvent` per trigger; tier 2 replays
(:class:`ReplayResult`), checks the batch (:class:`SampleFinding` with its
:class:`DataProblem` s), replays each fix (:class:`Fix`) and writes a
:class:`Report`, which the bundle renders as ``report.json``; the config
rules' :class:`ConfigFinding` s (``mmnan doctor``, the hook's
``before_train``) travel in it too. What a trigger's diagnosis came to on
one rank is one :class:`Diagnosis` (:mod:`._diagnosis`). Enum members are
``str`` subclasses, so they compare equal to, and serialize as, their value
(``Trigger.LOSS == 'loss'``). What a run met, one :class:`Incident` a line,
is its work dir's journal (:mod:`._journal`).
"""
from ._diagnosis import Diagnosis
from ._event import HISTORY_FIELDS, TRIGGERS, NonFiniteEvent, Trigger
from ._journal import (ACTS, INCIDENT_KINDS, JOURNAL_FILE, JOURNAL_VERSION,
                       Incident, IncidentKind, crash_reason, in_flight,
                       quarantined_name)
from ._findings import (KINDS, NONFINITE_DATA, ConfigFinding, Culprit,
                        DataProblem, Kind, ProblemCategory, RankFinding,
                        ReplayResult, SampleFinding, SampleId,
                        sample_name)
from ._report import (FIX_KINDS, REPORT_FORMAT_VERSION, Divergence, Fix,
                      FixKind, Origin, Report, verified_fix)

__all__ = [
    'ACTS', 'INCIDENT_KINDS', 'Incident', 'IncidentKind', 'JOURNAL_FILE',
    'JOURNAL_VERSION', 'crash_reason', 'in_flight', 'quarantined_name',
    'ConfigFinding', 'Culprit', 'DataProblem', 'Diagnosis', 'Divergence',
    'FIX_KINDS',
    'Fix', 'FixKind', 'HISTORY_FIELDS', 'KINDS', 'Kind', 'NONFINITE_DATA',
    'NonFiniteEvent', 'Origin', 'ProblemCategory', 'RankFinding',
    'REPORT_FORMAT_VERSION', 'ReplayResult', 'Report', 'SampleFinding',
    'SampleId', 'sample_name',
    'TRIGGERS', 'Trigger', 'verified_fix'
]
