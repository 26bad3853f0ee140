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
training. ``skip``, ``rewind`` and ``drop`` raise once ``max_skips``
consecutive update steps were left out; an answer that escalates (a rewind
with no snapshot to go back to) raises whatever the policy. A forward that
raised for any other reason (its diagnosis finds no non-finite value)
propagates unchanged, the diagnosis attached.
"""
import dataclasses
import enum
import logging

from ..errors import NonFiniteError
from ..records import Trigger
from ._samples import raised_by_nonfinite, received

# The policies that leave a triggering update step unapplied.
_LEAVE_OUT = ('skip', 'rewind', 'drop')


class Action(enum.Enum):
    """What the carrier of a decision does with the step."""

    APPLY = 'apply'  #: apply it as MMEngine would have (``'warn'``)
    SKIP = 'skip'  #: leave it out: gradients zeroed, ``train/nan_skipped``
    DROP = 'drop'  #: recompute it without the answer's samples
    RAISE = 'raise'  #: raise :class:`~mmnanhook.NonFiniteError`
    PROPAGATE = 'propagate'  #: let the forward's own exception go on


@dataclasses.dataclass(frozen=True)
class Decision(object):
    """What a trigger leads to.

    Args:
        action (Action): What the carrier does.
        message (str): The event's message with what the answer adds (the
            diagnosis, the verified fix, the bundle, why it escalates): the
            error's text.
    """

    action: Action
    message: str

    def error(self, event, answer):
        """The :class:`~mmnanhook.NonFiniteError` of ``Action.RAISE``."""
        return NonFiniteError(
            self.message, event.trigger.value, iter=event.iter,
            rank=event.rank, bad_ranks=event.bad_ranks, bundle=answer.bundle,
            report=answer.report_dict())


class Policy(object):
    """The policies of one run, asked by tier 1 and by the hook's run.

    Args:
        options (CheckOptions): ``policy``, ``spike_policy``, ``max_skips``.
    """

    def __init__(self, options):
        self.options = options

    @property
    def leaves_steps_out(self):
        """Whether a trigger or a spike may leave its step unapplied (so
        what each forward writes must be kept to be undone)."""
        return bool(set(_LEAVE_OUT) & set((self.options.policy,
                                           self.options.spike_policy)))

    @property
    def rewinds(self):
        """Whether a trigger or a spike may go back to a snapshot (so
        snapshots are taken)."""
        return 'rewind' in (self.options.policy, self.options.spike_policy)

    def spike_triggers(self):
        """Whether a spike is a trigger: anything but ``'warn'`` (logged
        and counted only)."""
        return self.options.spike_policy != 'warn'

    @property
    def warns_only(self):
        """Whether every triggering step is applied as it is (``'warn'``)."""
        return self.options.policy == 'warn'

    def drops_at_all(self):
        """Whether triggers may be recomputed without samples."""
        return self.options.policy == 'drop'

    def of(self, event):
        """The policy that handles ``event``."""
        if event.trigger == Trigger.SPIKE:
            return self.options.spike_policy
        return self.options.policy

    def level(self, event):
        """The log level of ``event``: an error when it stops training."""
        stops = event.trigger == Trigger.EXCEPTION or \
            self.of(event) == 'raise'
        return logging.ERROR if stops else logging.WARNING

    def undoes_forward(self, event):
        """Whether what the failing forward wrote (BN running statistics)
        is put back before anything else: its step is left out."""
        return event.trigger != Trigger.EXCEPTION and \
            self.of(event) in _LEAVE_OUT

    def may_rewind(self, event):
        """Whether ``event`` goes back to a snapshot when something
        diverged before it (else it is skipped)."""
        return event.trigger != Trigger.EXCEPTION and \
            self.of(event) == 'rewind'

    def diagnosers(self, event, rewinds):
        """The ranks that replay and diagnose ``event``: those whose batch
        is implicated (every rank when none is singled out), and for a spike
        only when it stops or rewinds training."""
        spike = event.trigger == Trigger.SPIKE
        if spike and not rewinds and self.of(event) != 'raise':
            return []
        return list(event.bad_ranks or range(event.world_size))

    def drops(self, event, data):
        """Whether ``event``'s step is recomputed without samples: a
        trigger under ``'drop'`` (a forward that raised only when its data
        made it raise)."""
        return (event.trigger != Trigger.SPIKE and self.of(event) == 'drop'
                and (event.trigger != Trigger.EXCEPTION or data))

    def quarantines(self, event, data, quarantine_skips):
        """Whether ``'skip'`` / ``'rewind'`` quarantine the samples of
        ``event`` (``quarantine_skips``; ``'drop'`` always does, for what
        it dropped)."""
        return (quarantine_skips and event.trigger != Trigger.SPIKE and data
                and self.of(event) in ('skip', 'rewind'))

    def decide(self, event, answer, consecutive_skips):
        """What a trigger of the update step leads to.

        Args:
            event (NonFiniteEvent): The trigger.
            answer (Answer): What the listener did and found.
            consecutive_skips (int): Update steps left out in a row before
                this one.

        Returns:
            Decision: ``RAISE``, ``DROP`` (with ``answer.drop``), ``SKIP``
            or ``APPLY``.
        """
        policy = self.of(event)
        lines = [event.message, answer.text()]
        escalate = answer.escalate
        if (not escalate and policy in _LEAVE_OUT
                and consecutive_skips >= self.options.max_skips):
            escalate = ("policy %r already skipped %d consecutive update "
                        'steps (max_skips=%d)' %
                        (policy, consecutive_skips, self.options.max_skips))
        lines.append(escalate)
        message = '\n'.join(line for line in lines if line)
        if policy == 'raise' or escalate:
            return Decision(Action.RAISE, message)
        if policy == 'drop' and answer.drop is not None:
            return Decision(Action.DROP, message)
        if policy in _LEAVE_OUT:
            return Decision(Action.SKIP, message)
        return Decision(Action.APPLY, message)

    def after_forward(self, event, answer, consecutive_skips):
        """What a train step whose forward raised leads to.

        The policy applies only when non-finite values made the forward
        raise, on every rank it raised on (a rank that only received the
        failure through another's samples aside); otherwise, and under
        ``'warn'``, the original exception propagates with the answer's
        text as a note.

        Returns:
            Decision: ``PROPAGATE`` (its message: the note), ``RAISE``,
            ``DROP`` or ``SKIP``.
        """
        findings = answer.findings
        if findings is not None:
            stops = any(f.raises and not received(f, findings)
                        for f in findings)
        else:
            stops = not raised_by_nonfinite(answer.report)
        decision = None if stops else self.decide(event, answer,
                                                  consecutive_skips)
        if decision is None or decision.action is Action.APPLY:
            return Decision(Action.PROPAGATE, answer.text())
        return decision
