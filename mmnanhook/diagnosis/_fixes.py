"""Proven advice: the failing iteration replayed with each fix the findings
suggest, from the same weights, batch and RNG state.

Each fix is one plain forward and backward (no instrumentation, no anomaly
mode): finite with it, the fix is *verified*; still non-finite, *refuted*
(never shown as advice). A fix that needs the train pipeline (a filter, the
annotation's real image size) first runs the implicated sample through it
without the fix: when that control does not make the bad box again, nothing
can be concluded and the fix stays untested, saying why.
"""
from __future__ import annotations

import os.path as osp
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from .._batch import (UnknownBatchError, batch_size, leave_out_refused,
                      replace_samples, split_batch)
from .._format import format_value
from ..records import Fix, FixKind, ProblemCategory
from ..recovery import samples_to_drop
from ._data import check_batch
from ._pipeline import filter_advice, image_too_large, with_declared_size

_BOX_FIXED = (ProblemCategory.DEGENERATE, )


def _outcome(replay):
    """``(finite, loss, detail)`` of a replay with a fix."""
    loss = replay.losses.get('loss')
    if replay.error is not None:
        return False, None, 'the replay with it raises {}: {}'.format(
            replay.error['type'], replay.error['message'].split('\n')[0])
    if replay.nonfinite:
        bad = ', '.join('{}={}'.format(k, format_value(replay.losses.get(k)))
                        for k in replay.nonfinite_losses)
        return False, loss, 'still non-finite with it ({})'.format(
            bad or 'gradients')
    return True, loss, None


def _replayed(kind, text, session, batch, samples, how):
    finite, loss, detail = _outcome(session.run(batch))
    return Fix(kind, text, finite, loss, detail or how, samples)


def _names(findings):
    return ', '.join('{} ({})'.format(
        s.index, osp.basename(s.img_path) if s.img_path else s.name)
        for s in findings)


class _Resampler(object):
    """Implicated samples through the train pipeline again (once each)."""

    def __init__(self, pipeline: Optional[Any],
                 sources: Optional[Dict[int, Any]],
                 angle_range: Optional[Tuple[float, float]]) -> None:
        self.pipeline = pipeline
        self.sources = sources or {}
        self.angle_range = angle_range
        self._control = {}
        self._replays = []

    def why_not(self, index: int) -> Optional[str]:
        """Why sample ``index`` cannot go through the pipeline, or None."""
        if self.pipeline is None:
            return 'the train pipeline is unknown'
        info = self.sources.get(index)
        if info is None:
            return 'the annotation of sample {} is unknown'.format(index)
        return image_too_large(info.get('img_path'))

    def problems(self, packed: Optional[Dict[str, Any]]
                 ) -> Set[Optional[ProblemCategory]]:
        """The box problem categories of one packed sample."""
        if packed is None:
            return set()
        (found, ) = check_batch(
            {'inputs': [packed['inputs']],
             'data_samples': [packed['data_samples']]}, self.angle_range)
        return found.categories

    def control(self, index: int) -> bool:
        """The sample through the unchanged pipeline, and whether it makes
        a bad box again."""
        if index not in self._control:
            packed = self.pipeline.run(self.sources[index])
            self._control[index] = bool(
                self.problems(packed) & set(_BOX_FIXED))
        return self._control[index]

    def run(self, index: int, info: Optional[Dict[str, Any]] = None,
            with_filter: bool = False) -> Optional[Dict[str, Any]]:
        return self.pipeline.run(info or self.sources[index], with_filter)

    def replay(self, kind: Union[FixKind, str], text: str, session: Any,
               packed: Dict[int, Any], samples: List[int], how: str) -> Fix:
        """Replay the batch with ``packed`` in place of its samples; a
        batch an earlier fix already made is not replayed again (the same
        batch from the same state gives the same result)."""
        for earlier, fix in self._replays:
            if _same_packed(earlier, packed):
                return Fix(kind, text, fix.finite, fix.loss,
                           '{}; with it the pipeline makes the very batch '
                           'of the fix "{}": the same replay'.format(
                               how, fix.fix), samples)
        try:
            batch = replace_samples(session.data_batch, packed)
        except UnknownBatchError as error:
            return Fix(kind, text, None, None, 'not replayed: {}'.format(
                error), samples)
        fix = _replayed(kind, text, session, batch, samples, how)
        self._replays.append((packed, fix))
        return fix


