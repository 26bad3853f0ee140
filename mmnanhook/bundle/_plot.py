"""The history plot of a bundle (``history.png``)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from ..records import HISTORY_FIELDS

_TITLES = {
    'loss': 'loss',
    'grad_norm': 'gradient norm',
    'lr': 'learning rate',
    'loss_scale': 'AMP loss scale',
}


def _plot_series(ax, iters, values, title, fail_iter, spiked=(),
                 rewinds=()):
    finite = [v if v is not None and math.isfinite(v) else float('nan')
              for v in values]
    # Points marked: a run that failed at iteration 1 has one finite value,
    # which a line alone never draws.
    ax.plot(iters, finite, color='tab:blue', linewidth=1, marker='o',
            markersize=4)
    marked = [(i, v) for i, v in zip(iters, finite)
              if i in spiked and not math.isnan(v)]
    if marked:
        ax.scatter([i for i, _ in marked], [v for _, v in marked],
                   marker='^', color='tab:orange', zorder=3,
                   label='spike ({})'.format(len(marked)))
    for index, (at, _) in enumerate(rewinds):
        ax.axvline(at, color='tab:green', linestyle=':', linewidth=1.2,
                   label='rewind' if index == 0 else None)
    # Non-finite values have no y coordinate: mark them along the top edge
    # (x in data coordinates, y in axes coordinates).
    bad = [(i, v) for i, v in zip(iters, values)
           if v is not None and not math.isfinite(v)]
    if bad:
        ax.scatter([i for i, _ in bad], [0.95] * len(bad), marker='x',
                   color='tab:red', transform=ax.get_xaxis_transform(),
                   label='non-finite ({})'.format(
                       ', '.join(sorted(set(str(v) for _, v in bad)))),
                   zorder=3)
    positive = [v for v in finite if not math.isnan(v)]
    if positive and min(positive) > 0 and max(positive) >= 10 * min(
            positive):
        ax.set_yscale('log')
        # Plain labels: the default mathtext ones cost most of the plot's
        # time, and the plot is made while training waits.
        ax.yaxis.set_major_formatter(_plain_formatter())
        ax.yaxis.set_minor_formatter(_plain_formatter(minor=True))
    if fail_iter is not None:
        ax.axvline(fail_iter, color='tab:red', linestyle='--', linewidth=1,
                   label='failing iteration {}'.format(fail_iter))
    ax.set_ylabel(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        # Not over the points (one point alone sits in a corner).
        ax.legend(loc='best', fontsize='small')


def _plain_formatter(minor=False):
    from matplotlib.ticker import FuncFormatter
    if minor:
        return FuncFormatter(lambda value, pos: '')
    return FuncFormatter(lambda value, pos: '{:g}'.format(value))


def plot_history(records: List[Dict[str, Any]], path: str,
                 fail_iter: Optional[int] = None) -> None:
    """Plot loss, gradient norm, learning rate and loss scale into a PNG.

    Series without any recorded value (e.g. the loss scale without AMP) are
    left out; positive series spanning a decade or more use a log scale.
    Spikes are marked on their series, rewinds by a dotted line.

    Args:
        records (list[dict]): As returned by :meth:`History.records`.
        path (str): PNG file to write.
        fail_iter (int, optional): Iteration marked by a vertical line.
    """
    # The object-oriented API with the Agg canvas leaves pyplot and the
    # process-wide backend untouched; matplotlib loads only when plotting.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    iters = [record['iter'] for record in records]
    fields = [field for field in HISTORY_FIELDS
              if any(record.get(field) is not None for record in records)]
    figure = Figure(figsize=(8, 2.2 * max(len(fields), 1)))
    FigureCanvasAgg(figure)
    if not fields:
        ax = figure.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, 'no history recorded', ha='center', va='center',
                transform=ax.transAxes)
        ax.set_axis_off()
    else:
        axes = figure.subplots(len(fields), 1, sharex=True, squeeze=False)
        rewinds = [(r['iter'], r['rewind']) for r in records
                   if r.get('rewind') is not None]
        for ax, field in zip(axes[:, 0], fields):
            spiked = set(r['iter'] for r in records
                         if field in (r.get('spike') or ()))
            _plot_series(ax, iters, [record.get(field) for record in records],
                         _TITLES[field], fail_iter, spiked, rewinds)
        axes[-1, 0].set_xlabel('iteration')
        # Iterations are whole numbers: no 0.25 ticks on a short history.
        from matplotlib.ticker import MaxNLocator
        axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    # Fixed margins instead of tight_layout(), which lays out every text twice.
    figure.subplots_adjust(left=0.12, right=0.98, top=0.97, bottom=0.08,
                           hspace=0.15)
    figure.savefig(path, format='png', dpi=100)
