"""``mmnan doctor CONFIG``: the config rules, the dataset pass and the fp16
headroom of one config, in one report; and the rules at a run's start."""
from __future__ import annotations

import logging
from typing import Any, List, Optional

from .._log import log
from ..diagnosis import filter_advice, train_pipeline
from ..records import ConfigFinding, ProblemCategory
from ._dataset import (WHERE_THE_DATA_IS, check_dataset, load_config,
                       opencv_threads_of, try_build_dataset)
from ._headroom import (FP16_MAX, confirm_overflow, cpu_fp16_autocast,
                        measure)
from ._rules import config_findings

# How many flagged modules the headroom lists (largest first).
SHOWN_MODULES = 10


class DoctorReport(object):
    """What ``mmnan doctor`` found in one config.

    Attributes:
        config (list[ConfigFinding]): The config rules' findings.
        scanned (int, optional): Samples the dataset pass checked (``None``:
            not run).
        samples (list[SampleFinding]): The samples with problems.
        ranges (list[ModuleRange]): Modules over or near fp16's range.
        loss_scale (float, optional): The config's static AMP loss scale
            (``None``: dynamic, or no AMP).
        backoff (tuple, optional): ``(module, halvings)``: the module whose
            gradient makes a dynamic GradScaler halve its initial scale most
            (each halving a skipped step), when any does.
        confirmed (tuple, optional): ``(module, overflowed)`` of the
            predicted overflow run under fp16 autocast on the CPU;
            ``overflowed`` is ``None`` where torch cannot.
        notes (list[str]): What was not checked, and why.
        unbuilt (str, optional): Why the train dataset could not be built
            here (``FileNotFoundError: ...``): neither the dataset nor the
            headroom was checked (the config rules were).
        data (bool): Whether the dataset pass was asked for.
        headroom (bool): Whether the headroom was asked for.
    """

    def __init__(self) -> None:
        self.config = []
        self.unbuilt = None
        self.data = self.headroom = True
        self.scanned = None
        self.samples = []
        self.ranges = []
        self.loss_scale = None
        self.backoff = None
        self.confirmed = None
        self.notes = []

    @property
    def dataset_unchecked(self) -> Optional[str]:
        """Why the dataset part was not checked, when it was asked for and
        its dataset cannot be built, else ``None``."""
        if not self.data or self.unbuilt is None:
            return None
        return 'not checked: the train dataset cannot be built here ({}); ' \
            '{}, or pass --no-data'.format(self.unbuilt, WHERE_THE_DATA_IS)

    @property
    def headroom_skipped(self) -> Optional[str]:
        """Why the headroom part was skipped, when it was asked for and its
        batches cannot be had, else ``None``."""
        if not self.headroom or self.unbuilt is None:
            return None
        # Its batches come from the same dataset.
        return 'skipped: no batch to train on, the train dataset cannot ' \
            'be built here ({})'.format(
                'as above' if self.data else self.unbuilt)

    @property
    def found(self) -> bool:
        """Whether anything was found (``mmnan doctor`` exits 1)."""
        return bool(self.config or self.samples or self.ranges)


def unfiltered_boxes(cfg: Any, samples: List[Any]) -> List[ConfigFinding]:
    """A finding when degenerate GT boxes reach the loss and the train
    pipeline has no ``FilterAnnotations`` (the data's and the config's
    fault together); the fix is the step the diagnosis's fixes replay,
    named for the config's scope, at the place they put it.

    Args:
        cfg (mmengine.Config): The config.
        samples (list[SampleFinding]): The dataset pass's flagged samples.

    Returns:
        list[ConfigFinding]: One finding, or none (also when the pipeline
        a sample goes through cannot be told).
    """
    degenerate = [s for s in samples
                  if ProblemCategory.DEGENERATE in s.categories]
    loader = cfg.get('train_dataloader') or {}
    pipeline = train_pipeline(cfg) if degenerate else None
    if pipeline is None or 'FilterAnnotations' in str(loader):
        return []
    return [ConfigFinding(
        'degenerate_boxes_unfiltered', 'train_dataloader.dataset.pipeline',
        '{} sample(s) with zero-size GT boxes reach the loss (first: {}) and '
        'the train pipeline has no FilterAnnotations'.format(
            len(degenerate), degenerate[0].img_path),
        'the mmdet FAQ "Loss goes Nan", mmrotate #759 (PR #760)',
        filter_advice(pipeline))]


