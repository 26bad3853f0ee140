"""The config rules over every config file the installed OpenMMLab packages
ship (their ``.mim/configs``, ``_base_`` files left out): what
``mmnan doctor`` says of the zoo itself, unmodified."""
import collections
import glob
import importlib
import os.path as osp
import warnings

from mmnanhook.doctor import config_findings

PACKAGES = ('mmdet', 'mmrotate', 'mmseg')


def shipped_configs(package):
    """Every config file ``package`` ships, ``_base_`` files left out."""
    module = importlib.import_module(package)
    root = osp.join(osp.dirname(module.__file__), '.mim', 'configs')
    return sorted(p for p in glob.glob(osp.join(root, '**', '*.py'),
                                       recursive=True)
                  if '_base_' not in p.split(osp.sep)
                  and '__pycache__' not in p)


def sweep(packages=PACKAGES):
    """Run every rule over every shipped config of the importable packages.

    Returns:
        dict: ``package -> dict(configs=int, unloadable=list, findings=
        {path: [ConfigFinding]}, counts=Counter(rule -> configs))``.
    """
    from mmengine.config import Config
    result = {}
    for package in packages:
        try:
            paths = shipped_configs(package)
        except ImportError:
            continue
        found = dict(configs=len(paths), unloadable=[], findings={},
                     counts=collections.Counter())
        for path in paths:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter('ignore')
                    cfg = Config.fromfile(path)
            except Exception as error:  # noqa: BLE001 - counted, not fatal
                found['unloadable'].append((path, repr(error)[:200]))
                continue
            findings = config_findings(cfg, filename=path)
            if findings:
                found['findings'][path] = findings
            for rule in set(f.rule for f in findings):
                found['counts'][rule] += 1
        result[package] = found
    return result
