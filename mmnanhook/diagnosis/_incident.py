"""Tier 2 of a trigger, in two steps: :func:`examine` replays and diagnoses
the failing iteration; :func:`conclude` completes the report (with every rank's
findings under DDP), logs it and writes the bundle. Both run inside the
update step, before the policy acts, so the parameters and optimizer state
are still those before the failing step."""
import contextlib
import functools
import json
import logging
import os.path as osp
import time
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from mmengine.optim import AmpOptimWrapper

from .._log import log
from .._mmengine import compile_options, members, unwrap_model
from ..bundle import (CONFIG_FILE, DATA_BATCH, MODEL, OPTIMIZER, REPORT_HTML,
                      REPORT_TEXT, RNG, STATE_FROM, StatePlan, bundle_name,
                      render_manifest, sample_image_name, sample_info_name,
                      to_strict_json, write_bundle)
from ..memory import restore_rng
from ..quarantine import name_samples
from ..records import Report, Trigger
from ..report import (cross_rank, explain_by_config, finalize,
                      format_report, render_html, sample_pictures)
from ._data import angle_range_from_config, annotations, declared_sizes
from ._composed import trace_parts
from ._diagnose import diagnose
from ._pipeline import image_too_large, train_pipeline
from ._divergence import apply_divergence, weight_evidence
from ._state import preserved_rng


# The replays run the model eagerly, whatever the run compiled: forward
# hooks, autograd-node hooks and anomaly mode see every module and op only
# there.
COMPILED_NOTE = (
    'the run\'s train_step is compiled (torch.compile); the replays ran it '
    'eagerly: a fault made only by the compiled code (a backend\'s kernels '
    'or fusions) is not reproduced by them')


def _amp_dtype(optim_wrapper):
    # The autocast dtype of the run: AmpOptimWrapper's ``cast_dtype``, and
    # fp16 (autocast's default on CUDA) when it names none.
    for member in members(optim_wrapper):
        if isinstance(member, AmpOptimWrapper):
            return getattr(member, 'cast_dtype', None) or torch.float16
    return None


def _unreplayed_report(summary):
    # A diagnosis that did not run (or crashed) must not cost the bundle.
    return Report(summary=summary)


def _identities(runner, data_batch, indices):
    # Who each sample is: a label missing never costs the diagnosis.
    try:
        return name_samples(runner.train_dataloader.dataset, data_batch,
                            indices)
    except Exception as error:  # noqa: BLE001 - a missing detail only
        log('mmnanhook: the samples of the batch are not named ({}: '
            '{})'.format(type(error).__name__, error), logging.WARNING)
        return None


def _annotations(runner, data_batch, infos, identities):
    # What the annotations say of the batch's images; the bundle keeps it,
    # as a replay has no dataset to ask.
    try:
        return annotations(runner.train_dataloader.dataset, data_batch,
                           infos, identities)
    except Exception as error:  # noqa: BLE001 - a missing detail only
        log('mmnanhook: the annotations of the batch are unknown ({}: '
            '{})'.format(type(error).__name__, error), logging.WARNING)
        return None


def _sample_files(report, infos):
    """The data info and image file of each implicated sample, for an
    offline replay of the fixes: ``(blobs, manifest entries)``."""
    blobs, kept = {}, {}
    for sample in report.samples:
        info = infos.get(sample.index)
        path = (info or {}).get('img_path')
        if path is None or image_too_large(path):
            continue
        try:
            with open(path, 'rb') as f:
                image = f.read()
        except OSError:  # the fixes are then untested offline, no more
            continue
        names = dict(info=sample_info_name(sample.index),
                     image=sample_image_name(sample.index, path))
        blobs[names['info']] = json.dumps(info).encode()
        blobs[names['image']] = image
        kept[str(sample.index)] = names
    return blobs, kept


class Material(NamedTuple):
    """What a trigger's bundle is written from, kept from its examination
    until the bundle is written (then let go)."""

    data_batch: Any
    rng_state: dict
    start_attributes: Any
    optim_state: dict
    amp_dtype: Any
    infos: dict
    found: Any
    identities: Any
    divergence: Any
    lowered: Optional[dict]
    replays: Callable
    start: float
    # The key of the optim wrapper member whose update step a model with
    # its own train_step failed in (the manifest's ``update_step``).
    update_step: Optional[str] = None


