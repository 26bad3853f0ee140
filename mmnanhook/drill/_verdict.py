"""What a drill's runs mean: one :class:`Verdict` for the clean run, one
per fault, each a few :class:`Check` lines that hold or do not."""
from __future__ import annotations

from typing import Any, Dict, List, Optional


class Check(object):
    """One claim of a verdict.

    Args:
        name (str): ``'trains'``, ``'unchanged'``, ``'caught'``,
            ``'named'``, ``'policy'`` or ``'finite'``.
        ok (bool): Whether it holds.
        detail (str): What was seen.
    """

    def __init__(self, name: str, ok: bool, detail: str) -> None:
        self.name = name
        self.ok = bool(ok)
        self.detail = detail

    def to_dict(self) -> Dict[str, Any]:
        return dict(name=self.name, ok=self.ok, detail=self.detail)


class Verdict(object):
    """The checks of one run of the drill.

    Args:
        run (str): ``'clean'`` or the fault (``'data'``, ``'loss'``,
            ``'grad'``).
        rank (int): The rank whose run it judges.
        checks (list[Check]): Its checks.
    """

    def __init__(self, run: str, rank: int, checks: List[Check]) -> None:
        self.run = run
        self.rank = rank
        self.checks = checks

    @property
    def ok(self) -> bool:
        """Whether every check holds."""
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> Optional[Check]:
        """The first check that does not hold, or ``None``."""
        return next((c for c in self.checks if not c.ok), None)

    def lines(self) -> List[str]:
        """The verdict as the terminal shows it."""
        head = '{:<6} {}'.format(self.run, 'holds' if self.ok else 'FAILS')
        return [head] + ['  {} {:<9} {}'.format('ok ' if c.ok else 'NO ',
                                                c.name, c.detail)
                         for c in self.checks]

    def to_dict(self) -> Dict[str, Any]:
        return dict(run=self.run, rank=self.rank, ok=self.ok,
                    checks=[c.to_dict() for c in self.checks])


def _error(outcome):
    return outcome.get('died') or outcome.get('error')


def _short(text, width=120):
    """``text`` cut to ``width`` characters (the run's log has it whole)."""
    if text is None or len(text) <= width:
        return text
    return text[:width - 3] + '...'


def judge_clean(without: Optional[dict], with_hook: Optional[dict],
                length: int, rank: int) -> Verdict:
    """The clean runs: the config trains here, and NanDetectHook changes
    nothing of it.

    Args:
        without, with_hook (dict, optional): The two runs' outcomes
            (``None``: not run).
        length (int): Iterations each should have trained.
        rank (int): This rank.
    """
    checks = []
    for name, outcome, what in (('trains', without, 'without mmnanhook'),
                                ('trains', with_hook, 'with mmnanhook')):
        if outcome is None:
            checks.append(Check(name, False, what + ': not run'))
            continue
        at = outcome.get('nonfinite_loss_at')
        bad = _error(outcome) or (
            '{} of {} iterations'.format(outcome['iters'], length)
            if outcome['iters'] != length else
            # Nothing to drill against: the config is not clean here.
            'the loss is not finite at iteration {}'.format(at)
            if at is not None else None)
        checks.append(Check(name, bad is None, '{}: {}'.format(
            what, bad or '{} iterations'.format(length))))
    if with_hook is not None and not _error(with_hook):
        triggers = ['{} at iteration {}'.format(b['trigger'], b['iter'])
                    for b in with_hook['bundles']]
        checks.append(Check('quiet', not triggers, ', '.join(triggers) or
                            'no trigger'))
        difference = with_hook.get('difference', 'not compared')
        checks.append(Check(
            'unchanged', difference is None,
            'weights, buffers, optimizer, EMA, losses and LRs bitwise as '
            'without mmnanhook' if difference is None else
            'differs from the run without mmnanhook at ' + difference))
    return Verdict('clean', rank, checks)


