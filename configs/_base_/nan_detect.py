# mmnanhook as a `_base_` file, merge-safe next to any zoo config:
#
#     _base_ = ['mmdet::retinanet/retinanet_r50_fpn_1x_coco.py',
#               'mmnanhook::_base_/nan_detect.py']
#
# MMEngine refuses a key that two `_base_` files both define, and the zoo
# configs define every key that registers hooks (`default_hooks`,
# `custom_hooks`, sometimes `custom_imports`). This file therefore defines
# only keys no zoo config uses: `runner_type`, which tools/train.py of
# mmdet / mmrotate / mmpretrain / mmseg honours, names a Runner that adds one
# NanDetectHook; its options go in `nan_detect`. The dotted type imports
# mmnanhook itself (mmengine imports `mmnanhook.registry` for the scope; tested
# on mmengine 0.7.1, 0.9.1 and 0.10.7), so no `custom_imports` is needed.
#
# In a config of your own (not a `_base_` file), or with a script that calls
# Runner.from_cfg itself, use the one-line form instead:
#
#     default_hooks = dict(nan_detect=dict(type='mmnanhook.NanDetectHook'))
runner_type = 'mmnanhook.NanDetectRunner'
nan_detect = dict()