def examine(runner: Any, event: Any, data_batch: Any,
            rng_state: Dict[str, Any],
            history_records: Sequence[Dict[str, Any]], options: Any,
            divergence: Optional[Any] = None,
            start_weight: Optional[float] = None, rewind: bool = False,
            replays: Callable[[], Any] = contextlib.nullcontext,
            start_attributes: Optional[Any] = None,
            drop_refused: Optional[str] = None,
            indices: Optional[Sequence[Optional[int]]] = None,
            train_step: Optional[Any] = None
            ) -> Tuple[Report, Material]:
    """Replay and diagnose a trigger (no bundle yet).

    Args:
        runner (Runner): The runner.
        event (NonFiniteEvent): The trigger, its failing micro-step found.
        data_batch: The raw batch of the failing iteration.
        rng_state (dict): RNG states before the failing iteration's forward.
        history_records (list[dict]): Recent per-iteration history.
        options (HookOptions): Whether to replay, with anomaly mode or not;
            ``rewind``'s LR factor and cooldown.
        divergence (Divergence, optional): Evidence of a divergence before
            the trigger (:func:`~mmnanhook.diagnosis.divergence_evidence`).
        start_weight (float, optional): The largest ``|weight|`` when
            training started: a weight grown far beyond it is evidence of a
            divergence too (:func:`weight_evidence`).
        rewind (bool): The policy goes back to a snapshot and lowers the LR
            (``options.rewind``): the steps after it test that fix.
        replays (callable): A context manager the replays run in: under
            DDP, :func:`~._local.local_replays` (on this rank alone); the
            report says what it made local.
        start_attributes (Attributes, optional): The data preprocessor's
            attributes before the failing forward: every replay starts from
            them.
        drop_refused (str, optional): Why ``policy='drop'`` only skips in
            this run (:func:`~mmnanhook.recovery.drop_unavailable`).
        indices (list, optional): The dataset index of each sample of the
            batch (the sampler's): what the report names (the file of its
            data info) and a drop quarantines.
        train_step (OwnTrainStep, optional): The model's own
            ``train_step``, replayed up to the update step that failed
            (:func:`~._own_step.own_train_step`).

    Returns:
        tuple: The :class:`~mmnanhook.records.Report` and the
        :class:`Material` of its bundle.
    """
    start = time.time()
    model = unwrap_model(runner.model)
    amp_dtype = _amp_dtype(runner.optim_wrapper)
    optim_state = runner.optim_wrapper.state_dict()
    infos = {}
    identities = _identities(runner, data_batch, indices)
    found = _annotations(runner, data_batch, infos, identities)
    # As a bundle gives them back: the fixes replay alike offline.
    infos = dict((i, json.loads(json.dumps(to_strict_json(info))))
                 for i, info in infos.items())
    scope = None
    if options.replay:
        try:
            with replays() as scope:
                report = diagnose(
                    model, data_batch,
                    restore_rng=functools.partial(restore_rng, rng_state),
                    start_attributes=start_attributes, amp_dtype=amp_dtype,
                    angle_range=angle_range_from_config(runner.cfg),
                    optimizer_state=optim_state,
                    anomaly=options.anomaly != 'never',
                    declared=declared_sizes(found),
                    pipeline=train_pipeline(runner.cfg),
                    sources=infos, retry=event.trigger != Trigger.SPIKE,
                    drop_refused=drop_refused,
                    composed=functools.partial(
                        trace_parts, dataset=runner.train_dataloader.dataset),
                    compiled=compile_options(runner),
                    identities=identities, train_step=train_step)
        except Exception as error:  # noqa: BLE001 - never mask the trigger
            log('mmnanhook: the replay diagnosis failed: {}: {}'.format(
                type(error).__name__, error), logging.ERROR)
            report = _unreplayed_report(
                'the replay diagnosis failed: {}: {}'.format(
                    type(error).__name__, error))
    else:
        report = _unreplayed_report('no replay (replay=False)')
    if compile_options(runner) is not None and \
            report.kind == 'not_reproduced':
        report.notes.append(COMPILED_NOTE)
    if divergence is None:
        divergence = weight_evidence(history_records, report.largest_param,
                                     start_weight, amp=amp_dtype is not None)
    # What the steps after a rewind test, as the manifest says it.
    lowered = dict(lr_factor=options.rewind.lr_factor,
                   cooldown=options.rewind.cooldown) if rewind else None
    if apply_divergence(report, divergence, lowered):
        finalize(report)
    local = scope.describe() if scope is not None else None
    if local:
        report.local_modules = list(scope.modules)
        report.notes.append(local)
    return report, Material(data_batch, rng_state, start_attributes,
                            optim_state, amp_dtype, infos, found, identities,
                            divergence, lowered, replays, start,
                            train_step.failing if train_step is not None
                            else None)


