"""One index of a dataset's samples by image file, shared by every lookup.

The quarantine (every index that loads a file), the composed guard (the
same, for the dataset Mosaic/MixUp partners are drawn from) and the
diagnosis (the data info of a batch's images, the index of a composed
sample's part) ask a dataset which of its indices load a file. A walk over
the dataset answers that with one ``get_data_info`` per sample (an unpickle
under mmengine's ``serialize_data``: 6 us for an info of two instances,
more with more): 11 s for 1.7 million, on the path of a trigger.

Two ways answer without waiting for a walk. A search: mmengine's
``BaseDataset`` keeps its data infos as one byte buffer (each info pickled,
one after the other) and the end offset of each: the path's UTF-8 bytes are
found in the buffer by one ``memmem`` (about 10 GB/s: 50 ms for the 484 MB
of 1.7 million infos), and the offsets say whose info each hit is in. Infos
kept as Python objects (``serialize_data=False``) are searched by one pass
over their ``img_path``; mmengine's Concat, Repeat and ClassBalanced
wrappers map their datasets' answers to their own indices. Before trusting
the search with a dataset, its first and last samples' paths must be found
in their own infos: a ``get_data_info`` that makes ``img_path`` up (a
subclass's) is not searched. And an index: :class:`SampleIndex` walks the
dataset once and keeps two arrays, the 8-byte digest of each sample's
``img_path``, sorted, and the dataset index of each (12 bytes a sample,
20 MB for 1.7 million); a lookup is then a binary search (0.6 ms on 1.7
million, where a search costs 50 ms a file, and a batch's files are
searched one by one). Either way, every candidate is confirmed by its
``get_data_info`` (a hit may be part of a longer path, or another field).

A large dataset is walked by a child process forked at ``before_train``
(:func:`~._list.prepare_index`): it reads the dataset copy-on-write, takes
none of the training process's locks (the GIL included: a thread would take
the 11 s of a 1.7 million walk from the training thread), runs at the lowest
priority (a core the training wants is the training's), and writes the
arrays into shared memory, which the training process reads, and every
dataloader worker forked later inherits without a copy. It is a stranger to
the training process (:mod:`mmnanhook._child`: none of its signal handlers,
exit functions or frames run there) and never waited for without a bound:
the run's end stops it (:meth:`SampleIndex.close`), and a lookup that waits
for it gives up once it made no progress for :data:`STALLED` seconds (then
walks in process). Until it is done,
the lookups of a dataset that can be searched search it, so a trigger in
the first iterations costs what it costs later (the index took 10 s and
more on 1.7 million infos, and a trigger then waited for it); a dataset
that cannot be searched waits for the walk (a small one is walked at its
first lookup, in process). After :data:`MANY_FILES` files searched, the
lookups wait for the walk too (or walk, where none was begun): many files
at once (a reviewed quarantine list) cost less so.

Just over 500 lines, one concern: the index (the searches that answer
before it, the walk, and the walk's child with its bounds).
"""
from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import mmap
import os
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._child import REAP_WITHIN, Child, can_fork
from .._log import log

# Samples from which a dataset is walked in a forked child: below, the walk
# at the first lookup costs under about 0.05 s (6 us a sample), no more than
# a fork of a large training process and its copy-on-write faults.
BACKGROUND_FROM = 8192

# Wrappers whose index i is their dataset's index i (the same data info):
# they share its index.
_SAME_INDICES = ('MultiImageMixDataset', )

# Seconds a lookup that needs the walk's arrays waits for a child whose
# progress stands still (it is stopped, or stuck) before it stops it and
# walks in process: the child counts every sample it reads (6 us each).
STALLED = 10.0

# id(dataset) -> its SampleIndex, while the dataset lives.
_INDEXES = {}

# Files whose indices a SampleIndex keeps: a trigger asks for its batch's
# files in the diagnosis, then again in the quarantine and the guard.
_KEPT = 64

# Files searched before the lookups wait for the walk (begin it, if none
# was): a walk costs about as much as 180 searches (an unpickle of 6 us a
# sample against 280 bytes at 10 GB/s), so a reviewed list of a thousand
# files is resolved by the index, while a run's first triggers (a few files
# each) are searched.
MANY_FILES = 32

# What the portable search copies at a time (where libc has no memmem).
_CHUNK = 1 << 26


def _libc_memmem():
    try:
        function = ctypes.CDLL(None).memmem
    except (OSError, AttributeError, TypeError):
        return None
    function.restype = ctypes.c_void_p
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                         ctypes.c_size_t]
    return function


_MEMMEM = _libc_memmem()


