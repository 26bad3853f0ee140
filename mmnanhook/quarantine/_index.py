"""One index of a dataset's samples by image file, shared by every lookup.

The quarantine (every index that loads a file), the composed guard (the
same, for the dataset Mosaic/MixUp partners are drawn from) and the
diagnosis (the data info of a batch's images, the index of a composed
sample's part) ask a dataset which of its indices load a file. A walk over
the dataset answers that with one ``get_data_info`` per sample (an unpickle
under mmengine's ``serialize_data``: 6 us for an info of two instances,
more with more): 11 s for 1.7 million, on the path of a trigger, and the
quarantine's map of every file to its indices was 414 MB of strings (a
rank; ``benchmarks/index_scale.py``). :class:`SampleIndex` walks it once
per dataset and keeps two arrays: the 8-byte digest of each sample's
``img_path``, sorted, and the dataset index of each (12 bytes a sample,
20 MB for 1.7 million). A lookup is a binary search, then one
``get_data_info`` per candidate, which confirms it (digests may collide):
O(the indices that load the file), whatever the dataset's size.

A large dataset is walked by a child process forked at ``before_train``
(:func:`~._list.prepare_index`): it reads the dataset copy-on-write, takes
none of the training process's locks (the GIL included), runs at the lowest
priority (a core the training wants is the training's), and writes the
arrays into shared memory, which the training process reads, and every
dataloader worker forked later inherits without a copy. A lookup before
the walk is done waits for it.
"""
import ctypes
import hashlib
import mmap
import multiprocessing
import os
import signal
import weakref

import numpy as np

# Samples from which a dataset is walked in a forked child: below, the walk
# at the first lookup costs under about 0.05 s (6 us a sample), no more than
# a fork of a large training process and its copy-on-write faults.
BACKGROUND_FROM = 8192

# Wrappers whose index i is their dataset's index i (the same data info):
# they share its index.
_SAME_INDICES = ('MultiImageMixDataset', )

# prctl's option that signals a child when its parent ends.
_PR_SET_PDEATHSIG = 1

# id(dataset) -> its SampleIndex, while the dataset lives.
_INDEXES = {}


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


def _walk(dataset, digests, positions):
    """Fill ``digests`` (sorted) and ``positions`` (the dataset index of
    each; ascending where digests are equal) from ``dataset``."""
    parts = bytearray()
    for index in range(len(digests)):
        path, _ = _path(dataset, index)
        # A sample without a file gets digest 0: a lookup that lands on it
        # is refused when confirmed.
        parts += _digest(path) if path is not None else bytes(8)
    unsorted = np.frombuffer(bytes(parts), dtype='<i8')
    order = np.argsort(unsorted, kind='stable')
    digests[:] = unsorted[order]
    positions[:] = order


def _build_in_child(dataset, buffer, count):
    # An interrupt from the terminal is the training process's to handle;
    # a core the training (or its loader workers) wants is theirs.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(19)
    try:
        # Linux: ends with the training process, however it ends.
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass
    _walk(dataset, *_views(buffer, count))


def _views(buffer, count):
    # The digests, then the positions, in one shared buffer.
    digests = np.frombuffer(buffer, dtype='<i8', count=count)
    positions = np.frombuffer(buffer, dtype=_position_dtype(count),
                              count=count, offset=8 * count)
    return digests, positions


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
        builds (int): How many times the dataset was walked for it (1 once
            built, in this process or a child).
    """

    def __init__(self, dataset):
        self._dataset = weakref.ref(dataset)
        self.builds = 0
        self._digests = self._positions = None
        self._builder = self._buffer = None
        self._count = 0

    @property
    def dataset(self):
        return self._dataset()

    @property
    def nbytes(self):
        """Bytes of the index's arrays (0 until built)."""
        return 0 if self._digests is None else (
            self._digests.nbytes + self._positions.nbytes)

    def start(self, background=True):
        """Start the walk, in a forked child when ``background`` (and the
        platform forks), else now; nothing when it was started before.

        Args:
            background (bool): Walk in a child process.
        """
        if self.builds:
            return
        dataset = self.dataset
        self._count = len(dataset) if hasattr(dataset, 'get_data_info') \
            else 0
        self.builds += 1
        if background and self._count and \
                'fork' in multiprocessing.get_all_start_methods():
            # Anonymous shared memory: the child's writes are the parent's
            # (and its later workers') arrays.
            self._buffer = mmap.mmap(-1, (8 + np.dtype(_position_dtype(
                self._count)).itemsize) * self._count)
            builder = multiprocessing.get_context('fork').Process(
                target=_build_in_child,
                args=(dataset, self._buffer, self._count),
                name='mmnanhook-index', daemon=True)
            try:
                builder.start()
            except (AssertionError, OSError):
                # A daemonic process may not have children; no fork left.
                self._buffer = None
            else:
                self._builder = builder
                return
        self._build_here()

    def _build_here(self):
        digests = np.empty(self._count, dtype='<i8')
        positions = np.empty(self._count, dtype=_position_dtype(self._count))
        _walk(self.dataset, digests, positions)
        self._digests, self._positions = digests, positions

    def indices(self, path):
        """Every index of the dataset whose sample loads ``path``,
        ascending."""
        return [index for index, _ in self._matches(path)]

    def first(self, path):
        """``(index, data info)`` of the first sample that loads ``path``,
        or ``(None, None)``."""
        return next(self._matches(path), (None, None))

    def close(self):
        """Stop a walk still under way (the run ended before it)."""
        builder, self._builder = self._builder, None
        if builder is not None and builder.is_alive():
            builder.terminate()
        if builder is not None:
            builder.join()

    def _matches(self, path):
        digests, positions = self._ready()
        digest = int.from_bytes(_digest(str(path)), 'little', signed=True)
        lo = int(np.searchsorted(digests, digest, side='left'))
        hi = int(np.searchsorted(digests, digest, side='right'))
        dataset = self.dataset
        for index in positions[lo:hi].tolist():
            found, info = _path(dataset, index)
            if found == str(path):
                yield index, info

    def _ready(self):
        if not self.builds:
            self.start(background=False)
        builder, self._builder = self._builder, None
        if builder is not None:
            builder.join()
            if builder.exitcode == 0:
                self._digests, self._positions = _views(self._buffer,
                                                        self._count)
            else:
                # The child died (killed, out of memory): walk here.
                self._buffer = None
                self.builds += 1
                self._build_here()
        return self._digests, self._positions


def sample_index(dataset):
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
