"""What a diagnosis finds, by fact: the kind of a failure, a sample's data
problems, a culprit, what each DDP rank found, a config rule's finding, one
replay's measurements.
"""
from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple, Optional, Sequence, Set, Union

from ._event import _StrEnum


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
    #: another ground-truth target (keypoints, their labels, heatmaps, a
    #: target image) holds NaN / Inf
    NONFINITE_TARGET = 'nonfinite_target'
    DEGENERATE = 'degenerate'  #: a GT box side is (near) zero or negative
    OUTSIDE = 'outside'  #: a GT box lies outside its image
    ANGLE = 'angle'  #: a rotated box's angle is outside the configured range
    PIPELINE = 'pipeline'  #: the data pipeline raised (``mmnan scan``)
    LABEL = 'label'  #: a GT label outside ``[0, num_classes)``
    MASK = 'mask'  #: segmentation map values neither a class nor ignored
    ALL_IGNORE = 'all_ignore'  #: every pixel ignored under avg_non_ignore


# A sample with one of these carries non-finite values into the forward.
NONFINITE_DATA = (ProblemCategory.NONFINITE_INPUT,
                  ProblemCategory.NONFINITE_BOX,
                  ProblemCategory.NONFINITE_TARGET)


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


class SampleId(NamedTuple):
    """Who one sample of a batch is: the dataset index its sampler gave it
    (what the quarantine, the crash record and the report go by) and its
    file, a label for people.

    Args:
        index (int, optional): Its index in the train dataset (the
            dataloader's: a wrapper's own index under Concat/Repeat/
            ClassBalanced); ``None`` when the loader's index stream was not
            seen (a batch sampled before the hook started, an iterable
            dataset).
        file (str, optional): Its image file, from its metainfo or its data
            info; ``None`` when neither has one.
    """

    index: Optional[int] = None
    file: Optional[str] = None

    @property
    def name(self) -> str:
        """The file, else ``dataset index N``, else ``no img_path``."""
        return sample_name(self.file, self.index)


def sample_name(file: Optional[str], index: Optional[int]) -> str:
    """How a sample is named for people: its file, else its dataset index.

    Args:
        file (str, optional): Its image file.
        index (int, optional): Its dataset index.
    """
    if file:
        return file
    return 'dataset index %d' % index if index is not None else 'no img_path'


class SampleFinding(object):
    """What was found about one sample of the failing batch.

    Args:
        index (int): Position in the batch.
        img_path (str, optional): Its image file.
        problems (list[DataProblem]): Its data problems (may be empty).
        dataset_index (int, optional): Its index in the train dataset (the
            sampler's), what a drop quarantines; ``None`` when unknown.
    """

    __slots__ = ('index', 'img_path', 'problems', 'dataset_index')

    def __init__(self, index: Optional[int], img_path: Optional[str] = None,
                 problems: Optional[Sequence[DataProblem]] = None,
                 dataset_index: Optional[int] = None) -> None:
        self.index = index
        self.img_path = img_path
        self.problems = list(problems or [])
        self.dataset_index = dataset_index

    @property
    def categories(self) -> Set[Optional[ProblemCategory]]:
        """The categories of its problems."""
        return set(p.category for p in self.problems)

    @property
    def name(self) -> str:
        """Its file, else ``dataset index N``, else ``no img_path``."""
        return sample_name(self.img_path, self.dataset_index)

    def to_dict(self) -> Dict[str, Any]:
        """As ``report.json`` stores it: problems as their sentences;
        ``dataset_index`` only when known (a report of a batch whose index
        stream was not seen reads as before)."""
        data = {'index': self.index, 'img_path': self.img_path,
                'problems': [p.text for p in self.problems]}
        if self.dataset_index is not None:
            data['dataset_index'] = self.dataset_index
        return data

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> SampleFinding:
        """Read back :meth:`to_dict` (problem categories unknown)."""
        return cls(data.get('index'), data.get('img_path'),
                   [DataProblem(None, text)
                    for text in data.get('problems') or []],
                   data.get('dataset_index'))


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
        return 'Culprit(%r, rank %s)' % (self.sample.name, self.rank)


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
    def culprit(self) -> bool:
        """Whether samples of its own batch made the failure."""
        return bool(self.samples)

    def to_dict(self) -> Dict[str, Any]:
        """As ``report.json`` stores it (and the ranks exchange it)."""
        data = dict((name, getattr(self, name)) for name in self.__slots__)
        data['samples'] = [s.to_dict() for s in self.samples]
        return data

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> RankFinding:
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

    def line(self) -> str:
        """One line: what, where, why, the fix."""
        return '[{}] {}: {} (seen in {}); fix: {}'.format(
            self.rule, self.where, self.what, self.why, self.fix)

    def to_dict(self) -> Dict[str, Any]:
        """As ``report.json`` stores it."""
        return dict((name, getattr(self, name)) for name in self.__slots__)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> ConfigFinding:
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

    def __init__(self) -> None:
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
    def nonfinite(self) -> bool:
        """Whether the replay reproduced a non-finite value."""
        norm_bad = (self.grad_norm is not None
                    and not math.isfinite(self.grad_norm))
        return bool(self.nonfinite_losses or self.nonfinite_grad_count
                    or norm_bad or self.nan_check_stopped)