def _offsets(buffer, needle, start=0, end=None):
    """Every offset of ``needle`` in ``buffer[start:end]`` (a C-contiguous
    byte array), ascending; overlapping hits included."""
    end = buffer.nbytes if end is None else end
    found = []
    if not needle or end - start < len(needle):
        return found
    if _MEMMEM is not None:
        # No copy of the buffer: 10 GB/s here, 4x the portable way.
        base = buffer.ctypes.data
        while end - start >= len(needle):
            hit = _MEMMEM(base + start, end - start, needle, len(needle))
            if not hit:
                break
            found.append(hit - base)
            start = hit - base + 1
        return found
    view = memoryview(buffer).cast('B')
    for chunk in range(start, end, _CHUNK):
        # Chunks overlap by the needle's length less one: a hit across two
        # is found once, in the first.
        piece = bytes(view[chunk:min(end, chunk + _CHUNK + len(needle) - 1)])
        hit = piece.find(needle)
        while hit >= 0:
            found.append(chunk + hit)
            hit = piece.find(needle, hit + 1)
    return found


def _encoded(path):
    # As pickle writes a str (protocols 1 to 5).
    return path.encode('utf-8', 'surrogatepass')


def _own_path(dataset, index):
    """``img_path`` of sample ``index`` when it is a str or absent
    (``(True, None)``); ``(False, None)`` for anything else."""
    info = dataset.get_data_info(index)
    path = info.get('img_path') if isinstance(info, dict) else None
    return (path is None or isinstance(path, str)), path


def _serialized_search(dataset):
    """Candidates by a search of mmengine's serialized infos."""
    data, ends = dataset.data_bytes, dataset.data_address
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or \
            not data.flags['C_CONTIGUOUS'] or len(ends) != len(dataset):
        return None
    for index in {0, len(dataset) - 1}:
        usable, path = _own_path(dataset, index)
        start = int(ends[index - 1]) if index else 0
        if not usable or path is not None and not _offsets(
                data, _encoded(path), start, int(ends[index])):
            return None

    def search(path: str) -> List[int]:
        hits = _offsets(data, _encoded(path))
        return np.unique(np.searchsorted(ends, hits, side='right')).tolist()

    return search


def _listed_search(dataset):
    """Candidates by one pass over infos kept as Python objects."""
    infos = dataset.data_list
    if not isinstance(infos, list) or len(infos) != len(dataset):
        return None
    for index in {0, len(dataset) - 1}:
        usable, path = _own_path(dataset, index)
        own = infos[index]
        if not usable or not isinstance(own, dict) or \
                own.get('img_path') != path:
            return None

    def search(path: str) -> List[int]:
        return [index for index, info in enumerate(infos)
                if info.get('img_path') == path]

    return search


def _mmengine_own(dataset, cls):
    # A subclass that maps indices its own way is not searched.
    return isinstance(dataset, cls) and all(
        getattr(type(dataset), name, None) is getattr(cls, name, None)
        for name in ('get_data_info', '_get_ori_dataset_idx'))


def _wrapper_search(dataset):
    """Candidates of mmengine's wrappers, from their datasets'."""
    from mmengine.dataset import (ClassBalancedDataset, ConcatDataset,
                                  RepeatDataset)
    if _mmengine_own(dataset, ConcatDataset):
        parts = [_search_of(each) for each in dataset.datasets]
        if any(part is None for part in parts):
            return None
        starts = [0] + list(dataset.cumulative_sizes[:-1])
        return lambda path: [start + index
                             for start, part in zip(starts, parts)
                             for index in part(path)]
    if _mmengine_own(dataset, RepeatDataset):
        # Its numbers, not itself: the search must not keep the dataset
        # alive (its index goes with it).
        inner, size, times = (_search_of(dataset.dataset), dataset._ori_len,
                              dataset.times)
        if inner is None:
            return None
        return lambda path: [copy * size + index for copy in range(times)
                             for index in inner(path)]
    if _mmengine_own(dataset, ClassBalancedDataset):
        inner = _search_of(dataset.dataset)
        if inner is None:
            return None
        repeats = np.asarray(dataset.repeat_indices, dtype=np.int64)
        return lambda path: np.flatnonzero(
            np.isin(repeats, inner(path))).tolist()
    return None


