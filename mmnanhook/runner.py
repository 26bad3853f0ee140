"""``NanDetectRunner``: what the ``_base_`` snippet uses to add the hook.

MMEngine refuses a config whose ``_base_`` files define the same top-level
key twice, and every zoo config defines both keys that register hooks
(``default_hooks``, and often ``custom_hooks``). A ``_base_`` file that adds
a hook next to a zoo config can therefore only use a key the zoo does not:
``runner_type``, which ``tools/train.py`` of mmdet, mmrotate, mmpretrain and
mmseg honour (``RUNNERS.build(cfg)``). This runner is MMEngine's ``Runner``
plus one ``NanDetectHook`` built from the config's ``nan_detect`` options.
"""
from __future__ import annotations

from mmengine.config import Config
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

from .hook import NanDetectHook

# The config key holding the hook's options for the snippet.
OPTIONS_KEY = 'nan_detect'


@RUNNERS.register_module()
class NanDetectRunner(Runner):
    """``Runner`` with a ``NanDetectHook`` registered, unless one already is.

    The hook's options come from the config's ``nan_detect`` dict (see
    ``configs/_base_/nan_detect.py``); everything else is ``Runner``'s.
    """

    @classmethod
    def from_cfg(cls, cfg: Config) -> Runner:
        runner = super(NanDetectRunner, cls).from_cfg(cfg)
        if not any(isinstance(h, NanDetectHook) for h in runner.hooks):
            runner.register_hook(
                NanDetectHook(**dict(cfg.get(OPTIONS_KEY) or {})))
        return runner
