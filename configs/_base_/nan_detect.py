# Enable mmnanhook in any MMEngine-based config (mmdet 3.x, mmrotate 1.x):
#
#     _base_ = ['./my_detector.py',
#               'path/to/mmnanhook/configs/_base_/nan_detect.py']
#
# `custom_imports` registers NanDetectHook in mmengine's root HOOKS registry,
# which every downstream scope (mmdet, mmrotate) falls back to. Note that a
# child config's own `custom_hooks` list replaces this one (lists are not
# merged): there, add dict(type='NanDetectHook') to that list instead.
custom_imports = dict(imports=['mmnanhook'], allow_failed_imports=False)
custom_hooks = [dict(type='NanDetectHook')]
