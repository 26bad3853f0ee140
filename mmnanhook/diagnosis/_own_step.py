"""A replay of a model whose ``train_step`` is its own, not
``BaseModel.train_step``'s.

A GAN (mmagic's ``BaseGAN``: the discriminator's update step, then the
generator's), an inpaintor or any model that overrides ``train_step`` makes
its losses in its own order and hands each to one member of an
``OptimWrapperDict``: ``forward(mode='loss')`` and ``parse_losses`` are not
what it trains (a GAN's forward samples images). Its failing update step is
replayed through the model's own ``train_step`` instead, up to the update
step that failed: every member's update before it does nothing (the run
applied it already: the model holds its result), and the loss handed to
the failing member is the replay's, its ``parse_losses`` terms with it.
The train step stops there, so nothing after it runs: no parameter is
written (an EMA update comes after the generator's step), as no replay
writes one.

Nothing of the run's wrappers changes: each member's methods are replaced
on the instance while a replay runs, and its counters put back after.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from mmengine.model import BaseModel
from mmengine.optim import OptimWrapperDict

from .._inputs import check_inputs
from .._patch import patched

# The counters of an OptimWrapper that a train step sets (mmagic's GANs
# call initialize_count_status on the generator's every step).
_COUNTERS = ('_inner_count', '_max_counts', '_remainder_counts',
             '_divisible_counts')


def overrides_train_step(model: Any) -> bool:
    """Whether ``model`` (unwrapped) trains with a ``train_step`` of its own
    class, not ``BaseModel.train_step``.

    Args:
        model (nn.Module): The model.
    """
    own = getattr(type(model), 'train_step', None)
    return isinstance(model, BaseModel) and own is not None and \
        own is not BaseModel.train_step


def member_key(optim_wrapper: Any, wrapper: Any) -> Optional[str]:
    """The key of ``wrapper`` among the members of ``optim_wrapper`` (an
    ``OptimWrapperDict``), or ``None`` (one wrapper, or not a member).

    Args:
        optim_wrapper (OptimWrapper | OptimWrapperDict): The run's.
        wrapper (OptimWrapper, optional): The one whose update step
            triggered.
    """
    if wrapper is None or not isinstance(optim_wrapper, OptimWrapperDict):
        return None
    for key, member in optim_wrapper.items():
        if member is wrapper:
            return key
    return None


class _Reached(BaseException):
    """Stops the train step at the update step replayed (a BaseException:
    a model's ``except Exception`` does not swallow it)."""


class OwnTrainStep(object):
    """The failing update step of a model with its own ``train_step``.

    Args:
        optim_wrapper (OptimWrapper | OptimWrapperDict): The run's (or one
            built from its config, for an offline replay): what the train
            step is given.
        failing (str, optional): The key of the member whose update step
            failed; ``None``: the first update step of the train step (a
            single wrapper, or a trigger that names none: an exception
            raised in backward).
    """

    def __init__(self, optim_wrapper: Any,
                 failing: Optional[str] = None) -> None:
        self.optim_wrapper = optim_wrapper
        self.failing = failing

    def _members(self) -> List[Tuple[Optional[str], Any]]:
        if isinstance(self.optim_wrapper, OptimWrapperDict):
            return list(self.optim_wrapper.items())
        return [(None, self.optim_wrapper)]

    def describe(self, model: Any) -> str:
        """Which train step and update step a replay runs, for a note."""
        where = 'the first update step' if self.failing is None else \
            "the update step of optim wrapper '{}'".format(self.failing)
        return ('{}.train_step is the model\'s own: the replays ran it up '
                'to {}'.format(type(model).__name__, where))

    @contextlib.contextmanager
    def replaying(self, model: Any,
                  autocast: Callable[[], Any], check: bool
                  ) -> Iterator[Callable[[Any], Tuple[Any, Dict[str, Any]]]]:
        """The replay's forward while the block runs: ``batch -> (loss,
        log_vars)``, the loss the train step hands the failing update step.

        The block holds the backward too: what the train step set for that
        update step (a GAN's discriminator without gradients while the
        generator's loss is made) holds for its backward, and is put back on
        exit (``requires_grad`` of every parameter, the members' counters).

        Args:
            model (BaseModel): The unwrapped model.
            autocast (callable): ``() -> context manager``: what the
                members' ``optim_context`` is in the replay (the session
                decides the autocast, as for ``BaseModel.train_step``).
            check (bool): Check the preprocessed inputs (the batch has
                floating-point ones), as the run's input check does.
        """
        caught = {}
        grads = [(p, p.requires_grad) for p in model.parameters()]
        counters = [(member, dict((k, vars(member)[k]) for k in _COUNTERS
                                  if k in vars(member)))
                    for _, member in self._members()]
        parse = model.parse_losses

        def parse_losses(losses):
            loss, log_vars = parse(losses)
            caught['log_vars'] = log_vars
            return loss, log_vars

        def reached(loss):
            caught['loss'] = loss
            raise _Reached()

        def update(key):
            stop = self.failing is None or key == self.failing

            def update_params(loss, *args, **kwargs):
                if stop:
                    reached(loss)
                # Applied by the run already: the model holds its result.

            return update_params

        def context(model):
            return autocast()

        def nothing(*args, **kwargs):
            return None

        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(model, 'parse_losses', parse_losses))
            preprocessor = getattr(model, 'data_preprocessor', None)
            if check and preprocessor is not None:
                preprocess = preprocessor.forward

                def checked(*args, **kwargs):
                    data = preprocess(*args, **kwargs)
                    check_inputs(data)
                    return data

                stack.enter_context(patched(preprocessor, 'forward', checked))
            for key, member in self._members():
                update_params = update(key)
                # A train step that calls backward (then step) itself
                # reaches its update step there.
                for name, value in (('update_params', update_params),
                                    ('backward', update_params),
                                    ('step', nothing), ('zero_grad', nothing),
                                    ('optim_context', context),
                                    ('initialize_count_status', nothing)):
                    stack.enter_context(patched(member, name, value))

            def forward(batch):
                caught.clear()
                try:
                    # The class's: not what the instance holds (the hook's
                    # wrapper, which ends the run when a step raises, or a
                    # compiled step): every replay runs the model eagerly.
                    type(model).train_step(model, batch, self.optim_wrapper)
                except _Reached:
                    return caught['loss'], caught.get('log_vars') or {}
                raise RuntimeError(
                    '{}.train_step ended without reaching {} in the '
                    'replay'.format(type(model).__name__, 'an update step'
                                    if self.failing is None else
                                    "the update step of optim wrapper "
                                    "'{}'".format(self.failing)))

            try:
                yield forward
            finally:
                for param, flag in grads:
                    if param.requires_grad != flag:
                        param.requires_grad_(flag)
                for member, saved in counters:
                    vars(member).update(saved)


def own_train_step(model: Any, optim_wrapper: Any,
                   failing: Optional[str] = None) -> Optional[OwnTrainStep]:
    """The :class:`OwnTrainStep` of ``model``, or ``None`` when it trains
    with ``BaseModel.train_step`` (or no optim wrapper is known).

    Args:
        model (nn.Module): The unwrapped model.
        optim_wrapper (OptimWrapper | OptimWrapperDict, optional): The
            run's.
        failing (str, optional): The failing member's key.
    """
    if optim_wrapper is None or not overrides_train_step(model):
        return None
    return OwnTrainStep(optim_wrapper, failing)

