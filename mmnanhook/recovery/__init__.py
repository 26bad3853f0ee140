"""What a trigger leads to: one room decides, the others carry it out.

* :mod:`._policy`: :class:`Policy`, every branch on a policy's name (what
  ``'raise'``, ``'skip'``, ``'warn'``, ``'rewind'`` and ``'drop'`` each do
  with a trigger of the update step, of a forward that raised, of a spike),
  asked once per trigger: :meth:`Policy.plan`.
* :mod:`._plan`: what is known when a trigger fires (:class:`Circumstances`),
  the frozen :class:`Plan` the policy answers with (fallbacks and limits
  included), and the final :class:`Decision` it comes to once the diagnosis
  is in.
* :mod:`._answer`: :class:`Answer`, what carrying out a trigger's plan did
  and found (the bundle, the diagnosis, the drop prepared).
* :mod:`._executor`: :func:`carry_out`, the one place a :class:`Decision`
  is carried out, on a :class:`Step`: the update step of an optim wrapper
  (:mod:`mmnanhook.sentinel`) or a train step whose forward raised
  (:mod:`mmnanhook.run`). Fallbacks included: a drop that cannot be used is
  a skip.
* :mod:`._samples`: which samples a ``'drop'`` leaves out, on one rank or
  on every rank alike (:func:`drop_decision`), and each rank's finding.

The trigger procedure (:mod:`mmnanhook.run`) asks for the plan and carries
it out; tier 1 (:mod:`mmnanhook.sentinel`) says how each act is done on an
update step (apply, skip, recompute without samples, let go), and asks for
a plan itself only when no hook runs (a self-checking optim wrapper).
Framework-free: records and options only.
"""
from ._answer import Answer
from ._executor import Step, carry_out
from ._plan import Action, Circumstances, Decision, Plan
from ._policy import Policy
from ._samples import (DropDecision, data_culprits, drop_decision,
                       drop_unavailable, rank_finding, raised_by_nonfinite,
                       received, samples_to_drop)

__all__ = [
    'Action', 'Answer', 'carry_out', 'Circumstances', 'Decision',
    'data_culprits', 'drop_decision',
    'drop_unavailable', 'DropDecision', 'Plan', 'Policy', 'rank_finding',
    'raised_by_nonfinite', 'received', 'samples_to_drop', 'Step'
]
