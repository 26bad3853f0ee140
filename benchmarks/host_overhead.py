"""Tier 1's host time per iteration: a real Runner training a model whose
compute is negligible, so that the iteration is all host work.

The model (registered here) is ``--blocks`` blocks of a ``Linear`` and a
``BatchNorm1d`` (4 parameter tensors and 3 buffers each) on 16-vectors,
behind mmengine's ``BaseDataPreprocessor``, with ``--terms`` loss terms; SGD,
no ``clip_grad`` unless ``--clip``. Each variant trains its own Runner and
the runners take turns, one iteration at a time in a random order each
round, as in ``overhead.py`` (whose machinery this reuses). The figure is the
median over iterations of ``t_variant - t_plain`` for the same iteration, in
microseconds; its median over ``--repeats`` fresh sets of runners [min, max].
"plain again" is a second plain runner: the noise floor.

The breakdown then trains ``NanDetectHook()`` (and the other policies asked
for) once more beside plain, with the parts of tier 1 timed in place: each
part is a function of mmnanhook wrapped in a timer that subtracts the timed
parts it calls (exclusive time), summed per iteration; the median per
iteration. A part whose function is not in the tree measured (an older or
newer layout) shows ``-``. "the rest" is the breakdown run's own paired
difference minus the parts: the wrappers, the bindings, and the timers' own
cost (about a microsecond per timed call).

Usage::

    python benchmarks/host_overhead.py --threads 1
    python benchmarks/host_overhead.py --iters 20 --repeats 1 --warmup 5
    python benchmarks/host_overhead.py --compile aot_eager --warmup 10
"""
import _tests_path  # noqa: F401 - tests/ on the path (mmnan_testing)
import argparse
import collections
import datetime
import functools
import importlib
import statistics
import sys
import tempfile
import threading
import time

import _models  # benchmarks/_models.py, next to this script
import overhead  # benchmarks/overhead.py: the turns, the runners

POLICIES = ('raise', 'skip', 'drop')

# (part, module, attribute path): where tier 1 spends host time. Several
# entries may name one part: the names of more than one layout of mmnanhook,
# so that the same benchmark breaks down an earlier commit too.
PARTS = [
    ('RNG capture', 'mmnanhook.sentinel._steps', 'capture_rng'),
    ('RNG capture', 'mmnanhook.sentinel._rng', 'StepRng.capture'),
    ('RNG capture', 'mmnanhook.memory._rng', 'StepRng.capture'),
    ('step memory, preprocessor attributes', 'mmnanhook.sentinel._steps',
     'StepMemory.keep'),
    ('step memory, preprocessor attributes', 'mmnanhook.sentinel._steps',
     'StepMemory.preprocessor_attributes'),
    ('step memory, preprocessor attributes', 'mmnanhook.memory._steps',
     'StepMemory.keep'),
    ('buffer snapshot (skip, drop)', 'mmnanhook.sentinel._steps',
     'BufferSnapshot.__init__'),
    ('buffer snapshot (skip, drop)', 'mmnanhook.memory._steps',
     'BufferSnapshot.__init__'),
    ('gradient norm (tensor ops)', 'mmnanhook.sentinel._norms',
     'GradNorms.__init__'),
    ('gradient norm (tensor ops)', 'mmnanhook._norms', 'GradNorms.__init__'),
    ('gradients collected', 'mmnanhook.sentinel._sentinel',
     '_params_with_grads'),
    ("the check's other tensor ops", 'mmnanhook.sentinel._check', '_sync'),
    ('the read (tolist)', 'torch', 'Tensor.tolist'),
    ('decision (StepCheck.check)', 'mmnanhook.sentinel._check',
     'StepCheck.check'),
    ('sentinel (check_step, _tell)', 'mmnanhook.sentinel._sentinel',
     'WrapperSentinel.check_step'),
    ('sentinel (check_step, _tell)', 'mmnanhook.sentinel._sentinel',
     'WrapperSentinel.measure'),
    ('sentinel (check_step, _tell)', 'mmnanhook.sentinel._sentinel',
     'WrapperSentinel.admit'),
    ('spikes', 'mmnanhook.sentinel._spikes', 'SpikeDetector.observe'),
    ('input check (float inputs: a sum, one sync)', 'mmnanhook._inputs',
     'nonfinite_samples'),
    ('input check (float inputs: a sum, one sync)', 'mmnanhook._inputs',
     'floating'),
    ('record of the samples in flight', 'mmnanhook.quarantine._flight',
     'FlightRecorder.begin'),
    ('record of the samples in flight', 'mmnanhook.quarantine._flight',
     'FlightRecorder.end'),
    ('MessageHub scalars', 'mmengine.logging', 'MessageHub.update_scalar'),
    ('history (after_iter)', 'mmnanhook._run', 'HookRun.after_iter'),
    ('history (after_iter)', 'mmnanhook.run._state', 'HookRun.after_iter'),
    # Wrappers of MMEngine's own work: what they call of it (their argument
    # ``prev``) is timed apart and left out.
    ('train step wrapper (anomaly mode, guards)', 'mmnanhook._run',
     'HookRun.train_step'),
    ('train step wrapper (anomaly mode, guards)', 'mmnanhook.run._state',
     'HookRun.train_step'),
    ('optim wrapper bindings (record the loss, ...)',
     'mmnanhook.sentinel._sentinel', 'WrapperSentinel.update_params'),
    ('optim wrapper bindings (record the loss, ...)',
     'mmnanhook.sentinel._sentinel', 'WrapperSentinel.backward'),
    ('optim wrapper bindings (record the loss, ...)',
     'mmnanhook.sentinel._sentinel', 'WrapperSentinel.step'),
    ('optim wrapper bindings (record the loss, ...)',
     'mmnanhook.sentinel._sentinel', 'WrapperSentinel.clip_grad'),
    ('optim wrapper bindings (record the loss, ...)',
     'mmnanhook.sentinel._sentinel', 'WrapperSentinel.optim_context'),
]
# The wrappers above: the index of the argument that is MMEngine's work.
_PREV = {'HookRun.train_step': 1}
_PREV.update(dict.fromkeys(
    ('WrapperSentinel.update_params', 'WrapperSentinel.backward',
     'WrapperSentinel.step', 'WrapperSentinel.clip_grad',
     'WrapperSentinel.optim_context'), 2))
