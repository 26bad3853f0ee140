"""The bypass guard: no update step reaches the weights unchecked.

Every in-place write to a tensor bumps its version counter, and optimizers
write parameters in place, so the sum of the parameters' versions changes
exactly when something wrote them. Around each train step the guard compares
that sum with the number of checks the wrapper's sentinel ran: weights that
changed while no check ran mean something stepped the optimizer around
mmnanhook (a method rebound on the instance after the install, a
``train_step`` that calls ``optimizer.step()`` itself, ...), and training
stops there instead of running unprotected. Reading the counters is
host-only: no device sync, about 0.1 us per parameter.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any

from ..errors import CheckBypassedError
from ._install import sentinel_of

_version = attrgetter('_version')


def _describe(callable_):
    func = getattr(callable_, '__func__', callable_)
    module = getattr(func, '__module__', None) or '?'
    name = getattr(func, '__qualname__', None) or repr(func)
    return '%s.%s' % (module, name)


class BypassGuard(object):
    """Watches the optim wrappers a handle installed into.

    Args:
        handle (NanDetectHandle): What :func:`install_nan_detect` returned.
    """

    def __init__(self, handle: Any) -> None:
        self._watched = []
        for wrapper, sentinel in zip(handle.wrappers, handle.sentinels):
            params = [p for group in wrapper.optimizer.param_groups
                      for p in group['params']]
            self._watched.append(
                (wrapper, sentinel, params, vars(wrapper).get('step')))
        self._before = None

    def start(self) -> None:
        """Note the weights' versions and check counts before a train step."""
        self._before = [(sum(map(_version, params)), sentinel.check.checks)
                        for _, sentinel, params, _ in self._watched]

    def verify(self, iter: int) -> bool:
        """After the train step started by :meth:`start`.

        Args:
            iter (int): The training iteration, for the message.

        Returns:
            bool: Whether a check ran in this step (for any wrapper).

        Raises:
            CheckBypassedError: Naming the wrapper and what bypassed it.
        """
        before, self._before = self._before, None
        if before is None:
            return False
        checked = False
        for (wrapper, sentinel, params, step), (versions, checks) in zip(
                self._watched, before):
            ran = sentinel.check.checks != checks
            checked = checked or ran
            if ran or sum(map(_version, params)) == versions:
                continue
            raise CheckBypassedError(self._message(wrapper, sentinel, step,
                                                   iter))
        return checked

    @staticmethod
    def _message(wrapper, sentinel, step, iter):
        name = type(wrapper).__name__
        now = vars(wrapper).get('step')
        if sentinel_of(wrapper) is not sentinel:
            what = ('its mmnanhook sentinel was replaced or removed after '
                    'the install')
        elif now is not step:
            what = ('%s.step was replaced on the instance after mmnanhook '
                    'installed its check, by %s, which does not call it' %
                    (name, _describe(now)))
        else:
            what = ('the optimizer was stepped without going through '
                    '%s.step (e.g. a train_step that calls '
                    'optimizer.step() itself)' % name)
        return ('mmnanhook: the weights of %s changed in train iteration %s '
                'but mmnanhook\'s check did not run: %s. Training is stopped '
                'so that it does not go on unprotected.' % (name, iter, what))
