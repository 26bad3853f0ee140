"""One training run under ``NanDetectHook``: the top floor of the package.

* :mod:`._state`: :class:`HookRun`, what the run keeps from step to step (the
  listener of its sentinels).
* :mod:`._trigger`: :class:`TriggerProcedure`, the one place a trigger is
  carried out: the policy's plan asked once, then each room called in the
  plan's order.

Everything below (sentinel, diagnosis, recovery, quarantine, report, bundle)
is imported from here; nothing below imports this.
"""
from ._state import HookRun
from ._trigger import TriggerProcedure

__all__ = ['HookRun', 'TriggerProcedure']