def check_run_config(runner: Any,
                     mode: Optional[str]) -> List[ConfigFinding]:
    """The config rules on a run's config, at ``before_train``.

    Args:
        runner (Runner): The run (its config and world size).
        mode (str, optional): ``'warn'``: a warning line per finding;
            ``'raise'``: a ``RuntimeError`` when any is found; ``None``: the
            rules are not run.

    Returns:
        list[ConfigFinding]: The findings.
    """
    if mode is None:
        return []
    cfg = getattr(runner, 'cfg', None)
    try:
        findings = config_findings(cfg, world_size=runner.world_size)
    except Exception as error:  # noqa: BLE001 - advice never stops a run
        log('mmnanhook doctor: the config rules failed: {}: {}'.format(
            type(error).__name__, error), logging.WARNING)
        return []
    for finding in findings:
        log('mmnanhook doctor: ' + finding.line(), logging.WARNING)
    if findings and mode == 'raise':
        raise RuntimeError(
            "mmnanhook doctor found {} problem(s) in the config (doctor="
            "'raise'): {}".format(len(findings), '; '.join(
                f.line() for f in findings)))
    return findings


def _headroom(cfg, iters, report):
    """Train ``iters`` fp32 iterations of the config on the CPU and record
    every module's ranges into ``report``."""
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import MODELS, init_default_scope
    from mmengine.runner import Runner, set_random_seed
    if cfg.get('default_scope') is not None:
        init_default_scope(cfg.default_scope)
    # Its own dataset, as a run builds it: the pass's may hold what the
    # pipeline cached (a CachedMosaic's images).
    dataset, _, report.unbuilt = try_build_dataset(cfg)
    if dataset is None:
        return
    # The same figures every time: the model's initial weights are random.
    set_random_seed((cfg.get('randomness') or {}).get('seed') or 0)
    model = MODELS.build(cfg.model)
    loader_cfg = dict(cfg.train_dataloader, dataset=dataset, num_workers=0,
                      persistent_workers=False)
    loader = Runner.build_dataloader(loader_cfg, seed=0)
    wrapper_cfg = dict(cfg.optim_wrapper)
    scale = wrapper_cfg.get('loss_scale')
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        report.loss_scale = float(scale)
    # fp32: the point is what half precision would do to these values.
    if 'Amp' in str(wrapper_cfg.get('type', '')):
        wrapper_cfg['type'] = 'OptimWrapper'
        wrapper_cfg.pop('loss_scale', None)
        wrapper_cfg.pop('dtype', None)
    wrapper = build_optim_wrapper(model, wrapper_cfg)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == iters:
            break
    ranges = measure(model, batches, wrapper)
    report.ranges = [r for r in ranges
                     if r.verdict(report.loss_scale)][:SHOWN_MODULES]
    worst = max(ranges, key=lambda r: r.gradient, default=None)
    if report.loss_scale is None and worst is not None and worst.backoff():
        report.backoff = (worst.name, worst.backoff())
    # A forward value past the range is what one fp16 forward can show.
    over = [r for r in report.ranges if r.activation > FP16_MAX]
    if cpu_fp16_autocast() is None:
        report.notes.append(
            'fp16 headroom predicted from fp32 values only: this torch '
            'cannot run fp16 autocast on a CPU to confirm it')
    elif over:
        report.confirmed = (over[0].name, confirm_overflow(
            model, batches[0], over[0].name))


def run_doctor(config_path: str, world_size: Optional[int] = None,
               data: bool = True, headroom_iters: int = 2,
               workers: int = 1) -> DoctorReport:
    """Check one config: rules, dataset, fp16 headroom.

    The rules need the config only, and run first: a dataset that cannot be
    built here (the data on another machine, its codebase not installed)
    leaves the dataset and the headroom unchecked, said in the report
    (:attr:`DoctorReport.unbuilt`), not raised.

    Args:
        config_path (str): The config file.
        world_size (int, optional): GPUs the run will use (the LR rule);
            else the config's name says it (``8xb2``) or the rule is silent.
        data (bool): Run the dataset pass.
        headroom_iters (int): fp32 iterations for the headroom; 0: none.
        workers (int): Processes of the dataset pass.

    Returns:
        DoctorReport: What was found.

    Raises:
        DatasetError: The config cannot be loaded.
    """
    report = DoctorReport()
    report.data, report.headroom = data, bool(headroom_iters)
    cfg = load_config(config_path, 'load')
    report.config = config_findings(cfg, filename=config_path,
                                    world_size=world_size)
    if data:
        dataset, context, report.unbuilt = try_build_dataset(cfg)
        if dataset is None:
            return report
        report.scanned = len(dataset)
        for _, found in check_dataset(dataset, context, workers=workers,
                                      opencv_threads=opencv_threads_of(cfg)):
            report.samples.extend(finding for finding, _ in found)
        report.config.extend(unfiltered_boxes(cfg, report.samples))
    if headroom_iters:
        try:
            _headroom(cfg, headroom_iters, report)
        except Exception as error:  # noqa: BLE001 - said, not raised
            report.notes.append('fp16 headroom not measured: {}: {}'.format(
                type(error).__name__, error))
    return report
