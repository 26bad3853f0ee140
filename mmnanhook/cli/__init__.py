"""The ``mmnan`` command: ``replay``, ``inspect``, ``scan``, ``demo``.

* :mod:`._main`: the argument parser and the exit codes.
* :mod:`._replay`: offline replay of a bundle.
* :mod:`._scan`: the pre-flight scan of a config's dataset.
* ``demo``: :mod:`mmnanhook.demo`.
"""
from ._main import build_parser, main, run

__all__ = ['build_parser', 'main', 'run']
