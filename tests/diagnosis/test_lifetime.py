"""Nothing of a diagnosis outlives it: no hooks, no graph, no kept batch,
and a process that keeps the error can still exit (torch 1.7 included).

Reachability is inspected (hook dictionaries of the modules, what the
error, the report, the hook and the optim wrapper can reach), not timed;
the exit test only bounds each run of the script.
"""
import os.path as osp
import subprocess
import sys
import time

import pytest
import torch

from mmnanhook import NonFiniteError
from mmnanhook._mmengine import unwrap_model
from mmnanhook.diagnosis import diagnose
from mmnanhook.run import TriggerProcedure
from mmnanhook.memory import capture_rng, restore_rng
from mmnanhook.sentinel import sentinel_of
from mmnan_testing import exit_check, lifetime
from mmnan_testing.toy import ToyModel

EXIT_RUNS = 10
# A hang is forever; a run takes ~10 s alone and several times that on a
# loaded 2-core machine: the bound only tells the two apart.
EXIT_LIMIT_S = 300


def _hook_of(runner):
    (hook, ) = [h for h in runner.hooks if type(h).__name__ == 'NanDetectHook']
    return hook


@pytest.mark.mmdet
@pytest.mark.parametrize('fault', exit_check.FAULTS)
@pytest.mark.parametrize('policy', ['raise', 'skip', 'warn'])
def test_nothing_of_the_diagnosis_is_left(tmp_path, fault, policy,
                                          monkeypatch):
    runner = exit_check.build_runner(fault, str(tmp_path), policy=policy)
    hook = _hook_of(runner)
    # Graph tensors alive when the diagnosis starts: the training step's.
    before = set()
    prepare = TriggerProcedure._prepare

    def noting_prepare(procedure, plan, evidence, *args):
        before.update(lifetime.live_graph_ids())
        return prepare(procedure, plan, evidence, *args)

    monkeypatch.setattr(TriggerProcedure, '_prepare', noting_prepare)
    error = None
    try:
        runner.train()
    except NonFiniteError as exc:
        error = exc
    assert (error is not None) == (policy == 'raise')
    model = unwrap_model(runner.model)
    assert lifetime.module_hooks(model) == []
    ow = runner.optim_wrapper
    assert sentinel_of(ow) is None and lifetime.bindings_left(ow) == []
    monkeypatch.undo()
    assert before
    roots = [hook, ow]
    if error is not None:
        roots += [error, error.report]
    # Only the training step's own graph, held by the frames of the error's
    # traceback; nothing the replay made.
    made_later = [path for obj, path in lifetime.reachable_graph(roots)
                  if id(obj) not in before]
    assert made_later == []
    # The kept batches, RNG states and buffer copies are released: the
    # run's whole state.
    assert hook._run is None
    if error is not None:
        # The gradients of the step nobody will apply are freed too.
        assert all(p.grad is None for p in model.parameters())


def _toy_batch(fault):
    return {'inputs': [torch.randn(4) for _ in range(2)],
            'fault': [fault, '']}


@pytest.mark.parametrize('fault', ['nan_grad', 'nan_term', 'inplace'])
def test_a_replay_frees_every_graph_it_made(fault):
    torch.manual_seed(0)
    model = ToyModel()
    batch = _toy_batch(fault)
    state = capture_rng()
    before = lifetime.live_graph_ids()
    report = diagnose(model, batch, restore_rng=lambda: restore_rng(state))
    assert report.kind in ('backward', 'forward', 'exception', 'data')
    assert lifetime.live_graph_ids() <= before
    assert lifetime.module_hooks(model) == []


@pytest.mark.everyday_leg('dota')
def test_the_exit_check_script_exits_promptly_every_time(tmp_path):
    """In make test on the DOTA leg, where torch 1.7's exit hangs live;
    the modern leg's runs are in the full tier (fresh processes each: their
    point)."""
    # Two at a time: the runs are independent processes.
    runs = [(exit_check.FAULTS[i % len(exit_check.FAULTS)], 20 + i)
            for i in range(EXIT_RUNS)]
    results = []
    for start in range(0, len(runs), 2):
        procs = []
        for fault, code in runs[start:start + 2]:
            work = str(tmp_path / ('%s_%d' % (fault, code)))
            procs.append((fault, code, time.time(), subprocess.Popen(
                [sys.executable, '-m', 'mmnan_testing.exit_check', fault,
                 work, str(code)], stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, universal_newlines=True)))
        for fault, code, started, proc in procs:
            try:
                out, _ = proc.communicate(
                    timeout=max(1, EXIT_LIMIT_S - (time.time() - started)))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                results.append((fault, 'hung', out[-2000:]))
                continue
            results.append((fault, proc.returncode == code and
                            '"raised": true' in out, out[-2000:]))
    bad = [r for r in results if r[1] is not True]
    assert not bad, bad
    assert osp.isdir(str(tmp_path))


@pytest.mark.mmdet
def test_short_soak_skips_every_bad_step_and_keeps_few_bundles(tmp_path):
    from mmnan_testing.soak import run_soak
    result = run_soak(str(tmp_path), iters=50, max_dumps=3, tail=40)
    planned = result['planned']
    assert set(planned.values()) == {'data', 'backward'}
    assert result['iters'] == 50
    assert result['skipped'] == len(planned) == 5
    assert result['finite']
    assert result['bundles'] == 3
