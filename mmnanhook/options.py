"""Every option of mmnanhook, validated in one place.

``NanDetectHook`` and the ``NanDetect*OptimWrapper`` classes take their
options from here, so a bad value fails at build time with the same message
naming the option, whichever way it was configured.
"""
import math
import os

POLICIES = ('raise', 'skip', 'warn', 'rewind', 'drop')
SPIKE_POLICIES = (None, 'warn', 'skip', 'rewind', 'raise')
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


def anomaly_wanted(anomaly, train_iters):
    """Whether anomaly mode is on in a train iteration, ``train_iters``
    iterations into the run (``anomaly`` checked by :func:`check_anomaly`)."""
    return anomaly == 'always' or (is_count(anomaly) and
                                   train_iters < anomaly)


def check_path(name, value):
    """``value``: a path or ``None``."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError('%s must be a path or None, got %r' % (name, value))


# Clean runs of the tiny detectors and of the zoo's RetinaNet R50 and
# RTMDet-tiny (with their warmups) stay below 2.1x (loss) and 8x (gradient
# norm) their running median (see the README); divergences go far beyond.
SPIKE_FACTORS = {'loss': 4.0, 'grad_norm': 20.0}


def spike_factors(value):
    """``spike_factor`` as ``{'loss': f, 'grad_norm': g}``, validated."""
    if value is None:
        return dict(SPIKE_FACTORS)
    if isinstance(value, dict):
        unknown = set(value) - set(SPIKE_FACTORS)
        if unknown:
            raise ValueError('spike_factor keys must be among %s, got %s' %
                             (', '.join(sorted(SPIKE_FACTORS)),
                              ', '.join(sorted(map(str, unknown)))))
        factors = dict(SPIKE_FACTORS, **value)
    else:
        factors = dict.fromkeys(SPIKE_FACTORS, value)
    for factor in factors.values():
        check_number('spike_factor', factor, minimum=1.0)
    return factors


class CheckOptions(object):
    """The options of the per-step check (tier 1), validated.

    Args:
        policy (str): What a trigger does: ``'raise'``, ``'skip'``,
            ``'warn'``, ``'rewind'`` or ``'drop'``.
        max_skips (int): Consecutive skipped update steps after which
            ``'skip'`` raises.
        min_loss_scale (float, optional): Under AMP, a loss scale below this
            is a trigger; ``None`` disables the check.
        max_overflow_skips (int, optional): Under AMP, more consecutive
            overflow skips than this are a trigger; ``None`` disables it.
        spike_policy (str, optional): What a spike does: ``None`` (no spike
            detection), ``'warn'``, ``'skip'``, ``'rewind'`` or ``'raise'``.
        spike_window (int): Iterations a spike band is computed over.
        spike_warmup (int): Iterations seen before any is judged.
        spike_factor (float | dict): How many times the band's median a
            spike is at least: one number for both series, or a dict with
            ``'loss'`` and / or ``'grad_norm'``.

    Raises:
        ValueError: Naming the first bad option.
    """

    __slots__ = ('policy', 'max_skips', 'min_loss_scale', 'max_overflow_skips',
                 'spike_policy', 'spike_window', 'spike_warmup',
                 'spike_factor')

    def __init__(self, policy='raise', max_skips=10, min_loss_scale=1.0,
                 max_overflow_skips=20, spike_policy='warn', spike_window=50,
                 spike_warmup=20, spike_factor=None):
        check_choice('policy', policy, POLICIES)
        check_count('max_skips', max_skips, 0)
        check_number('min_loss_scale', min_loss_scale, allow_none=True)
        check_count('max_overflow_skips', max_overflow_skips, 0,
                    allow_none=True)
        check_choice('spike_policy', spike_policy, SPIKE_POLICIES)
        check_count('spike_window', spike_window, 2)
        check_count('spike_warmup', spike_warmup, 1)
        if spike_warmup > spike_window:
            raise ValueError('spike_warmup must be <= spike_window, got %r > '
                             '%r' % (spike_warmup, spike_window))
        spike_factor = spike_factors(spike_factor)
        self.policy = policy
        self.max_skips = max_skips
        self.min_loss_scale = min_loss_scale
        self.max_overflow_skips = max_overflow_skips
        self.spike_policy = spike_policy
        self.spike_window = spike_window
        self.spike_warmup = spike_warmup
        self.spike_factor = spike_factor

    @property
    def skips(self):
        """Whether a trigger or a spike may leave its step unapplied (so
        what its forward wrote must be undone)."""
        return bool(set(('skip', 'rewind', 'drop')) &
                    set((self.policy, self.spike_policy)))

    @property
    def rewinds(self):
        """Whether a trigger or a spike may go back to a snapshot."""
        return 'rewind' in (self.policy, self.spike_policy)

    def needs_hook(self):
        """Why only ``NanDetectHook`` can apply these options, or ``None``:
        what a self-checking optim wrapper refuses at build time."""
        if self.rewinds:
            return ("policy/spike_policy 'rewind' needs NanDetectHook, which "
                    'keeps the snapshots to go back to; configure the hook')
        if self.policy == 'drop':
            # Without the hook's replay no sample is singled out: the step
            # would only be skipped, BN statistics and all.
            return ("policy 'drop' needs NanDetectHook, which replays the "
                    'batch to find the samples to leave out and quarantines '
                    "them; configure the hook with policy='drop', or give "
                    "the optim wrapper policy='skip'")
        return None

    def __repr__(self):
        return 'CheckOptions(%s)' % ', '.join(
            '%s=%r' % (k, getattr(self, k)) for k in self.__slots__)


class RewindOptions(object):
    """The options of ``policy='rewind'``, validated.

    Args:
        snapshot_interval (int): Iterations between snapshots of a good
            state.
        snapshot_device (str): Where the snapshots live.
        max_snapshots (int): How many are kept.
        lr_factor (float): After a rewind, every param group's LR is
            multiplied by this for ``cooldown`` update steps (compounded
            over consecutive rewinds; the schedulers never see it).
        cooldown (int): Update steps the LR stays lowered.
        max_rewinds (int): Consecutive rewinds (without ``cooldown`` clean
            update steps in between) after which training stops.

    Raises:
        ValueError: Naming the first bad option.
    """

    __slots__ = ('snapshot_interval', 'snapshot_device', 'max_snapshots',
                 'lr_factor', 'cooldown', 'max_rewinds')

    def __init__(self, snapshot_interval=50, snapshot_device='cpu',
                 max_snapshots=2, lr_factor=0.1, cooldown=100, max_rewinds=3):
        check_count('snapshot_interval', snapshot_interval, 1)
        if not isinstance(snapshot_device, str):
            raise ValueError('snapshot_device must be a device name such as '
                             "'cpu' or 'cuda', got %r" % (snapshot_device, ))
        try:
            import torch
            torch.device(snapshot_device)
        except (RuntimeError, TypeError) as error:
            raise ValueError('snapshot_device %r is not a device: %s' %
                             (snapshot_device, error))
        check_count('max_snapshots', max_snapshots, 1)
        check_number('lr_factor', lr_factor)
        if not 0 < lr_factor <= 1:
            raise ValueError('lr_factor must be in (0, 1], got %r' %
                             (lr_factor, ))
        check_count('cooldown', cooldown, 0)
        check_count('max_rewinds', max_rewinds, 1)
        self.snapshot_interval = snapshot_interval
        self.snapshot_device = snapshot_device
        self.max_snapshots = max_snapshots
        self.lr_factor = lr_factor
        self.cooldown = cooldown
        self.max_rewinds = max_rewinds


class QuarantineOptions(object):
    """The options of the quarantine, validated.

    Args:
        quarantine (str, optional): A reviewed list to start from; read
            now, so a file that is not one fails at build time.
        quarantine_file (str, optional): Where the run's list is written
            (``None``: ``{work_dir}/nan_quarantine.json``).
        quarantine_skips (bool): Whether ``'skip'`` and ``'rewind'``
            quarantine the samples a diagnosis names too.

    Raises:
        ValueError: Naming the first bad option, or the file (a
            :class:`~mmnanhook.quarantine.QuarantineError`).
    """

    __slots__ = ('reviewed', 'path', 'skips')

    def __init__(self, quarantine=None, quarantine_file=None,
                 quarantine_skips=False):
        check_path('quarantine', quarantine)
        check_path('quarantine_file', quarantine_file)
        check_bool('quarantine_skips', quarantine_skips)
        if quarantine is not None:
            from .quarantine import read_quarantine
            read_quarantine(quarantine)
        self.reviewed = quarantine
        self.path = quarantine_file
        self.skips = quarantine_skips

    def used_by(self, policy):
        """Whether a run under ``policy`` keeps a quarantine."""
        return policy == 'drop' or self.skips or self.reviewed is not None
