# Runtime shared by the tiny test-bed detectors: a short iteration-based CPU
# run on a real Runner, logging every iteration and saving no checkpoints.
# No val/test loops: the test bed exercises training.
train_cfg = dict(type='IterBasedTrainLoop', max_iters=3)
val_cfg = None
test_cfg = None

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='SGD', lr=0.01, momentum=0.9, weight_decay=0.0001))

# The shape of the zoo's schedule_1x.py, scaled to iterations: a linear warmup
# and step decays. Param schedulers wrap optim_wrapper.step on the instance
# before any hook runs, so every tiny run goes through that path as zoo runs
# do. The milestones are fixed iterations, so a run of a few iterations
# behaves the same whatever max_iters is.
param_scheduler = [
    dict(type='LinearLR', start_factor=0.25, by_epoch=False, begin=0, end=4),
    dict(type='MultiStepLR', by_epoch=False, begin=0, end=1000,
         milestones=[200, 400], gamma=0.1)
]

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=1),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=None,
    sampler_seed=dict(type='DistSamplerSeedHook'))

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='gloo'))

# A fixed seed makes the pipeline's random flips, and so a run, repeatable.
randomness = dict(seed=0)

log_processor = dict(type='LogProcessor', window_size=1, by_epoch=False)
log_level = 'INFO'
load_from = None
resume = False

# Children add `dataset`. No worker processes (a 2-core CI box pays more to
# start them than they save) and no shuffling, so image k of the dataset's
# order lands in iteration k // batch_size, where tests and demos expect it.
train_dataloader = dict(
    batch_size=2,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=False))
