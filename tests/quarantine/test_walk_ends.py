"""The index walk forked at ``before_train`` never takes down or holds up the
training process (issue 52): a run whose process has a preemption handler
(SIGTERM: checkpoint, exit) ends while the walk is under way, or with the
walk's child stopped; the handler never runs in the child, the process ends
within seconds, and no child is left. One process, and 2 gloo ranks.

Before issue 52 the child was a plain fork of the training process: the
dataset's finalizer sent it SIGTERM, which ran the user's handler there
(``handler.<child pid>`` written), and a stopped child was joined forever
(the process never exited).
"""
import json
import os
import os.path as osp
import subprocess
import sys
import time

import pytest

from mmnan_testing.ddp import run_ranks
from mmnan_testing.preempt import alive

# A process that drops its walk exits in this many seconds after its last
# line (its interpreter's exit included); the walk alone takes 40 s.
EXITS_WITHIN = 15


def _no_trace_of_the_walk(out_dir, results):
    for result in results:
        # The walk was under way when the run ended ...
        assert result['walking_at_end'], result
        # ... stopped when the runner and its dataset went, and gone.
        assert result['dropped_in'] < 5 and not result['alive'], result
        assert not alive(result['pid'])
    # The preemption handler ran nowhere (no process was sent SIGTERM but
    # the walk's child).
    assert not [name for name in os.listdir(out_dir)
                if name.startswith('handler.')]


@pytest.mark.parametrize('scenario', ['walk_ends', 'walk_stopped'])
def test_a_run_ends_while_its_walk_goes_on(tmp_path, scenario):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    log = tmp_path / 'log.txt'
    with open(str(log), 'wb') as out:
        # A file, not a pipe: the walk's child holds the process's stdout.
        process = subprocess.Popen(
            [sys.executable, '-m', 'mmnan_testing.preempt', scenario,
             str(tmp_path)], stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
    ended = time.time()
    output = log.read_text(errors='replace')
    assert process.returncode == 0, output[-5000:]
    trained = [float(line.split()[1]) for line in output.splitlines()
               if line.startswith('trained ')]
    assert trained and ended - trained[0] < EXITS_WITHIN, output[-5000:]
    with open(osp.join(str(tmp_path), 'rank0.json')) as f:
        _no_trace_of_the_walk(str(tmp_path), [json.load(f)])


@pytest.mark.ddp
@pytest.mark.parametrize('scenario', ['walk_ends', 'walk_stopped'])
def test_every_rank_ends_while_its_walk_goes_on(tmp_path, scenario):
    results, _ = run_ranks(scenario, tmp_path, module='mmnan_testing.preempt',
                           timeout=180)
    assert len({result['pid'] for result in results}) == 2
    _no_trace_of_the_walk(str(tmp_path), results)
