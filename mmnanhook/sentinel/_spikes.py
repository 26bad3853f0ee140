"""Spike detection: a finite loss or gradient norm far above its recent band.

Framework-free and host-only: it sees the floats tier 1's one sync already
brought to the host, so it costs no sync and a few float operations per
iteration. The band of a series is robust to the spikes it looks for: the
median and the median absolute deviation (MAD) of the last ``window``
values that were not spikes themselves. After ``warmup`` values, a value is
a spike when it is both ``factor`` times the median and more than
``threshold`` robust standard deviations (1.4826 * MAD) above it; the
second condition keeps a series whose values are all of one magnitude from
flagging its ordinary noise, the first keeps a series with a tiny MAD (a
plateau) from flagging a small step.
"""
from __future__ import annotations

import bisect
import collections
import math
from typing import Any, Dict, List, Optional, Tuple, Union

# 1.4826 * MAD estimates the standard deviation of normal data.
_MAD_TO_STD = 1.4826


def _median(values):
    return _sorted_median(sorted(values))


def _sorted_median(ordered):
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


class Spike(object):
    """One spike of one series.

    Attributes:
        series (str): ``'loss'`` or ``'grad_norm'``.
        iter (int): The iteration.
        value (float): The spiked value.
        median (float): The band's median.
        high (float): The band's upper edge.
        factor (float): ``value / median``.
    """

    __slots__ = ('series', 'iter', 'value', 'median', 'high', 'factor')

    def __init__(self, series: str, iter: int, value: float, median: float,
                 high: float) -> None:
        self.series = series
        self.iter = iter
        self.value = value
        self.median = median
        self.high = high
        self.factor = value / median if median > 0 else math.inf

    def to_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self):
        return ('%s spike at iter %s: %.6g is %.3gx the median %.6g (band up '
                'to %.6g)' % (self.series, self.iter, self.value, self.factor,
                              self.median, self.high))


class SeriesBand(object):
    """The robust band of one series of positive values.

    Args:
        window (int): Values the band is computed over.
        warmup (int): Values seen before any is judged.
        factor (float): How many times the median a spike is at least.
        threshold (float): How many robust standard deviations above the
            median a spike is at least.
    """

    def __init__(self, window: int = 50, warmup: int = 20,
                 factor: float = 4.0, threshold: float = 6.0) -> None:
        self.values = collections.deque(maxlen=window)
        # The same values in order: the median of every step without a sort.
        self._ordered = []
        self.warmup = warmup
        self.factor = factor
        self.threshold = threshold

    def band(self) -> Optional[Tuple[float, float]]:
        """``(median, upper edge)``, or ``None`` during the warm-up."""
        median = self._median()
        return None if median is None else (median, self._high(median))

    def _median(self):
        if len(self.values) < max(self.warmup, 1):
            return None
        return _sorted_median(self._ordered)

    def _high(self, median):
        mad = _median([abs(v - median) for v in self.values])
        return max(median * self.factor,
                   median + self.threshold * _MAD_TO_STD * mad)

    def judge(self, value: Optional[float]
              ) -> Optional[Tuple[float, float]]:
        """Whether ``value`` is a spike; a value that is not joins the band.

        Returns:
            tuple | None: ``(median, high)`` of the band it broke out of.
        """
        if value is None or not math.isfinite(value):
            return None
        median = self._median()
        # The upper edge is at least factor x the median: the MAD is needed
        # only above that, rarely.
        if median is not None and value > median * self.factor:
            high = self._high(median)
            if value > high:
                return median, high
        values = self.values
        if len(values) == values.maxlen:
            ordered = self._ordered
            del ordered[bisect.bisect_left(ordered, values[0])]
        values.append(value)
        bisect.insort(self._ordered, value)
        return None


class SpikeDetector(object):
    """Spikes of the total loss and the gradient norm.

    Args:
        window, warmup, threshold: See :class:`SeriesBand`.
        factor (float | dict): See :class:`SeriesBand`; a dict gives each
            series its own.
    """

    SERIES = ('loss', 'grad_norm')

    def __init__(self, window: int = 50, warmup: int = 20,
                 factor: Union[float, Dict[str, float]] = 4.0,
                 threshold: float = 6.0) -> None:
        factors = factor if isinstance(factor, dict) else dict.fromkeys(
            self.SERIES, factor)
        self.bands = {name: SeriesBand(window, warmup, factors[name],
                                       threshold)
                      for name in self.SERIES}
        self.spikes = []

    def observe(self, iter: int, loss: Optional[float],
                grad_norm: Optional[float]) -> List[Spike]:
        """Judge one update step's values.

        Args:
            iter (int): The iteration.
            loss (float, optional): Its total loss.
            grad_norm (float, optional): Its gradient norm.

        Returns:
            list[Spike]: The spikes of this step (usually none).
        """
        found = []
        for name, value in (('loss', loss), ('grad_norm', grad_norm)):
            band = self.bands[name].judge(value)
            if band is not None:
                found.append(Spike(name, iter, value, band[0], band[1]))
        self.spikes.extend(found)
        return found

    def median(self, series: str) -> Optional[float]:
        """The current median of ``series``, or ``None`` before any value."""
        band = self.bands[series]
        return _sorted_median(band._ordered) if band.values else None
