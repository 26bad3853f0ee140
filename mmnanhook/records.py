"""Typed records of what mmnanhook saw: one class per fact.

One module (over 500 lines) because it is one contract: every record a room
hands another, and ``report.json``'s schema, which reads them all back.

Tier 1 builds a :class:`NonFiniteEvent` per trigger; tier 2 replays
(:class:`ReplayResult`), checks the batch (:class:`SampleFinding` with its
:class:`DataProblem` s), replays each fix (:class:`Fix`) and writes a
:class:`Report`, which the bundle renders as ``report.json``; the config
rules' :class:`ConfigFinding` s (``mmnan doctor``, the hook's
``before_train``) travel in it too. Enum members are ``str`` subclasses, so
they compare equal to, and serialize as, their value
(``Trigger.LOSS == 'loss'``).
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import math
from typing import Dict, List, Optional, Sequence, Union


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
    SPIKE = 'spike'  #: a finite loss or gradient norm far above its band


TRIGGERS = tuple(t.value for t in Trigger)

# The scalars of one history record (as MessageHub's ``train/<field>``): what
# tier 1 keeps per iteration and a bundle's ``history.json`` / plot show.
HISTORY_FIELDS = ('loss', 'grad_norm', 'lr', 'loss_scale')


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
        spikes (list[dict], optional): The spikes of this step
            (``Trigger.SPIKE``).
        shared (bool): Every rank of a distributed run has this event, in
            the same step (the update step's check, a forward vote): the
            ranks then exchange their findings and act alike.
        bad_grad_iter (int, optional): The micro-step whose gradients alone
            are not finite, once a replay of each has found it (a
            gradient-only fault under accumulation; :meth:`at_micro_step`).
    """

    def __init__(self, trigger: Union[Trigger, str], message: str,
                 iter: Optional[int] = None, epoch: Optional[int] = None,
                 rank: int = 0, world_size: int = 1,
                 bad_ranks: Optional[Sequence[int]] = None,
                 losses: Optional[Dict[str, float]] = None,
                 nonfinite_losses: Optional[Sequence[str]] = None,
                 bad_loss_iters: Optional[Sequence[int]] = None,
                 grad_norm: Optional[float] = None,
                 nonfinite_grads: Optional[Sequence[str]] = None,
                 nonfinite_grad_count: int = 0,
                 loss_scale: Optional[float] = None,
                 exception: Optional[str] = None,
                 forward_traceback: Optional[str] = None,
                 spikes: Optional[Sequence[dict]] = None,
                 shared: bool = False,
                 bad_grad_iter: Optional[int] = None) -> None:
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
        self.spikes = list(spikes or [])
        self.shared = bool(shared)
        self.bad_grad_iter = bad_grad_iter

    def at_micro_step(self, iter):
        """This event with its micro-step found: a copy whose
        ``bad_grad_iter`` is ``iter``."""
        located = copy.copy(self)
        located.bad_grad_iter = iter
        return located

    @property
    def fail_iter(self):
        """The iteration whose batch to replay: the bad micro-step's (by its
        loss, or by its gradients alone), if any."""
        if self.bad_loss_iters:
            return self.bad_loss_iters[0]
        return self.iter if self.bad_grad_iter is None else self.bad_grad_iter

    def __repr__(self):
        return 'NonFiniteEvent(%s)' % self.message


class Kind(_StrEnum):
    """What a diagnosis found the failure to be."""

    DATA = 'data'  #: a sample's data (GT boxes, inputs)
    FORWARD = 'forward'  #: a module of the forward pass made it
    BACKWARD = 'backward'  #: a backward op made it from finite gradients
    PARAMS = 'params'  #: parameters or buffers were non-finite already
    OPTIMIZER_STATE = 'optimizer_state'  #: so was the optimizer state
    OVERFLOW = 'overflow'  #: only the AMP dtype's range is exceeded
    EXCEPTION = 'exception'  #: the replay raised
    NOT_REPRODUCED = 'not_reproduced'  #: the replay came out finite
    DIVERGENCE = 'divergence'  #: spikes or a blow-up came before it


KINDS = tuple(k.value for k in Kind)