def judge_fault(fault: str, outcome: Optional[dict], spec: dict,
                policy: str, rank: int) -> Verdict:
    """One fault's run.

    Args:
        fault (str): The fault.
        outcome (dict, optional): The run's outcome (``None``: not run).
        spec (dict): The drill's ``iter``, ``rank``, ``length``.
        policy (str): NanDetectHook's policy in the drill.
        rank (int): This rank.
    """
    if outcome is None or outcome.get('died'):
        why = 'not run (an earlier run ended the drill)' if outcome is None \
            else outcome['died']
        return Verdict(fault, rank, [Check('caught', False, why)])
    at, planted_rank = spec['iter'], spec['rank']
    planted = outcome['planted'] or {}
    here = rank == planted_rank
    if here and not planted.get('hit'):
        return Verdict(fault, rank, [Check(
            'planted', False, 'iteration {} never ran: {}'.format(
                at, _error(outcome) or 'the run is shorter'))])
    bundles = [b for b in outcome['bundles'] if b['iter'] == at]
    # Raised in the fault's iteration (a later one is a fault let through).
    raised = outcome['error_type'] == 'NonFiniteError' and \
        outcome['iters'] == at
    finite_after = planted.get('finite_after')
    if finite_after is None:  # the iteration raised: the weights as left
        finite_after = outcome['finite']
    # DDP promises a rank without the fault the path of the rank with it,
    # not a diagnosis of its own: a bundle is written where the fault was.
    took = None if here or bundles or raised else _took(outcome, at)
    seen = 'trigger {} at iteration {}'.format(bundles[0]['trigger'], at) \
        if bundles else 'raised in iteration {}'.format(at) if raised else \
        "rank {}'s trigger at iteration {}, followed here: {}".format(
            planted_rank, at, took) if took else \
        'no trigger in iteration {}'.format(at)
    checks = [Check('caught', (bundles or raised or took) and finite_after,
                    '{}; weights {} after iteration {}'.format(
                        seen, 'finite' if finite_after else 'NOT finite',
                        at))]
    if here:
        checks.append(_named(fault, planted, bundles))
    checks.append(_policy(fault, policy, outcome, planted, spec, here,
                          blamed=bool(_files(bundles))))
    checks.append(Check('finite', outcome['finite'],
                        'weights finite at the end' if outcome['finite']
                        else 'weights NOT finite at the end'))
    return Verdict(fault, rank, checks)


# What a rise of each counter in an iteration says the rank did.
_ACTS = (('nan_skipped', 'the step left out'),
         ('samples_dropped', 'the step taken without the dropped samples'),
         ('rewinds', 'a rewind'))


def _took(outcome, at):
    """What this rank did in iteration ``at`` by its policy's counters (a
    step left out, samples dropped, a rewind), or ``None``: nothing."""
    counters = outcome.get('counters') or []
    if len(counters) <= at:
        return None
    before = counters[at - 1] if at > 0 else {}
    acts = [what for name, what in _ACTS
            if counters[at].get(name, 0) > before.get(name, 0)]
    return ' and '.join(acts) or None


def _files(bundles):
    return [s for b in bundles for s in b['samples'] if s]


def _named(fault, planted, bundles):
    name = planted.get('name')
    if fault == 'data':
        named = _files(bundles)
        ok = name in named
        what = 'sample ' + str(name)
        if not named:
            # The NaN is planted in the batch, not in a file: a diagnosis
            # that finds the file loading finite (a Mosaic sample's main
            # image) or knows none (mmyolo's collate) names the sample's
            # place, and must blame no file.
            named = ['sample {}'.format(i) for b in bundles
                     for i in b['sample_indices']]
            ok, what = 'sample 0' in named, 'sample 0'
    elif fault == 'loss':
        named = [t for b in bundles for t in b['nonfinite_losses']]
        ok = name in named
        what = 'loss term ' + str(name)
    else:
        named = [p for b in bundles for p in b['nonfinite_grads']] + [
            b['module'] for b in bundles if b['module']]
        ok = any(name == n or str(name).startswith(n + '.') for n in named)
        what = 'parameter ' + str(name)
    return Check('named', ok, '{} planted; named: {}'.format(
        what, ', '.join(map(str, named[:4])) or 'nothing'))


def _policy(fault, policy, outcome, planted, spec, here, blamed):
    length, at = spec['length'], spec['iter']
    error, scalars = _error(outcome), outcome['scalars']
    finished = error is None and outcome['iters'] == length
    if policy == 'raise':
        ok = outcome['error_type'] == 'NonFiniteError' and \
            outcome['iters'] == at
        seen = 'NonFiniteError raised in iteration {}'.format(at) if ok \
            else _short(error) or 'trained on'
    elif policy == 'drop' and fault == 'data':
        # The file is quarantined where the diagnosis blamed it.
        listed = not here or not blamed or \
            planted['name'] in outcome['quarantined']
        ok = finished and listed and (scalars['samples_dropped'] >= 1
                                      or not here)
        seen = _short(error) or '{} sample(s) dropped, quarantined: {}'.format(
            scalars['samples_dropped'],
            ', '.join(outcome['quarantined']) or 'none')
    elif policy in ('skip', 'drop', 'rewind'):
        left_out = scalars['nan_skipped'] + scalars['rewinds']
        ok = finished and left_out >= 1
        seen = _short(error) or '{} step(s) skipped, {} rewind(s), {} ' \
            'sample(s) dropped'.format(scalars['nan_skipped'],
                                       scalars['rewinds'],
                                       scalars['samples_dropped'])
    else:  # 'warn' steps as MMEngine would: the finite checks judge it
        ok = finished
        seen = _short(error) or 'stepped'
    return Check('policy', ok, "'{}': {}".format(policy, seen))
