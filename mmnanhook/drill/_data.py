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
  VOC (the writer's subdirectories), DOTA; of the other codebases, by the
  dataset's class: mmseg's ADE20K (label maps, ``reduce_zero_label`` as the
  dataset reads them), mmpretrain's ImageNet / ``CustomDataset`` (class
  folders and an annotation list), mmpose's COCO keypoints (a person an
  image), mmagic's LQ/GT pairs (the LQ images ``scale`` times smaller);
* its image sizes: the size its dataset declares every image has (DOTA's
  ``img_shape``, scaled as the drill scales the pipelines), at least the
  ``min_size`` its ``filter_cfg`` keeps.

Under a launcher every rank trains one copy, as real ranks train one
dataset: rank 0 writes it, the others wait for it (a quarantine written by
one rank names a file every rank's dataset loads).

Over 500 lines because it is one concern: what the stand-in is (format,
classes, sizes) is read from the same dataset configs it is then written
for and pointed at; each format is a few lines in each of those steps,
and split by format the steps would be repeated per file.
"""
from __future__ import annotations

import copy
import inspect
import math
import os
import os.path as osp
import shutil
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .. import demo
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
# The formats of the other codebases, by the dataset's class: its package
# and a class of its MRO (the codebase's own, not mmdet's namesake).
_CODEBASE_FORMATS = (('mmseg', 'ADE20KDataset', 'ade20k'),
                     ('mmpretrain', 'CustomDataset', 'imagenet'),
                     ('mmpose', 'CocoDataset', 'coco_keypoints'),
                     ('mmagic', 'BasicImageDataset', 'pairs'))
# Packages whose datasets are not detection's: a class of theirs without a
# format above has none (mmpose's ``CocoDataset`` is no mmdet COCO).
_CODEBASES = ('mmseg', 'mmpretrain', 'mmpose', 'mmagic')
# What ``data_format`` knows, for the line that says it knows no other.
FORMATS = 'COCO, VOC, DOTA, ADE20K, ImageNet, COCO keypoints, LQ/GT pairs'
# The keys of mmagic's ``data_prefix`` that read LQ/GT pairs (restoration);
# its other layouts (a folder of GT images, of video frames) have none.
_PAIR_KEYS = ['gt', 'img']


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


def _codebase_format(leaf):
    """The format of a dataset config whose class is of another codebase
    than mmdet's (see :data:`_CODEBASE_FORMATS`): ``(True, format or
    None)``; ``(False, None)`` for a class of none of them, or one not
    found."""
    cls = _dataset_class(leaf.get('type'))
    package = str(getattr(cls, '__module__', '')).split('.')[0]
    if package not in _CODEBASES:
        return False, None
    for owner, base, kind in _CODEBASE_FORMATS:
        if package == owner and any(
                c.__name__ == base and c.__module__.startswith(owner + '.')
                for c in cls.__mro__):
            prefix = leaf.get('data_prefix')
            if kind == 'pairs' and not (isinstance(prefix, dict) and sorted(
                    prefix) == _PAIR_KEYS):
                return True, None
            return True, kind
    return True, None


def data_format(cfg: Any) -> Optional[str]:
    """The format a synthetic stand-in of the config's data is written in:
    ``'coco'``, ``'coco_masks'``, ``'voc'``, ``'dota'``, ``'ade20k'``,
    ``'imagenet'``, ``'coco_keypoints'`` or ``'pairs'``; ``None`` for
    another.

    Args:
        cfg (mmengine.Config): The loaded config, its default scope current.
    """
    found = [_codebase_format(d) for d in leaves(cfg)]
    if any(other for other, _ in found):
        kinds = {kind for _, kind in found}
        return kinds.pop() if len(kinds) == 1 else None
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


def _dataset_class(type_name):
    """The registered dataset class a config's ``type`` names, or
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
    return cls


def _class_default(type_name):
    """The classes of a registered dataset class's ``METAINFO``, or
    ``None``."""
    metainfo = getattr(_dataset_class(type_name), 'METAINFO', None) or {}
    return metainfo.get('classes')


