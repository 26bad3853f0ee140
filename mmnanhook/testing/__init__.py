"""Test beds and fixtures, as ``mmengine.testing`` ships its own: synthetic
datasets, the tiny detector configs, the model-zoo tier, a toy model, planted
faults and CPU-only AMP wrappers. Not imported by the package itself.

* :mod:`.synthetic`: deterministic COCO / VOC / DOTA / ImageNet / ADE20K
  datasets with planted defects.
* :mod:`.testbed`: the tiny detector configs of ``configs/``.
* :mod:`.zoo`: configs shipped inside the installed OpenMMLab packages.
* :mod:`.toy`: a toy model and runner factory (mmengine only).
* :mod:`.faults`: small modules with one planted bug each.
* :mod:`.cpu_amp`: AMP optim wrappers that run on a CPU.
"""