def _same_packed(a, b):
    """Whether two ``{position: packed sample | None}`` are the same."""
    if sorted(a) != sorted(b):
        return False
    return all(_sample_key(a[i]) == _sample_key(b[i]) for i in a)


def _sample_key(packed):
    # What a replay reads of a packed sample, as comparable plain values.
    if packed is None:
        return None
    sample = packed['data_samples']
    gt = getattr(sample, 'gt_instances', None)
    boxes = getattr(gt, 'bboxes', None)
    boxes = getattr(boxes, 'tensor', boxes)
    labels = getattr(gt, 'labels', None)
    return (_values(packed['inputs']), _values(boxes), _values(labels),
            repr(sorted((k, repr(v)) for k, v in sample.metainfo.items())))


def _values(tensor):
    if not isinstance(tensor, torch.Tensor):
        return repr(tensor)
    return (tuple(tensor.shape), str(tensor.dtype),
            tensor.detach().cpu().contiguous().numpy().tobytes())


def _resample(finding, resampler, make, packed):
    """Put the fixed sample into ``packed``; why it cannot be, or None."""
    why = resampler.why_not(finding.index)
    if why is None and not resampler.control(finding.index):
        why = ('the train pipeline run again (its random transforms drawn '
               'anew) does not make the bad box of sample {}: nothing to '
               'compare with'.format(finding.index))
    if why is None:
        packed[finding.index], why = make(finding)
    return why


def _pipeline_fix(kind, text, findings, session, resampler, make):
    """A fix applied by the pipeline to each of ``findings``' samples, then
    the batch replayed. ``make(finding) -> (packed | None, why_not)``."""
    samples = [s.index for s in findings]
    packed = {}
    for finding in findings:
        try:
            why = _resample(finding, resampler, make, packed)
        except Exception as error:  # noqa: BLE001 - the fix untested only
            why = 'the train pipeline raised {}: {}'.format(
                type(error).__name__, str(error).split('\n')[0])
        if why is not None:
            return Fix(kind, text, None, None, 'not replayed: ' + why,
                       samples)
    if len(packed) == batch_size(session.data_batch) and not any(
            packed.values()):
        return Fix(kind, text, None, None, 'not replayed: with it the '
                   'pipeline drops every sample of the batch', samples)
    dropped = [i for i, p in sorted(packed.items()) if p is None]
    how = 'replayed with sample(s) {} through the train pipeline with the ' \
        'fix'.format(', '.join(str(s) for s in samples))
    if dropped:
        how += ('; it leaves no box in sample(s) {}, which the pipeline then '
                'drops (the dataset draws another)'.format(
                    ', '.join(str(i) for i in dropped)))
    return resampler.replay(kind, text, session, packed, samples, how)


def _filter_fix(findings, session, resampler):
    text = filter_advice(resampler.pipeline)

    def make(finding):
        packed = resampler.run(finding.index, with_filter=True)
        if resampler.problems(packed) & set(_BOX_FIXED):
            return None, 'the filter leaves the bad box of sample {}'.format(
                finding.index)
        return packed, None

    return _pipeline_fix(FixKind.FILTER, text, findings, session, resampler,
                         make)


def _real_size(data_batch, index, declared):
    """``((width, height) as loaded, (width, height) declared)``."""
    samples = data_batch.get('data_samples') or []
    said = declared[index] if index < len(declared) else None
    shape = (getattr(samples[index], 'metainfo', None) or {}).get(
        'ori_shape') if index < len(samples) else None
    if shape is None or said is None:
        return None, said
    return (int(shape[1]), int(shape[0])), said


