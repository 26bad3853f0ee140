"""What only the tests and benchmarks use (never shipped in the wheel): test
beds and fixtures, as ``mmengine.testing`` has its own. ``tests/conftest.py``
puts ``tests/`` on the path of pytest and of every process a test starts;
benchmarks put it there themselves.

* :mod:`.testbed`: the demo's tiny detectors (:mod:`mmnanhook.demo`) and a
  wider variant for benchmarks.
* :mod:`.zoo`: configs shipped inside the installed OpenMMLab packages.
* :mod:`.toy`: a toy model and runner factory (mmengine only).
* :mod:`.faults`: small modules with one planted bug each.
* :mod:`.cpu_amp`: AMP optim wrappers that run on a CPU.
* :mod:`.cuda_zoo`: the zoo RetinaNet R50 of the device checks, and their
  CPU dry run; :mod:`.cuda_zoo_modules`, the modules its configs name.
"""
