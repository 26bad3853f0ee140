"""Typed records of what mmnanhook saw: one class per fact.

Tier 1 builds a :class:`NonFiniteEvent` per trigger; tier 2 and the bundle
read it. Enum members are ``str`` subclasses, so they compare equal to, and
serialize as, their value (``Trigger.LOSS == 'loss'``).
"""
import enum


class _StrEnum(str, enum.Enum):

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)


class Trigger(_StrEnum):
    """What made tier 1 act."""

    LOSS = 'loss'  #: a loss term was non-finite
    GRAD = 'grad'  #: a gradient, or the gradient norm, was non-finite
    EXCEPTION = 'exception'  #: backward raised (e.g. anomaly mode)
    AMP_SCALE = 'amp_scale'  #: the AMP loss scale collapsed


TRIGGERS = tuple(t.value for t in Trigger)


class NonFiniteEvent(object):
    """What was non-finite in one update step, handed to listeners.

    Args:
        trigger (Trigger | str): What triggered.
        message (str): Human-readable description.
        iter (int, optional): Global training iteration of the update step.
        epoch (int, optional): Training epoch.
        rank (int): Rank that builds the event.
        world_size (int): Number of ranks.
        bad_ranks (list[int]): Ranks whose loss was non-finite.
        losses (dict): Loss term name -> float (non-finite values kept).
        nonfinite_losses (list[str]): Names of the non-finite loss terms.
        bad_loss_iters (list[int]): Iterations (micro-steps under gradient
            accumulation) whose loss was non-finite on this rank.
        grad_norm (float, optional): Total gradient norm before clipping,
            unscaled under AMP.
        nonfinite_grads (list[str]): Parameters with non-finite gradients,
            at most :data:`mmnanhook._format.MAX_NAMES`.
        nonfinite_grad_count (int): How many parameters have them.
        loss_scale (float, optional): AMP loss scale used for the step.
        exception (str, optional): ``'Type: message'`` of the exception
            raised in backward, for ``Trigger.EXCEPTION``. Only its text: the
            exception object's traceback would keep the autograd graph alive.
        forward_traceback (str, optional): Anomaly mode's traceback of the
            forward op involved, when it was on.
    """

    def __init__(self, trigger, message, iter=None, epoch=None, rank=0,
                 world_size=1, bad_ranks=None, losses=None,
                 nonfinite_losses=None, bad_loss_iters=None, grad_norm=None,
                 nonfinite_grads=None, nonfinite_grad_count=0,
                 loss_scale=None, exception=None, forward_traceback=None):
        if trigger not in TRIGGERS:
            raise ValueError('unknown trigger %r; one of %s' %
                             (trigger, ', '.join(TRIGGERS)))
        self.trigger = Trigger(trigger)
        self.message = message
        self.iter = iter
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size
        self.bad_ranks = list(bad_ranks or [])
        self.losses = dict(losses or {})
        self.nonfinite_losses = list(nonfinite_losses or [])
        self.bad_loss_iters = list(bad_loss_iters or [])
        self.grad_norm = grad_norm
        self.nonfinite_grads = list(nonfinite_grads or [])
        self.nonfinite_grad_count = nonfinite_grad_count
        self.loss_scale = loss_scale
        self.exception = exception
        self.forward_traceback = forward_traceback

    @property
    def fail_iter(self):
        """The iteration whose batch to replay: the bad micro-step's, if any."""
        return (self.bad_loss_iters or [self.iter])[0]

    def __repr__(self):
        return 'NonFiniteEvent(%s)' % self.message