def _declared_size_fixes(findings, session, resampler, declared):
    fixes = []
    for finding in findings:
        real, said = _real_size(session.data_batch, finding.index, declared)
        if real is None:
            continue
        name = osp.basename(finding.img_path or '') or 'the image'
        text = ('in the annotation of {} declare the file\'s real size, '
                'width {} and height {} (it declares {}x{})'.format(
                    name, real[0], real[1], said[0], said[1]))

        def make(finding, real=real):
            info = with_declared_size(
                resampler.sources[finding.index], real[0], real[1],
                resampler.pipeline.drops_outside_declared())
            return resampler.run(finding.index, info), None

        fixes.append(_pipeline_fix(FixKind.DECLARED_SIZE, text, [finding],
                                   session, resampler, make))
    return fixes


def _drop_fix(report, session, refused):
    """The batch without the implicated samples (those with data problems
    when nothing was replayed one by one, e.g. beside non-finite weights);
    ``refused``: why ``policy='drop'`` would only skip in this run."""
    indices = sorted(set(s.index for s in report.samples))
    if not indices:
        return None
    n = batch_size(session.data_batch)
    text = 'leave out sample(s) {}'.format(_names(report.samples))
    layout = leave_out_refused(session.data_batch)
    dropped, _ = samples_to_drop(report, n, refused=layout)
    if dropped == indices and refused:
        text += ": `NanDetectHook(policy='drop')` would only skip the step " \
            'here ({})'.format(refused)
    elif dropped == indices:
        text += ": `NanDetectHook(policy='drop')` does it and quarantines them"
    if not n or len(indices) >= n:
        return Fix(FixKind.DROP_SAMPLES, text, None, None,
                   'not replayed: no other sample is left in the batch',
                   indices)
    if layout is not None:
        return Fix(FixKind.DROP_SAMPLES, text, None, None,
                   'not replayed: the batch\'s layout is not one mmnanhook '
                   'knows how to leave a sample out of ({})'.format(layout),
                   indices)
    keep = [i for i in range(n) if i not in indices]
    return _replayed(FixKind.DROP_SAMPLES, text, session,
                     split_batch(session.data_batch, keep), indices,
                     'replayed without sample(s) {}'.format(
                         ', '.join(str(i) for i in indices)))


def _data_fixes(report, session, resampler, declared):
    fixes = []
    implicated = [s for s in report.samples if s.problems]
    degenerate = [s for s in implicated
                  if ProblemCategory.DEGENERATE in s.categories]
    if degenerate:
        fixes.append(_filter_fix(degenerate, session, resampler))
    mismatched = [s for s in implicated
                  if ProblemCategory.SIZE_MISMATCH in s.categories]
    fixes.extend(_declared_size_fixes(mismatched, session, resampler,
                                      declared))
    return fixes


def fp32_fix(report: Any, replay: Any) -> Fix:
    """The float32 replay of an AMP run, as a fix."""
    finite, loss, detail = _outcome(replay)
    where = "'{}'".format(report.module) if report.module else 'the model'
    return Fix(FixKind.FP32,
               "run {} in float32 (`optim_wrapper.type='OptimWrapper'`, or "
               '`torch.autocast(device_type, enabled=False)` around '
               'it)'.format(where), finite, loss,
               detail or 'replayed in float32')


