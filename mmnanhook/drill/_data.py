"""The data a drill trains on: the config's own where it is here, else a
synthetic stand-in written as the config would read its own data, and why
a train dataset that builds is empty, in the config's terms.

The stand-in is made in what the config says of its data, wherever its
dataset (or a wrapper round it) says it:

* its classes: ``metainfo['classes']``, else the dataset class's own
  (``CocoDataset``'s 80), cut to the model's ``num_classes`` (the smallest
  of its heads but an RPN's) so that every label is one the model has;
  written in any other classes, the config's filters would leave the
  stand-in empty (``ValueError: need at least one array to concatenate``,
  issue 64);
* its annotation format: COCO (with masks where a pipeline loads them),
  VOC (the writer's subdirectories), DOTA;
* its image sizes: the size its dataset declares every image has (DOTA's
  ``img_shape``, scaled as the drill scales the pipelines), at least the
  ``min_size`` its ``filter_cfg`` keeps.

Under a launcher every rank trains one copy, as real ranks train one
dataset: rank 0 writes it, the others wait for it (a quarantine written by
one rank names a file every rank's dataset loads).
"""
from __future__ import annotations

import copy
import math
import os
import os.path as osp
import shutil
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..demo import synthetic
from ..doctor import config_dicts
from ..errors import DatasetError

# The synthetic VOC data is a VOC2007 directory.
VOC_YEAR = 'VOC2007'
# The stand-in's image side where its dataset says none.
SIDE = 320
# Classes shown in a line (the rest counted).
_SHOWN = 5
# How often a rank waiting for rank 0's stand-in looks (seconds).
_POLL = 0.2


def dataset_configs(dataset: Dict[str, Any]
                    ) -> Iterator[Dict[str, Any]]:
    """Every dataset config inside ``dataset`` (wrappers, Concat members),
    outermost first.

    Args:
        dataset (dict): The train loader's dataset config.
    """
    yield dataset
    if 'dataset' in dataset:  # RepeatDataset, MultiImageMixDataset ...
        for inner in dataset_configs(dataset['dataset']):
            yield inner
    for member in dataset.get('datasets') or []:
        for inner in dataset_configs(member):
            yield inner


def _chains(dataset, outer=()):
    """``(leaf, [its wrappers, innermost first])`` of every dataset config
    that reads files (no ``dataset``/``datasets``)."""
    inner = ([dataset['dataset']] if 'dataset' in dataset else []) + list(
        dataset.get('datasets') or [])
    if not inner:
        yield dataset, list(outer)
    for member in inner:
        for found in _chains(member, (dataset, ) + tuple(outer)):
            yield found


def leaves(cfg: Any) -> List[Dict[str, Any]]:
    """The dataset configs of the train loader that read files.

    Args:
        cfg (mmengine.Config): The loaded config.
    """
    return [leaf for leaf, _ in _chains(cfg.train_dataloader.dataset)]


def data_format(cfg: Any) -> Optional[str]:
    """The format a synthetic stand-in of the config's data is written in:
    ``'coco'``, ``'coco_masks'``, ``'voc'`` or ``'dota'``; ``None`` for
    another."""
    types = [str(d.get('type', '')).lower() for d in leaves(cfg)]
    if any('panoptic' in t for t in types):
        return None
    if types and all('dota' in t for t in types):
        return 'dota'
    if types and all('voc' in t or 'xml' in t for t in types):
        return 'voc'
    if types and all('coco' in t for t in types):
        return 'coco_masks' if _with_mask(cfg.train_dataloader.dataset) \
            else 'coco'
    return None


def _with_mask(node):
    """Whether a step of the pipelines loads masks."""
    return any(d.get('with_mask') is True for _, d in config_dicts(node))


