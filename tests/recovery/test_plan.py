"""The plan of a trigger as a table: every policy x trigger kind x evidence x
limits, no runner.

``TABLE`` is the module docstring of :mod:`mmnanhook.recovery._policy` row by
row, written out: what each trigger leads to, fallbacks and limits
included. ``test_every_combination_*`` go over the whole product and check
what must hold in every cell; ``DECISIONS`` the rows a diagnosis still
chooses among (a drop with nothing to drop, a forward that did not raise on
non-finite values).
"""
import itertools
import logging

import pytest

from mmnanhook.options import CheckOptions, RewindOptions
from mmnanhook.records import (DataProblem, Kind, NonFiniteEvent,
                               RankFinding, Report, SampleFinding, Trigger)
from mmnanhook.recovery import (Action, Answer, Circumstances, Plan, Policy)

POLICIES = ('raise', 'skip', 'warn', 'rewind', 'drop')
# (name, trigger, in backward): how each kind of trigger reaches the policy.
KINDS = [('loss', Trigger.LOSS, False), ('grad', Trigger.GRAD, False),
         ('amp_scale', Trigger.AMP_SCALE, False),
         ('spike', Trigger.SPIKE, False),
         ('forward', Trigger.EXCEPTION, False),
         ('backward', Trigger.EXCEPTION, True)]
# What is known when it fires, by name.
EVIDENCE = {
    'quiet': dict(),
    'diverged': dict(diverged=True, rewind_to=40),
    'no_snapshot': dict(diverged=True, no_rewind='no snapshot older than '
                        'iteration 50 to rewind to'),
    'max_rewinds': dict(diverged=True, rewind_to=40, consecutive_rewinds=3),
    'max_skips': dict(consecutive_skips=10),
    'oom': dict(out_of_memory=True),
    'no_replay': dict(replays=False),
}
SKIP, RAISE, APPLY, DROP, PROPAGATE = (Action.SKIP, Action.RAISE,
                                       Action.APPLY, Action.DROP,
                                       Action.PROPAGATE)
WARNING, ERROR = logging.WARNING, logging.ERROR

# (policy, spike_policy, kind, evidence) -> (action, undo, rewind_to,
# quarantine, escalate (a part of it), level)
TABLE = [
    # raise: diagnose, raise; a spike raises too under spike_policy='raise'
    ('raise', 'warn', 'loss', 'quiet', RAISE, False, None, False, None,
     ERROR),
    ('raise', 'raise', 'spike', 'quiet', RAISE, False, None, False, None,
     ERROR),
    ('raise', 'warn', 'forward', 'quiet', RAISE, False, None, False, None,
     ERROR),
    # skip: undo, skip; raise at max_skips
    ('skip', 'warn', 'loss', 'quiet', SKIP, True, None, True, None, WARNING),
    ('skip', 'warn', 'grad', 'diverged', SKIP, True, None, True, None,
     WARNING),
    ('skip', 'warn', 'loss', 'max_skips', RAISE, True, None, True,
     'max_skips=10', ERROR),
    ('skip', 'skip', 'spike', 'quiet', SKIP, True, None, False, None,
     WARNING),
    ('skip', 'warn', 'forward', 'quiet', SKIP, False, None, True, None,
     ERROR),
    # warn: apply as MMEngine would; a forward's exception goes on
    ('warn', 'warn', 'loss', 'quiet', APPLY, False, None, False, None,
     WARNING),
    ('warn', 'warn', 'forward', 'quiet', PROPAGATE, False, None, False, None,
     ERROR),
    # rewind: back to the snapshot when something diverged; else skip;
    # raise when it cannot go back or went back too often
    ('rewind', 'warn', 'loss', 'quiet', SKIP, True, None, True, None,
     WARNING),
    ('rewind', 'warn', 'loss', 'diverged', SKIP, True, 40, True, None,
     WARNING),
    ('rewind', 'warn', 'grad', 'no_snapshot', RAISE, True, None, True,
     'no snapshot older', ERROR),
    ('rewind', 'warn', 'loss', 'max_rewinds', RAISE, True, None, True,
     'max_rewinds=3', ERROR),
    ('rewind', 'rewind', 'spike', 'diverged', SKIP, True, 40, False, None,
     WARNING),
    ('rewind', 'warn', 'forward', 'diverged', SKIP, False, None, True, None,
     ERROR),
    # drop: recompute without the samples; skip when it cannot
    ('drop', 'warn', 'loss', 'quiet', DROP, True, None, False, None,
     WARNING),
    ('drop', 'warn', 'loss', 'max_skips', RAISE, True, None, False,
     'max_skips=10', ERROR),
    ('drop', 'skip', 'spike', 'quiet', SKIP, True, None, False, None,
     WARNING),
    ('drop', 'warn', 'forward', 'quiet', DROP, False, None, False, None,
     ERROR),
    # a forward that ran out of memory, or any without replays: untouched
    ('drop', 'warn', 'forward', 'oom', PROPAGATE, False, None, False, None,
     ERROR),
    ('skip', 'warn', 'forward', 'no_replay', PROPAGATE, False, None, False,
     None, ERROR),
    # an exception in backward goes on whatever the policy
    ('skip', 'warn', 'backward', 'quiet', PROPAGATE, False, None, True, None,
     ERROR),
    ('drop', 'warn', 'backward', 'quiet', PROPAGATE, False, None, False,
     None, ERROR),
]


