"""The report of a diagnosis: its fields, summary line, hints and text."""
from ..records import KINDS, Report
from ._report import (FORMAT_VERSION, finalize, format_report, make_hints,
                      new_report, summarize)

__all__ = [
    'FORMAT_VERSION', 'KINDS', 'Report', 'finalize', 'format_report',
    'make_hints', 'new_report', 'summarize'
]
