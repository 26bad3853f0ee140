"""Every option of mmnanhook, validated in one place.

``NanDetectHook`` and the ``NanDetect*OptimWrapper`` classes take their
options from here, so a bad value fails at build time with the same message
naming the option, whichever way it was configured. Each option's default is
written once, as its dataclass field's.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Dict, Optional, Sequence, Union

POLICIES = ('raise', 'skip', 'warn', 'rewind', 'drop')
SPIKE_POLICIES = (None, 'warn', 'skip', 'rewind', 'raise')
ANOMALY_MODES = ('on_trigger', 'always', 'never')


def is_count(value: Any) -> bool:
    """Whether ``value`` is an int (and not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(name: str, value: Any, minimum: int,
                allow_none: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= minimum."""
    if allow_none and value is None:
        return
    if not is_count(value) or value < minimum:
        raise ValueError('%s must be an int >= %d%s, got %r' %
                         (name, minimum, ' or None' if allow_none else '',
                          value))


def check_bool(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError('%s must be True or False, got %r' % (name, value))


def check_number(name: str, value: Any, minimum: float = 0.0,
                 allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number >= minimum."""
    if allow_none and value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < minimum):
        raise ValueError('%s must be a finite number >= %s%s, got %r' %
                         (name, minimum, ' or None' if allow_none else '',
                          value))


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is in ``choices``."""
    if value not in choices:
        raise ValueError('%s must be one of %s, got %r' %
                         (name, ', '.join(map(repr, choices)), value))


def check_anomaly(anomaly: Any) -> None:
    """``anomaly``: one of :data:`ANOMALY_MODES` or an int >= 0."""
    if anomaly in ANOMALY_MODES:
        return
    if not is_count(anomaly) or anomaly < 0:
        raise ValueError(
            'anomaly must be one of %s or an int >= 0 (anomaly mode on for '
            'that many train iterations), got %r' %
            (', '.join(map(repr, ANOMALY_MODES)), anomaly))


def anomaly_wanted(anomaly: Union[str, int],
                   train_iters: int) -> bool:
    """Whether anomaly mode is on in a train iteration, ``train_iters``
    iterations into the run (``anomaly`` checked by :func:`check_anomaly`)."""
    return anomaly == 'always' or (is_count(anomaly) and
                                   train_iters < anomaly)


def check_path(name: str, value: Any) -> None:
    """``value``: a path or ``None``."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError('%s must be a path or None, got %r' % (name, value))


# Clean runs of the tiny detectors and of the zoo's RetinaNet R50 and
# RTMDet-tiny (with their warmups) stay below 2.1x (loss) and 8x (gradient
# norm) their running median (see the README); divergences go far beyond.
SPIKE_FACTORS = {'loss': 4.0, 'grad_norm': 20.0}


def spike_factors(value: Union[float, Dict[str, float], None]
                  ) -> Dict[str, float]:
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


def _take(cls, kwargs):
    """``cls`` built from the entries of ``kwargs`` that name its fields
    (popped)."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    return cls(**dict((n, kwargs.pop(n)) for n in names if n in kwargs))


def _set(obj, name, value):
    # Normalized in __post_init__ of a frozen dataclass.
    object.__setattr__(obj, name, value)


@dataclasses.dataclass(frozen=True)
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
            ``'loss'`` and / or ``'grad_norm'`` (kept as that dict).

    Raises:
        ValueError: Naming the first bad option.
    """

    policy: str = 'raise'
    max_skips: int = 10
    min_loss_scale: Optional[float] = 1.0
    max_overflow_skips: Optional[int] = 20
    spike_policy: Optional[str] = 'warn'
    spike_window: int = 50
    spike_warmup: int = 20
    spike_factor: Union[None, float, dict] = None

    def __post_init__(self):
        check_choice('policy', self.policy, POLICIES)
        check_count('max_skips', self.max_skips, 0)
        check_number('min_loss_scale', self.min_loss_scale, allow_none=True)
        check_count('max_overflow_skips', self.max_overflow_skips, 0,
                    allow_none=True)
        check_choice('spike_policy', self.spike_policy, SPIKE_POLICIES)
        check_count('spike_window', self.spike_window, 2)
        check_count('spike_warmup', self.spike_warmup, 1)
        if self.spike_warmup > self.spike_window:
            raise ValueError('spike_warmup must be <= spike_window, got %r > '
                             '%r' % (self.spike_warmup, self.spike_window))
        _set(self, 'spike_factor', spike_factors(self.spike_factor))

    take = classmethod(_take)


@dataclasses.dataclass(frozen=True)
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

    snapshot_interval: int = 50
    snapshot_device: str = 'cpu'
    max_snapshots: int = 2
    lr_factor: float = 0.1
    cooldown: int = 100
    max_rewinds: int = 3

    def __post_init__(self):
        check_count('snapshot_interval', self.snapshot_interval, 1)
        if not isinstance(self.snapshot_device, str):
            raise ValueError('snapshot_device must be a device name such as '
                             "'cpu' or 'cuda', got %r" %
                             (self.snapshot_device, ))
        try:
            import torch
            torch.device(self.snapshot_device)
        except (RuntimeError, TypeError) as error:
            raise ValueError('snapshot_device %r is not a device: %s' %
                             (self.snapshot_device, error))
        check_count('max_snapshots', self.max_snapshots, 1)
        check_number('lr_factor', self.lr_factor)
        if not 0 < self.lr_factor <= 1:
            raise ValueError('lr_factor must be in (0, 1], got %r' %
                             (self.lr_factor, ))
        check_count('cooldown', self.cooldown, 0)
        check_count('max_rewinds', self.max_rewinds, 1)

    take = classmethod(_take)


@dataclasses.dataclass(frozen=True)
class QuarantineOptions(object):
    """The options of the quarantine, validated.

    Args:
        quarantine (str, optional): A reviewed list to start from; read
            when the hook is built (:class:`~mmnanhook.NanDetectHook`), so
            a file that is not one fails at build time.
        quarantine_file (str, optional): Where the run's list is written
            (``None``: ``{work_dir}/nan_quarantine.json``).
        quarantine_skips (bool): Whether ``'skip'`` and ``'rewind'``
            quarantine the samples a diagnosis names too.

    Raises:
        ValueError: Naming the first bad option.
    """

    quarantine: Optional[str] = None
    quarantine_file: Optional[str] = None
    quarantine_skips: bool = False

    def __post_init__(self):
        check_path('quarantine', self.quarantine)
        check_path('quarantine_file', self.quarantine_file)
        check_bool('quarantine_skips', self.quarantine_skips)

    take = classmethod(_take)


# What the config rules' findings do at before_train.
DOCTOR_CHOICES = ('warn', 'raise', None)
# Which bundles hold the model (and optimizer) state.
DUMP_STATE_CHOICES = ('per_kind', 'every')


@dataclasses.dataclass(frozen=True)
class HookOptions(object):
    """Every option of ``NanDetectHook`` (see its docstring), validated.

    Args:
        anomaly (str | int): When anomaly mode is on (:func:`check_anomaly`).
        dump_dir (str, optional): Where bundles are written.
        max_dumps (int): Bundles kept per rank; 0 writes none.
        replay (bool): Whether a trigger is replayed to diagnose it.
        history (int): Iterations of history kept for a bundle.
        dump_optimizer (bool): Whether bundles hold the optimizer state.
        dump_state (str): Which bundles hold the state: ``'per_kind'``
            (the first of each kind of incident, on one rank) or
            ``'every'``.
        doctor (str, optional): What the config rules' findings do at
            ``before_train``: ``'warn'`` (a log line each), ``'raise'``
            (training does not start), ``None`` (not run).
        check (CheckOptions): Tier 1's.
        rewind (RewindOptions): ``'rewind'``'s.
        quarantine (QuarantineOptions): The quarantine's.
    """

    anomaly: Union[str, int] = 'on_trigger'
    dump_dir: Optional[str] = None
    max_dumps: int = 5
    replay: bool = True
    history: int = 200
    dump_optimizer: bool = True
    dump_state: str = 'per_kind'
    doctor: Optional[str] = 'warn'
    check: CheckOptions = dataclasses.field(default_factory=CheckOptions)
    rewind: RewindOptions = dataclasses.field(default_factory=RewindOptions)
    quarantine: QuarantineOptions = dataclasses.field(
        default_factory=QuarantineOptions)

    def __post_init__(self):
        check_anomaly(self.anomaly)
        check_path('dump_dir', self.dump_dir)
        check_count('max_dumps', self.max_dumps, 0)
        check_bool('replay', self.replay)
        check_count('history', self.history, 0)
        check_bool('dump_optimizer', self.dump_optimizer)
        check_choice('dump_state', self.dump_state, DUMP_STATE_CHOICES)
        check_choice('doctor', self.doctor, DOCTOR_CHOICES)

    @classmethod
    def build(cls, **kwargs: Any) -> HookOptions:
        """The options from a hook config's keyword arguments.

        Raises:
            TypeError: For an option no part knows, naming it.
            ValueError: For a bad value, naming its option.
        """
        parts = dict(check=CheckOptions.take(kwargs),
                     rewind=RewindOptions.take(kwargs),
                     quarantine=QuarantineOptions.take(kwargs))
        own = [f.name for f in dataclasses.fields(cls) if f.name not in parts]
        unknown = sorted(set(kwargs) - set(own))
        if unknown:
            raise TypeError('NanDetectHook got unknown option(s): %s' %
                            ', '.join(unknown))
        return cls(**dict(kwargs, **parts))
