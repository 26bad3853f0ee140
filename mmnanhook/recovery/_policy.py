"""What each policy does with a trigger: every branch on a policy's name.

==========  ==============================  ===============================
policy      a non-finite update step        a forward that raised on
                                            non-finite values
==========  ==============================  ===============================
``raise``   diagnose, write the bundle,     the same (the original
            raise ``NonFiniteError``        exception is its context)
``skip``    undo what the forward wrote,    undo, skip the step
            diagnose, skip the step
            (gradients zeroed)
``warn``    diagnose, log, apply the step   diagnose, let the original
            as MMEngine would have          exception propagate
``rewind``  undo, diagnose; go back to the  as ``skip``
            snapshot before a divergence
            and lower the LR (``skip`` when
            nothing diverged)
``drop``    undo, diagnose; recompute the   take the train step again
            step without the samples the    without them; ``skip`` when
            diagnosis singles out and       none can be singled out
            quarantine them; ``skip`` when
            none can be singled out
==========  ==============================  ===============================

A spike (a finite loss or gradient norm far above its band) follows
``spike_policy`` the same way, diagnosed only when it stops or rewinds
training. The fallbacks and limits, each a row of :meth:`Policy.plan`:

* ``rewind`` with nothing diverged before the trigger (a single bad batch)
  skips; with a divergence but no snapshot old enough, the ranks holding
  different ones, or ``max_rewinds`` consecutive rewinds already made, it
  raises;
* ``drop`` skips when no sample can be singled out (no replay, a single
  sample, every sample failing alone, a failure not about samples, several
  optimizers, a DDP rank that cannot take part without samples or cannot
  prepare its part) and when the recomputation raises or triggers again;
* ``skip``, ``rewind`` and ``drop`` raise once ``max_skips`` consecutive
  update steps were left out;
* a forward that raised for any reason but non-finite values (its diagnosis
  finds none, on some rank it raised on) propagates unchanged, the diagnosis
  attached; one that ran out of memory, or any under ``replay=False``,
  propagates untouched (a replay would fail the same way);
* an exception raised in backward propagates whatever the policy, the
  diagnosis attached;
* ``skip`` and ``rewind`` also quarantine the samples of a data diagnosis
  under ``quarantine_skips``.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from ..options import CheckOptions, RewindOptions
from ..records import Trigger
from ._plan import Action, Circumstances, Plan

# The policies that leave a triggering update step unapplied.
_LEAVE_OUT = ('skip', 'rewind', 'drop')


class Policy(object):
    """The policies of one run: what it keeps ready, and the plan of each
    trigger.

    Args:
        options (CheckOptions): ``policy``, ``spike_policy``, ``max_skips``.
        rewind (RewindOptions, optional): ``max_rewinds`` (consecutive
            rewinds after which ``'rewind'`` raises) and ``cooldown``.
        quarantine_skips (bool): ``'skip'`` and ``'rewind'`` quarantine the
            samples of a data diagnosis too.
    """

    def __init__(self, options: CheckOptions,
                 rewind: Optional[RewindOptions] = None,
                 quarantine_skips: bool = False) -> None:
        self.options = options
        self.rewind = rewind
        self.quarantine_skips = quarantine_skips

    @property
    def leaves_steps_out(self) -> bool:
        """Whether a trigger or a spike may leave its step unapplied (so
        what each forward writes must be kept to be undone)."""
        return bool(set(_LEAVE_OUT) & set((self.options.policy,
                                           self.options.spike_policy)))

    @property
    def rewinds(self) -> bool:
        """Whether a trigger or a spike may go back to a snapshot (so
        snapshots are taken)."""
        return 'rewind' in (self.options.policy, self.options.spike_policy)

    def spike_triggers(self) -> bool:
        """Whether a spike is a trigger: anything but ``'warn'`` (logged
        and counted only)."""
        return self.options.spike_policy != 'warn'

    @property
    def warns_only(self) -> bool:
        """Whether every triggering step is applied as it is (``'warn'``)."""
        return self.options.policy == 'warn'

    def drops_at_all(self) -> bool:
        """Whether triggers may be recomputed without samples."""
        return self.options.policy == 'drop'

    def quarantines_crashes(self) -> bool:
        """Whether the samples in flight when an earlier run in the work
        dir died inside a step are quarantined at the start: under
        ``'drop'``, which leaves a step's bad samples out."""
        return self.drops_at_all()

    def needs_hook(self) -> Optional[str]:
        """Why only ``NanDetectHook`` can carry these policies out, or
        ``None``: what a self-checking optim wrapper refuses at build
        time."""
        if self.rewinds:
            return ("policy/spike_policy 'rewind' needs NanDetectHook, which "
                    'keeps the snapshots to go back to; configure the hook')
        if self.drops_at_all():
            # Without the hook's replay no sample is singled out: the step
            # would only be skipped, BN statistics and all.
            return ("policy 'drop' needs NanDetectHook, which replays the "
                    'batch to find the samples to leave out and quarantines '
                    "them; configure the hook with policy='drop', or give "
                    "the optim wrapper policy='skip'")
        return None

    def of(self, event: Any) -> str:
        """The policy that handles ``event``."""
        if event.trigger == Trigger.SPIKE:
            return self.options.spike_policy
        return self.options.policy

    def plan(self, known: Circumstances) -> Plan:
        """The :class:`Plan` of one trigger: every row of the module's
        table, fallbacks and limits included.

        Args:
            known (Circumstances): What is known when it fires.
        """
        event = known.event
        policy = self.of(event)
        exception = event.trigger == Trigger.EXCEPTION
        if exception and not known.in_backward and (
                not known.replays or known.out_of_memory):
            # A replay would fail as the forward did.
            return Plan(event, policy, logging.ERROR, Action.PROPAGATE,
                        diagnose=False)
        level = logging.ERROR if exception or policy == 'raise' \
            else logging.WARNING
        rewinds = (not exception and policy == 'rewind'
                   and known.diverged)
        spike = event.trigger == Trigger.SPIKE
        if spike and not rewinds and policy != 'raise':
            diagnosers = ()
        else:
            diagnosers = tuple(event.bad_ranks or range(event.world_size))
        if not known.together:
            # Alone, or a trigger only this rank saw.
            diagnosers = tuple(r for r in diagnosers if r == event.rank)
        rows = dict(event=event, policy=policy, level=level,
                    diagnosers=diagnosers,
                    undo=not exception and policy in _LEAVE_OUT,
                    quarantine=(self.quarantine_skips and not spike
                                and policy in ('skip', 'rewind')))
        if known.in_backward:
            return Plan(action=Action.PROPAGATE, **rows)
        escalate = self._limit(policy, known, rewinds)
        if escalate:
            # It stops training: an error, as a trigger under 'raise' is.
            rows['level'] = logging.ERROR
        if policy == 'raise' or escalate:
            action = Action.RAISE
        elif policy == 'warn':
            action = Action.PROPAGATE if exception else Action.APPLY
        elif policy == 'drop' and not spike:
            action = Action.DROP
        else:
            action = Action.SKIP
        return Plan(action=action, escalate=escalate,
                    rewind_to=known.rewind_to if rewinds and not escalate
                    else None, drop=action is Action.DROP,
                    nonfinite_only=exception, **rows)

    def _limit(self, policy, known, rewinds):
        """Why the trigger raises whatever the policy, or ``None``."""
        if rewinds and known.no_rewind:
            return known.no_rewind
        limit = self.rewind
        if rewinds and known.consecutive_rewinds >= limit.max_rewinds:
            return ("policy 'rewind' already went back %d consecutive "
                    'times without %d clean update steps in between '
                    '(max_rewinds=%d)' % (known.consecutive_rewinds,
                                          limit.cooldown, limit.max_rewinds))
        if (policy in _LEAVE_OUT
                and known.consecutive_skips >= self.options.max_skips):
            return ("policy %r already skipped %d consecutive update "
                    'steps (max_skips=%d)' %
                    (policy, known.consecutive_skips, self.options.max_skips))
        return None
