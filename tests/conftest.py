import importlib
import os
import traceback

import pytest
import torch

from mmnan_testing.loaders import end_left_workers

# The test support package (tests/mmnan_testing) is on pytest's path because
# this file's directory is; processes the tests start (DDP ranks, the CLI,
# exit checks) find it through PYTHONPATH, as a user's project would be found.
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ['PYTHONPATH'] = os.pathsep.join(
    [_TESTS] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep)
                if p and p != _TESTS])

# Two torch threads on the 2 shared cores of CI stall tiny-detector iterations
# for seconds; one thread is ~5x faster and steady.
torch.set_num_threads(1)

# Why a marked test may be skipped in a leg: said in the report, never silent.
_SKIP_REASONS = {
    'mmdet': 'mmdet (with compiled mmcv ops) is not installed in this environment',
    'mmrotate': 'mmrotate 1.x needs mmdet<=3.1 and so mmcv<2.1, whose C++14 build '
    'torch>=2.1 rejects: it runs in the DOTA leg (.venv-dota), not here',
    'mmseg': 'mmsegmentation 1.2.2 is installed in the modern leg only: its '
    'dependencies are not pinned for the torch 1.7 twin of the Docker image',
    'mmyolo': 'mmyolo 0.6.0 asserts mmcv < 2.1.0: it is installed in the DOTA leg '
    '(mmcv 2.0.1, mmdet 3.1.0) only',
    # The codebases leg's own: each imports a torchvision that loads, which
    # neither other leg has (scripts/leg.sh says why).
    'mmpretrain': 'mmpretrain 1.2.0 runs in the codebases leg (.venv-codebases) only',
    'mmpose': 'mmpose 1.3.2 runs in the codebases leg (.venv-codebases) only',
    'mmagic': 'mmagic 1.2.0 runs in the codebases leg (.venv-codebases) only',
}


# What must import for a marker's tests to run (mmpretrain's datasets import
# torchvision; mmyolo's registration, prettytable; mmpose's datasets,
# xtcocotools; mmagic's models, diffusers and transformers).
_MODULES = {'mmpretrain': 'mmpretrain.datasets', 'mmyolo': 'mmyolo.utils',
            'mmpose': 'mmpose.datasets', 'mmagic': 'mmagic.models'}


def _import_error(name):
    """The traceback of importing ``name`` and ``mmcv.ops``, or None."""
    try:
        importlib.import_module(_MODULES.get(name, name))
        importlib.import_module('mmcv.ops')
        return None
    except Exception:  # noqa: BLE001 - reported or turned into a skip
        return traceback.format_exc()


def _required():
    """The markers whose packages this leg installs by design.

    ``scripts/test_leg.sh`` sets them from ``scripts/leg.sh``: there a broken
    install is an error, not a skip. A plain ``pytest`` (no leg) skips.
    """
    names = os.environ.get('MMNANHOOK_LEG_REQUIRES', '')
    return [n for n in names.split(',') if n]


def _leg_share(config, items):
    """In a leg that says its share (``MMNANHOOK_LEG_ONLY``: markers), only
    the tests marked with one of them: the codebases leg proves its
    packages; mmnanhook's own code is the other legs' to test. A test
    marked ``on_legs(...)`` runs on the legs it names alone, whatever their
    share (a tier's legs balanced, each leg's torch in compat's range)."""
    leg = os.environ.get('MMNANHOOK_LEG')
    only = [n for n in os.environ.get('MMNANHOOK_LEG_ONLY', '').split(',')
            if n]

    def runs_here(item):
        placed = item.get_closest_marker('on_legs')
        if leg and placed is not None:
            return leg in placed.args
        return not only or any(item.get_closest_marker(n) for n in only)

    kept, left = [], []
    for item in items:
        (kept if runs_here(item) else left).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


def _tiers(items):
    """A test marked ``everyday_leg(...)`` runs in ``make test`` on the legs
    it names and in ``make test-zoo`` on the others: one test per mechanism
    in the everyday tier, each leg's everyday share within its core, every
    test still run on every leg by the two tiers together."""
    leg = os.environ.get('MMNANHOOK_LEG')
    if not leg:  # a plain pytest, outside the tiers: everything is everyday
        return
    for item in items:
        marker = item.get_closest_marker('everyday_leg')
        if marker is not None and leg not in marker.args:
            item.add_marker(pytest.mark.zoo_full)


@pytest.fixture(autouse=True)
def _distribution_checks_put_back():
    # torch.compile's first use turns torch.distributions' argument checks
    # off for the whole process (torch._dynamo's TorchPatcher): a later
    # test's mmpose RLE loss then made a NaN where a user's process raises.
    from torch.distributions import Distribution
    before = Distribution._validate_args
    yield
    Distribution._validate_args = before


@pytest.fixture(autouse=True)
def _no_dataloader_workers_left():
    # Each test's workers end with it, not seconds into another test.
    yield
    end_left_workers()


# First: the markers added here must be in place before ``-m`` deselects.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _leg_share(config, items)
    _tiers(items)
    errors = {name: _import_error(name) for name in _SKIP_REASONS}
    broken = [name for name in _required()
              if errors.get(name, 'not a marker of tests/conftest.py')]
    if broken:
        raise pytest.UsageError(
            'this leg installs %s by design, but it does not import '
            '(MMNANHOOK_LEG_REQUIRES=%s):\n%s' % (
                ', '.join(broken), os.environ['MMNANHOOK_LEG_REQUIRES'],
                '\n'.join('%s: %s' % (n, errors.get(
                    n, 'not a marker of tests/conftest.py'))
                          for n in broken)))
    available = {name: errors[name] is None for name in _SKIP_REASONS}
    for item in items:
        for name, reason in _SKIP_REASONS.items():
            if item.get_closest_marker(name) and not available[name]:
                item.add_marker(pytest.mark.skip(reason=reason))
