"""Each sample of a batch known by the index its sampler gave it.

What acts on a sample (the drop, the quarantine, the record of a step a
process died in, the report) goes by its index in the train dataset; its
file, when its metainfo or data info has one, is a label for people. A
batch does not carry its indices (mmyolo's ``yolov5_collate`` keeps not even
the samples' metainfo), but torch's dataloader iterator draws every index
batch in the main process (``next(self._sampler_iter)``, for worker
processes too) and yields the batches in the order it drew them (its
default ``in_order``): :class:`Drawn` records each index batch as it is
drawn, and the iterator's ``_next_data`` takes the oldest one off as it
yields its batch. So the indices follow the batch through workers, their
prefetch, ``persistent_workers``, ``InfiniteSampler``, the quarantine's
substitutes (drawn before them) and any dataset wrapper (the indices are
the loader's dataset's own).

Every iterator of the loader is watched: those that already run when the
hook starts (``IterBasedTrainLoop``'s; the batches they prefetched before
are not known: ``None``), and every one the loader makes later (its
``_get_iterator``; a persistent iterator's ``_reset`` draws from the batch
sampler's recording iterator again). The cost is a deque append and pop per
batch, in the main process.
"""
from __future__ import annotations

import collections
import logging
import weakref
from numbers import Integral
from typing import Any, List, Optional, Sequence

from .._batch import batch_size, file_of, sample_files
from .._log import log
from .._patch import set_attribute
from ..records import SampleId


class Drawn(object):
    """An index stream of a dataloader iterator whose index batches are
    kept until the iterator yields what was loaded from them.

    Args:
        source: The stream it reads (what torch's iterator drew from).
        pending (int): Batches drawn before it was in place and not yet
            yielded: their indices are unknown.

    Attributes:
        queue (collections.deque): The index batches drawn and not yet
            yielded, oldest first (``None``: unknown).
    """

    def __init__(self, source: Any, pending: int = 0) -> None:
        self.source = source
        self.queue = collections.deque([None] * max(0, pending))

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.source)
        self.queue.append(_indices(batch))
        return batch


class Drained(object):
    """An index stream that is over, keeping the one it ended: an iterator
    whose workers finish what they were given
    (:class:`~._workers.Handover`) still yields those batches, whose indices
    its :class:`Drawn` holds.

    Args:
        source: The stream it ended.
    """

    def __init__(self, source: Any) -> None:
        self.source = source

    def __iter__(self):
        return self

    def __next__(self):
        raise StopIteration


def _indices(batch):
    """The dataset indices of one index batch (``None`` where not an
    index: an iterable dataset's); ``None`` for a lone index
    (``batch_size=None``: no batch)."""
    if not isinstance(batch, (list, tuple)):
        return None
    return [int(i) if isinstance(i, Integral) and not isinstance(i, bool)
            else None for i in batch]


def drawn_of(iterator: Any) -> Optional[Drawn]:
    """The :class:`Drawn` a dataloader iterator draws through, under the
    streams wrapped around or inside it; ``None``."""
    stream = vars(iterator).get('_sampler_iter')
    while stream is not None and not isinstance(stream, Drawn):
        stream = getattr(stream, 'source', None)
    return stream


def inside_drawn(iterator: Any) -> Any:
    """Where a stream wrapped around an iterator's index stream goes so that
    a :class:`Drawn` stays outermost (it must record the indices loaded,
    after any substitute): the :class:`Drawn` itself (its ``source``), or the
    iterator (its ``_sampler_iter``)."""
    stream = vars(iterator).get('_sampler_iter')
    return stream if isinstance(stream, Drawn) else iterator


class _DrawnBatches(object):
    """A loader's batch sampler whose every iterator is a :class:`Drawn`;
    each other attribute, read or set, is the batch sampler's own (the
    quarantine's sampler goes into its ``sampler``).

    Args:
        batch_sampler: The loader's.
    """

    def __init__(self, batch_sampler: Any) -> None:
        object.__setattr__(self, 'batch_sampler', batch_sampler)

    def __iter__(self):
        return Drawn(iter(self.batch_sampler))

    def __len__(self):
        return len(self.batch_sampler)

    def __getattr__(self, name):
        if name == 'batch_sampler':
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)

    def __setattr__(self, name, value):
        setattr(self.batch_sampler, name, value)


