"""ForwardGuard's votes and record in one process, with stand-ins for the
collectives and the vote: which collectives of a train step are voted
before, and what a rank whose forward raised calls for the others (two real
ranks: tests/sentinel/test_ddp.py)."""
import datetime
import types

import pytest
import torch
import torch.distributed as dist

from mmnanhook.distributed import ForwardGuard

NAMES = ('all_reduce', 'all_gather', 'broadcast', 'all_gather_object')

# A batch norm that shares its statistics, as the guard sees one: a module
# of its ``norms`` whose forward all-reduces them (mmcv's SyncBN does so
# from ``mmcv.ops.sync_bn``).
NORM = types.ModuleType('stand_in_sync_bn')
exec('import torch.distributed as dist\n'
     'def statistics(tensor):\n'
     '    dist.all_reduce(tensor)\n', NORM.__dict__)


class Votes(object):
    """The run's ranks, as far as the guard sees them: the votes counted,
    the run's timeout."""

    def __init__(self):
        self.count = 0
        self.timeout = datetime.timedelta(seconds=42)

    def before_backward(self):
        self.count += 1


class Work(object):
    """What a collective called with ``async_op=True`` returns."""

    def __init__(self):
        self.waited = None

    def wait(self, timeout=datetime.timedelta(0)):
        # torch's default (0) waits without a bound.
        self.waited = timeout


class Guarded(object):
    """A guard over stand-in collectives: ``calls`` their calls (name, args,
    kwargs), ``backwards`` the backwards so far."""

    def __init__(self, monkeypatch):
        self.calls, self.backwards, self.works = [], 0, []
        for name in NAMES:
            monkeypatch.setattr(dist, name, self._collective(name),
                                raising=False)
        self.votes = Votes()
        self.guard = ForwardGuard(self.votes, [NORM.__name__])
        self.guard.install()

    def _collective(self, name):
        def collective(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if kwargs.get('async_op'):
                self.works.append(Work())
                return self.works[-1]
            return None

        return collective

    def step(self, *collectives):
        """One train step calling ``collectives`` (``(name, args, kwargs)``,
        ``'backward'`` for a backward); returns the votes it took."""
        before = self.votes.count
        self.guard.begin(lambda: self.backwards)
        for collective in collectives:
            if collective == 'backward':
                self.backwards += 1
            elif collective[0] == 'norm':
                NORM.statistics(*collective[1])
            else:
                name, args, kwargs = collective
                getattr(dist, name)(*args, **kwargs)
        self.guard.end()
        return self.votes.count - before


@pytest.fixture
def run(monkeypatch):
    guarded = Guarded(monkeypatch)
    yield guarded
    guarded.guard.remove()


def reduce(size=1):
    return 'all_reduce', (torch.ones(size), ), dict(op=dist.ReduceOp.SUM)


def test_the_first_step_votes_before_each_collective_then_the_first_alone(
        run):
    assert run.step(*[reduce()] * 20) == 20
    assert run.step(*[reduce()] * 20) == 1
    assert run.step(*[reduce()] * 20) == 1
    assert run.guard.seen == 60


def test_from_a_collective_unlike_the_record_each_is_voted_before(run):
    run.step(reduce(), reduce(), reduce(), reduce())
    # Another shape at the second: voted before it and after it.
    assert run.step(reduce(), reduce(2), reduce(), reduce()) == 4
    # A collective more than recorded.
    assert run.step(reduce(), reduce(2), reduce(), reduce(), reduce()) == 2
    # Recorded again from each.
    assert run.step(reduce(), reduce(2), reduce(), reduce(), reduce()) == 1


def test_a_collective_not_replayable_is_voted_before_from_there(run):
    obj = ('all_gather_object', ([None, None], 'x'), {})
    assert run.step(reduce(), reduce(), obj, reduce()) == 4
    assert run.step(reduce(), reduce(), obj, reduce()) == 3


def test_collectives_after_the_first_backward_are_voted_before_each(run):
    run.step(reduce())
    # A second optimizer's forward; the record stays the first forward's.
    assert run.step(reduce(), 'backward', reduce(), reduce()) == 3
    assert run.step(reduce()) == 1


def test_a_rank_whose_forward_raised_calls_the_others_rest_with_zeros(run):
    gathered = [torch.ones(3, dtype=torch.float64) for _ in range(2)]
    recorded = [
        reduce(),
        ('all_gather', (gathered, torch.ones(3, dtype=torch.float64)),
         dict(async_op=True)),
        ('broadcast', (torch.ones(2, 2, dtype=torch.int64), ), dict(src=1)),
        reduce(4)]
    run.step(*recorded)
    run.guard.begin(lambda: run.backwards)
    dist.all_reduce(torch.ones(1), op=dist.ReduceOp.SUM)
    del run.calls[:]
    # The forward raises after the first: the others call the three left.
    run.guard.abandon(True)
    assert [c[0] for c in run.calls] == ['all_gather', 'broadcast',
                                         'all_reduce']
    (out, tensor), kwargs = run.calls[0][1:]
    for zeros in out + [tensor]:
        assert zeros.dtype == torch.float64 and zeros.shape == (3, )
        assert torch.equal(zeros, torch.zeros_like(zeros))
    assert kwargs == dict(async_op=True)
    # Waited for, within the run's timeout.
    assert run.works[-1].waited == run.votes.timeout
    (tensor, ), kwargs = run.calls[1][1:]
    assert tensor.dtype == torch.int64 and tensor.shape == (2, 2)
    assert torch.equal(tensor, torch.zeros_like(tensor))
    assert kwargs == dict(src=1)
    assert run.calls[2][1][0].shape == (4, )
    assert run.calls[2][2] == dict(op=dist.ReduceOp.SUM)
    # The forward vote alone; then a step taken again votes before each.
    before = run.votes.count
    dist.all_reduce(torch.ones(1))
    assert run.votes.count == before + 1
    run.guard.end()
    # Not recorded: the next step is the first's again.
    assert run.step(*recorded) == 1


@pytest.mark.parametrize('case', ['peer', 'before_any', 'first_step',
                                  'after_all'])
def test_no_collective_is_called_where_the_others_wait_in_a_vote(run, case):
    if case != 'first_step':
        run.step(reduce(), reduce())
    run.guard.begin(lambda: run.backwards)
    if case != 'before_any':
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp.SUM)
    if case == 'after_all':
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp.SUM)
    del run.calls[:]
    run.guard.abandon(case != 'peer')
    assert run.calls == []
    run.guard.end()


