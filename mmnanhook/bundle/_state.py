"""Which bundles hold the model and optimizer state.

The state is the bulk of a bundle (a 220M-parameter model with AdamW: about
2.6 GB); the batch, the report and the pictures are a few MB. A run that drops
1000 bad samples, or 64 ranks that all see one trigger, would write that state
1000 or 64 times. So a bundle holds the state only when it is the first of its
kind of incident in the run, and only on one rank (the culprit's); every other
bundle names the bundle that holds it (:class:`StateRef`). The bytes a run
writes for its diagnoses are then bounded by one state per kind of incident.
"""
from __future__ import annotations

import dataclasses
import glob
import os.path as osp

from typing import Any, Dict, List, Optional, Sequence, Set


@dataclasses.dataclass(frozen=True)
class StateRef(object):
    """The bundle whose model (and optimizer) state a bundle replays from.

    Args:
        iter (int): Its trigger's iteration.
        rank (int): The rank that wrote it.
        run (str, optional): The run that wrote it (the runner's
            ``timestamp``, alike on every rank): a resumed run writes into
            the same dump dir, its iterations again.
    """

    iter: int
    rank: int
    run: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        """As the manifest's ``state_from`` stores it."""
        return dict(iter=self.iter, rank=self.rank, run=self.run)

    @classmethod
    def from_dict(cls, data: Any) -> StateRef:
        """Read back :meth:`to_dict`.

        Raises:
            ValueError: ``data`` is not one.
        """
        if not isinstance(data, dict) or not all(
                isinstance(data.get(k), int) for k in ('iter', 'rank')) \
                or not isinstance(data.get('run'), (str, type(None))):
            raise ValueError('not a state reference: {!r}'.format(data))
        return cls(int(data['iter']), int(data['rank']), data.get('run'))

    @classmethod
    def of(cls, manifest: Dict[str, Any]) -> StateRef:
        """The reference that names the bundle of ``manifest``."""
        return cls(manifest.get('iter'), manifest.get('rank'),
                   manifest.get('run'))

    def candidates(self, dump_dir: str) -> List[str]:
        """Bundle directories of ``dump_dir`` this reference may name
        (:func:`~._layout.bundle_name`, with the suffix a clash adds),
        newest first."""
        stem = osp.join(glob.escape(dump_dir),
                        '*_iter{:06d}_rank{}'.format(self.iter, self.rank))
        return sorted(glob.glob(stem) + glob.glob(stem + '_*'), reverse=True)


@dataclasses.dataclass(frozen=True)
class StatePlan(object):
    """What one bundle does with the state.

    Args:
        write (bool): It holds the state.
        ref (StateRef, optional): Else, the bundle that holds it.
    """

    write: bool
    ref: Optional[StateRef] = None


def _incident(trigger, findings, kind, diagnosers):
    """The kind of an incident and the rank that writes its state, alike on
    every rank: under DDP from every rank's findings (the culprits' kinds,
    every diagnosis' when no rank is one; the first culprit, else the first
    rank that diagnosed). An incident of one rank alone (``diagnosers`` is
    that rank) is its own."""
    if findings:
        culprits = [f for f in findings if f.culprit]
        kinds = [f.kind for f in culprits] or [
            f.kind for f in findings if f.kind]
        writer = min([f.rank for f in culprits] or list(diagnosers) or [0])
    else:
        kinds = [getattr(kind, 'value', kind)]
        writer = min(list(diagnosers) or [0])
    key = (trigger.value, ) + tuple(sorted(set(str(k) for k in kinds)))
    return key, writer


class StateLedger(object):
    """The bundles of a run that hold a state, by kind of incident.

    Every rank keeps the same ledger (:meth:`record` is called on every rank
    with what the ranks exchanged), so any rank's bundle can name the one
    another rank wrote.

    Args:
        run (str, optional): The run's id (:class:`StateRef`).
        every (bool): Every bundle holds the state (``dump_state='every'``).
    """

    def __init__(self, run: Optional[str] = None,
                 every: bool = False) -> None:
        self.run = run
        self.every = every
        self._held = {}

    def plan(self, event: Any, iter: int, findings: Optional[List[Any]],
             kind: Any, diagnosers: Sequence[int]) -> StatePlan:
        """What this rank's bundle of an incident does with the state.

        Args:
            event (NonFiniteEvent): The trigger (its rank is this one).
            iter (int): Its iteration, as its bundles' manifests say it.
            findings (list[RankFinding], optional): Every rank's (DDP).
            kind (Kind, optional): This rank's diagnosis' kind.
            diagnosers (list[int]): The ranks that diagnose the trigger.

        Returns:
            StatePlan: Write it, or name the bundle that holds it.
        """
        if self.every:
            return StatePlan(True)
        key, writer = _incident(event.trigger, findings, kind, diagnosers)
        held = self._held.get(key)
        if held is not None:
            return StatePlan(False, held)
        if event.rank == writer:
            return StatePlan(True)
        return StatePlan(False, StateRef(iter, writer, self.run))

    def record(self, event: Any, iter: int,
               findings: Optional[List[Any]], kind: Any,
               diagnosers: Sequence[int]) -> None:
        """The incident's bundles are written (arguments as :meth:`plan`):
        a new kind's state is in its writer's bundle."""
        if self.every:
            return
        key, writer = _incident(event.trigger, findings, kind, diagnosers)
        self._held.setdefault(key, StateRef(iter, writer, self.run))

    def kept(self) -> Set[StateRef]:
        """The bundles that hold a state later bundles may name: never
        pruned."""
        return set(self._held.values())
