"""What tier 1 keeps per step: the history ring buffer and the RNG states."""
import logging
import random

import numpy as np
import pytest
import torch

from mmnanhook.memory import History, capture_rng, restore_rng


def test_history_ring_buffer():
    history = History(maxlen=3)
    for it in range(5):
        history.append(it, loss=torch.tensor(float(it)), lr=0.1)
    history.append(5, loss=float('nan'), grad_norm=float('inf'))
    records = history.records()
    assert len(history) == 3 and history.maxlen == 3
    assert [r['iter'] for r in records] == [3, 4, 5]
    assert records[0] == {'iter': 3, 'loss': 3.0, 'grad_norm': None,
                          'lr': 0.1, 'loss_scale': None}
    assert np.isnan(records[-1]['loss']) and records[-1]['grad_norm'] > 1e308


def test_rng_capture_restore_reproduces_draws():
    state = capture_rng()
    first = (torch.rand(5), torch.randn(2, 2), np.random.rand(3),
             np.random.randint(0, 1000, 4), random.random(),
             random.randint(0, 10**9))
    restore_rng(state)
    second = (torch.rand(5), torch.randn(2, 2), np.random.rand(3),
              np.random.randint(0, 1000, 4), random.random(),
              random.randint(0, 10**9))
    for a, b in zip(first, second):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # The state is a snapshot, not a view of the live generators.
    assert not torch.equal(torch.rand(5), first[0])


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason='checks the CPU-only path of a GPU bundle')
def test_restore_rng_skips_cuda_state_without_cuda(caplog):
    caplog.set_level(logging.INFO, logger='test_history_rng')
    logger = logging.getLogger('test_history_rng')
    state = capture_rng()
    state['cuda'] = [torch.zeros(16, dtype=torch.uint8)]
    expected = torch.rand(3)
    restore_rng(state, logger=logger)
    assert torch.equal(torch.rand(3), expected)
    assert 'CUDA RNG states were captured but CUDA is not available' in \
        caplog.text


def _same_state(a, b):
    """Two :func:`capture_rng` states are equal, entry by entry."""
    assert a.keys() == b.keys()
    assert torch.equal(a['torch'], b['torch'])
    assert a['random'] == b['random']
    name, key, pos, has_gauss, gauss = a['numpy']
    assert (name, pos, has_gauss, gauss) == (b['numpy'][0], ) + tuple(
        b['numpy'][2:])
    assert np.array_equal(key, b['numpy'][1])


def test_step_rng_answers_what_a_full_capture_does():
    from mmnanhook import compat
    from mmnanhook.memory._rng import StepRng
    # Both generators are read as bytes on both legs; else this test would
    # only compare full captures with full captures.
    assert compat.numpy_mt_reader() is not None
    assert compat.python_mt_reader() is not None
    np.random.seed(1)
    random.seed(1)
    rng = StepRng()
    first = rng.capture()
    again = rng.capture()
    # Nothing drew: the states kept are answered again, not copied.
    assert again['numpy'] is first['numpy']
    assert again['random'] is first['random']
    draws = [
        lambda: np.random.rand(3),
        # An odd count of Gaussians leaves one cached (has_gauss) ...
        lambda: np.random.standard_normal(3),
        # ... which the next one uses without drawing from the key.
        lambda: np.random.standard_normal(),
        lambda: np.random.standard_normal(),
        lambda: random.random(),
        lambda: random.gauss(0.0, 1.0),
        # Uses random's cached Gaussian: the key does not change.
        lambda: random.gauss(0.0, 1.0),
        lambda: np.random.seed(1),
        lambda: random.seed(1),
        lambda: np.random.set_state(first['numpy']),
        lambda: random.setstate(first['random']),
        lambda: torch.rand(2),
        lambda: None,
    ]
    for draw in draws:
        draw()
        _same_state(rng.capture(), capture_rng())
    # What it answered restores the draws that followed.
    np.random.standard_normal(3)
    random.gauss(0.0, 1.0)
    state = rng.capture()
    expected = (np.random.standard_normal(2), random.gauss(0.0, 1.0))
    restore_rng(state)
    assert (np.random.standard_normal(2) == expected[0]).all()
    assert random.gauss(0.0, 1.0) == expected[1]
