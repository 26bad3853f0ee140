"""Every option of mmnanhook, validated in one place.

``NanDetectHook`` and the ``NanDetect*OptimWrapper`` classes take their
options from here, so a bad value fails at build time with the same message
naming the option, whichever way it was configured.
"""
import math
import os

POLICIES = ('raise', 'skip', 'warn')
ANOMALY_MODES = ('on_trigger', 'always', 'never')


def is_count(value):
    """Whether ``value`` is an int (and not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(name, value, minimum, allow_none=False):
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= minimum."""
    if allow_none and value is None:
        return
    if not is_count(value) or value < minimum:
        raise ValueError('%s must be an int >= %d%s, got %r' %
                         (name, minimum, ' or None' if allow_none else '',
                          value))


def check_bool(name, value):
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError('%s must be True or False, got %r' % (name, value))


def check_number(name, value, minimum=0.0, allow_none=False):
    """Raise ``ValueError`` unless ``value`` is a finite number >= minimum."""
    if allow_none and value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < minimum):
        raise ValueError('%s must be a finite number >= %s%s, got %r' %
                         (name, minimum, ' or None' if allow_none else '',
                          value))


def check_choice(name, value, choices):
    """Raise ``ValueError`` naming ``name`` unless ``value`` is in ``choices``."""
    if value not in choices:
        raise ValueError('%s must be one of %s, got %r' %
                         (name, ', '.join(map(repr, choices)), value))


def check_anomaly(anomaly):
    """``anomaly``: one of :data:`ANOMALY_MODES` or an int >= 0."""
    if anomaly in ANOMALY_MODES:
        return
    if not is_count(anomaly) or anomaly < 0:
        raise ValueError(
            'anomaly must be one of %s or an int >= 0 (anomaly mode on for '
            'that many train iterations), got %r' %
            (', '.join(map(repr, ANOMALY_MODES)), anomaly))


def check_path(name, value):
    """``value``: a path or ``None``."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError('%s must be a path or None, got %r' % (name, value))


class CheckOptions(object):
    """The options of the per-step check (tier 1), validated.

    Args:
        policy (str): What a trigger does: ``'raise'``, ``'skip'`` or
            ``'warn'``.
        max_skips (int): Consecutive skipped update steps after which
            ``'skip'`` raises.
        min_loss_scale (float, optional): Under AMP, a loss scale below this
            is a trigger; ``None`` disables the check.
        max_overflow_skips (int, optional): Under AMP, more consecutive
            overflow skips than this are a trigger; ``None`` disables it.

    Raises:
        ValueError: Naming the first bad option.
    """

    __slots__ = ('policy', 'max_skips', 'min_loss_scale', 'max_overflow_skips')

    def __init__(self, policy='raise', max_skips=10, min_loss_scale=1.0,
                 max_overflow_skips=20):
        check_choice('policy', policy, POLICIES)
        check_count('max_skips', max_skips, 0)
        check_number('min_loss_scale', min_loss_scale, allow_none=True)
        check_count('max_overflow_skips', max_overflow_skips, 0,
                    allow_none=True)
        self.policy = policy
        self.max_skips = max_skips
        self.min_loss_scale = min_loss_scale
        self.max_overflow_skips = max_overflow_skips

    def __repr__(self):
        return 'CheckOptions(%s)' % ', '.join(
            '%s=%r' % (k, getattr(self, k)) for k in self.__slots__)
