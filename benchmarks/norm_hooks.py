"""The gradient norm taken in backward (``register_post_accumulate_grad_hook``,
torch >= 2.1: each gradient's norm while it is still in cache) against one
``_foreach_norm`` after backward, as tier 1 takes it: host time of backward
plus the norm, on the model of ``host_overhead.py`` (CPU).

Usage::

    python benchmarks/norm_hooks.py --blocks 4 16 --iters 2000
"""
import argparse
import sys

import cuda_sync  # benchmarks/cuda_sync.py, next to this script


def _model(blocks):
    import torch.nn as nn
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
        for _ in range(blocks)
    ])


def _median_us(step, iters, warmup):
    # cuda_sync's timing loop; nothing to wait for on the CPU.
    return cuda_sync._median_us(step, iters, warmup, lambda: None)


def measure(blocks, iters, warmup):
    """``(parameter tensors, us with one pass after, us with the hooks)``."""
    import torch
    model = _model(blocks)
    x = torch.randn(8, 16)
    params = list(model.parameters())
    norms = []

    def backward():
        model(x).pow(2).mean().backward()

    def after():
        backward()
        torch.linalg.vector_norm(torch.stack(
            torch._foreach_norm([p.grad for p in params], 2.0)))
        for p in params:
            p.grad = None

    def hooked():
        backward()
        torch.linalg.vector_norm(torch.stack(norms))
        del norms[:]
        for p in params:
            p.grad = None

    plain = _median_us(after, iters, warmup)
    handles = [p.register_post_accumulate_grad_hook(
        lambda p: norms.append(torch.linalg.vector_norm(p.grad)))
        for p in params]
    try:
        hooks = _median_us(hooked, iters, warmup)
    finally:
        for handle in handles:
            handle.remove()
    return len(params), plain, hooks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--blocks', type=int, nargs='+', default=[4, 16])
    parser.add_argument('--iters', type=int, default=2000)
    parser.add_argument('--warmup', type=int, default=50)
    args = parser.parse_args(argv)
    import torch
    if not hasattr(torch.Tensor, 'register_post_accumulate_grad_hook'):
        raise SystemExit('register_post_accumulate_grad_hook needs torch '
                         '>= 2.1')
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print('| parameter tensors | backward + one _foreach_norm after (us) '
          '| backward with a norm hook per parameter (us) |')
    print('| --- | --- | --- |')
    for blocks in args.blocks:
        print('| %d | %.1f | %.1f |' % measure(blocks, args.iters,
                                               args.warmup))
    return 0


if __name__ == '__main__':
    sys.exit(main())
