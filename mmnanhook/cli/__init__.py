"""The ``mmnan`` command: ``replay``, ``inspect``, ``scan``, ``doctor``,
``demo``.

* :mod:`._main`: the argument parser and the exit codes.
* :mod:`._replay`: offline replay of a bundle.
* ``scan``, ``doctor``: :mod:`mmnanhook.doctor`.
* ``demo``: :mod:`mmnanhook.demo`.
"""
from ._main import build_parser, main, run

__all__ = ['build_parser', 'main', 'run']