def conclude(runner: Any, event: Any, report: Report, material: Material,
             history_records: Sequence[Dict[str, Any]], options: Any,
             level: int = logging.ERROR,
             findings: Optional[Sequence[Any]] = None,
             config_findings: Sequence[Any] = (),
             states: Optional[Any] = None,
             diagnosers: Sequence[int] = ()) -> Tuple[Optional[str], list]:
    """Complete an examined trigger's report, log it, and write its bundle.

    Args:
        runner (Runner): The runner.
        event (NonFiniteEvent): The trigger, its failing micro-step found.
        report (Report): Its diagnosis (:func:`examine`).
        material (Material): What its bundle is written from.
        history_records (list[dict]): Recent per-iteration history.
        options (HookOptions): Where bundles go (``dump_dir``, by default
            :func:`default_dump_dir`), how many (``max_dumps``; 0 writes
            none), with the optimizer state or not.
        level (int): The log level of the diagnosis: a warning for a
            trigger the policy handles, an error for one that stops
            training.
        findings (tuple[RankFinding], optional): Under DDP, every rank's:
            the report then names the culprit rank and sample.
        config_findings (list[ConfigFinding]): What the config rules found
            at ``before_train``: in the report, a hint for each that
            explains this trigger.
        states (StateLedger, optional): Which bundles of the run hold a
            state; ``None``: this one does.
        diagnosers (list[int]): The ranks that diagnose this trigger (for
            ``states``).

    Returns:
        tuple: The bundle written (``None``: none) and the pictures.
    """
    model = unwrap_model(runner.model)
    if findings is not None:
        cross_rank(report, findings, event.rank)
    explain_by_config(report, config_findings)
    text = format_report(report)
    log(text, level)
    # The pictures run the data preprocessor in training mode: as a replay
    # (on this rank alone, from the failing iteration's RNG and attributes).
    with material.replays(), preserved_rng():
        restore_rng(material.rng_state)
        if material.start_attributes is not None:
            material.start_attributes.restore()
        pictures = _pictures(model, material.data_batch, report,
                             material.found)
    if not options.max_dumps:
        return None, pictures
    divergence = material.divergence
    manifest = render_manifest(
        event, runner.epoch, material.amp_dtype, material.found,
        divergence.to_dict() if divergence is not None else None)
    if manifest['iter'] is None:
        manifest['iter'] = runner.iter
    # Who each sample is (dataset index, file): an offline replay names
    # them as the run did.
    manifest['samples'] = None if material.identities is None else [
        [s.index, s.file] for s in material.identities]
    manifest['run'] = getattr(runner, 'timestamp', None)
    # An offline replay of a model with its own train_step stops at the
    # same optim wrapper's update step.
    manifest['update_step'] = material.update_step
    plan = StatePlan(True) if states is None else states.plan(
        event, manifest['iter'], report.ranks, report.kind, diagnosers)
    tensors = {DATA_BATCH: material.data_batch, RNG: material.rng_state}
    if plan.write:
        tensors[MODEL] = model.state_dict()
        if options.dump_optimizer:
            tensors[OPTIMIZER] = material.optim_state
    else:
        manifest[STATE_FROM] = plan.ref.to_dict()
    blobs, manifest['sources'] = _sample_files(report, material.infos)
    manifest['rewind'] = material.lowered
    blobs.update((p.name, p.png()) for p in pictures)
    path = write_bundle(
        options.dump_dir or default_dump_dir(runner),
        bundle_name(manifest['iter'], event.rank), manifest,
        tensors, {CONFIG_FILE: _config_text(runner.cfg),
                  REPORT_TEXT: text + '\n'},
        to_strict_json(report.to_dict()), history_records,
        max_dumps=options.max_dumps,
        blobs=blobs, keep=states.kept() if states is not None else (),
        render=functools.partial(_render_html, report, manifest, pictures))
    return path, pictures


def _pictures(model, data_batch, report, found):
    # A picture never costs the bundle or the diagnosis.
    try:
        return sample_pictures(model, data_batch, report.samples, found)
    except Exception as error:  # noqa: BLE001 - pictures are extras
        log('mmnanhook: no sample pictures: {}: {}'.format(
            type(error).__name__, error), logging.WARNING)
        return []


def _render_html(report, manifest, pictures, history_png, versions):
    page = render_html(report, dict(manifest, versions=versions), pictures,
                       history_png)
    return {REPORT_HTML: page.encode('utf-8')}


def _config_text(cfg):
    # pretty_text runs yapf, which rejects some valid configs: a plain
    # ``key = repr(value)`` listing still rebuilds the model.
    try:
        return cfg.pretty_text
    except Exception as error:  # noqa: BLE001 - never lose the bundle
        log('mmnanhook: config.py written unformatted ({}: {})'.format(
            type(error).__name__, error), logging.WARNING)
        return '\n'.join('{} = {!r}'.format(key, value)
                         for key, value in cfg.to_dict().items()) + '\n'


def default_dump_dir(runner: Any) -> str:
    """``{work_dir}/nan_dumps``."""
    return osp.join(runner.work_dir, 'nan_dumps')
