"""Exceptions raised by mmnanhook."""
from __future__ import annotations

from typing import List, Optional, Sequence


class NonFiniteError(FloatingPointError):
    """A loss, gradient or loss scale went non-finite during training.

    Args:
        message (str): Human-readable description.
        trigger (str): ``'loss'``, ``'grad'``, ``'exception'`` or
            ``'amp_scale'``.
        iter (int, optional): Global training iteration (``runner.iter``).
        rank (int): Rank that raises.
        bad_ranks (list[int], optional): Ranks that saw the bad value.
        bundle (str, optional): Path of the bundle written for it.
        report (dict, optional): The tier-2 diagnosis, when one ran.
    """

    def __init__(self, message: str, trigger: str,
                 iter: Optional[int] = None, rank: int = 0,
                 bad_ranks: Optional[Sequence[int]] = None,
                 bundle: Optional[str] = None,
                 report: Optional[dict] = None) -> None:
        super().__init__(message)
        self.trigger = trigger
        self.iter = iter
        self.rank = rank
        self.bad_ranks: List[int] = list(bad_ranks or [])
        self.bundle = bundle
        self.report = report


class BundleError(Exception):
    """A bundle is missing, corrupt, partial, foreign or of unknown format."""


class DatasetError(Exception):
    """The config cannot be loaded, its train dataset cannot be built, or a
    scan cannot start (its files cannot be written, a progress record of
    another scan)."""


class CheckBypassedError(RuntimeError):
    """The optimizer changed the weights without mmnanhook's check running.

    Raised by ``NanDetectHook`` at the first iteration where that happens, so
    that training never goes on while the log claims it is protected.
    """


class PeerForwardFailed(RuntimeError):
    """Under DDP, the forward raised on another rank: no rank runs this
    backward (each takes the same path instead).

    Args:
        ranks (list[int]): The ranks whose forward raised.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = list(ranks)
        super(PeerForwardFailed, self).__init__(
            'the forward raised on rank(s) %s' %
            ', '.join(map(str, self.ranks)))


class RankTimeoutError(RuntimeError):
    """Under DDP, a rank did not answer a vote or an exchange of
    mmnanhook's within the group's timeout (``env_cfg.dist_cfg.timeout``):
    every rank still there stops, and the message, one line, names it.

    Args:
        message (str): The line (also logged).
        ranks (list[int]): The ranks that did not answer; empty when every
            rank was still there (another gave up first) or none could be
            told.
    """

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super(RankTimeoutError, self).__init__(message)
        self.ranks = list(ranks)


class NonFiniteInputError(RuntimeError):
    """A train step's inputs hold NaN/Inf after the data preprocessor:
    stopped before any op of the model ran (an op fed NaN may crash the
    process, as mmcv's deformable convolution does on the CPU).

    Args:
        samples (list[int]): The batch positions of the samples whose
            input is not finite.
        names (list[str], optional): Their image files, where known.
    """

    def __init__(self, samples: Sequence[int],
                 names: Optional[Sequence[Optional[str]]] = None) -> None:
        self.samples = list(samples)
        names = list(names or [None] * len(self.samples))
        super(NonFiniteInputError, self).__init__(
            'the input of %s is not finite after the data preprocessor; '
            'stopped before the forward' % ', '.join(
                'sample %d%s' % (i, ' (%s)' % n if n else '')
                for i, n in zip(self.samples, names)))