class ProblemCategory(_StrEnum):
    """The kind of a problem found in a sample's data."""

    SIZE_MISMATCH = 'size_mismatch'  #: declared image size is not the file's
    NONFINITE_INPUT = 'nonfinite_input'  #: the input holds NaN / Inf
    NONFINITE_BOX = 'nonfinite_box'  #: a GT box has NaN / Inf coordinates
    DEGENERATE = 'degenerate'  #: a GT box side is (near) zero or negative
    OUTSIDE = 'outside'  #: a GT box lies outside its image
    ANGLE = 'angle'  #: a rotated box's angle is outside the configured range
    PIPELINE = 'pipeline'  #: the data pipeline raised (``mmnan scan``)
    LABEL = 'label'  #: a GT label outside ``[0, num_classes)``
    MASK = 'mask'  #: segmentation map values neither a class nor ignored
    ALL_IGNORE = 'all_ignore'  #: every pixel ignored under avg_non_ignore


# A sample with one of these carries non-finite values into the forward.
NONFINITE_DATA = (ProblemCategory.NONFINITE_INPUT,
                  ProblemCategory.NONFINITE_BOX)


class DataProblem(object):
    """One problem found in one sample's data.

    Args:
        category (ProblemCategory | str, optional): What kind of problem;
            ``None`` for a problem read back from an old ``report.json``.
        text (str): The sentence the report shows.
        box (int, optional): Index of the GT box concerned.
    """

    __slots__ = ('category', 'text', 'box')

    def __init__(self, category: Union[ProblemCategory, str, None],
                 text: str, box: Optional[int] = None) -> None:
        self.category = None if category is None else ProblemCategory(
            category)
        self.text = text
        self.box = box

    def __str__(self):
        return self.text

    def __repr__(self):
        return 'DataProblem(%s, %r)' % (self.category, self.text)


class SampleFinding(object):
    """What was found about one sample of the failing batch.

    Args:
        index (int): Position in the batch.
        img_path (str, optional): Its image file.
        problems (list[DataProblem]): Its data problems (may be empty).
    """

    __slots__ = ('index', 'img_path', 'problems')

    def __init__(self, index: Optional[int], img_path: Optional[str] = None,
                 problems: Optional[Sequence[DataProblem]] = None) -> None:
        self.index = index
        self.img_path = img_path
        self.problems = list(problems or [])

    @property
    def categories(self):
        """The categories of its problems."""
        return set(p.category for p in self.problems)

    def to_dict(self):
        """As ``report.json`` stores it: problems as their sentences."""
        return {'index': self.index, 'img_path': self.img_path,
                'problems': [p.text for p in self.problems]}

    @classmethod
    def from_dict(cls, data):
        """Read back :meth:`to_dict` (problem categories unknown)."""
        return cls(data.get('index'), data.get('img_path'),
                   [DataProblem(None, text)
                    for text in data.get('problems') or []])


class Culprit(object):
    """A sample that fails on its own, and the rank whose batch held it:
    what the quarantine lists.

    Args:
        sample (SampleFinding): What was found about it.
        rank (int, optional): Its rank under DDP; ``None``: this one.
    """

    __slots__ = ('sample', 'rank')

    def __init__(self, sample: SampleFinding,
                 rank: Optional[int] = None) -> None:
        self.sample = sample
        self.rank = rank

    def __repr__(self):
        return 'Culprit(%r, rank %s)' % (self.sample.img_path, self.rank)