def _search_of(dataset):
    """A function of a path giving, ascending, every index of ``dataset``
    that may load it (the ones that do among them), without a walk; or
    ``None`` when the dataset cannot be searched so."""
    from mmengine.dataset import BaseDataset
    if not getattr(dataset, '_fully_initialized', True) and hasattr(
            dataset, 'full_init'):
        # As its get_data_info would (lazy_init=True).
        dataset.full_init()
    if not isinstance(dataset, BaseDataset):
        return _wrapper_search(dataset)
    if not len(dataset):
        return lambda path: []
    if getattr(dataset, 'serialize_data', False):
        return _serialized_search(dataset)
    return _listed_search(dataset)


def _digest(path):
    # The same in every process (``hash`` of a str is salted per process).
    return hashlib.blake2b(path.encode('utf-8', 'surrogatepass'),
                           digest_size=8).digest()


def _path(dataset, index):
    """``img_path`` of ``dataset``'s sample ``index`` (as text), and its data
    info; ``None`` for a sample that names no file."""
    info = dataset.get_data_info(index)
    path = info.get('img_path') if isinstance(info, dict) else None
    return (None, None) if path is None else (str(path), info)


def _walk(dataset, digests, positions, progress=None):
    """Fill ``digests`` (sorted) and ``positions`` (the dataset index of
    each; ascending where digests are equal) from ``dataset``, counting the
    samples read in ``progress[0]`` as it goes."""
    parts = bytearray()
    for index in range(len(digests)):
        path, _ = _path(dataset, index)
        # A sample without a file gets digest 0: a lookup that lands on it
        # is refused when confirmed.
        parts += _digest(path) if path is not None else bytes(8)
        if progress is not None:
            progress[0] = index
    unsorted = np.frombuffer(bytes(parts), dtype='<i8')
    order = np.argsort(unsorted, kind='stable')
    digests[:] = unsorted[order]
    positions[:] = order


def _walk_in_child(dataset, buffer, count):
    # A core the training (or its loader workers) wants is theirs.
    os.nice(19)
    _walk(dataset, *_views(buffer, count))


def _views(buffer, count):
    """The digests, the positions and the progress (one int64) in one
    shared buffer."""
    digests = np.frombuffer(buffer, dtype='<i8', count=count)
    progress = np.frombuffer(buffer, dtype='<i8', count=1, offset=8 * count)
    positions = np.frombuffer(buffer, dtype=_position_dtype(count),
                              count=count, offset=8 * count + 8)
    return digests, positions, progress


def _position_dtype(count):
    return np.int32 if count < 2**31 else np.int64


def _canonical(dataset):
    while type(dataset).__name__ in _SAME_INDICES and getattr(
            dataset, 'dataset', None) is not None:
        dataset = dataset.dataset
    return dataset


