"""The one executor of a step's fate, on a step that records what is done to
it: every decision, and a drop that is applied, taken without being applied,
or cannot be used. No runner: the acts of a real step are tested where they
are (the sentinel's update step, the run's forward step)."""
import pytest

from mmnanhook.errors import NonFiniteError
from mmnanhook.records import NonFiniteEvent, Report, Trigger
from mmnanhook.recovery import Action, Answer, Decision, Step, carry_out

EVENT = NonFiniteEvent(Trigger.LOSS, 'at iter 5: loss is nan', iter=5)


class _Drop(object):

    def __init__(self):
        self.undo = object()


class _Step(Step):
    """Records the acts; a recomputation answers ``recomputed``."""

    def __init__(self, recomputed=True):
        self.acts = []
        self.recomputed = recomputed

    def apply(self):
        self.acts.append('apply')

    def leave_out(self, undo):
        self.acts.append(('leave_out', undo))

    def recompute(self, drop):
        self.acts.append(('recompute', drop))
        return self.recomputed

    def stop(self):
        self.acts.append('stop')

    def propagate(self, note):
        self.acts.append(('propagate', note))


def _carry_out(action, step, answer=Answer(), message='why'):
    dropped = []
    done = carry_out(Decision(action, message), EVENT, answer, step,
                     dropped=dropped.append)
    return done, dropped


@pytest.mark.parametrize('action,acts', [
    (Action.APPLY, ['apply']),
    (Action.SKIP, [('leave_out', None)]),
    (Action.PROPAGATE, [('propagate', 'why')]),
])
def test_each_decision_is_one_act(action, acts):
    step = _Step()
    done, dropped = _carry_out(action, step)
    assert done is action
    assert step.acts == acts and dropped == []


def test_a_raise_lets_go_of_the_step_then_raises_with_the_answer():
    step = _Step()
    answer = Answer(bundle='/dumps/b', report=Report(summary='data'))
    with pytest.raises(NonFiniteError) as info:
        _carry_out(Action.RAISE, step, answer, 'at iter 5: loss is nan')
    assert step.acts == ['stop']
    assert info.value.bundle == '/dumps/b'
    assert info.value.iter == 5


@pytest.mark.parametrize('recomputed,dropped', [(True, True),
                                                (False, False)])
def test_a_drop_taken_is_the_step_quarantined_only_when_applied(
        recomputed, dropped):
    step, drop = _Step(recomputed), _Drop()
    done, told = _carry_out(Action.DROP, step, Answer(drop=drop))
    assert done is Action.DROP
    assert step.acts == [('recompute', drop)]
    assert told == ([drop] if dropped else [])


def test_a_drop_that_cannot_be_used_is_a_skip_with_its_undo():
    step, drop = _Step(None), _Drop()
    done, told = _carry_out(Action.DROP, step, Answer(drop=drop))
    assert done is Action.SKIP
    assert step.acts == [('recompute', drop), ('leave_out', drop.undo)]
    assert told == []
