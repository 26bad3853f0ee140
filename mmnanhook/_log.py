"""Logging for mmnanhook's own lines.

mmengine's ``print_log`` calls the logger itself, so MMLogger's ERROR format
(which shows where the record was made) would name mmengine's
``logger.py`` in every line; :func:`log` names the mmnanhook code that
logged.
"""
from __future__ import annotations

import logging
from typing import Union

from mmengine.logging import MMLogger

from .compat import LOG_CALLER


def log(message: str, level: int = logging.INFO,
        logger: Union[logging.Logger, str, None] = None) -> None:
    """Log ``message`` at ``level``.

    Args:
        message (str): The line(s).
        level (int): A ``logging`` level.
        logger (logging.Logger | str, optional): A logger, ``'silent'``, or
            the current ``MMLogger`` (``None`` / ``'current'``).
    """
    if logger == 'silent':
        return
    if not isinstance(logger, logging.Logger):
        logger = MMLogger.get_current_instance()
    logger.log(level, message, **LOG_CALLER)
