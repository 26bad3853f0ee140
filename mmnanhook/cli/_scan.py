"""Pre-flight scan: run a config's train dataset pipeline over the whole
dataset and list the samples whose ground truth would poison the loss, and
the images whose annotation declares another size than the file has.

With a ``show`` directory, each flagged sample's pictures are written there
(the pipeline's output with its GT boxes, and the file with its annotation).
"""
import os
import os.path as osp

from .._format import one_line as _one_line
from ..diagnosis import (angle_range_from_config, annotation_of, check_batch,
                         declared_size)
from ..records import DataProblem, ProblemCategory, SampleFinding


class ScanError(Exception):
    """The config cannot be loaded or its train dataset cannot be built."""


def _build_dataset(config_path):
    """(dataset, angle range) of a config's train dataloader."""
    from mmengine.config import Config
    from mmengine.registry import DATASETS, init_default_scope
    try:
        cfg = Config.fromfile(config_path)
        if cfg.get('default_scope') is not None:
            init_default_scope(cfg.default_scope)
        dataset = DATASETS.build(cfg.train_dataloader.dataset)
    except Exception as error:  # noqa: BLE001 - any failure is bad input
        raise ScanError(_one_line(
            'cannot build the train dataset of {}: {}: {}'.format(
                config_path, type(error).__name__, error)))
    return dataset, angle_range_from_config(cfg)


def _data_info(dataset, index):
    # mmengine's BaseDataset knows a sample's image and declared size
    # without running the pipeline; a plain torch Dataset does not.
    get_info = getattr(dataset, 'get_data_info', None)
    info = get_info(index) if get_info is not None else None
    return info if isinstance(info, dict) else {}


def _check_sample(dataset, index, angle_range):
    """(:class:`SampleFinding`, pipeline output or ``None``) of one sample
    (``index`` in the dataset)."""
    info = _data_info(dataset, index)
    try:
        item = dataset[index]
    except Exception as error:  # noqa: BLE001 - it would stop training too
        return SampleFinding(index, info.get('img_path'), [DataProblem(
            ProblemCategory.PIPELINE, _one_line(
                'the pipeline failed: {}: {}'.format(
                    type(error).__name__, error)))]), None
    batch = {'inputs': [item['inputs']],
             'data_samples': [item['data_samples']]}
    result = check_batch(batch, angle_range=angle_range,
                         declared=[declared_size(dataset, info)])[0]
    result.index = index
    return result, item


def _show(directory, dataset, finding, item):
    """Write the pictures of one flagged sample; return their paths."""
    from ..report import finding_pictures, pipeline_image
    image = sample = None
    if item is not None and getattr(item.get('inputs'), 'dim',
                                    lambda: 0)() == 3:
        image, sample = pipeline_image(item['inputs']), item['data_samples']
    info = _data_info(dataset, finding.index)
    paths = []
    for picture in finding_pictures(finding, image, sample,
                                    annotation_of(dataset, info)):
        path = osp.join(directory, picture.name)
        with open(path, 'wb') as f:
            f.write(picture.png())
        paths.append(path)
    return paths


def scan_config(config_path, progress=True, show=None):
    """Check every sample of a config's training dataset.

    Args:
        config_path (str): An mmengine config file (``custom_imports`` and
            ``_base_`` are honoured).
        progress (bool): Show a progress bar.
        show (str, optional): A directory to write each bad sample's
            pictures into (``sample<index>_input.png``: the pipeline's output
            with its GT boxes, the offending ones in red;
            ``sample<index>_file.png``: the file with the annotation's boxes).

    Returns:
        tuple[int, list[SampleFinding], dict]: The number of samples
        scanned, a :class:`~mmnanhook.records.SampleFinding` for each bad
        sample (``index``: its dataset index; a sample whose pipeline raises,
        e.g. an unreadable image, is a bad sample) and the paths of the
        pictures written for each (dataset index -> list of paths).

    Raises:
        ScanError: The config cannot be loaded, its train dataset cannot be
            built or ``show`` cannot be written; the message is one line.
    """
    from mmengine.utils import track_iter_progress

    dataset, angle_range = _build_dataset(config_path)
    if show is not None:
        try:
            os.makedirs(show, exist_ok=True)
        except OSError as error:
            raise ScanError('cannot write pictures into {}: {}'.format(
                show, error.strerror or error))
    indices = range(len(dataset))
    if progress:
        indices = track_iter_progress(list(indices))
    bad, shown = [], {}
    for index in indices:
        result, item = _check_sample(dataset, index, angle_range)
        if result.problems:
            bad.append(result)
            if show is not None:
                shown[index] = _show(show, dataset, result, item)
    return len(dataset), bad, shown