# Left out of the parts: MMEngine's work inside a wrapper.
_PLAIN = 'plain work inside a wrapper'
# Timed only when called by a timed part of mmnanhook (plain MMEngine reads
# and logs too), and then only by these parts.
_ONLY_UNDER = {
    'the read (tolist)': ("the check's other tensor ops", ),
    'MessageHub scalars': None,
}


def _register():
    import torch
    import torch.nn as nn
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS, MODELS
    from torch.utils.data import Dataset

    @MODELS.register_module(force=True)
    class HostBenchModel(BaseModel):
        """Negligible compute; a detector's handful of loss terms."""

        def __init__(self, blocks=16, width=16, terms=4):
            super(HostBenchModel, self).__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width))
                for _ in range(blocks))
            self.terms = terms

        def forward(self, inputs, data_samples=None, mode='tensor'):
            x = torch.stack(inputs)
            for block in self.blocks:
                x = block(x)
            if mode != 'loss':
                return x
            return dict(('loss_%d' % i, x[:, i].pow(2).mean())
                        for i in range(self.terms))

    @DATASETS.register_module(force=True)
    class HostBenchDataset(Dataset):
        metainfo = dict(name='host_bench')

        def __init__(self, n=64, width=16):
            g = torch.Generator().manual_seed(0)
            self.items = [dict(inputs=torch.randn(width, generator=g))
                          for _ in range(n)]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, index):
            return self.items[index]


def _builder(args):

    def build(work_dir, data_dir, iters):
        from mmengine.config import Config
        optim = dict(optimizer=dict(type='SGD', lr=1e-4, momentum=0.9))
        if args.clip:
            optim['clip_grad'] = dict(max_norm=35, norm_type=2)
        cfg = Config(dict(
            default_scope='mmengine',
            model=dict(type='HostBenchModel', blocks=args.blocks,
                       terms=args.terms),
            work_dir=work_dir,
            train_dataloader=dict(
                dataset=dict(type='HostBenchDataset'),
                sampler=dict(type='InfiniteSampler', shuffle=True),
                batch_size=8, num_workers=0),
            train_cfg=dict(by_epoch=False, max_iters=iters),
            optim_wrapper=optim,
            default_hooks=dict(checkpoint=None),
            randomness=dict(seed=0),
            log_level='WARNING'))
        if args.compile:
            cfg.compile = dict(backend=args.compile)
        return cfg

    return build


