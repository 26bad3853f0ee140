"""The drill's runs, in a process of their own (``python -m
mmnanhook.drill SPEC``): the clean run without NanDetectHook, the clean run
with it, then one run per fault; after each, what it did is written to this
rank's results file (atomically), so that the process that started them
knows which run was under way should this one die (an op's SIGSEGV).
"""
from __future__ import annotations

import copy
import json
import math
import os
import os.path as osp
import traceback
from typing import Any, Dict, Optional

import torch
from mmengine.hooks import Hook

from .._mmengine import unwrap_model
from ..bundle import MANIFEST, REPORT
from ..errors import DatasetError
from ._config import hook_config, prepare, without_hook
from ._data import empty_reason
from ._faults import FaultInjector

CLEAN_WITHOUT, CLEAN = 'clean_without', 'clean'
_SCALARS = ('nan_skipped', 'samples_dropped', 'rewinds')


def results_path(work_dir: str, rank: int) -> str:
    """This rank's results file."""
    return osp.join(work_dir, 'results.rank{}.json'.format(rank))


def read_results(path: str) -> Dict[str, Any]:
    """A results file (``{}`` while none was written)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_results(path: str, results: Dict[str, Any]) -> None:
    """Write a results file atomically (its reader may look at any time)."""
    with open(path + '.tmp', 'w') as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(path + '.tmp', path)


class _Probe(Hook):
    """The losses and LRs of each iteration of a run."""

    priority = 'LOWEST'

    def __init__(self) -> None:
        self.losses, self.lrs = [], []
        # The policy's counters after each iteration: under DDP a rank
        # without the fault shows its part of a trigger by them alone.
        self.counters = []
        self.started = False

    def before_train(self, runner: Any) -> None:
        # The loop, its loader and dataset are built by now.
        self.started = True

    def after_train_iter(self, runner: Any, batch_idx: int,
                         data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        loss = (outputs or {}).get('loss')
        self.losses.append(None if loss is None else float(loss))
        # get_lr: an OptimWrapperDict's too (mmagic's GANs).
        self.lrs.append(runner.optim_wrapper.get_lr())
        self.counters.append({n: _scalar(runner, n) for n in _SCALARS})


def _state(runner, probe):
    """What a clean run must leave bitwise alike with and without the hook:
    the weights and buffers, the optimizer, an EMA model, losses and LRs."""
    state = dict(model=unwrap_model(runner.model).state_dict(),
                 optimizer=runner.optim_wrapper.state_dict(),
                 losses=probe.losses, lrs=probe.lrs)
    for hook in runner.hooks:
        if getattr(hook, 'ema_model', None) is not None:
            state['ema'] = hook.ema_model.state_dict()
    return copy.deepcopy(state)


def _same_tensor(a, b):
    """Equal bitwise but for NaN, which equals NaN here."""
    if not (torch.is_tensor(a) and torch.is_tensor(b)) or \
            a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a, b) or bool(((a == b) | ((a != a) & (b != b)))
                                     .all())


def first_difference(a: Any, b: Any,
                     path: str = 'state') -> Optional[str]:
    """Where ``a`` and ``b`` (tensors in nested dicts and lists) differ
    first, bitwise; ``None`` when they do not."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return None if _same_tensor(a, b) else path
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(a, key=str) != sorted(b, key=str):
            return path + ' (keys)'
        keys = sorted(a, key=str)
        found = (first_difference(a[k], b[k], '{}.{}'.format(path, k))
                 for k in keys)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return path + ' (length)'
        found = (first_difference(x, y, '{}[{}]'.format(path, i))
                 for i, (x, y) in enumerate(zip(a, b)))
    else:
        return None if a == b else path
    return next((f for f in found if f is not None), None)


def _bundles(run_dir, rank):
    """What this rank's bundles of a run say (manifest and report)."""
    found = []
    dumps = osp.join(run_dir, 'nan_dumps')
    for name in sorted(os.listdir(dumps)) if osp.isdir(dumps) else []:
        try:
            with open(osp.join(dumps, name, MANIFEST)) as f:
                manifest = json.load(f)
            with open(osp.join(dumps, name, REPORT)) as f:
                report = json.load(f)
        except (OSError, ValueError):
            continue
        if manifest.get('rank', 0) != rank:
            continue
        found.append(dict(
            iter=manifest.get('iter'), trigger=manifest.get('trigger'),
            nonfinite_losses=manifest.get('nonfinite_losses') or [],
            nonfinite_grads=(manifest.get('nonfinite_grads') or {}).get(
                'names', []),
            samples=[s.get('img_path') for s in report.get('samples') or []],
            sample_indices=[s.get('index')
                            for s in report.get('samples') or []],
            module=report.get('module'), kind=report.get('kind'),
            summary=report.get('summary')))
    return found


def _quarantined(run_dir):
    from ..quarantine import read_quarantine
    path = osp.join(run_dir, 'nan_quarantine.json')
    if not osp.isfile(path):
        return []
    return [s.file for s in read_quarantine(path)]