class RankFinding(object):
    """What one rank found of a trigger that every rank saw, exchanged
    between the ranks (DDP) so that each bundle names the culprit and every
    rank takes the same path.

    Args:
        rank (int): The rank.
        kind (str, optional): Its diagnosis' kind; ``None`` when it did not
            diagnose (its own batch was not implicated).
        samples (list[SampleFinding]): Its samples that fail on their own.
        iter (int, optional): The iteration of its failing batch (a
            micro-step's under gradient accumulation).
        batch_size (int, optional): Samples in its failing batch.
        drop (list[int], optional): Batch positions ``'drop'`` would leave
            out on it; ``None`` when it cannot (``reason``).
        reason (str, optional): Why it cannot drop.
        nonfinite_data (bool): Its batch holds non-finite inputs or targets.
        reproduced (bool, optional): Whether its batch replayed on this rank
            alone was non-finite.
        raises (bool): Its forward raised an exception that no policy
            handles (not made by non-finite values): every rank stops.
        error (str, optional): That exception, ``Type: message``: every
            rank stops naming it.
    """

    __slots__ = ('rank', 'kind', 'samples', 'iter', 'batch_size', 'drop',
                 'reason', 'nonfinite_data', 'reproduced', 'raises', 'error')

    def __init__(self, rank: int, kind: Optional[str] = None,
                 samples: Optional[Sequence[SampleFinding]] = None,
                 iter: Optional[int] = None,
                 batch_size: Optional[int] = None,
                 drop: Optional[Sequence[int]] = None,
                 reason: Optional[str] = None, nonfinite_data: bool = False,
                 reproduced: Optional[bool] = None, raises: bool = False,
                 error: Optional[str] = None) -> None:
        self.rank = rank
        self.kind = kind
        self.samples = list(samples or [])
        self.iter = iter
        self.batch_size = batch_size
        self.drop = None if drop is None else list(drop)
        self.reason = reason
        self.nonfinite_data = bool(nonfinite_data)
        self.reproduced = reproduced
        self.raises = bool(raises)
        self.error = error if self.raises else None

    @property
    def culprit(self):
        """Whether samples of its own batch made the failure."""
        return bool(self.samples)

    def to_dict(self):
        """As ``report.json`` stores it (and the ranks exchange it)."""
        data = dict((name, getattr(self, name)) for name in self.__slots__)
        data['samples'] = [s.to_dict() for s in self.samples]
        return data

    @classmethod
    def from_dict(cls, data):
        """Read back :meth:`to_dict`."""
        data = dict((k, data.get(k)) for k in cls.__slots__)
        data['samples'] = [SampleFinding.from_dict(s)
                           for s in data['samples'] or []]
        return cls(**data)

    def __repr__(self):
        return 'RankFinding(rank %d: %s, samples %s)' % (
            self.rank, self.kind, [s.index for s in self.samples])


class ConfigFinding(object):
    """A cause of NaN/Inf that a config shows before training.

    Args:
        rule (str): The rule that found it (a key of
            :data:`mmnanhook.doctor.RULES`).
        where (str): The config key, dotted (``model.bbox_head.loss_bbox``).
        what (str): What is wrong there.
        why (str): Where it was reported upstream (issue threads).
        fix (str): The fix, as a config edit.
    """

    __slots__ = ('rule', 'where', 'what', 'why', 'fix')

    def __init__(self, rule: str, where: str, what: str, why: str,
                 fix: str) -> None:
        self.rule = rule
        self.where = where
        self.what = what
        self.why = why
        self.fix = fix

    def line(self):
        """One line: what, where, why, the fix."""
        return '[{}] {}: {} (seen in {}); fix: {}'.format(
            self.rule, self.where, self.what, self.why, self.fix)

    def to_dict(self):
        """As ``report.json`` stores it."""
        return dict((name, getattr(self, name)) for name in self.__slots__)

    @classmethod
    def from_dict(cls, data):
        """Read back :meth:`to_dict`."""
        return cls(**dict((k, data.get(k)) for k in cls.__slots__))

    def __repr__(self):
        return 'ConfigFinding(%s at %s)' % (self.rule, self.where)


class ReplayResult(object):
    """What one replay of the failing iteration produced.

    Attributes:
        losses (dict): Loss term -> float.
        nonfinite_losses (list[str]): The non-finite terms.
        grad_norm (float, optional): Total gradient norm after backward.
        nonfinite_grads (list[str]): Parameters with non-finite gradients.
        nonfinite_grad_count (int): How many.
        nan_check_stopped (bool): torch < 1.13 cannot turn anomaly mode's NaN
            check off; when it stopped backward, the NaN was reproduced.
        error (dict, optional): ``phase``, ``type``, ``message``,
            ``traceback``, ``frames`` of an exception the replay raised.
        anomaly (AnomalyRecord, optional): Anomaly mode's messages.
        backward (Origin, optional): The first backward node that made a
            non-finite gradient from finite ones.
    """

    def __init__(self):
        self.losses = {}
        self.nonfinite_losses = []
        self.grad_norm = None
        self.nonfinite_grads = []
        self.nonfinite_grad_count = 0
        self.nan_check_stopped = False
        self.error = None
        self.anomaly = None
        self.backward = None

    @property
    def nonfinite(self):
        """Whether the replay reproduced a non-finite value."""
        norm_bad = (self.grad_norm is not None
                    and not math.isfinite(self.grad_norm))
        return bool(self.nonfinite_losses or self.nonfinite_grad_count
                    or norm_bad or self.nan_check_stopped)