def num_classes(model: Dict[str, Any]) -> Optional[int]:
    """The fewest classes a head of ``model`` has (an RPN's one class, which
    takes every label as foreground, left out); ``None`` where none says.

    Args:
        model (dict): The config's ``model``.
    """
    counts = [d['num_classes'] for path, d in config_dicts(model)
              if isinstance(d.get('num_classes'), int)
              and not isinstance(d.get('num_classes'), bool)
              and d['num_classes'] > 0 and 'rpn' not in path.lower()]
    return min(counts) if counts else None


def _class_default(type_name):
    """The classes of a registered dataset class's ``METAINFO``, or
    ``None``."""
    from mmengine.registry import DATASETS, DefaultScope
    current = DefaultScope.get_current_instance()
    try:
        if not isinstance(type_name, str):
            cls = type_name
        else:
            # As DATASETS.build looks it up: in the scope's registry (the
            # root one does not look into its children).
            with DATASETS.switch_scope_and_registry(
                    current.scope_name if current else None) as registry:
                cls = registry.get(type_name)
    except Exception:  # noqa: BLE001 - a class we cannot import: unknown
        return None
    metainfo = getattr(cls, 'METAINFO', None) or {}
    return metainfo.get('classes')


def said_classes(leaf: Dict[str, Any],
                 wrappers: Sequence[Dict[str, Any]] = ()) -> Any:
    """The classes a dataset config reads: its ``metainfo``'s, else the
    nearest wrapper's, else its class's own; ``None`` where none says.

    Args:
        leaf (dict): A dataset config that reads files.
        wrappers (sequence[dict]): The wrappers round it, innermost first.
    """
    for node in [leaf] + list(wrappers):
        metainfo = node.get('metainfo') or {}
        if metainfo.get('classes') is not None:
            return metainfo['classes']
    return _class_default(leaf.get('type'))


def _as_names(classes):
    # A string is one class name (``classes=('balloon')`` lost its comma).
    return (classes, ) if isinstance(classes, str) else tuple(classes)


def show_classes(classes: Any) -> str:
    """Classes as a line says them: the first few, the rest counted.

    Args:
        classes (tuple[str] | str): A ``metainfo``'s classes.
    """
    if isinstance(classes, str):
        return repr(classes)
    names = [str(c) for c in classes]
    if len(names) <= _SHOWN:
        return ', '.join(names)
    return '{}, ... ({} in all)'.format(', '.join(names[:_SHOWN]),
                                        len(names))


class StandIn(object):
    """How the synthetic stand-in of a config's data is written.

    Args:
        kind (str): ``'coco'``, ``'coco_masks'``, ``'voc'`` or ``'dota'``.
        classes (tuple[str], optional): The category names it is written
            in (``None``: the writer's own).
        side (int): The side of its square images, in pixels.
        of (int, optional): How many classes the config has, where the
            model has fewer (``classes`` are its first ones).
        declared (bool): Whether the dataset declares its images' shape
            (DOTA's ``img_shape``): set to the stand-in's.
    """

    def __init__(self, kind: str, classes: Optional[Tuple[str, ...]],
                 side: int, of: Optional[int] = None,
                 declared: bool = False) -> None:
        self.kind = kind
        self.classes = classes
        self.side = side
        self.of = of
        self.declared = declared

    def says(self, images: int) -> str:
        """What the drill changed of the config's data, for the user.

        Args:
            images (int): How many images it has.
        """
        line = 'a synthetic {} dataset of {} images of {} px'.format(
            self.kind, images, self.side)
        if self.classes is None:
            return line
        if self.of is not None:
            return '{} in the first {} of its {} classes (the model has ' \
                'num_classes={}): {}'.format(line, len(self.classes),
                                             self.of, len(self.classes),
                                             show_classes(self.classes))
        return '{} in its {} class{} ({})'.format(
            line, len(self.classes), '' if len(self.classes) == 1 else 'es',
            show_classes(self.classes))

    def write(self, root: str, num_images: int, seed: int = 0) -> None:
        """Write the stand-in.

        Args:
            root (str): The directory (created if missing).
            num_images (int): How many images.
            seed (int): The writer's seed.
        """
        extra = {} if self.classes is None else dict(classes=self.classes)
        if self.kind in ('coco', 'coco_masks'):
            synthetic.make_coco_dataset(root, num_images=num_images,
                                        image_size=self.side, seed=seed,
                                        masks=self.kind == 'coco_masks',
                                        **extra)
        elif self.kind == 'voc':
            synthetic.make_voc_dataset(osp.join(root, VOC_YEAR),
                                       num_images=num_images,
                                       image_size=self.side, seed=seed,
                                       **extra)
        else:
            synthetic.make_dota_dataset(root, num_images=num_images,
                                        image_size=self.side, seed=seed,
                                        **extra)


