"""Pre-flight scan: run a config's train dataset pipeline over the whole
dataset and list the samples whose ground truth would poison the loss, and
the images whose annotation declares another size than the file has."""
from .._format import one_line as _one_line
from ..diagnosis import angle_range_from_config, check_batch, declared_size
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
    """The :class:`SampleFinding` of one sample (``index`` in the dataset)."""
    info = _data_info(dataset, index)
    try:
        item = dataset[index]
    except Exception as error:  # noqa: BLE001 - it would stop training too
        return SampleFinding(index, info.get('img_path'), [DataProblem(
            ProblemCategory.PIPELINE, _one_line(
                'the pipeline failed: {}: {}'.format(
                    type(error).__name__, error)))])
    batch = {'inputs': [item['inputs']],
             'data_samples': [item['data_samples']]}
    result = check_batch(batch, angle_range=angle_range,
                         declared=[declared_size(dataset, info)])[0]
    result.index = index
    return result


def scan_config(config_path, progress=True):
    """Check every sample of a config's training dataset.

    Args:
        config_path (str): An mmengine config file (``custom_imports`` and
            ``_base_`` are honoured).
        progress (bool): Show a progress bar.

    Returns:
        tuple[int, list[dict]]: The number of samples scanned and
        a :class:`~mmnanhook.records.SampleFinding` for each bad sample
        (``index``: its dataset index); a sample whose pipeline raises (e.g.
        an unreadable image) is a bad sample.

    Raises:
        ScanError: The config cannot be loaded or its train dataset cannot
            be built; the message is one line.
    """
    from mmengine.utils import track_iter_progress

    dataset, angle_range = _build_dataset(config_path)
    indices = range(len(dataset))
    if progress:
        indices = track_iter_progress(list(indices))
    bad = []
    for index in indices:
        result = _check_sample(dataset, index, angle_range)
        if result.problems:
            bad.append(result)
    return len(dataset), bad