class FixKind(_StrEnum):
    """What a fix changes in the failing iteration before it is replayed."""

    DROP_SAMPLES = 'drop_samples'  #: the batch without the implicated samples
    FILTER = 'filter'  #: a box filter inserted into the train pipeline
    DECLARED_SIZE = 'declared_size'  #: the annotation's size made the file's
    FP32 = 'fp32'  #: the iteration in float32 instead of under autocast
    LOWER_LR = 'lower_lr'  #: a lower learning rate from a good state
    NONE = 'none'  #: nothing that can be applied mechanically


FIX_KINDS = tuple(k.value for k in FixKind)


class Fix(object):
    """One fix a report suggests, and what replaying with it gave.

    Args:
        kind (FixKind | str): What the fix changes.
        fix (str): The change, written to be copied into a config or an
            annotation file.
        finite (bool, optional): Whether the failing iteration replayed with
            the fix is finite; ``None`` when it was not replayed (``detail``
            says why).
        loss (float, optional): The replayed total loss.
        detail (str, optional): How it was checked, or why it was not.
        samples (list[int]): Batch positions of the samples it concerns.
        hint (int, optional): Index of the hint it verifies in the report's
            ``hints``.
    """

    __slots__ = ('kind', 'fix', 'finite', 'loss', 'detail', 'samples', 'hint')

    def __init__(self, kind: Union[FixKind, str], fix: str,
                 finite: Optional[bool] = None, loss: Optional[float] = None,
                 detail: Optional[str] = None,
                 samples: Optional[Sequence[int]] = None,
                 hint: Optional[int] = None) -> None:
        self.kind = FixKind(kind)
        self.fix = fix
        self.finite = None if finite is None else bool(finite)
        self.loss = loss
        self.detail = detail
        self.samples = list(samples or [])
        self.hint = hint

    @property
    def status(self):
        """``'verified'`` (finite with it), ``'refuted'`` (still
        non-finite) or ``'untested'``."""
        if self.finite is None:
            return 'untested'
        return 'verified' if self.finite else 'refuted'

    def to_dict(self):
        """As ``report.json`` stores it."""
        data = dict((name, getattr(self, name)) for name in self.__slots__)
        data['kind'] = self.kind.value
        data['status'] = self.status
        return data

    @classmethod
    def from_dict(cls, data):
        """Read back :meth:`to_dict`."""
        return cls(**dict((k, data.get(k)) for k in cls.__slots__))

    def __repr__(self):
        return 'Fix(%s, %s: %r)' % (self.kind, self.status, self.fix)


def verified_fix(fixes: Optional[Sequence[Fix]]) -> Optional[Fix]:
    """The verified :class:`Fix` to act on first: one that verifies a hint
    (the most specific hint first), else the first verified; ``None`` when
    none is."""
    verified = [f for f in fixes or [] if f.status == 'verified']
    verified.sort(key=lambda f: (f.hint is None, f.hint or 0))
    return verified[0] if verified else None


