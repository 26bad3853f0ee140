"""The pictures of a diagnosis and its report card, to the MMEngine
visualizer: they land in every backend the config set up (TensorBoard, W&B,
local files)."""
from __future__ import annotations

import logging
from typing import Any, Iterable

from ._pictures import report_card


def to_visualizer(visualizer: Any, report: Any, pictures: Iterable[Any],
                  step: int, logger: logging.Logger) -> None:
    """Send a diagnosis' pictures and report card to ``visualizer``.

    Args:
        visualizer (Visualizer, optional): The runner's; nothing without.
        report (Report): The diagnosis.
        pictures (list[SamplePicture]): Its samples' pictures.
        step (int): The trigger's iteration.
        logger (logging.Logger): Where a failure is said (it never costs
            the policy).
    """
    if visualizer is None:
        return
    try:
        card = report_card(report, step)
        for picture in list(pictures) + [card]:
            # No '/': LocalVisBackend writes '<name>_<step>.png' into one
            # directory and silently drops a name with a subdirectory.
            name = 'mmnanhook_' + (picture.view if picture.index < 0 else
                                   picture.name.rsplit('.', 1)[0])
            visualizer.add_image(name, picture.rgb(), step=step)
    except Exception as error:  # noqa: BLE001 - never costs the policy
        logger.warning('mmnanhook: the visualizer did not take the '
                       'pictures: %s: %s' % (type(error).__name__, error))
