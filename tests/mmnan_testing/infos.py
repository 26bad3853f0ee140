"""Datasets of data infos only (no images): mmengine ``BaseDataset``\\ s as
large as a real one's annotation file, to measure and test what looks
samples up by file.

:class:`InfoDataset` holds ``len(paths)`` data infos shaped like mmdet's
(``img_path``, ``width``, ``height``, two instances), serialized as mmdet's
datasets keep them (``serialize_data=True``), and counts its
``get_data_info`` calls.
"""
from mmengine.dataset import BaseDataset


def objects365_path(index):
    """An Objects365-like image path (the dataset has 1.7 M images)."""
    return 'data/objects365/train/images/v1/patch%d/objects365_v1_%08d.jpg' % (
        index // 34000, index)


def info_of(index, path):
    """A data info like mmdet's ``CocoDataset`` gives."""
    return dict(img_path=path, img_id=index, width=640, height=480,
                instances=[dict(bbox=[1.0, 2.0, 30.0, 40.0], bbox_label=3,
                                ignore_flag=0),
                           dict(bbox=[5.0, 6.0, 70.0, 80.0], bbox_label=7,
                                ignore_flag=0)])


class InfoDataset(BaseDataset):
    """Data infos of ``paths``, in order (a path may repeat); no pipeline.

    Args:
        paths (list[str | None]): Each sample's ``img_path`` (``None``: a
            sample that names no file).
        **kwargs: ``BaseDataset``'s (``serialize_data`` defaults to True).

    Attributes:
        calls (int): ``get_data_info`` calls in this process.
    """

    def __init__(self, paths, **kwargs):
        self.paths = paths
        self.calls = 0
        super(InfoDataset, self).__init__(ann_file='', **kwargs)

    def load_data_list(self):
        infos = [info_of(i, p) for i, p in enumerate(self.paths)]
        # Kept serialized only, as mmdet's are: 1.7 M path strings would be
        # 150 MB more of the process measured.
        self.paths = None
        return infos

    def get_data_info(self, idx):
        self.calls += 1
        return super(InfoDataset, self).get_data_info(idx)