def _variants(policies):
    variants = [('plain', []), ('plain again (noise floor)', [])]
    for policy in policies:
        options = {} if policy == 'raise' else dict(policy=policy)
        variants.append(('NanDetectHook(%s)' % ', '.join(
            '%s=%r' % kv for kv in options.items()),
            [dict(type='NanDetectHook', **options)]))
    return variants


def _differences(times):
    """Per variant, the median over iterations of ``t - t_plain`` (us)."""
    return [statistics.median((a - b) * 1e6 for a, b in zip(t, times[0]))
            for t in times]


def _call_timed(local, part, func, args, kwargs):
    """``func(*args, **kwargs)``, its time less that of the timed calls
    inside it added to ``part``."""
    stack = local.stack
    frame = [part, 0.0]
    stack.append(frame)
    start = time.perf_counter()
    try:
        return func(*args, **kwargs)
    finally:
        spent = time.perf_counter() - start
        stack.pop()
        local.spent[part] += spent - frame[1]
        if stack:
            stack[-1][1] += spent


class _Timers(object):
    """The parts of :data:`PARTS` wrapped in exclusive-time timers."""

    def __init__(self):
        self.local = threading.local()
        self.found = set()
        self._undo = []
        for part, module, path in PARTS:
            self._wrap(part, module, path)

    def _wrap(self, part, module_name, path):
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            return
        *outer, name = path.split('.')
        for attr in outer:
            owner = getattr(owner, attr, None)
        if owner is None or not hasattr(owner, name):
            return
        # None: inherited (Tensor.tolist is TensorBase's), deleted to undo.
        own = owner.__dict__.get(name)
        self.found.add(part)
        self._undo.append((owner, name, own))
        setattr(owner, name, self._timed(part, getattr(owner, name),
                                         _PREV.get(path)))

    def _timed(self, part, func, prev=None):
        local = self.local
        only_under = _ONLY_UNDER.get(part, ())
        inner = self._timed(_PLAIN, None) if prev is not None else None

        def timed(*args, **kwargs):
            if prev is not None and getattr(local, 'stack', None) is not None:
                args = list(args)
                args[prev] = functools.partial(inner, args[prev])
            if func is None:
                # _PLAIN: the callable is the first argument.
                return _call_timed(local, part, args[0], args[1:], kwargs)
            stack = getattr(local, 'stack', None)
            if stack is None or (part in _ONLY_UNDER and (
                    not stack or only_under is not None
                    and stack[-1][0] not in only_under)):
                return func(*args, **kwargs)
            return _call_timed(local, part, func, args, kwargs)

        return timed

    def probe(self, index, hooked):
        """Hooks collecting each iteration's parts (of runner ``index``,
        when it is hooked): the first and the last of the iteration."""
        from mmengine.hooks import Hook

        local, per_iter = self.local, self.per_iter[index]

        class Start(Hook):
            priority = 'HIGHEST'

            def before_train_iter(self, runner, batch_idx, data_batch=None):
                if hooked:
                    local.stack = []
                    local.spent = collections.Counter()

        class End(Hook):
            priority = 'LOWEST'

            def after_train_iter(self, runner, batch_idx, data_batch=None,
                                 outputs=None):
                if hooked:
                    per_iter.append(dict(local.spent))
                    local.stack = None

        return [Start(), End()]

    def remove(self):
        for owner, name, own in reversed(self._undo):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._undo = []


