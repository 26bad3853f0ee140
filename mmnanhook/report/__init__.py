"""The report of a diagnosis (a :class:`~mmnanhook.records.Report`): its
one-line summary, its hints and its text.

* :mod:`._summary`: :func:`summarize`.
* :mod:`._hints`: :func:`keyed_hints` (each hint with the fix that checks it).
* :mod:`._text`: :func:`format_report`.
* :mod:`._pictures`: pictures of the implicated samples.
* :mod:`._html`: ``report.html``, self-contained.
* :mod:`._visualizer`: the pictures and the report card to the MMEngine
  visualizer.
* :mod:`._windows`: a spoilt micro-step's values out of the log windows.
* :mod:`._ranks`: under DDP, the culprit rank and sample in every rank's
  report.
* :mod:`._config`: the config's findings (``mmnan doctor``) in a report.
"""
from __future__ import annotations

from ..records import KINDS, REPORT_FORMAT_VERSION as FORMAT_VERSION, Report
from ._config import explain_by_config, explains
from ._hints import keyed_hints
from ._html import config_section, page, render_html
from ._ranks import cross_rank
from ._pictures import (Picture, finding_pictures, pipeline_image, report_card,
                        sample_pictures)
from ._summary import summarize
from ._text import format_report
from ._visualizer import to_visualizer
from ._windows import forget_nonfinite


def new_report() -> Report:
    """A report with every field present and nothing found yet."""
    return Report()


def finalize(report: Report) -> Report:
    """Fill ``summary`` and ``hints`` from the findings; return the report.

    Args:
        report (Report): A report, filled in.
    """
    report.summary = summarize(report)
    keyed = keyed_hints(report)
    report.hints = [text for _, text in keyed]
    keys = [key for key, _ in keyed]
    for fix in report.fixes:
        fix.hint = keys.index(fix.kind) if fix.kind in keys else None
    return report


__all__ = [
    'FORMAT_VERSION', 'KINDS', 'Picture', 'Report', 'config_section',
    'cross_rank', 'explain_by_config', 'explains', 'finalize',
    'finding_pictures', 'forget_nonfinite', 'format_report', 'keyed_hints',
    'new_report', 'page', 'pipeline_image', 'render_html', 'report_card',
    'sample_pictures', 'summarize', 'to_visualizer'
]