class SampleIndex(object):
    """The indices of one dataset's samples by their image file.

    One per dataset (:func:`sample_index`): every lookup of a run shares it.

    Args:
        dataset: A dataset with ``get_data_info`` (an mmengine
            ``BaseDataset`` or one of its wrappers); without it, no index
            names a file.

    Attributes:
        builds (int): How many times a walk of the dataset was begun for
            it (1 once begun, in this process or a child; 0 for a small
            dataset that is searched; one more each time a walk is done
            again, in process, for one that did not end).
    """

    def __init__(self, dataset: Any) -> None:
        self._dataset = weakref.ref(dataset)
        self.builds = 0
        self._digests = self._positions = None
        self._builder = self._buffer = None
        self._count = 0
        self._search = None
        self._searchable = None
        self._searches = 0
        self._found = collections.OrderedDict()

    @property
    def dataset(self) -> Any:
        return self._dataset()

    @property
    def searched(self) -> bool:
        """Whether lookups can search the dataset's infos (they do until
        a walk's arrays are there, if ever)."""
        if self._searchable is None:
            dataset = self.dataset
            self._search = None if dataset is None else _search_of(dataset)
            self._searchable = self._search is not None
        return self._searchable

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays (0 until built)."""
        return 0 if self._digests is None else (
            self._digests.nbytes + self._positions.nbytes)

    def start(self, background: bool = True) -> None:
        """Start the walk, in a forked child when ``background`` (and the
        platform forks), else now; nothing when it was started before.
        Until a child's walk is done, a dataset that can be searched
        (:attr:`searched`) is searched: no lookup waits for it.

        Args:
            background (bool): Walk in a child process.
        """
        if self.builds:
            return
        dataset = self.dataset
        self._count = len(dataset) if hasattr(dataset, 'get_data_info') \
            else 0
        self.builds += 1
        if background and self._count and can_fork():
            # Anonymous shared memory: the child's writes are the parent's
            # (and its later workers') arrays.
            self._buffer = mmap.mmap(-1, (8 + np.dtype(_position_dtype(
                self._count)).itemsize) * self._count + 8)
            try:
                self._builder = Child(_walk_in_child,
                                      (dataset, self._buffer, self._count))
            except OSError:
                self._buffer = None  # no fork left: walked here
            else:
                return
        self._build_here()

    def _build_here(self):
        digests = np.empty(self._count, dtype='<i8')
        positions = np.empty(self._count, dtype=_position_dtype(self._count))
        _walk(self.dataset, digests, positions)
        self._digests, self._positions = digests, positions

    def indices(self, path: str) -> List[int]:
        """Every index of the dataset whose sample loads ``path``,
        ascending."""
        return list(self._lookup(str(path)))

    def first(self, path: str
              ) -> Tuple[Optional[int], Optional[Dict[str, Any]]]:
        """``(index, data info)`` of the first sample that loads ``path``,
        or ``(None, None)``."""
        found = self._lookup(str(path))
        if not found:
            return None, None
        return found[0], self.dataset.get_data_info(found[0])

    def close(self) -> None:
        """Stop a walk still under way (the run ended before it), within
        the bound of :meth:`~mmnanhook._child.Child.stop`; a later lookup
        that needs the arrays walks in process."""
        builder, self._builder = self._builder, None
        if builder is None:
            return
        if builder.poll() is None and not builder.stop():
            log('mmnanhook: the index walk (pid %d) was not gone %g s after '
                'SIGKILL (stuck in the kernel): not waited for any longer'
                % (builder.pid, REAP_WITHIN), logging.WARNING)
        if builder.exitcode == 0:
            self._adopt()
        else:
            self._buffer = None

    def _lookup(self, path):
        found = self._found.get(path)
        if found is None:
            dataset = self.dataset
            found = tuple(index for index in self._candidates(path)
                          if _path(dataset, index)[0] == path)
            self._found[path] = found
            if len(self._found) > _KEPT:
                self._found.popitem(last=False)
        return found

    def _candidates(self, path):
        arrays = self._arrays(wait=not self.searched or
                              self._searches >= MANY_FILES)
        if arrays is None:
            self._searches += 1
            return self._search(path)
        digests, positions = arrays
        digest = int.from_bytes(_digest(path), 'little', signed=True)
        lo = int(np.searchsorted(digests, digest, side='left'))
        hi = int(np.searchsorted(digests, digest, side='right'))
        return sorted(positions[lo:hi].tolist())

    def _arrays(self, wait):
        """The walk's arrays; ``None`` without ``wait`` when they are not
        there yet (no walk begun, or a child's under way)."""
        builder = self._builder
        if builder is not None:
            if builder.poll() is None:
                if not wait:
                    return None
                self._wait_for(builder)
            self._builder = None
            if builder.exitcode == 0:
                self._adopt()
            else:
                self._buffer = None
        if self._digests is None and wait:
            if not self.builds:
                self.start(background=False)
            else:
                # The child died (killed, out of memory), was stopped for
                # standing still or by close(), and nothing else answers:
                # walk here.
                self.builds += 1
                self._build_here()
        if self._digests is None:
            return None
        return self._digests, self._positions

    def _wait_for(self, builder):
        """Wait for the child's walk while it makes progress; one that made
        none for :data:`STALLED` s (stopped, or stuck) is killed, and the
        log says so."""
        progress = _views(self._buffer, self._count)[2]
        seen, since = int(progress[0]), time.monotonic()
        while builder.wait(1.0) is None:
            if int(progress[0]) != seen:
                seen, since = int(progress[0]), time.monotonic()
            elif time.monotonic() - since >= STALLED:
                builder.stop()
                log('mmnanhook: the index walk of the dataset (pid %d) made '
                    'no progress for %g s at sample %d of %d (stopped or '
                    'stuck): killed it; walking here' % (
                        builder.pid, STALLED, seen, self._count),
                    logging.WARNING)
                return

    def _adopt(self):
        # The child's arrays, done, in the shared buffer.
        self._digests, self._positions, _ = _views(self._buffer, self._count)


def sample_index(dataset: Any) -> SampleIndex:
    """The :class:`SampleIndex` of ``dataset``, shared by every lookup while
    the dataset lives (created on the first call, not yet built)."""
    dataset = _canonical(dataset)
    key = id(dataset)
    index = _INDEXES.get(key)
    if index is None or index.dataset is not dataset:
        index = _INDEXES[key] = SampleIndex(dataset)
        weakref.finalize(dataset, _forget, key, index)
    return index


def _forget(key, index):
    if _INDEXES.get(key) is index:
        del _INDEXES[key]
    index.close()