def _breakdown(args, build, variants, work_root):
    """Per hooked variant: part -> median us per iteration, and the run's
    paired difference."""
    timers = _Timers()
    timers.per_iter = [[] for _ in variants]
    try:
        times = overhead._run_model(
            'breakdown', build, args.iters, args.warmup, work_root, 0,
            variants, probe=lambda i: timers.probe(i, i >= 2))
    finally:
        timers.remove()
    total = _differences(times)
    result = []
    for index in range(2, len(variants)):
        kept = timers.per_iter[index][args.warmup:]
        parts = collections.OrderedDict()
        for part, _, _ in PARTS:
            if part in parts:
                continue
            parts[part] = statistics.median(
                it.get(part, 0.0) * 1e6 for it in kept) \
                if part in timers.found else None
        result.append((parts, total[index]))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iters', type=int, default=300,
                        help='timed iterations per variant (default 300)')
    parser.add_argument('--repeats', type=int, default=3,
                        help='fresh sets of runners (default 3)')
    parser.add_argument('--warmup', type=int, default=20,
                        help='untimed first iterations (default 20)')
    parser.add_argument('--policies', nargs='+', choices=POLICIES,
                        default=list(POLICIES))
    parser.add_argument('--blocks', type=int, default=16,
                        help='Linear + BatchNorm1d blocks (default 16: 64 '
                        'parameter tensors, 48 buffers)')
    parser.add_argument('--terms', type=int, default=4,
                        help='loss terms (default 4)')
    parser.add_argument('--clip', action='store_true',
                        help='clip_grad (max_norm 35): the clip reuses the '
                        'norm')
    parser.add_argument('--compile', metavar='BACKEND',
                        help='compile the train step with this backend '
                        '(as the config key compile)')
    parser.add_argument('--no-breakdown', action='store_true')
    parser.add_argument('--threads', type=int,
                        help="torch intra-op threads (default: torch's "
                        'choice)')
    parser.add_argument('--work-dir', help='default: a temporary directory')
    args = parser.parse_args(argv)
    if args.iters < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error('--iters and --repeats must be >= 1, --warmup >= 0')
    _models.set_threads(args)
    if args.compile:
        import torch._dynamo
        # Every runner compiles the same code objects.
        torch._dynamo.config.cache_size_limit = 256
        torch._dynamo.config.accumulated_cache_size_limit = 4096

    import mmnanhook  # noqa: F401 - registers NanDetectHook
    _register()
    build = _builder(args)
    variants = _variants(args.policies)
    work_root = args.work_dir or tempfile.mkdtemp(prefix='mmnan_host_')
    print('# mmnanhook host time per iteration, %s' %
          datetime.datetime.now().isoformat(timespec='minutes'))
    print('# machine: %s; mmnanhook from %s' % (overhead._machine(),
                                                mmnanhook.__file__))
    print('# model: %d blocks (%d parameter tensors), %d loss terms, %s%s' % (
        args.blocks, 4 * args.blocks, args.terms,
        'clip_grad' if args.clip else 'no clip_grad',
        ', compiled (%s)' % args.compile if args.compile else ''))
    print('# %d repeats (fresh runners) x %d timed iterations per variant '
          'after %d warm-up, paired per iteration: median over iterations '
          'of t_variant - t_plain; median over repeats [min, max]\n' %
          (args.repeats, args.iters, args.warmup))
    runs = [_differences(overhead._run_model(
        'host', build, args.iters, args.warmup, work_root, repeat, variants))
        for repeat in range(args.repeats)]
    print('| variant | host us/iter over plain [min, max] |')
    print('| --- | --- |')
    for index, (label, _) in enumerate(variants[1:], 1):
        values = [run[index] for run in runs]
        print('| %s | %.0f [%.0f, %.0f] |' % (
            label, statistics.median(values), min(values), max(values)))
    sys.stdout.flush()
    if args.no_breakdown:
        return 0
    hooked = variants[2:]
    result = _breakdown(args, build, variants, work_root)
    print('\n# breakdown: one more set of runners, the parts timed in place '
          '(median us per iteration of each)\n')
    print('| part | %s |' % ' | '.join(label for label, _ in hooked))
    print('| --- |%s' % (' --- |' * len(hooked)))
    for part in result[0][0]:
        print('| %s | %s |' % (part, ' | '.join(
            '-' if parts[part] is None else '%.1f' % parts[part]
            for parts, _ in result)))
    sums = [sum(v for v in parts.values() if v is not None)
            for parts, _ in result]
    print('| sum of the parts | %s |' % ' | '.join('%.1f' % s for s in sums))
    print('| the rest (run total minus the parts) | %s |' % ' | '.join(
        '%.1f' % (total - s) for (_, total), s in zip(result, sums)))
    print('| this run\'s total over plain | %s |' % ' | '.join(
        '%.1f' % total for _, total in result))
    return 0


if __name__ == '__main__':
    sys.exit(main())
