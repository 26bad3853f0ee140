"""What the carrying out of a trigger's plan found, before its decision."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

from ..records import RankFinding, Report


@dataclasses.dataclass(frozen=True)
class Answer(object):
    """What the carrying out of one trigger's plan did and found.

    Args:
        bundle (str, optional): The bundle written for it.
        report (Report, optional): Its diagnosis.
        drop (Recomputation, optional): The step to recompute without samples
            (``'drop'``), prepared for the plan.
        findings (tuple[RankFinding], optional): Under DDP, every rank's
            finding of a trigger every rank saw.
    """

    bundle: Optional[str] = None
    report: Optional[Report] = None
    drop: Any = None
    findings: Optional[Tuple[RankFinding, ...]] = None

    def text(self) -> str:
        """What the answer adds to an error message."""
        lines = []
        if self.report is not None and self.report.summary:
            lines.append(self.report.summary)
        # Under DDP every rank stops naming what stopped them all: a rank
        # that did not diagnose (its forward went fine) names the samples
        # the others found, as rank 0's log is the one users read.
        lines.extend("rank %d's forward raised %s" % (f.rank, f.error)
                     for f in self.findings or () if f.error)
        if self.report is None:
            lines.extend('rank %d: sample %s (%s)%s' % (
                f.rank, s.index, s.img_path or 'no img_path',
                ''.join(': ' + p.text for p in s.problems[:1]))
                for f in self.findings or () for s in f.samples)
        fix = self.report.verified_fix() if self.report is not None else None
        if fix is not None:
            # The one line a user acts on: proven on the failing iteration.
            lines.append('verified fix: %s' % fix.fix)
        if self.bundle:
            lines.append('bundle: %s' % self.bundle)
        return '\n'.join(lines)

    def report_dict(self) -> Optional[dict]:
        """``report.json``'s content, as an error carries it, or ``None``."""
        return self.report.to_dict() if self.report is not None else None
