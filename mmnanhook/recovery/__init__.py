"""What a trigger leads to: one room decides, the others carry it out.

* :mod:`._policy`: :class:`Policy`, every branch on a policy's name (what
  ``'raise'``, ``'skip'``, ``'warn'``, ``'rewind'`` and ``'drop'`` each do
  with a trigger of the update step, of a forward that raised, of a spike),
  and the typed :class:`Decision` it takes.
* :mod:`._answer`: :class:`Answer`, what the listener of a trigger (the
  hook's run) did and found, handed to the sentinel that decides with it.
* :mod:`._samples`: which samples a ``'drop'`` leaves out, on one rank or
  on every rank alike (:func:`drop_decision`), and each rank's finding.

Tier 1 (:mod:`mmnanhook.sentinel`) asks :class:`Policy` and carries out the
decision (apply, skip, recompute without samples, raise); the hook's run
(:mod:`mmnanhook._run`) asks it what to diagnose, undo, rewind and
quarantine. Framework-free: records and options only.
"""
from ._answer import Answer
from ._policy import Action, Decision, Policy
from ._samples import (DropDecision, data_culprits, drop_decision,
                       drop_unavailable, rank_finding, raised_by_nonfinite,
                       received, samples_to_drop)

__all__ = [
    'Action', 'Answer', 'Decision', 'data_culprits', 'drop_decision',
    'drop_unavailable', 'DropDecision', 'Policy', 'rank_finding',
    'raised_by_nonfinite', 'received', 'samples_to_drop'
]