def lower_lr_fix(divergence: Any,
                 rewind: Optional[Dict[str, Any]] = None) -> Fix:
    """The lower learning rate a divergence calls for, as a fix.

    No replay of one iteration can verify it: it takes the weights from
    before the divergence began and the steps since. Under
    ``policy='rewind'`` training itself does, from a snapshot (the log says
    whether the lowered LR held); otherwise the record says what keeps one.

    Args:
        divergence (Divergence): The report's divergence.
        rewind (dict, optional): ``lr_factor`` and ``cooldown`` of the rewind
            about to be done.
    """
    lr = divergence.lr
    began = divergence.began_at
    if rewind is not None:
        return Fix(FixKind.LOWER_LR,
                   "lower the LR x{:g} for {} update steps from the last good "
                   "snapshot before iter {} (policy='rewind')".format(
                       rewind['lr_factor'], rewind['cooldown'], began),
                   None, None, 'verified by training on: the steps after the '
                   'rewind run at the lowered LR, and the log says whether '
                   "they stayed finite ('verified: the LR ... held') or not "
                   "('refuted: ...')")
    text = ('optim_wrapper.optimizer.lr={}'.format(format_value(lr / 10.0))
            if lr else 'a lower learning rate')
    return Fix(FixKind.LOWER_LR, text, None, None,
               'not replayed: a lower LR must be tried from the weights from '
               'before iter {}, and no snapshot of them is kept; '
               "`NanDetectHook(policy='rewind')` keeps one every "
               '`snapshot_interval` iterations and tries it by training '
               'on'.format(began))


# Why nothing can be replayed, by kind.
_NONE_WHY = {
    'params': 'the weights were non-finite before the step: only weights '
              'from a good checkpoint can be tried, and the bundle holds none',
    'optimizer_state': 'the optimizer state was non-finite before the step: '
                       'only a good checkpoint can be tried',
    'exception': 'the replay raises: a fix of the code raising is needed',
    'not_reproduced': 'the replay is finite: there is no failure to replay a '
                      'fix against',
}


def no_fix(report: Any, tried: bool = False) -> Fix:
    """The record saying that no fix can be applied mechanically, and why.

    Args:
        report (Report): The classified report.
        tried (bool): Fixes were replayed, none of them finite.
    """
    why = _NONE_WHY.get(report.kind)
    if why is None and tried:
        why = 'none of the fixes above makes the failing iteration finite'
    if why is None:
        where = report.location or 'the reported op'
        why = ('the first non-finite value is made by code at {}: a change '
               'there (see the hints) is checked by `mmnan replay` on this '
               'bundle, not by mmnanhook'.format(where))
    return Fix(FixKind.NONE, None, None, None, why)


def verify_fixes(report: Any, session: Any, pipeline: Optional[Any] = None,
                 sources: Optional[Dict[int, Any]] = None,
                 declared: Optional[Sequence[Any]] = None,
                 angle_range: Optional[Tuple[float, float]] = None,
                 fp32: Optional[Any] = None,
                 drop_refused: Optional[str] = None) -> List[Fix]:
    """Replay the failing iteration with each fix the findings suggest.

    Args:
        report (Report): The classified report (kind, samples).
        session (ReplaySession): The replays' session.
        pipeline (TrainPipeline, optional): The run's train pipeline.
        sources (dict, optional): Batch position -> the sample's data info
            (its ``img_path`` readable here).
        declared (list, optional): Per batch position, the ``(width,
            height)`` its annotation declares, or ``None``.
        angle_range (tuple, optional): Allowed rotated-box angles.
        fp32 (ReplayResult, optional): The float32 replay of an AMP run.
        drop_refused (str, optional): Why ``policy='drop'`` only skips in
            the run: the fix leaving samples out then does not advise it.

    Returns:
        list[Fix]: One per fix; when none is verified, last, a
        ``FixKind.NONE`` record saying why none can be applied mechanically.
    """
    fixes = []
    if fp32 is not None:
        fixes.append(fp32_fix(report, fp32))
    # Not for an AMP overflow: the samples only exceed the dtype's range.
    drop = _drop_fix(report, session, drop_refused) if report.kind not in (
        'not_reproduced', 'exception', 'overflow') else None
    if drop is not None:
        fixes.append(drop)
    if report.kind == 'data':
        fixes.extend(_data_fixes(
            report, session, _Resampler(pipeline, sources, angle_range),
            list(declared or [])))
    if not any(f.status == 'verified' for f in fixes):
        fixes.append(no_fix(report, tried=any(
            f.status == 'refuted' for f in fixes)))
    return fixes