def norm(channels=4):
    return 'norm', (torch.ones(2 * channels + 1), )


def test_a_norms_statistics_are_voted_on_and_recorded_as_any_collective(
        run):
    """Issue 65: a batch norm's collectives were exempt, so that a rank
    stopped before its first one left the others waiting in it."""
    step = [norm(), norm(8), reduce(), norm()]
    # The first step votes before each; then before the first alone, which
    # may be a norm's.
    assert run.step(*step) == 4
    assert run.step(*step) == 1
    assert run.step(*step[:2] + [norm(), reduce()]) == 3
    # Not the train step's own: neither counted nor answered to a replay.
    assert run.guard.seen == 3
    run.guard.begin(lambda: run.backwards)
    for collective in step:
        NORM.statistics(*collective[1]) if collective[0] == 'norm' else \
            dist.all_reduce(*collective[1], **collective[2])
    assert [c[0][0] for c in run.guard.step_collectives()] == ['all_reduce']
    run.guard.end()


def test_a_norms_backward_is_neither_voted_on_nor_recorded(run):
    run.step(norm())
    assert run.step(norm(), 'backward', norm(), norm()) == 1
    # The record is the forward's alone.
    assert run.step(norm()) == 1


@pytest.mark.parametrize('first_step', [False, True])
def test_a_rank_stopped_before_its_first_collective_answers_the_norms(
        run, first_step):
    """The input check stops a rank on entry to its forward: the others'
    norms vote before their first collective, then call the rest of the
    record; the stopped rank answers that rest."""
    step = [norm(), norm(8), reduce()]
    if not first_step:
        run.step(*step)
    run.guard.begin(lambda: run.backwards)
    del run.calls[:]
    run.guard.abandon(True)
    # Where the others vote first (every entry in the first step, the first
    # entry after it), this rank votes from its handler: nothing to call.
    assert run.calls == []
    run.guard.end()
