"""Offline replay of a bundle: rebuild the model from the bundle's config,
load its parameters, batch and RNG, and run the tier-2 diagnosis again."""
from __future__ import annotations

import functools
import json
import os.path as osp
from typing import Any, Tuple

import torch

from .._mmengine import members
from ..bundle import (AMP_DTYPES, CONFIG_FILE, DATA_BATCH, MODEL, OPTIMIZER,
                      RNG, TORCH_SUFFIX, load_bundle, state_dict_mismatch)
from ..diagnosis import (OwnTrainStep, angle_range_from_config,
                         apply_divergence, declared_sizes, diagnose,
                         overrides_train_step, train_pipeline)
from ..errors import BundleError
from ..records import Divergence, Report, SampleId
from ..recovery import drop_unavailable
from ..report import explain_by_config, finalize
from ..memory import restore_rng


def config_from_text(text: str) -> Any:
    """An mmengine ``Config`` from the text a bundle holds."""
    from mmengine.config import Config
    return Config.fromstring(text, file_format='.py')


def build_model(cfg: Any, device: str = 'cpu') -> torch.nn.Module:
    """Build ``cfg.model`` in the config's default scope, in train mode.

    Args:
        cfg (mmengine.Config): The training config.
        device (str): Where the model goes.
    """
    from mmengine.registry import MODELS, init_default_scope
    if cfg.get('default_scope') is not None:
        init_default_scope(cfg.default_scope)
    model = MODELS.build(cfg.model)
    return model.to(device).train()


def _load_inputs(path, device):
    bundle = load_bundle(path, load=(DATA_BATCH, RNG))
    # The bundle holding the state: this one, or the one it names.
    state = bundle.state_bundle()
    # Every .pth is refused or loaded before the config runs.
    state.load(MODEL)
    if state.has(OPTIMIZER):
        state.load(OPTIMIZER)
    if device == 'cuda' and not torch.cuda.is_available():
        raise BundleError('--device cuda: no CUDA device on this machine')
    try:
        cfg = config_from_text(bundle.text(CONFIG_FILE))
        model = build_model(cfg, device)
        problem = state_dict_mismatch(model.state_dict(), state.load(MODEL))
        if problem is not None:
            raise BundleError('{}: {}'.format(
                osp.join(state.path, MODEL + TORCH_SUFFIX), problem))
        model.load_state_dict(state.load(MODEL))
    except BundleError:
        raise
    except Exception as error:  # noqa: BLE001 - any rebuild failure is bad input
        raise BundleError(' '.join(
            'cannot rebuild the model of {}: {}: {}'.format(
                path, type(error).__name__, error).split()))
    return bundle, state, cfg, model


def _train_step(cfg, model, bundle):
    """The model's own ``train_step`` (a GAN's), replayed up to the update
    step the run failed in (the manifest's ``update_step``) with optim
    wrappers built from the config as the run built them (none steps), and
    why ``policy='drop'`` only skips with them (the fixes say it as the
    run did); ``(None, None)`` for a model that trains with
    ``BaseModel.train_step``."""
    if not overrides_train_step(model):
        return None, None
    from mmengine.optim import build_optim_wrapper
    try:
        optim_wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    except Exception as error:  # noqa: BLE001 - a bundle it cannot replay
        raise BundleError(' '.join(
            'cannot build the optim wrapper of {} ({}.train_step, which the '
            'replay runs, takes it): {}: {}'.format(
                bundle.path, type(model).__name__, type(error).__name__,
                error).split()))
    return (OwnTrainStep(optim_wrapper, bundle.manifest.get('update_step')),
            drop_unavailable(len(members(optim_wrapper))))


def _sources(bundle):
    """Batch position -> data info of each sample the bundle keeps a copy
    of, its ``img_path`` the copy (for the fixes that run it through the
    train pipeline again)."""
    sources = {}
    for index, names in (bundle.manifest.get('sources') or {}).items():
        try:
            # Only files the manifest lists (verified): never a path of its
            # choosing outside the bundle.
            if names['image'] not in bundle.files:
                raise KeyError('{} is no file of the bundle'.format(
                    names['image']))
            info = json.loads(bundle.text(names['info']))
            info['img_path'] = osp.join(bundle.path, names['image'])
            sources[int(index)] = info
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise BundleError('corrupt "sources" entry {!r} in {}: {}: '
                              '{}'.format(index, bundle.path,
                                          type(error).__name__, error))
    return sources


def _identities(bundle):
    """Who each sample of the batch was (dataset index, file), as the run
    knew it; ``None`` for a bundle that does not say (an earlier one)."""
    samples = bundle.manifest.get('samples')
    if not isinstance(samples, list):
        return None
    try:
        return [SampleId(None if index is None else int(index),
                         None if file is None else str(file))
                for index, file in samples]
    except (TypeError, ValueError) as error:
        raise BundleError('corrupt "samples" in {}: {}: {}'.format(
            bundle.path, type(error).__name__, error))


def replay_bundle(path: str, device: str = 'cpu',
                  fp32: bool = False) -> Tuple[Any, Report]:
    """Replay the failing iteration of a bundle and diagnose it.

    Args:
        path (str): Bundle directory.
        device (str): ``'cpu'`` or ``'cuda'``.
        fp32 (bool): Replay in fp32 even when the run used autocast.

    Returns:
        tuple[Bundle, Report]: The bundle and the new report.

    Raises:
        BundleError: Not a bundle, a corrupt or missing file, or a model that
            cannot be rebuilt from the bundle's config.
    """
    bundle, state, cfg, model = _load_inputs(path, device)
    train_step, drop_refused = _train_step(cfg, model, bundle)
    amp_dtype = None if fp32 else AMP_DTYPES.get(
        bundle.manifest.get('amp_dtype'))
    report = diagnose(
        model,
        bundle.load(DATA_BATCH),
        restore_rng=functools.partial(restore_rng, bundle.load(RNG)),
        amp_dtype=amp_dtype,
        angle_range=angle_range_from_config(cfg),
        optimizer_state=state.load(OPTIMIZER)
        if state.has(OPTIMIZER) else None,
        declared=declared_sizes(bundle.manifest.get('annotations')),
        pipeline=train_pipeline(cfg), sources=_sources(bundle),
        retry=bundle.manifest.get('trigger') != 'spike',
        identities=_identities(bundle), train_step=train_step,
        drop_refused=drop_refused)
    # What the run knew of a divergence before the trigger, again.
    if apply_divergence(report,
                        Divergence.from_dict(bundle.manifest.get('divergence')),
                        bundle.manifest.get('rewind')):
        finalize(report)
    # The run's config findings are facts of its before_train, kept in
    # report.json: the replay explains by them as the run did.
    explain_by_config(report, Report.from_dict(bundle.report).config_findings)
    if state is not bundle:
        report.notes.append(bundle.state_note())
    return bundle, report
