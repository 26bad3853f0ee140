custom_hooks = [
    dict(
        dump_dir=
        '/tmp/pytest-of-root/pytest-0/test_fp16_range_overflow_is_di0/dumps',
        type='NanDetectHook'),
]
custom_imports = dict(
    allow_failed_imports=False,
    imports=[
        'mmnan_testing.cuda_toy',
        'mmnanhook',
    ])
default_hooks = dict(checkpoint=None)
default_scope = 'mmengine'
experiment_name = 'cuda_toy_7a7e995ab20747fa8e40bc8ef2d0a07c'
log_level = 'WARNING'
model = dict(type='SmallResNet')
optim_wrapper = dict(
    dtype='float16',
    loss_scale='dynamic',
    optimizer=dict(lr=0.01, momentum=0.9, type='SGD'),
    type='AmpOptimWrapper')
randomness = dict(seed=0)
train_cfg = dict(by_epoch=False, max_iters=4)
train_dataloader = dict(
    batch_size=2,
    collate_fn=dict(type='pseudo_collate'),
    dataset=dict(faults=dict({2: 'fp16_range'}), n=16, type='CudaToyDataset'),
    num_workers=0,
    sampler=dict(shuffle=False, type='DefaultSampler'))
work_dir = '/tmp/pytest-of-root/pytest-0/test_fp16_range_overflow_is_di0'
