"""Under DDP, every rank takes the same path: tier 1's votes, tier 2's
exchange of findings, and no rank left waiting in a collective.

* :mod:`._ranks`: :class:`Ranks` (the vote after every forward, the
  decisions, the exchange of findings in gloo groups of their own, each
  bounded by a timeout that names the rank that did not answer).
* :mod:`._collectives`: a collective call as a record, called again with
  zeros of its tensors' shapes; what it wrote.
* :mod:`._forward_guard`: :class:`ForwardGuard` (no rank waits in a
  collective of a train step whose forward raised on another) and
  :func:`start_distributed` (the distributed side of a run set up).
"""
from ._collectives import (COLLECTIVES, collective_outputs,
                           collective_signature)
from ._forward_guard import ForwardGuard, start_distributed
from ._ranks import Ranks

__all__ = [
    'collective_outputs', 'collective_signature', 'COLLECTIVES',
    'ForwardGuard', 'Ranks', 'start_distributed'
]