def stand_in(cfg: Any, kind: str, factor: Optional[float] = None
             ) -> StandIn:
    """The stand-in of ``cfg``'s data in format ``kind``, in the config's
    classes and image sizes (see the module docstring).

    Args:
        cfg (mmengine.Config): The loaded config.
        kind (str): Of :func:`data_format`.
        factor (float, optional): How the drill scales the pipelines' image
            sizes (a declared image shape is scaled alike).
    """
    names: List[str] = []
    sides, declared = [], False
    for leaf, wrappers in _chains(cfg.train_dataloader.dataset):
        classes = said_classes(leaf, wrappers)
        for name in _as_names(classes) if classes is not None else ():
            if name not in names:
                names.append(name)
        shape = leaf.get('img_shape')
        if isinstance(shape, (list, tuple)) and shape:
            declared = True
            sides.append(int(round(max(shape) * (factor or 1.0))))
        min_size = (leaf.get('filter_cfg') or {}).get('min_size')
        if isinstance(min_size, (int, float)) and min_size > 0:
            sides.append(int(math.ceil(min_size)))
    side = max(sides) if declared else max([SIDE] + sides)
    if not names:
        return StandIn(kind, None, side, declared=declared)
    count, of = num_classes(cfg.model), None
    if count is not None and count < len(names):
        names, of = names[:count], len(names)
    return StandIn(kind, tuple(names), side, of, declared)


def write_stand_in(stand: StandIn, root: str, num_images: int,
                   writes: bool = True, timeout: float = 900.0) -> str:
    """The stand-in under ``root``, written once for every rank: by this
    process (``writes``), else by rank 0, waited for.

    Written beside ``root`` and renamed into place, so that a rank that
    sees ``root`` sees it whole; a ``root`` already there is an earlier
    process's of the same drill (the same bytes).

    Args:
        stand (StandIn): What to write.
        root (str): Where.
        num_images (int): How many images.
        writes (bool): This process writes it; else it waits for it.
        timeout (float): Seconds a rank waits for it.

    Returns:
        str: Its ``data_root``.

    Raises:
        DatasetError: Rank 0 could not write it, or did not within
            ``timeout`` seconds.
    """
    root = osp.abspath(root)
    failed = root + '.failed'
    if writes:
        if not osp.isdir(root):
            partial = root + '.partial'
            shutil.rmtree(partial, ignore_errors=True)
            try:
                stand.write(partial, num_images)
                os.rename(partial, root)
            except Exception as error:  # noqa: BLE001 - said, in one line
                said = 'cannot write the synthetic dataset in {}: {}: {}' \
                    .format(root, type(error).__name__, error)
                # The other ranks wait for it: they learn why it is not.
                with open(failed, 'w') as f:
                    f.write(said)
                raise DatasetError(said)
        return root
    deadline = time.monotonic() + timeout
    while not osp.isdir(root):
        if osp.isfile(failed):
            with open(failed) as f:
                raise DatasetError('rank 0 ' + f.read())
        if time.monotonic() > deadline:
            raise DatasetError('rank 0 did not write the synthetic dataset '
                               'in {} within {:g} s'.format(root, timeout))
        time.sleep(_POLL)
    return root


