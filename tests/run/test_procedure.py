"""The trigger procedure on fake parts: a run that records what is asked of
it, a diagnostician that answers with a chosen report, a step that records
its acts. No runner, no model: what the procedure asks of each room, in the
plan's order, and what becomes of the step, for each policy."""
import dataclasses
import logging

import pytest

from mmnanhook.errors import NonFiniteError
from mmnanhook.memory import StepState
from mmnanhook.options import HookOptions
from mmnanhook.records import (Diagnosis, Kind, NonFiniteEvent, RankFinding,
                               Report, SampleFinding, Trigger)
from mmnanhook.recovery import Policy, Step
from mmnanhook.run._trigger import TriggerProcedure

EVENT = NonFiniteEvent(Trigger.LOSS, 'at iter 7: loss is nan', iter=7,
                       epoch=0, rank=0, world_size=1)


def _data_report():
    return Report(kind=Kind.DATA, summary='sample 1 holds a NaN',
                  samples=[SampleFinding(1, 'img_1.jpg')])


class _Diagnostician(object):
    """Answers with ``report``; names the bundle it writes."""

    def __init__(self, report):
        self.report = report
        self.asked = []

    def diagnose(self, request):
        self.asked.append(('diagnose', request.event.iter, request.level))
        return Diagnosis(request.event, RankFinding(0), self.report)

    def write(self, request, diagnosis, findings=None):
        self.asked.append(('write', findings))
        return dataclasses.replace(diagnosis, bundle='/dumps/iter_7')


class _Recorder(object):
    """A part of the run that notes every call made of it."""

    def __init__(self, calls, name, answers=None):
        self._calls, self._name, self._answers = calls, name, answers or {}

    def __getattr__(self, attr):
        def call(*args, **kwargs):
            self._calls.append((self._name, attr))
            answer = self._answers.get(attr)
            return answer(*args) if callable(answer) else answer
        return call


class _Drop(object):
    undo = None
    found = ['culprit']


class _Journal(object):
    """Notes each trigger and what became of its step."""

    def __init__(self, calls):
        self.calls = calls
        self.triggers = []

    def triggered(self, event, policy, answer, act, **rewind):
        self.calls.append(('journal', 'triggered'))
        self.triggers.append(dict(iter=event.iter, policy=policy, act=act,
                                  bundle=answer.bundle if answer else None,
                                  **rewind))

    def quarantined(self, samples):
        self.calls.append(('journal', 'quarantined'))


class _Run(object):
    """What the procedure reads of a run."""

    def __init__(self, policy):
        self.calls = []
        self.options = HookOptions.build(policy=policy)
        self.policy = Policy(self.options.check, self.options.rewind)
        self.logger = logging.getLogger('mmnanhook.tests.run')
        self.step = StepState()
        self.ranks = self.forward_guard = self.rewinder = None
        self.spike_detector = self.spike_norms = None
        self.history = _Recorder(self.calls, 'history',
                                 dict(records=lambda: []))
        self.buffers = _Recorder(self.calls, 'buffers')
        self.memory = _Recorder(self.calls, 'memory')
        self.quarantine = _Recorder(self.calls, 'quarantine')
        self.dropper = _Recorder(self.calls, 'dropper',
                                 dict(prepare=lambda *args: _Drop()))
        self.journal = _Journal(self.calls)

    def event_record(self, event):
        return dict(iter=event.iter, loss=float('nan'))

    def param_norms(self):
        return {}


class _Check(object):
    consecutive_skips = 0


class _Sentinel(object):
    check = _Check()


class _UpdateStep(Step):
    """An update step that records its acts; its recomputation passes."""

    def __init__(self):
        self.sentinel = _Sentinel()
        # The optim wrapper stepped (a model with its own train_step is
        # replayed up to its update step): none here.
        self.wrapper = None
        self.acts = []

    def apply(self):
        self.acts.append('apply')

    def leave_out(self, undo):
        self.acts.append('leave_out')

    def recompute(self, drop):
        self.acts.append('recompute')
        return True

    def stop(self):
        self.acts.append('stop')


def _trigger(policy, report):
    run, step = _Run(policy), _UpdateStep()
    diagnostician = _Diagnostician(report)
    procedure = TriggerProcedure(run, diagnostician)
    error = None
    try:
        procedure.update_step(EVENT, step)
    except NonFiniteError as exc:
        error = exc
    return run, step, diagnostician, error


@pytest.mark.parametrize('policy,acts', [('skip', ['leave_out']),
                                         ('warn', ['apply']),
                                         ('rewind', ['leave_out'])])
def test_the_diagnosis_comes_before_the_step_s_fate(policy, acts):
    run, step, diagnostician, error = _trigger(policy, _data_report())
    assert error is None and step.acts == acts
    assert [a[0] for a in diagnostician.asked] == ['diagnose', 'write']
    # Alone: nothing is exchanged.
    assert diagnostician.asked[1] == ('write', None)
    assert run.step.triggered
    # 'skip' and 'rewind' put back what the forward wrote first; 'warn'
    # applies the step as it is.
    assert (('buffers', 'restore') in run.calls) == (policy != 'warn')
    assert ('dropper', 'prepare') not in run.calls


def test_a_raise_carries_the_diagnosis_and_the_bundle():
    run, step, _, error = _trigger('raise', _data_report())
    assert step.acts == ['stop']
    assert error.bundle == '/dumps/iter_7'
    assert 'sample 1 holds a NaN' in str(error)
    assert error.report['kind'] == 'data'


def test_a_drop_is_prepared_recomputed_and_its_samples_quarantined():
    run, step, _, error = _trigger('drop', _data_report())
    assert error is None and step.acts == ['recompute']
    assert ('dropper', 'prepare') in run.calls
    # Quarantined once the step is applied, then journaled with its act.
    assert run.calls[-3:] == [('quarantine', 'record'),
                              ('journal', 'triggered'),
                              ('journal', 'quarantined')]
    assert isinstance(run.step.dropped, _Drop)


def test_a_drop_with_nothing_prepared_is_a_skip():
    run = _Run('drop')
    run.dropper = _Recorder(run.calls, 'dropper')  # prepares None
    step = _UpdateStep()
    TriggerProcedure(run, _Diagnostician(Report(kind=Kind.PARAMS))
                     ).update_step(EVENT, step)
    assert step.acts == ['leave_out']
    assert ('quarantine', 'record') not in run.calls
    assert run.step.dropped is None


@pytest.mark.parametrize('policy,report,act', [
    ('skip', _data_report(), 'skip'), ('warn', _data_report(), 'apply'),
    ('drop', _data_report(), 'drop'), ('raise', _data_report(), 'raise'),
    ('drop', Report(kind=Kind.PARAMS), 'skip')])
def test_the_journal_says_what_became_of_the_step(policy, report, act):
    """Once the step's fate is carried out (a raise too), the journal is
    told the act: a drop that fell back to a skip is a skip."""
    run = _Run(policy)
    if report.kind == Kind.PARAMS:
        run.dropper = _Recorder(run.calls, 'dropper')  # prepares None
    procedure = TriggerProcedure(run, _Diagnostician(report))
    try:
        procedure.update_step(EVENT, _UpdateStep())
    except NonFiniteError:
        assert act == 'raise'
    assert run.journal.triggers == [dict(iter=7, policy=policy, act=act,
                                         bundle='/dumps/iter_7')]