@dataclasses.dataclass
class Origin(object):
    """Where a replay saw the first non-finite value made: the forward's
    producer (``Report.forward``) or the backward node
    (``Report.backward``).

    Args:
        op (str, optional): The op (an autograd node's name in backward).
        module (str, optional): The module's path in the model.
        location (str, optional): ``file:line`` of the user's code.
        code (str, optional): That source line.
        nan, inf (int): Non-finite elements of its output, by kind.
        stack (str, optional): The user's frames, formatted (until the
            report's ``traceback`` takes the one shown).
        call (str, optional): The forward's module call (forward only).
    """

    op: Optional[str] = None
    module: Optional[str] = None
    location: Optional[str] = None
    code: Optional[str] = None
    nan: int = 0
    inf: int = 0
    stack: Optional[str] = None
    call: Optional[str] = None

    def to_dict(self):
        """As ``report.json`` stores it (``stack`` and ``call`` only where
        set)."""
        data = dataclasses.asdict(self)
        for name in ('stack', 'call'):
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data):
        """Read back :meth:`to_dict`; ``None`` stays ``None``."""
        if data is None:
            return None
        return cls(**dict((f.name, data.get(f.name))
                          for f in dataclasses.fields(cls)
                          if f.name in data))


@dataclasses.dataclass
class Divergence(object):
    """Where a divergence before a trigger began, and what it looked like
    (``Report.divergence``, and a bundle's manifest).

    Args:
        began_at (int): The iteration it began at.
        series (str): ``'loss'``, ``'grad_norm'`` or ``'weights'``.
        factor (float): How many times its band's median (the starting
            value of a blow-up; the largest weight at the start of training)
            the value reached.
        value (float): The value reached.
        median (float): What ``factor`` is over.
        lr (float, optional): The learning rate where it began.
        spikes (int): Spikes before the trigger.
        rise (dict): The values from where it began to the trigger:
            ``series`` and ``values`` (``[iter, value]`` pairs, ``None``
            where some are left out).
        grown (list[dict]): The parameters whose norms grew most: ``name``,
            ``before``, ``after``, ``ratio``.
        clip_max_norm (float, optional): A ``clip_grad`` value (twice the
            clean band's median gradient norm).
        amp (bool): The run used AMP.
        symptom_kind (str, optional): The kind the replay found, which the
            divergence explains.
    """

    began_at: int
    series: str
    factor: float
    value: float
    median: float
    lr: Optional[float] = None
    spikes: int = 0
    rise: dict = dataclasses.field(default_factory=dict)
    grown: List[dict] = dataclasses.field(default_factory=list)
    clip_max_norm: Optional[float] = None
    amp: bool = False
    symptom_kind: Optional[str] = None

    def to_dict(self):
        """As ``report.json`` and the manifest store it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data):
        """Read back :meth:`to_dict`; ``None`` (or an empty record) stays
        ``None``."""
        if not data:
            return None
        return cls(**dict((f.name, data[f.name])
                          for f in dataclasses.fields(cls)
                          if f.name in data))


# report.json's schema version.
REPORT_FORMAT_VERSION = 1


# Field -> default (a factory for mutable ones), in report.json's order.
_REPORT_FIELDS = (
    ('format_version', REPORT_FORMAT_VERSION),
    ('kind', None),
    ('module', None),
    ('op', None),
    ('location', None),
    ('code', None),
    ('params', list),
    ('optimizer_state', list),
    ('samples', list),
    ('summary', ''),
    ('hints', list),
    ('fixes', list),
    ('traceback', None),
    ('losses', dict),
    ('nonfinite_losses', list),
    ('grad_norm', None),
    ('nonfinite_grads', list),
    ('nonfinite_grad_count', 0),
    ('forward', None),
    ('backward', None),
    ('overflow', None),
    ('exception', None),
    ('divergence', None),
    ('batch_problems', list),
    ('sample_replays', None),
    ('largest_param', None),
    ('amp_dtype', None),
    ('replays_agree', None),
    ('compiled_agrees', None),
    ('ranks', list),
    ('local_modules', list),
    ('config_findings', list),
    ('notes', list),
    ('elapsed_s', None),
    ('fixes_s', None),
)
_SAMPLE_FIELDS = ('samples', 'batch_problems')
# Fields held as a typed record, stored as its dict.
_TYPED = dict(forward=Origin, backward=Origin, divergence=Divergence)


class Report(object):
    """The diagnosis of one trigger; rendered as ``report.json``.

    Attributes:
        kind (Kind, optional): What the failure is.
        module, op, location, code (str, optional): Where the first
            non-finite value was made: module path, autograd op,
            ``file:line`` and that source line.
        params, optimizer_state (list[str]): Non-finite parameters/buffers
            and optimizer-state entries.
        samples (list[SampleFinding]): The implicated samples;
            ``batch_problems``: every sample with a data problem.
        sample_replays (list[dict], optional): ``index``, ``result``,
            ``nonfinite_losses``, ``error`` of the one-sample replays.
        fixes (list[Fix]): The fixes replayed on the failing iteration
            (or why none could be).
        ranks (list[RankFinding]): Under DDP, what every rank found of a
            trigger all ranks saw (the culprit's samples among them).
        local_modules (list[str]): Modules that communicate in their
            forward (SyncBN), normalized with this rank's batch alone
            during the replays.
        config_findings (list[ConfigFinding]): What the config rules
            (``mmnan doctor``) found in the run's config at ``before_train``.
        replays_agree (bool, optional): For a failure the replay did not
            reproduce: whether a second replay was finite too (``False``: a
            fault that comes and goes).
        compiled_agrees (bool, optional): For a compiled run's failure the
            eager replay did not reproduce: whether the replay through the
            compiled forward was finite too (``False``: the compiled code's
            fault alone).
        summary (str), hints (list[str]), notes (list[str]),
        traceback (str, optional): What the report says.
        losses, nonfinite_losses, grad_norm, nonfinite_grads,
        nonfinite_grad_count: What the replay measured.
        forward, backward (Origin, optional): Where the forward, or a
            backward node from finite gradients, made the first non-finite
            value.
        overflow, exception (dict, optional): Details of those findings.
        divergence (Divergence, optional): Where a divergence began (see
            :func:`mmnanhook.diagnosis.divergence_evidence`).
        largest_param (dict, optional): ``name``, ``max_abs``.
        amp_dtype (str, optional): The autocast dtype replayed.
        elapsed_s (float, optional): Seconds the diagnosis took;
            ``fixes_s``, of which the fixes' replays.

    Args:
        **fields: Initial values; the others take their defaults.
    """

    def __init__(self, **fields) -> None:
        for name, default in _REPORT_FIELDS:
            setattr(self, name,
                    fields.pop(name) if name in fields else
                    (default() if callable(default) else default))
        if fields:
            raise TypeError('unknown report fields: %s' %
                            ', '.join(sorted(fields)))

    @property
    def kind(self):
        """The :class:`Kind` of the failure, ``None`` until classified."""
        return self._kind

    @kind.setter
    def kind(self, value):
        self._kind = None if value is None else Kind(value)

    def verified_fix(self) -> Optional[Fix]:
        """The verified :class:`Fix` to act on first, or ``None``
        (:func:`verified_fix`)."""
        return verified_fix(self.fixes)

    def to_dict(self) -> dict:
        """``report.json``'s content (floats as they are; the bundle writer
        makes them strict JSON)."""
        data = {}
        for name, _ in _REPORT_FIELDS:
            value = getattr(self, name)
            if name in _SAMPLE_FIELDS or name in ('fixes', 'ranks',
                                                  'config_findings'):
                value = [s.to_dict() for s in value]
            elif name in _TYPED and value is not None:
                value = value.to_dict()
            elif name == 'kind' and value is not None:
                value = value.value
            data[name] = value
        return data

    @classmethod
    def from_dict(cls, data):
        """Read a ``report.json`` back (missing fields take defaults)."""
        known = dict((k, v) for k, v in (data or {}).items()
                     if k in dict(_REPORT_FIELDS))
        for name in _SAMPLE_FIELDS:
            if name in known:
                known[name] = [SampleFinding.from_dict(s)
                               for s in known[name] or []]
        if 'fixes' in known:
            known['fixes'] = [Fix.from_dict(f) for f in known['fixes'] or []
                              if f.get('kind') in FIX_KINDS]
        if 'ranks' in known:
            known['ranks'] = [RankFinding.from_dict(r)
                              for r in known['ranks'] or []]
        if 'config_findings' in known:
            known['config_findings'] = [ConfigFinding.from_dict(f) for f in
                                        known['config_findings'] or []]
        for name, record in _TYPED.items():
            if name in known:
                known[name] = record.from_dict(known[name])
        if known.get('kind') not in (None, ) + KINDS:
            known['kind'] = None
        return cls(**known)
