"""The report of a trigger (``report.json``'s schema, which reads every record
back) and what it holds beyond the findings: the fixes replayed, where the
first non-finite value was made, where a divergence began.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Union

from ._event import _StrEnum
from ._findings import KINDS, ConfigFinding, Kind, RankFinding, SampleFinding


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
    def status(self) -> str:
        """``'verified'`` (finite with it), ``'refuted'`` (still
        non-finite) or ``'untested'``."""
        if self.finite is None:
            return 'untested'
        return 'verified' if self.finite else 'refuted'

    def to_dict(self) -> Dict[str, Any]:
        """As ``report.json`` stores it."""
        data = dict((name, getattr(self, name)) for name in self.__slots__)
        data['kind'] = self.kind.value
        data['status'] = self.status
        return data

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> Fix:
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

    def to_dict(self) -> Dict[str, Any]:
        """As ``report.json`` stores it (``stack`` and ``call`` only where
        set)."""
        data = dataclasses.asdict(self)
        for name in ('stack', 'call'):
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> Optional[Origin]:
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

    def to_dict(self) -> Dict[str, Any]:
        """As ``report.json`` and the manifest store it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]
                  ) -> Optional[Divergence]:
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

    def __init__(self, **fields: Any) -> None:
        for name, default in _REPORT_FIELDS:
            setattr(self, name,
                    fields.pop(name) if name in fields else
                    (default() if callable(default) else default))
        if fields:
            raise TypeError('unknown report fields: %s' %
                            ', '.join(sorted(fields)))

    @property
    def kind(self) -> Optional[Kind]:
        """The :class:`Kind` of the failure, ``None`` until classified."""
        return self._kind

    @kind.setter
    def kind(self, value: Union[Kind, str, None]) -> None:
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
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> Report:
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