def _event(trigger, world_size=1, bad_ranks=(0, ), rank=0):
    return NonFiniteEvent(trigger, 'at iter 50: it happened', iter=50,
                          rank=rank, world_size=world_size,
                          bad_ranks=list(bad_ranks))


def _policy(policy, spike_policy='warn', quarantine_skips=True):
    return Policy(CheckOptions(policy=policy, spike_policy=spike_policy),
                  RewindOptions(), quarantine_skips)


def _plan(policy, spike_policy, kind, evidence, **event):
    name, trigger, backward = dict((k[0], k) for k in KINDS)[kind]
    return _policy(policy, spike_policy).plan(Circumstances(
        _event(trigger, **event), in_backward=backward,
        **EVIDENCE[evidence]))


@pytest.mark.parametrize(
    'policy,spike_policy,kind,evidence,action,undo,rewind_to,quarantine,'
    'escalate,level', TABLE,
    ids=['-'.join(row[:4]) for row in TABLE])
def test_the_table(policy, spike_policy, kind, evidence, action, undo,
                   rewind_to, quarantine, escalate, level):
    plan = _plan(policy, spike_policy, kind, evidence)
    assert (plan.action, plan.undo, plan.rewind_to, plan.quarantine,
            plan.level) == (action, undo, rewind_to, quarantine, level)
    assert plan.drop == (action is DROP)
    if escalate is None:
        assert plan.escalate is None
    else:
        assert escalate in plan.escalate


CELLS = list(itertools.product(POLICIES, ('warn', 'skip', 'rewind', 'raise'),
                               [k[0] for k in KINDS], sorted(EVIDENCE)))


@pytest.mark.parametrize('policy,spike_policy,kind,evidence', CELLS)
def test_every_combination_keeps_the_rules(policy, spike_policy, kind,
                                           evidence):
    plan = _plan(policy, spike_policy, kind, evidence)
    handles = spike_policy if kind == 'spike' else policy
    assert plan.policy == handles
    known = EVIDENCE[evidence]
    # Exceptions are never undone, rewound or dropped from the update step.
    if kind in ('forward', 'backward'):
        assert not plan.undo and plan.rewind_to is None
        assert plan.nonfinite_only == (kind == 'forward' and plan.diagnose)
    if kind == 'backward':
        assert plan.action is PROPAGATE
    if kind == 'forward' and (known.get('out_of_memory')
                              or known.get('replays') is False):
        assert plan.action is PROPAGATE and not plan.diagnose
        return
    # Only 'rewind' goes back, only after a divergence, only to a snapshot,
    # and only within max_rewinds.
    if plan.rewind_to is not None:
        assert handles == 'rewind' and known.get('diverged')
        assert plan.action is SKIP and plan.rewind_to == known['rewind_to']
    # A limit reached, or a rewind that cannot go back, raises.
    if plan.escalate:
        assert plan.action is RAISE
    goes_back = handles == 'rewind' and kind not in ('forward', 'backward')
    if goes_back and (known.get('no_rewind')
                      or known.get('consecutive_rewinds')):
        assert plan.action is RAISE and plan.rewind_to is None
    elif goes_back and known.get('rewind_to') is not None \
            and not known.get('consecutive_skips'):
        assert plan.rewind_to == known['rewind_to']
    if (known.get('consecutive_skips') and kind != 'backward'
            and handles in ('skip', 'rewind', 'drop')):
        assert plan.action is RAISE and 'max_skips' in plan.escalate
    # 'raise' raises; 'warn' applies (or lets a forward's exception go on).
    if handles == 'raise' and kind != 'backward':
        assert plan.action is RAISE
    if handles == 'warn' and kind != 'backward':
        assert plan.action in (APPLY, PROPAGATE)
    # Only 'drop' drops, never a spike's step.
    assert plan.drop == (plan.action is DROP)
    if plan.drop:
        assert handles == 'drop' and kind != 'spike'
    # A spike is diagnosed only when it stops or rewinds training.
    if kind == 'spike' and handles not in ('raise', 'rewind'):
        assert plan.diagnosers == ()
    # It stops training (an exception, a raise, an escalation): an error;
    # else a warning.
    stops = kind in ('forward', 'backward') or plan.action is RAISE
    assert plan.level == (ERROR if stops else WARNING)