class SampleTracker(object):
    """The dataset indices of each batch the train dataloader yields.

    Args:
        loader (DataLoader): The train dataloader (in ``before_train``).
        iterators (list): Its iterators that already run
            (:func:`~._stream.live_iterators`).

    Attributes:
        refused (str | None): Why no batch's indices can be known (the
            loader yields batches out of order, or draws no index batches);
            said once in the log.
    """

    def __init__(self, loader: Any, iterators: Sequence[Any] = ()) -> None:
        self.refused = None
        self._last = None
        self._undo = []
        self._watched = []
        real = getattr(loader, 'batch_sampler', None)
        if not getattr(loader, 'in_order', True):
            self.refused = 'the train dataloader yields batches out of ' \
                'order (in_order=False)'
        elif real is None or getattr(type(loader), '_get_iterator',
                                     None) is None:
            self.refused = 'the train dataloader draws no index batches ' \
                'from a batch sampler (batch_size=None, or not a torch ' \
                'DataLoader)'
        if self.refused is not None:
            log('mmnanhook: the dataset index of each sample is not known: '
                '%s; samples are named by their files only' % self.refused,
                logging.WARNING)
            return
        wrapped = _DrawnBatches(real)
        # DataLoader refuses a new batch sampler once built; this one is
        # the same sampler, read through.
        object.__setattr__(loader, 'batch_sampler', wrapped)
        loader_ref = weakref.ref(loader)

        def restore_sampler() -> None:
            live = loader_ref()
            if live is not None and vars(live).get('batch_sampler') is \
                    wrapped:
                object.__setattr__(live, 'batch_sampler', real)

        self._undo.append(restore_sampler)
        make = type(loader)._get_iterator

        def get_iterator() -> Any:
            # No reference to the loader: no cycle through its dict that
            # would keep a persistent iterator's workers alive.
            iterator = make(loader_ref())
            self._watch(iterator)
            return iterator

        self._undo.append(set_attribute(loader, '_get_iterator',
                                        get_iterator))
        for iterator in iterators:
            if getattr(iterator, '_sampler_iter', None) is None:
                continue
            # Drawn and sent to workers before now, not yet yielded.
            pending = getattr(iterator, '_send_idx', 0) - getattr(
                iterator, '_rcvd_idx', 0)
            iterator._sampler_iter = Drawn(iterator._sampler_iter, pending)
            self._watch(iterator)

    def _watch(self, iterator):
        ref = weakref.ref(iterator)
        next_data = type(iterator)._next_data

        def watched_next_data() -> Any:
            it = ref()
            data = next_data(it)
            drawn = drawn_of(it)
            indices = drawn.queue.popleft() if drawn is not None and \
                drawn.queue else None
            self._last = (data, indices)
            return data

        set_attribute(iterator, '_next_data', watched_next_data)
        self._watched.append(ref)

    def indices(self, data_batch: Any) -> Optional[List[Optional[int]]]:
        """The dataset index of each sample of ``data_batch`` (``None``
        where unknown), when it is the batch the loader yielded last (what
        the loop hands the train step); else ``None``.

        Args:
            data_batch: The train step's batch.
        """
        last = self._last
        if last is None or last[0] is not data_batch or last[1] is None:
            return None
        if len(last[1]) != batch_size(data_batch):
            # A collate that leaves samples out: their places are unknown.
            return None
        return list(last[1])

    def remove(self) -> None:
        """Put the loader's batch sampler and ``_get_iterator`` back, and
        every iterator still alive as it was (again: a no-op)."""
        while self._undo:
            self._undo.pop()()
        for ref in self._watched:
            iterator = ref()
            if iterator is None:
                continue
            vars(iterator).pop('_next_data', None)
            index_sampler = vars(iterator).get('_index_sampler')
            if isinstance(index_sampler, _DrawnBatches):
                iterator._index_sampler = index_sampler.batch_sampler
            stream = vars(iterator).get('_sampler_iter')
            if isinstance(stream, Drawn):
                iterator._sampler_iter = stream.source
        self._watched = []
        self._last = None


def track_samples(loader: Any,
                  iterators: Sequence[Any] = ()) -> SampleTracker:
    """A :class:`SampleTracker` of the train dataloader, in place.

    Args:
        loader (DataLoader): ``runner.train_dataloader``.
        iterators (list): Its iterators already running.
    """
    return SampleTracker(loader, iterators)


def info_path(dataset: Any, index: Optional[int]) -> Optional[str]:
    """The file (``img_path``, else ``gt_path``:
    :func:`~mmnanhook._batch.file_of`) of the data info of ``dataset``'s
    sample ``index``;
    ``None`` for a dataset without data infos (a plain torch ``Dataset``),
    an index outside it, or an info without one."""
    if index is None or not hasattr(dataset, 'get_data_info'):
        return None
    try:
        if not 0 <= index < len(dataset):
            return None
        info = dataset.get_data_info(index)
    except Exception:  # noqa: BLE001 - a label only: a user's dataset
        return None
    path = file_of(info) if isinstance(info, dict) else None
    return None if path is None else str(path)


def name_samples(dataset: Any, data_batch: Any,
                 indices: Optional[Sequence[Optional[int]]]
                 ) -> List[SampleId]:
    """Who each sample of ``data_batch`` is: its dataset index and its file
    (its metainfo's ``img_path``, else its data info's). Failure path: a
    data info read per sample.

    A sample whose metainfo names another file than its index's data info
    was loaded from another index (mmengine's ``BaseDataset`` draws one
    anew when the pipeline drops a sample): its index is not kept.

    Args:
        dataset: The train dataset (the loader's).
        data_batch: The batch.
        indices (list, optional): :meth:`SampleTracker.indices`' answer.
    """
    n = batch_size(data_batch) or 0
    files = sample_files(data_batch) or []
    files = list(files) + [None] * (n - len(files))
    indices = list(indices) if indices is not None and len(indices) == n \
        else [None] * n
    named = []
    for index, file in zip(indices, files[:n]):
        own = info_path(dataset, index)
        if file is not None and own is not None and str(file) != own:
            index = None
        named.append(SampleId(index, str(file) if file is not None else own))
    return named
