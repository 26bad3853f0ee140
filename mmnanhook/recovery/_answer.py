"""What the listener of a trigger answers the sentinel that asked it."""
import dataclasses
from typing import Any, Optional, Tuple

from ..records import RankFinding, Report, verified_fix


@dataclasses.dataclass(frozen=True)
class Answer(object):
    """What the listener did and found about one trigger.

    Args:
        bundle (str, optional): The bundle written for it.
        report (Report, optional): Its diagnosis.
        summary (str, optional): The diagnosis in one paragraph (the
            report's, by default).
        drop (DropPlan, optional): The step to recompute without samples
            (``'drop'``), prepared by the listener.
        escalate (str, optional): Why training must stop whatever the policy
            (a rewind that could not go back).
        findings (tuple[RankFinding], optional): Under DDP, every rank's
            finding of a trigger every rank saw.
    """

    bundle: Optional[str] = None
    report: Optional[Report] = None
    summary: Optional[str] = None
    drop: Any = None
    escalate: Optional[str] = None
    findings: Optional[Tuple[RankFinding, ...]] = None

    def __post_init__(self):
        if self.summary is None and self.report is not None:
            object.__setattr__(self, 'summary', self.report.summary)

    def text(self):
        """What the answer adds to an error message."""
        lines = []
        if self.summary:
            lines.append(self.summary)
        # Under DDP every rank stops naming what stopped them all.
        lines.extend("rank %d's forward raised %s" % (f.rank, f.error)
                     for f in self.findings or () if f.error)
        fix = verified_fix([f.to_dict() for f in self.report.fixes]
                           if self.report is not None else None)
        if fix is not None:
            # The one line a user acts on: proven on the failing iteration.
            lines.append('verified fix: %s' % fix['fix'])
        if self.bundle:
            lines.append('bundle: %s' % self.bundle)
        return '\n'.join(lines)

    def report_dict(self):
        """``report.json``'s content, as an error carries it, or ``None``."""
        return self.report.to_dict() if self.report is not None else None
