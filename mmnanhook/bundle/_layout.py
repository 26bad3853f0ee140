"""The bundle's layout: its file names, format version and directory names,
and how the manifest and the JSON files render what mmnanhook recorded.

Layout of a bundle directory::

    manifest.json   written last; lists every other file with size and sha256
    report.json     the diagnosis
    <stem>.pth      torch.save'd objects (data_batch, model, optimizer, rng)
    config.py       the run's config; report.txt, the report as text
    history.json    the last iterations' loss / grad norm / lr / loss scale
    history.png     their plot, the failing iteration marked
    sample<i>_info.json, sample<i>_image.<ext>
                    an implicated sample's data info and image file (the
                    fixes run it through the train pipeline again)
"""
from __future__ import annotations

import datetime
import hashlib
import numbers
import os.path as osp
import platform
import sys
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from .._format import strict_float
from ..compat import distribution_version
from ..version import __version__

FORMAT_VERSION = 1

MANIFEST = 'manifest.json'
REPORT = 'report.json'
HISTORY_JSON = 'history.json'
HISTORY_PNG = 'history.png'
TORCH_SUFFIX = '.pth'
_RESERVED = (MANIFEST, REPORT, HISTORY_JSON, HISTORY_PNG)

# A bundle being written lives in '.mmnan-tmp.<pid>.<host>.<random>' inside
# dump_dir, so that a write killed midway is recognisable by its name.
_TMP_PREFIX = '.mmnan-tmp.'

CONFIG_FILE = 'config.py'
REPORT_TEXT = 'report.txt'
REPORT_HTML = 'report.html'
# Stems of the torch files.
DATA_BATCH = 'data_batch'
MODEL = 'model'
OPTIMIZER = 'optimizer'
RNG = 'rng'
# The manifest's key of the bundle a bundle without a state replays from
# (:class:`~mmnanhook.bundle.StateRef`).
STATE_FROM = 'state_from'


def sample_info_name(index: int) -> str:
    """The data info of the implicated sample at batch position ``index``
    (JSON): with its image file, what an offline replay runs through the
    train pipeline again to verify a fix."""
    return 'sample{}_info.json'.format(int(index))


def sample_image_name(index: int, path: str) -> str:
    """The copy of that sample's image file, its extension kept."""
    return 'sample{}_image{}'.format(int(index),
                                     osp.splitext(str(path))[1].lower())


# How a manifest names the autocast dtype of the run (absent: float32).
AMP_DTYPES = {'float16': torch.float16, 'bfloat16': torch.bfloat16}


def amp_dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """The manifest's name of an autocast dtype (``None`` for float32)."""
    for name, value in AMP_DTYPES.items():
        if dtype == value:
            return name
    return None


def render_manifest(event: Any, epoch: int,
                    amp_dtype: Optional[torch.dtype],
                    annotations: Optional[List[Any]],
                    divergence: Optional[Dict[str, Any]] = None
                    ) -> Dict[str, Any]:
    """The fields of ``manifest.json`` that describe a trigger.

    :func:`~mmnanhook.bundle.write_bundle` adds ``format_version``,
    ``created``, ``versions`` and ``files``.

    Args:
        event (NonFiniteEvent): The trigger.
        epoch (int): The training epoch.
        amp_dtype (torch.dtype, optional): The run's autocast dtype.
        annotations (list, optional): Per sample, what its annotation says
            (declared image size, boxes).
        divergence (dict, optional): Evidence of a divergence before the
            trigger; an offline replay applies it again.

    Returns:
        dict: Strict-JSON plain data.
    """
    return to_strict_json(dict(
        annotations=annotations,
        iter=event.iter,
        epoch=epoch,
        rank=event.rank,
        world_size=event.world_size,
        trigger=event.trigger.value,
        bad_ranks=event.bad_ranks,
        losses=event.losses,
        nonfinite_losses=event.nonfinite_losses,
        grad_norm=event.grad_norm,
        nonfinite_grads=dict(names=event.nonfinite_grads,
                             count=event.nonfinite_grad_count),
        loss_scale=event.loss_scale,
        amp_dtype=amp_dtype_name(amp_dtype),
        message=event.message,
        exception=event.exception,
        spikes=event.spikes,
        divergence=divergence))


# Module name -> distribution names, for packages not imported yet.
_PACKAGES = (
    ('torch', ('torch', )),
    ('mmengine', ('mmengine', 'mmengine-lite')),
    ('mmcv', ('mmcv', 'mmcv-full', 'mmcv-lite')),
    ('mmdet', ('mmdet', )),
    ('mmrotate', ('mmrotate', )),
)


def versions() -> Dict[str, Optional[str]]:
    """Versions of python, torch, the OpenMMLab packages and mmnanhook.

    An imported package reports its ``__version__``; one not imported yet is
    looked up in the installed distributions rather than imported (importing
    mmdet just to read its version costs seconds).

    Returns:
        dict: Package name -> version string, ``None`` when not installed.
    """
    result = {'python': platform.python_version()}
    for module, distributions in _PACKAGES:
        loaded = sys.modules.get(module)
        found = getattr(loaded, '__version__', None)
        result[module] = (str(found) if found is not None else
                          distribution_version(distributions))
    result['mmnanhook'] = __version__
    return result


def to_strict_json(obj: Any) -> Any:
    """Convert ``obj`` into plain data that :func:`json.dumps` writes as
    strict JSON.

    Non-finite floats become the strings ``"nan"``, ``"inf"`` and ``"-inf"``;
    numpy and torch scalars become python numbers, arrays and tensors
    (nested) lists, tuples and sets lists, mapping keys strings. Anything
    else is written as its ``str``, so that a report never fails to save.

    Args:
        obj: The object to convert.

    Returns:
        The converted object.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (np.ndarray, np.generic, torch.Tensor)):
        obj = obj.tolist() if not isinstance(obj, np.generic) else obj.item()
        return to_strict_json(obj)
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return strict_float(obj)
    if isinstance(obj, dict):
        return {str(key): to_strict_json(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_strict_json(value) for value in obj]
    return str(obj)


def bundle_name(iter: int, rank: int,
                when: Optional[datetime.datetime] = None) -> str:
    """Directory name of a bundle, e.g. ``20261130T214500_iter000123_rank0``.

    The local timestamp comes first so that a plain listing of ``dump_dir``
    shows bundles in the order they were written.

    Args:
        iter (int): Global iteration of the trigger.
        rank (int): Rank writing the bundle.
        when (datetime.datetime, optional): Time stamp; now by default.
    """
    when = when or datetime.datetime.now()
    return '{}_iter{:06d}_rank{}'.format(
        when.strftime('%Y%m%dT%H%M%S'), int(iter), int(rank))


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            digest.update(chunk)
    return digest.hexdigest()
