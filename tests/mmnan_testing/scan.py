"""Datasets and configs for the tests of ``mmnan scan`` at scale: the fast
mode, the quarantine list written while scanning, ``--resume``."""
import os
import os.path as osp
import subprocess
import sys

from . import testbed
from .cli import PROJECT_DIR


def _project_on_path():
    # In this process too: the scan imports the project module.
    if PROJECT_DIR not in sys.path:
        sys.path.insert(0, PROJECT_DIR)


def probe():
    """The project's ``scan_probe`` module, as this process imports it (its
    ``SEEN``: the samples the pipelines of this process ran on)."""
    _project_on_path()
    import scan_probe
    return scan_probe


def probed_config(tmp_path, name, num_images, defects, delay=0.0,
                  log=None, hold_from=None, release=None, **overrides):
    """A tiny config on a synthetic dataset whose train pipeline starts with
    ``scan_probe.RecordSample`` (recording each sample it runs on), dumped
    to ``tmp_path/config.py``.

    Args:
        tmp_path: The test's directory.
        name (str): A tiny config (``'retinanet_voc'``, ...).
        num_images (int): Images of the dataset.
        defects (dict): Image index -> defect kind.
        delay (float): Seconds the probe makes each sample take.
        log (str, optional): A file the probe appends each index to.
        hold_from (int, optional): Samples from this index on wait until
            the file ``release`` exists.
        release (str, optional): See ``hold_from``.
        **overrides: Config overrides (dotted keys).

    Returns:
        tuple[str, dict]: The config's path, and the dataset's description.
    """
    _project_on_path()
    data = testbed.make_dataset(name, str(tmp_path / 'data'),
                                num_images=num_images, defects=defects)
    cfg = testbed.tiny_config(name, data, str(tmp_path / 'run'), **overrides)
    cfg.train_dataloader.dataset.pipeline.insert(
        0, dict(type='RecordSample', delay=delay, log=log,
                hold_from=hold_from, release=release))
    cfg.merge_from_dict(dict(custom_imports=dict(
        imports=['scan_probe'], allow_failed_imports=False)))
    path = str(tmp_path / 'config.py')
    cfg.dump(path)
    return path, data


def image_paths(data):
    """Absolute image paths of a dataset written by ``testbed``."""
    return [osp.join(data['img_dir'], name) for name in data['images']]


def mmnan_process(*args):
    """``python -m mmnanhook ARGS`` started in a fresh process that can
    import the project's modules; not waited for.

    Returns:
        subprocess.Popen: With ``stdout`` and ``stderr`` as text pipes.
    """
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
        [PROJECT_DIR] + [p for p in os.environ.get('PYTHONPATH', '').split(
            os.pathsep) if p]))
    return subprocess.Popen(
        [sys.executable, '-m', 'mmnanhook'] + [str(a) for a in args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, env=env)
