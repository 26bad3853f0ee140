"""What one trigger's diagnosis came to on one rank: the one record tier 2
hands back to the trigger procedure."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

from ._event import NonFiniteEvent
from ._findings import RankFinding
from ._report import Report


@dataclasses.dataclass(frozen=True)
class Diagnosis(object):
    """What one trigger's diagnosis came to on this rank.

    Args:
        event (NonFiniteEvent): The trigger, its failing micro-step found.
        finding (RankFinding): What this rank tells the others of it (under
            DDP the trigger procedure exchanges it).
        report (Report, optional): This rank's diagnosis; ``None`` where it
            did not diagnose (not one of the ranks that do, no batch kept,
            neither a replay nor a bundle asked for).
        findings (tuple[RankFinding], optional): Under DDP, every rank's,
            once exchanged.
        bundle (str, optional): The bundle this rank wrote.
        material (object, optional): What the bundle is written from (the
            batch, its RNG state, the optimizer state) until it is written;
            ``None`` after.
    """

    event: NonFiniteEvent
    finding: RankFinding
    report: Optional[Report] = None
    findings: Optional[Tuple[RankFinding, ...]] = None
    bundle: Optional[str] = None
    material: Any = dataclasses.field(default=None, repr=False,
                                      compare=False)