def _scalar(runner, name):
    try:
        return int(runner.message_hub.get_scalar('train/' + name).current())
    except KeyError:
        return 0


def _train(cfg, fault, spec, rank):
    """One run; what it did, and its state (``None`` when it raised)."""
    from mmengine.runner import Runner
    probe = _Probe()
    injector = None if fault is None else FaultInjector(
        fault, spec['iter'], spec['rank'])
    runner = error = None
    try:
        runner = Runner.from_cfg(cfg)
        runner.register_hook(probe)
        if injector is not None:
            runner.register_hook(injector)
        runner.train()
    except Exception as caught:  # noqa: BLE001 - what a run raised is said
        error = caught
        traceback.print_exc()  # into the run's log, whole
    finally:
        if injector is not None:
            injector.remove()
    said = None
    if error is not None and not probe.started:
        # It never trained: an empty dataset says why in the config's
        # terms (else numpy's "need at least one array to concatenate").
        said = empty_reason(cfg)
    model = None if runner is None else unwrap_model(runner.model)
    outcome = dict(
        iters=len(probe.losses),
        counters=probe.counters,
        # The first iteration whose logged loss was not finite.
        nonfinite_loss_at=next((i for i, loss in enumerate(probe.losses)
                                if loss is not None and
                                not math.isfinite(loss)), None),
        error=None if error is None else said or '{}: {}'.format(
            type(error).__name__, str(error).splitlines()[0][:300]
            if str(error) else ''),
        error_type=None if error is None else type(error).__name__,
        finite=model is not None and all(
            bool(torch.isfinite(p).all()) for p in model.parameters()),
        scalars={n: 0 if runner is None else _scalar(runner, n)
                 for n in _SCALARS},
        bundles=_bundles(cfg.work_dir, rank),
        quarantined=_quarantined(cfg.work_dir),
        planted=None if injector is None else injector.planted.to_dict())
    return outcome, None if error else _state(runner, probe)


def _run_config(prepared, name, spec):
    cfg = copy.deepcopy(prepared.cfg)
    if name == CLEAN_WITHOUT:
        cfg = without_hook(cfg)
    cfg.work_dir = osp.join(spec['work_dir'], name)
    cfg.experiment_name = name
    cfg.launcher = spec['launcher']
    hook = hook_config(cfg)
    if hook is not None:
        hook['dump_dir'] = osp.join(cfg.work_dir, 'nan_dumps')
    return cfg


def _init_gloo(timeout):
    """The process group over gloo, from the launcher's environment:
    mmengine's ``init_dist`` sets a CUDA device first, which a CPU has not.
    Its collectives wait ``timeout`` seconds at most."""
    import datetime

    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group(
            'gloo', timeout=datetime.timedelta(seconds=timeout))


def run_all(spec: dict) -> None:
    """Run what ``spec`` asks that this rank's results do not hold yet.

    Args:
        spec (dict): ``config``, ``work_dir``, ``faults``, ``iter``,
            ``rank``, ``policy``, ``image_size``, ``synthetic``,
            ``launcher``, ``timeout`` (see :func:`mmnanhook.drill.run_drill`).
    """
    import mmnanhook  # noqa: F401 - NanDetectHook's registration
    from . import _sampler  # noqa: F401 - DrillSampler's registration
    rank = int(os.environ.get('RANK', 0))
    if spec['launcher'] != 'none' and not torch.cuda.is_available():
        _init_gloo(spec['timeout'])
    path = results_path(spec['work_dir'], rank)
    results = read_results(path)
    results.setdefault('runs', {})
    try:
        # One dataset for every rank, as real ranks train one: rank 0
        # writes a stand-in, the others wait for it. Not ``data``: the
        # data fault's run has that work dir.
        prepared = prepare(
            spec['config'], osp.join(spec['work_dir'], 'synthetic'),
            spec['length'], policy=spec['policy'],
            image_size=spec['image_size'], synthetic_data=spec['synthetic'],
            distributed=spec['launcher'] != 'none', writes=rank == 0,
            timeout=spec['timeout'])
    except DatasetError as error:  # said in one line by ``mmnan drill``
        results['failed'] = str(error)
        write_results(path, results)
        return
    results['prepared'] = dict(data=prepared.data, changes=prepared.changes,
                               policy=hook_config(prepared.cfg).get(
                                   'policy', 'raise'))
    clean_state = None
    for name in [CLEAN_WITHOUT, CLEAN] + list(spec['faults']):
        if name in results['runs']:
            continue
        results['started'] = name
        write_results(path, results)
        fault = None if name in (CLEAN_WITHOUT, CLEAN) else name
        outcome, state = _train(_run_config(prepared, name, spec), fault,
                                spec, rank)
        if name == CLEAN_WITHOUT:
            clean_state = state
        elif name == CLEAN and None not in (clean_state, state):
            outcome['difference'] = first_difference(clean_state, state)
        results['runs'][name] = outcome
        results['started'] = None
        write_results(path, results)
