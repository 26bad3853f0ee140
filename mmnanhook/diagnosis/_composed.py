"""A composed sample's non-finite input, traced to the image it came from.

A Mosaic or MixUp sample keeps its main image's ``img_path``; its parts are
in its metainfo (:data:`~mmnanhook.quarantine._composed.PARTS`). Each part's
image is loaded again as its dataset's pipeline loads it, before anything
composes, and checked: the finding then names the part whose pixels are not
finite, so the quarantine never names the innocent main image.
"""
from __future__ import annotations

import logging
from typing import Any, List

import numpy as np

from .._log import log
from ..quarantine import PARTS, mixers, part_image, sample_index
from ..records import DataProblem, ProblemCategory


def _nonfinite(image):
    if not isinstance(image, np.ndarray) or image.dtype.kind != 'f':
        return None
    nan, inf = int(np.isnan(image).sum()), int(np.isinf(image).sum())
    return (nan, inf) if nan or inf else None


def _index_of(sources, index, path):
    """The source dataset and index that load ``path`` (``index`` first)."""
    for source in sources:
        if index is not None and 0 <= index < len(source) and str(
                source.get_data_info(index).get('img_path')) == path:
            return source, index
    for source in sources:
        found, _ = sample_index(source).first(path)
        if found is not None:
            return source, found
    return None, None


def _check(sources, index, path):
    source, index = _index_of(sources, index, path)
    if source is None:
        return None, None
    return index, _nonfinite(part_image(source, index))


def trace_parts(findings: List[Any], data_batch: Any,
                dataset: Any) -> None:
    """Point each composed sample's non-finite input at the part it came
    from (failure path: loads the parts' images again).

    Args:
        findings (list[SampleFinding]): The batch's findings, changed in
            place: ``img_path`` becomes the part's file, and the problem
            says where the values came from.
        data_batch (dict): The batch.
        dataset: The train dataset (in this process).
    """
    samples = (data_batch or {}).get('data_samples')
    if not isinstance(samples, (list, tuple)):
        # mmyolo's yolov5_collate: one dict of the batch's boxes, no
        # sample's metainfo (its file is not known).
        samples = []
    sources = []
    for _, source, _ in mixers(dataset):
        if source is not None and all(source is not s for s in sources):
            sources.append(source)
    for finding in findings:
        meta = getattr(samples[finding.index], 'metainfo', {}) \
            if finding.index < len(samples) else {}
        if (not sources or ProblemCategory.NONFINITE_INPUT
                not in finding.categories):
            continue
        # The main image: its metainfo's, or its dataset index's data
        # info's (yolov5_collate keeps no metainfo, nor the parts).
        main = meta.get('img_path') or finding.img_path
        try:
            _trace(finding, str(main), meta.get(PARTS), sources,
                   finding.dataset_index)
        except Exception as error:  # noqa: BLE001 - the main image stays
            log('mmnanhook: the parts of composed sample %d are unknown '
                '(%s: %s)' % (finding.index, type(error).__name__, error),
                logging.WARNING)


def _unknown_part(finding, main):
    """A composed sample whose parts were not recorded (composed by a worker
    process that started before the guard) and whose main image is
    finite: a partner made it, which cannot be named. Its finding keeps no
    file, so that no innocent main image is quarantined."""
    finding.img_path = None
    finding.dataset_index = None
    finding.problems = [DataProblem(
        ProblemCategory.NONFINITE_INPUT,
        'input of this composed sample is not finite, but its main image {} '
        'loads finite: a Mosaic/MixUp partner made it, and the parts of this '
        'sample were not recorded (a worker process that started before '
        'the quarantine composed it)'.format(main))] + [
            p for p in finding.problems
            if p.category != ProblemCategory.NONFINITE_INPUT]


def _trace(finding, main, parts, sources, index=None):
    index, bad = _check(sources, index, main)
    if index is None or bad is not None:
        # The main image itself is not finite, or it is not one of the
        # composing datasets' (a sample nothing composed): it stays blamed.
        return
    if parts is None:
        _unknown_part(finding, main)
        return
    for index, path in parts:
        index, bad = _check(sources, index, str(path))
        if bad is None:
            continue
        finding.img_path = str(path)
        # The part's index is its source dataset's: the quarantine finds
        # the file's own indices in the train dataset.
        finding.dataset_index = None
        problems = [p for p in finding.problems
                    if p.category != ProblemCategory.NONFINITE_INPUT]
        finding.problems = [DataProblem(
            ProblemCategory.NONFINITE_INPUT,
            'input of this composed sample (main image {}) is not finite: '
            'it comes from its part {} (dataset index {}), whose image as '
            'loaded has {} NaN and {} Inf values'.format(
                main, path, index, bad[0], bad[1]))] + problems
        return
