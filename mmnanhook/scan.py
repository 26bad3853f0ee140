"""Pre-flight scan: run a config's train dataset pipeline over the whole
dataset and list the samples whose ground truth would poison the loss."""
from .data_checks import angle_range_from_config, check_batch


def scan_config(config_path, progress=True):
    """Check every sample of a config's training dataset.

    Args:
        config_path (str): An mmengine config file (``custom_imports`` and
            ``_base_`` are honoured).
        progress (bool): Show a progress bar.

    Returns:
        tuple[int, list[dict]]: The number of samples scanned and
        ``{'index', 'img_path', 'problems'}`` for each bad sample.
    """
    from mmengine.config import Config
    from mmengine.registry import DATASETS, init_default_scope
    from mmengine.utils import track_iter_progress

    cfg = Config.fromfile(config_path)
    if cfg.get('default_scope') is not None:
        init_default_scope(cfg.default_scope)
    dataset = DATASETS.build(cfg.train_dataloader.dataset)
    angle_range = angle_range_from_config(cfg)
    indices = range(len(dataset))
    if progress:
        indices = track_iter_progress(list(indices))
    bad = []
    for index in indices:
        item = dataset[index]
        batch = {'inputs': [item['inputs']],
                 'data_samples': [item['data_samples']]}
        result = check_batch(batch, angle_range=angle_range)[0]
        if result['problems']:
            result['index'] = index
            bad.append(result)
    return len(dataset), bad