def test_ddp_every_implicated_rank_diagnoses_together_only_its_own_alone():
    policy = _policy('skip')
    event = _event(Trigger.LOSS, world_size=4, bad_ranks=(1, 3), rank=1)
    together = policy.plan(Circumstances(event, together=True))
    alone = policy.plan(Circumstances(event))
    assert together.diagnosers == (1, 3) and alone.diagnosers == (1, )
    nobody = _event(Trigger.GRAD, world_size=2, bad_ranks=())
    assert policy.plan(Circumstances(nobody, together=True)).diagnosers == \
        (0, 1)


def _report(kind, samples=()):
    report = Report(kind=kind)
    report.samples = [SampleFinding(i) for i in samples]
    return report


# (policy, kind, answer) -> the decision's action: what the diagnosis still
# chooses among.
DECISIONS = [
    # a drop with nothing to drop is a skip
    ('drop', 'loss', Answer(), SKIP),
    ('drop', 'loss', Answer(drop=object()), DROP),
    # a forward that raised on non-finite values follows the policy...
    ('skip', 'forward', Answer(report=_report(Kind.DATA, [0])), SKIP),
    ('raise', 'forward', Answer(report=_report(Kind.DATA, [0])), RAISE),
    ('drop', 'forward', Answer(report=_report(Kind.DATA, [0]),
                               drop=object()), DROP),
    # ...one that raised for any other reason goes on, noted
    ('skip', 'forward', Answer(report=_report(Kind.EXCEPTION)), PROPAGATE),
    ('raise', 'forward', Answer(), PROPAGATE),
    # under DDP: on every rank it raised on (one that only received it aside)
    ('skip', 'forward', Answer(findings=(
        RankFinding(0, 'data', [SampleFinding(0)], iter=50,
                    reproduced=True),
        RankFinding(1, 'not_reproduced', reproduced=False, raises=True))),
     SKIP),
    ('skip', 'forward', Answer(findings=(
        RankFinding(0, raises=True, error='KeyError: x'),
        RankFinding(1, 'not_reproduced', reproduced=False))), PROPAGATE),
    ('warn', 'loss', Answer(), APPLY),
]


@pytest.mark.parametrize('policy,kind,answer,action', DECISIONS)
def test_what_the_diagnosis_still_chooses(policy, kind, answer, action):
    plan = _plan(policy, 'warn', kind, 'quiet')
    decision = plan.decide(answer)
    assert decision.action is action
    if action is RAISE:
        assert plan.event.message in decision.message


def test_the_error_carries_the_answer_and_why_it_escalates():
    plan = _plan('skip', 'warn', 'loss', 'max_skips')
    answer = Answer(bundle='/dumps/b',
                    report=Report(summary='diagnosis: data'))
    decision = plan.decide(answer)
    error = decision.error(plan.event, answer)
    assert error.bundle == '/dumps/b'
    assert str(error).splitlines() == [
        'at iter 50: it happened', 'diagnosis: data', 'bundle: /dumps/b',
        plan.escalate]


@pytest.mark.parametrize('data,prepare', [(True, True), (False, True)])
def test_an_update_step_drop_is_always_prepared_a_forward_only_on_data(
        data, prepare):
    report = _report(Kind.DATA if data else Kind.PARAMS, [1])
    step = _plan('drop', 'warn', 'loss', 'quiet')
    forward = _plan('drop', 'warn', 'forward', 'quiet')
    assert step.after_diagnosis(step.event, report) == (True, [])
    assert forward.after_diagnosis(forward.event, report) == (data, [])


def test_skip_quarantines_the_samples_of_a_data_diagnosis_only():
    plan = _plan('skip', 'warn', 'loss', 'quiet')
    drop, samples = plan.after_diagnosis(plan.event,
                                         _report(Kind.DATA, [0, 1]))
    assert not drop and [c.sample.index for c in samples] == [0, 1]
    assert plan.after_diagnosis(plan.event, _report(Kind.PARAMS, [0])) == \
        (False, [])
    assert isinstance(plan, Plan)
    with pytest.raises(Exception):
        plan.action = RAISE  # frozen


def test_a_rank_that_did_not_diagnose_stops_naming_the_others_culprit():
    """Under DDP a rank whose forward went fine does not diagnose: its error
    (rank 0's log, the one users read) names the samples the others found,
    each with its first problem (issue 65's ``'raise'``)."""
    plan = _plan('raise', 'warn', 'forward', 'quiet')
    answer = Answer(findings=(
        RankFinding(0, reproduced=None),
        RankFinding(1, 'data', [SampleFinding(0, '/data/5.png', [
            DataProblem(None, 'input has 12 NaN and 0 Inf values')])])))
    lines = plan.decide(answer).error(plan.event, answer).args[0].split('\n')
    assert 'rank 1: sample 0 (/data/5.png): input has 12 NaN and 0 Inf ' \
        'values' in lines
    # A rank with its own report says its own summary alone.
    own = Answer(report=Report(summary='diagnosis: data'),
                 findings=answer.findings)
    assert not any(line.startswith('rank 1: ') for line in
                   plan.decide(own).message.split('\n'))
