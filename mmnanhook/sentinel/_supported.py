"""Which optim wrappers tier 1 can check: every ``OptimWrapper`` and
``AmpOptimWrapper`` (their subclasses, an ``OptimWrapperDict``'s members),
not the engines that run backward and the step out of its reach."""
from __future__ import annotations

from typing import Any

from mmengine.optim import OptimWrapper

# Wrappers of these modules run backward and step inside an engine
# (DeepSpeed, ColossalAI) that exposes no gradients before the step.
_UNSUPPORTED_MODULES = ('mmengine._strategy', )

# Engine wrapper -> (the FlexibleRunner strategy that builds it, what the
# engine does inside its own step, out of mmnanhook's reach).
_ENGINES = {
    'DeepSpeedOptimWrapper': (
        'DeepSpeedStrategy',
        "the DeepSpeed engine's step computes the gradient norm, clips and "
        'skips fp16 overflows itself, and under ZeRO the gradients are '
        'partitioned in the engine, not in param.grad, before it'),
    'ColossalAIOptimWrapper': (
        'ColossalAIStrategy',
        "the ColossalAI booster's optimizer computes the gradient norm, "
        'clips (configured in the plugin) and skips overflows inside its '
        'own step, where the gradients are not in param.grad before it'),
}


def check_supported(optim_wrapper: Any) -> None:
    """Raise ``RuntimeError`` for a wrapper tier 1 cannot check, naming
    what would go unchecked and what to use instead."""
    cls = type(optim_wrapper)
    engines = [_ENGINES[c.__name__] for c in cls.__mro__
               if c.__name__ in _ENGINES]
    if engines:
        strategy, inside = engines[0]
        raise RuntimeError(
            'mmnanhook cannot protect training with %s (%s.%s): %s. Nothing '
            'would check the losses, the gradient norm or the update step, '
            'so NanDetectHook refuses to start instead of running '
            'unprotected. Remove NanDetectHook, or train with DDPStrategy or '
            'FSDPStrategy, which it checks.' %
            (strategy, cls.__module__, cls.__name__, inside))
    engine = any(
        c.__module__.startswith(_UNSUPPORTED_MODULES) for c in cls.__mro__)
    if engine or not isinstance(optim_wrapper, OptimWrapper):
        raise RuntimeError(
            'mmnanhook cannot check %s.%s: it supports OptimWrapper, '
            'AmpOptimWrapper, their subclasses and the members of an '
            'OptimWrapperDict. Wrappers such as DeepSpeedOptimWrapper and '
            'ColossalAIOptimWrapper run backward and the step inside their '
            'engine, where the gradients cannot be checked before the step; '
            'remove NanDetectHook or use one of the supported wrappers.' %
            (cls.__module__, cls.__name__))