def point_at(cfg: Any, stand: StandIn, root: str) -> None:
    """Every dataset of the config that reads files reads the stand-in at
    ``root`` (its pipeline, classes and filters as they are); in place.

    Args:
        cfg (mmengine.Config): The loaded config.
        stand (StandIn): The stand-in.
        root (str): Its ``data_root``.
    """
    for leaf in leaves(cfg):
        if stand.kind in ('coco', 'coco_masks'):
            leaf.update(data_root=root, ann_file=synthetic.COCO_ANN_FILE,
                        data_prefix=dict(img=synthetic.COCO_IMG_DIR + '/'))
        elif stand.kind == 'voc':
            leaf.update(data_root=root,
                        ann_file=osp.join(VOC_YEAR, synthetic.VOC_SPLIT_FILE),
                        data_prefix=dict(sub_data_root=VOC_YEAR + '/'))
            # XMLDataset's subdirectories, where the config names its own.
            for key, sub in (('img_subdir', synthetic.VOC_IMG_DIR),
                             ('ann_subdir', synthetic.VOC_ANN_DIR)):
                if key in leaf:
                    leaf[key] = sub
        else:
            leaf.update(data_root=root, ann_file=synthetic.DOTA_ANN_DIR + '/',
                        data_prefix=dict(
                            img_path=synthetic.DOTA_IMG_DIR + '/'))
        if stand.declared and 'img_shape' in leaf:
            leaf['img_shape'] = (stand.side, stand.side)
    for wrapper in dataset_configs(cfg.train_dataloader.dataset):
        if str(wrapper.get('type', '')).endswith('RepeatDataset'):
            wrapper['times'] = 1


def _has_instances(info):
    return bool(info.get('instances'))


def _leaf_empty(leaf, wrappers):
    """Why the dataset of ``leaf`` holds no sample, or ``None`` (it holds
    some, or its files cannot be read here)."""
    from mmengine.registry import DATASETS
    try:
        dataset = DATASETS.build(dict(copy.deepcopy(leaf), lazy_init=True))
        infos = dataset.load_data_list()
    except Exception:  # noqa: BLE001 - not here, or not ours to explain
        return None
    dataset.data_list = infos
    try:
        kept = dataset.filter_data()
    except Exception:  # noqa: BLE001 - as above
        return None
    if kept:
        return None
    what = '{} of {}'.format(leaf.get('type'),
                             getattr(dataset, 'ann_file', None) or
                             leaf.get('ann_file'))
    if not infos:
        return '{}: its annotations list no image'.format(what)
    classes = (getattr(dataset, 'metainfo', None) or {}).get('classes')
    if classes is None:
        classes = said_classes(leaf, wrappers)
    why = []
    if getattr(dataset, 'cat_ids', None) == []:
        # CocoDataset matched its classes to the file's categories by name.
        why.append('none of its classes ({}) is a category of its '
                   'annotation file'.format(show_classes(classes)))
    elif not any(_has_instances(info) for info in infos):
        why.append('none of its {} images has an instance of its classes '
                   '({})'.format(len(infos), show_classes(classes)))
    filters = leaf.get('filter_cfg')
    why.append('{} left none of its {} images'.format(
        'filter_cfg={}'.format(_show_dict(filters)) if filters else
        'its filter', len(infos)))
    return '{}: {}'.format(what, ', and '.join(why))


def _show_dict(value):
    """A config dict as the user wrote it: ``dict(a=1, b=True)``."""
    if not isinstance(value, dict):
        return repr(value)
    return 'dict({})'.format(', '.join('{}={!r}'.format(k, v)
                                       for k, v in value.items()))


def empty_reason(cfg: Any) -> Optional[str]:
    """Why the train dataset of ``cfg`` is empty, in the config's terms
    (which dataset, what its annotations hold, which filter left none), or
    ``None``: none of its datasets is empty, or their files cannot be read
    here.

    Args:
        cfg (mmengine.Config): The config, its default scope current.
    """
    for leaf, wrappers in _chains(cfg.train_dataloader.dataset):
        why = _leaf_empty(leaf, wrappers)
        if why is not None:
            return 'the train dataset is empty: ' + why
    return None
