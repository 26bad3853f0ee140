"""The demo's tiny detectors (:mod:`mmnanhook.demo`) as the tests use them,
plus a wider variant for benchmarks."""
from mmnanhook.demo import (TINY_CONFIGS, config_dir, dataset_kind,
                            make_dataset, tiny_config)

__all__ = [
    'R18_WIDTHS', 'TINY_CONFIGS', 'config_dir', 'dataset_kind', 'make_dataset',
    'tiny_config'
]

# ``tiny_config`` overrides that widen the tiny RetinaNet to ResNet-18 widths
# (11 M parameters) on 256 px inputs: a model whose iteration is dominated by
# compute, as real ones are, for benchmarks.
R18_WIDTHS = {
    'model.backbone.base_channels': 64,
    'model.neck.in_channels': [128, 256, 512],
    'model.neck.out_channels': 64,
    'model.bbox_head.in_channels': 64,
    'model.bbox_head.feat_channels': 64,
    'model.bbox_head.stacked_convs': 2,
    'train_dataloader.dataset.pipeline.2.scale': (256, 256),
}