def _init_default(type_name, name, default):
    """The default of a dataset class's ``__init__`` argument ``name``
    (ADE20K's ``reduce_zero_label=True``), else ``default``."""
    try:
        found = inspect.signature(_dataset_class(type_name)).parameters
    except (TypeError, ValueError):  # not found, or not a class
        return default
    value = found[name].default if name in found else default
    return default if value is inspect.Parameter.empty else value


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
    if any(',' in name for name in names):
        # ImageNet's ('tench, Tinca tinca', ...): one class, not two.
        names = [repr(name) for name in names]
    if len(names) <= _SHOWN:
        return ', '.join(names)
    return '{}, ... ({} in all)'.format(', '.join(names[:_SHOWN]),
                                        len(names))


class StandIn(object):
    """How the synthetic stand-in of a config's data is written.

    Args:
        kind (str): Of :func:`data_format`.
        classes (tuple[str], optional): The category names it is written
            in (``None``: the writer's own).
        side (int): The side of its square images, in pixels.
        of (int, optional): How many classes the config has, where the
            model has fewer (``classes`` are its first ones).
        declared (bool): Whether the dataset declares its images' shape
            (DOTA's ``img_shape``): set to the stand-in's.
        labels (int, optional): Where no class is named, how many the
            model has: the labels written are among them (an ImageNet
            ``CustomDataset`` without ``classes``).
        reduce_zero_label (bool): A label map's 0 is "other", ignored, and
            ``k`` class ``k - 1`` (ADE20K's, as its dataset reads it).
        scale (int, optional): How many times smaller LQ images are than
            GT images (pairs); ``side`` is the GT images'.
    """

    def __init__(self, kind: str, classes: Optional[Tuple[str, ...]],
                 side: int, of: Optional[int] = None,
                 declared: bool = False, labels: Optional[int] = None,
                 reduce_zero_label: bool = False,
                 scale: Optional[int] = None) -> None:
        self.kind = kind
        self.classes = classes
        self.side = side
        self.of = of
        self.declared = declared
        self.labels = labels
        self.reduce_zero_label = reduce_zero_label
        self.scale = scale

    def says(self, images: int) -> str:
        """What the drill changed of the config's data, for the user.

        Args:
            images (int): How many images it has.
        """
        line = 'a synthetic {} dataset of {} images of {} px'.format(
            self.kind, images, self.side)
        if self.scale is not None:
            line += ' (GT; LQ {}x smaller)'.format(self.scale)
        if self.reduce_zero_label:
            line += ' (label maps: 0 "other", class k written k + 1)'
        if self.classes is None:
            return line if self.labels is None else \
                '{} in labels 0-{} (the model has num_classes={})'.format(
                    line, min(self.labels, images) - 1, self.labels)
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
        count = len(self.classes) if self.classes is not None else \
            self.labels
        counted = {} if count is None else dict(num_classes=count)
        if self.kind == 'imagenet':
            demo.make_imagenet_dataset(root, num_images=num_images,
                                       image_size=self.side, seed=seed,
                                       **counted)
        elif self.kind == 'ade20k':
            demo.make_ade20k_dataset(
                root, num_images=num_images, image_size=self.side, seed=seed,
                reduce_zero_label=self.reduce_zero_label, **counted)
        elif self.kind == 'pairs':
            demo.make_pairs_dataset(root, num_images=num_images,
                                    gt_size=self.side, scale=self.scale,
                                    seed=seed)
        elif self.kind == 'coco_keypoints':
            demo.make_coco_keypoints_dataset(root, num_images=num_images,
                                             image_size=self.side, seed=seed)
        elif self.kind in ('coco', 'coco_masks'):
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


def _reduces_zero_label(leaf):
    """Whether the label maps of a segmentation dataset config are read
    with 0 "other": as its pipeline's ``LoadAnnotations`` says, else (the
    step saying nothing takes its dataset's) its dataset, else the dataset
    class's default (ADE20K's ``True``). mmseg asserts the step's and the
    dataset's agree."""
    for _, step in config_dicts(leaf.get('pipeline') or []):
        if step.get('reduce_zero_label') is not None:
            return bool(step['reduce_zero_label'])
    if leaf.get('reduce_zero_label') is not None:
        return bool(leaf['reduce_zero_label'])
    return bool(_init_default(leaf.get('type'), 'reduce_zero_label', False))


def _upscale(cfg):
    """How many times smaller a restoration config's LQ images are: its
    pipeline's ``SetValues`` scale (what ``PairedRandomCrop`` reads), else
    its model's ``upscale_factor``, else 4."""
    for path, found in config_dicts(cfg.train_dataloader.dataset):
        if path.endswith('dictionary') and isinstance(found.get('scale'),
                                                      int):
            return found['scale']
    for _, found in config_dicts(cfg.model):
        if isinstance(found.get('upscale_factor'), int):
            return found['upscale_factor']
    return 4


def _pairs_side(cfg, scale):
    """The GT side of a pairs stand-in: at least :data:`SIDE` and the GT
    patch ``PairedRandomCrop`` cuts, a multiple of ``scale``."""
    patches = [found['gt_patch_size'] for _, found in config_dicts(
        cfg.train_dataloader.dataset)
               if isinstance(found.get('gt_patch_size'), int)]
    return int(math.ceil(max([SIDE] + patches) / float(scale))) * scale


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
    sides, declared, reduce_zero_label = [], False, False
    for leaf, wrappers in _chains(cfg.train_dataloader.dataset):
        if kind == 'ade20k':
            reduce_zero_label = _reduces_zero_label(leaf)
        classes = said_classes(leaf, wrappers)
        # The classes of the members so far, not this one's: a name twice
        # in one dataset is two classes (ImageNet's two 'crane').
        before = set(names)
        for name in _as_names(classes) if classes is not None else ():
            if name not in before:
                names.append(name)
        shape = leaf.get('img_shape')
        if isinstance(shape, (list, tuple)) and shape:
            declared = True
            sides.append(int(round(max(shape) * (factor or 1.0))))
        min_size = (leaf.get('filter_cfg') or {}).get('min_size')
        if isinstance(min_size, (int, float)) and min_size > 0:
            sides.append(int(math.ceil(min_size)))
    side = max(sides) if declared else max([SIDE] + sides)
    if kind == 'pairs':
        scale = _upscale(cfg)
        return StandIn(kind, None, _pairs_side(cfg, scale), scale=scale)
    count, of = num_classes(cfg.model), None
    if not names:
        return StandIn(kind, None, side, declared=declared, labels=count,
                       reduce_zero_label=reduce_zero_label)
    if count is not None and count < len(names):
        names, of = names[:count], len(names)
    return StandIn(kind, tuple(names), side, of, declared,
                   reduce_zero_label=reduce_zero_label)


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
        if stand.kind == 'imagenet':
            # ``split`` names the folder and the list where these are not
            # given: given, whatever the config's split.
            leaf.update(data_root=root, ann_file=demo.IMAGENET_ANN_FILE,
                        data_prefix=demo.IMAGENET_SPLIT)
            if 'split' in leaf:
                leaf['split'] = demo.IMAGENET_SPLIT
        elif stand.kind == 'ade20k':
            # No ``ann_file``: every image of the folder, as ADE20K is read.
            leaf.update(data_root=root, ann_file='',
                        data_prefix=dict(img_path=demo.ADE_IMG_DIR,
                                         seg_map_path=demo.ADE_ANN_DIR),
                        img_suffix='.jpg', seg_map_suffix='.png')
        elif stand.kind == 'pairs':
            leaf.update(data_root=root, ann_file=demo.PAIRS_ANN_FILE,
                        data_prefix=dict(img=demo.PAIRS_LQ_DIR,
                                         gt=demo.PAIRS_GT_DIR),
                        # The writer's names are the same in both folders.
                        filename_tmpl=dict(img='{}', gt='{}'))
        elif stand.kind == 'coco_keypoints':
            leaf.update(data_root=root, ann_file=demo.KEYPOINTS_ANN_FILE,
                        data_prefix=dict(img=synthetic.COCO_IMG_DIR + '/'))
            if leaf.get('bbox_file'):
                # A detector's boxes of the user's images: the stand-in's
                # own are its annotations'.
                leaf['bbox_file'] = None
        elif stand.kind in ('coco', 'coco_masks'):
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
