"""The quarantine of one run: what it holds, where it is written, and what
keeps its samples out of the dataloader (its sampler, the index stream of an
iterator already running, the batches in flight)."""
from __future__ import annotations

import functools
import logging
import os.path as osp
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .._batch import UnknownBatchError
from .._log import log
from ._file import (FILE_NAME, QuarantinedSample, QuarantineError,
                    check_writable, keep_previous, read_quarantine,
                    write_quarantine)
from ._composed import guard_composed, mixers
from ._identity import info_path
from ._index import BACKGROUND_FROM, sample_index
from ._inflight import replace_data, without_quarantined
from ._sampler import Substitutes, install_sampler
from ._stream import install_stream
from ._workers import hand_over, stale_iterators


class Quarantine(object):
    """The samples a run never loads again, by their dataset index.

    A listed sample with a file, in a dataset with data infos, is keyed by
    the file: its indices are those of the train dataset that load the file
    now (an edited annotation file shifts them). One without a file, or in a
    dataset without data infos (a plain torch ``Dataset``: its file was a
    label from its metainfo), keeps its indices.

    Args:
        path (str): Where the list is written (``nan_quarantine.json``).
        dataset: The train dataset (the dataloader's, in this process).
        samples (list[QuarantinedSample]): The list to start from.
        writes (bool): Whether this process writes the list (under DDP the
            first rank of each node does; every rank holds it).

    Attributes:
        blocked (set[int]): The dataset indices never loaded again.
        files (set[str]): The quarantined image files.
        gone (list[str]): Listed files no index of the dataset loads.
        removed (int): Samples left out of batches in flight.
    """

    def __init__(self, path: str, dataset: Any,
                 samples: Iterable[QuarantinedSample] = (),
                 writes: bool = True) -> None:
        self.path = path
        self.dataset = dataset
        self.writes = writes
        self.samples = []
        self.blocked = set()
        self.files = set()
        self.gone = []
        self.removed = 0
        self._remove = ()
        self._composed = None
        self._hand_over = None
        self._refused = False
        for sample in samples:
            if sample.file is None or not names_files(dataset):
                self.samples.append(sample)
                self.blocked.update(sample.indices)
                if sample.file is not None:
                    self.files.add(sample.file)
            elif sample.file not in self.files:
                self.samples.append(sample)
                self.files.add(sample.file)
                indices = self.indices_of(sample.file)
                if indices:
                    sample.indices = indices
                    self.blocked.update(indices)
                else:
                    self.gone.append(sample.file)

    @classmethod
    def start(cls, path: str, dataset: Any, reviewed: Optional[str] = None,
              resume: bool = False, writes: bool = True) -> Quarantine:
        """The quarantine a run starts with.

        Args:
            path (str): Where the run's list is written; read back when
                ``resume`` and it exists, else an earlier run's list there
                is moved aside (:func:`keep_previous`).
            dataset: The train dataset.
            reviewed (str, optional): A list a user reviewed
                (``quarantine=PATH``).
            resume (bool): Whether the run resumes (``resume=True``).
            writes (bool): Whether this process writes the list.

        Raises:
            QuarantineError: Naming the file: unreadable, not a quarantine
                list, an index outside ``dataset`` for a sample without a
                file, or ``path`` not writable.
        """
        check_writable(path)
        samples = []
        sources = [reviewed] if reviewed else []
        if resume and osp.exists(path) and path not in sources:
            sources.append(path)
        for source in sources:
            listed = read_quarantine(source)
            for n, sample in enumerate(listed):
                bad = [i for i in sample.indices if i >= len(dataset)]
                if (sample.file is None or not names_files(dataset)) and bad:
                    raise QuarantineError(
                        'quarantine file %s: sample #%d names index %d, '
                        'outside the train dataset (%d samples)' % (
                            source, n, bad[0], len(dataset)))
            samples.extend(listed)
        if not resume and writes:
            keep_previous(path)
        return cls(path, dataset, samples, writes)

    def install(self, runner: Any, seed: int = 0) -> None:
        """Keep the quarantined samples out of ``runner``'s train dataloader
        from now on: its sampler, and the iterators already running (or say
        what cannot be: batches in flight are still cleared by
        :meth:`admit`, and the list is still written)."""
        loader = runner.train_dataloader
        substitute = Substitutes(self.blocked, len(loader.dataset), seed)
        self._remove = []
        try:
            self._remove.append(install_sampler(loader, substitute))
        except TypeError as error:
            log('mmnanhook: quarantined samples cannot be kept out of the '
                'index batches of this dataloader once its iterator '
                'restarts: %s; they are left out of the batches that hold '
                'them instead' % error, logging.WARNING)
        # Before the workers fork: they inherit the bound transforms.
        self._composed = guard_composed(runner, self.files)
        self._remove.append(self._composed.remove)
        self._remove.append(install_stream(runner, substitute))
        # Workers forked before the guard are replaced at the first
        # quarantine (at once for a reviewed list).
        stale = stale_iterators(runner) if self._composed.bound else []
        self._hand_over = functools.partial(hand_over, runner, stale) \
            if stale else None
        if self.blocked:
            self.replace_workers()

    def replace_workers(self) -> None:
        """Replace the worker processes that started before the guard (at
        the first quarantine, or when a composed sample they made names no
        parts: a partner of theirs failed); once."""
        if self._hand_over is not None:
            self._hand_over()
            self._hand_over = None

    def remove(self) -> None:
        """Put the loader's own sampler and index streams back."""
        for remove in reversed(self._remove):
            remove()
        self._remove = ()

    def admit(
        self, runner: Any, args: Sequence[Any], kwargs: Dict[str, Any],
        indices: Optional[Sequence[Optional[int]]] = None,
        empty: bool = True
    ) -> Tuple[Optional[Sequence[Any]], Optional[Dict[str, Any]],
               Optional[List[Optional[int]]]]:
        """``train_step``'s arguments without the quarantined samples of its
        batch (sampled before they were quarantined: in flight).

        Args:
            runner (Runner): The runner.
            args, kwargs: ``train_step``'s.
            indices (list, optional): The dataset index of each sample of
                the batch (:class:`~._identity.SampleTracker`).
            empty (bool): Whether a batch may be left without samples (the
                step then not taken). Under DDP every rank must take the
                step: such a batch is kept whole, and the step goes the way
                of a trigger.

        Returns:
            tuple: ``(args, kwargs, indices)``, the indices those of the
            samples left; ``(None, None, None)`` when no sample of the batch
            is left (the step is not taken).
        """
        data = args[0] if args else kwargs.get('data')
        try:
            admitted = without_quarantined(data, indices, self.blocked,
                                           self.files)
        except UnknownBatchError as error:
            if not self._refused:
                self._refused = True
                runner.logger.warning(
                    'mmnanhook: iter %d: a quarantined sample is in this '
                    'batch (sampled before the decision), but it cannot be '
                    'left out: %s; it trains once more' % (runner.iter, error))
            return args, kwargs, indices
        removed = admitted.removed
        if not removed:
            return args, kwargs, admitted.indices
        batch = admitted.batch
        if batch is None and not empty:
            runner.logger.warning(
                'mmnanhook: iter %d: every sample of this rank\'s batch is '
                'quarantined (%s), sampled before the decision; every rank '
                'takes the step, so the batch stays as it is' % (
                    runner.iter, ', '.join(removed)))
            return args, kwargs, indices
        self.removed += len(removed)
        runner.message_hub.update_scalar('train/quarantine_removed',
                                         self.removed)
        runner.logger.warning(
            'mmnanhook: iter %d: %s left out of the batch, quarantined after '
            'the batch was sampled (in flight)%s' % (
                runner.iter, ', '.join(removed), '' if batch is not None else
                '; no sample is left: the step is not taken'))
        if batch is None:
            return None, None, None
        args, kwargs = replace_data(args, kwargs, batch)
        return args, kwargs, admitted.indices

    def indices_of(self, file: str) -> List[int]:
        """Every index of the train dataset that loads ``file`` (the
        dataset wrappers, Repeat, Concat, ClassBalanced, map indices
        themselves)."""
        return sample_index(self.dataset).indices(file)

    def file_of(self, index: int) -> Optional[str]:
        """The file of the train dataset's sample ``index`` (its data
        info's), or ``None``."""
        return info_path(self.dataset, index)

    def add(self, file: Optional[str], reason: str,
            index: Optional[int] = None,
            **where: Any) -> Optional[QuarantinedSample]:
        """Quarantine one sample, by its dataset index or its file.

        Args:
            file (str, optional): Its image file; in a dataset with data
                infos every index that loads it is quarantined.
            reason (str): Why.
            index (int, optional): Its dataset index (the sampler's): what
                is quarantined where no data info names the file (a plain
                torch ``Dataset``), the file then a label.
            **where: ``iter``, ``epoch``, ``rank``, ``source``.

        Returns:
            QuarantinedSample | None: The new entry; ``None`` when it is
            already quarantined or no dataset index is known for it.
        """
        if file is not None and file in self.files:
            return None
        indices = self.indices_of(file) if file is not None else []
        if not indices and index is not None and \
                0 <= index < len(self.dataset):
            indices = [index]
        if not indices or (file is None and self.blocked.issuperset(
                indices)):
            return None
        sample = QuarantinedSample(indices, file, reason, **where)
        self.samples.append(sample)
        if file is not None:
            self.files.add(file)
        self.blocked.update(sample.indices)
        if self._composed is not None and file is not None:
            self._composed.block(file)
        if self._composed is not None:
            self.replace_workers()
        return sample

    def add_found(self, samples: Iterable[Any], **where: Any
                  ) -> Tuple[List[QuarantinedSample], List[Any]]:
        """Quarantine the samples a report names.

        Args:
            samples (list[Culprit]): The samples and their ranks.
            **where: As :meth:`add`.

        Returns:
            tuple: ``(added, unknown)``: the new entries, and the findings
            no dataset index could be found for (neither a dataset index
            nor a file that a sample of the dataset loads).
        """
        added, unknown = [], []
        for culprit in samples:
            found = culprit.sample
            file, index = found.img_path, found.dataset_index
            reason = '; '.join(p.text for p in found.problems) or \
                'fails on its own in the replay'
            if file in self.files or (file is None and index in self.blocked):
                continue
            # Under DDP a culprit names the rank whose batch held it.
            rank = where.get('rank') if culprit.rank is None else culprit.rank
            sample = self.add(file, reason, index, **dict(where, rank=rank)) \
                if file is not None or index is not None else None
            (added if sample is not None else unknown).append(
                sample if sample is not None else found)
        return added, unknown

    def record(self, findings: Sequence[Any], event: Any, source: str,
               logger: logging.Logger) -> None:
        """Quarantine the samples a handled trigger's report names, write
        the list, and log what happened.

        Args:
            findings (list[Culprit]): The samples the report names.
            event (NonFiniteEvent): The trigger.
            source (str): The policy that handled it.
            logger (logging.Logger): Where it is said.
        """
        added, unknown = self.add_found(
            findings, iter=event.iter, epoch=event.epoch, rank=event.rank,
            source=source)
        if any(f.sample.img_path is None and f.sample.dataset_index is None
               for f in findings):
            # A composed sample without recorded parts: from workers that
            # started before the guard.
            self.replace_workers()
        for finding in unknown:
            logger.warning(
                'mmnanhook: sample %s of the batch (%s) cannot be '
                'quarantined: no index of the train dataset is known for it' %
                (finding.index, finding.name))
        if not added:
            return
        try:
            self.save()
            where = 'listed in %s' % self.path if self.writes else \
                'listed by the first rank of this node'
        except OSError as error:
            where = 'NOT written to %s (%s): quarantined in this run only' % (
                self.path, error)
        for sample in added:
            logger.warning(
                'mmnanhook: quarantined %s: never loaded again in this run; '
                '%s' % (sample.describe(), where))

    def save(self) -> None:
        """Write the list (atomically).

        Raises:
            OSError: It could not be written (the samples stay quarantined
                in this run).
        """
        if self.writes:
            write_quarantine(self.path, self.samples)


def names_files(dataset: Any) -> bool:
    """Whether ``dataset``'s samples can be found by their file (it has
    data infos: an mmengine ``BaseDataset`` or one of its wrappers); else a
    sample is known by its index alone."""
    return hasattr(dataset, 'get_data_info')


def prepare_index(dataset: Any) -> List[Any]:
    """Start walking the train dataset, and each dataset its Mosaic/MixUp
    partners are drawn from, for their :class:`SampleIndex`: in a forked
    child for a large one (``BACKGROUND_FROM`` samples, its infos serialized
    as mmengine's ``BaseDataset`` does by default), else at the first
    lookup where the dataset cannot be searched instead. Until the child is
    done, the lookups of a dataset that can be searched (mmengine's) search
    it: none waits. Before the dataloader's workers fork: they inherit it.

    Args:
        dataset: The train dataset, in ``before_train``.

    Returns:
        list[SampleIndex]: The indexes whose walk began in a child: the
        run's end closes them (:meth:`SampleIndex.close`).
    """
    sources = [source for _, source, _ in mixers(dataset)]
    started = []
    for each in [dataset] + sources:
        # A dataset whose infos are Python objects (``serialize_data=False``)
        # would be copied page by page into the child (its walk touches
        # every object's count): walked at the first lookup instead.
        if hasattr(each, 'get_data_info') and len(
                each) >= BACKGROUND_FROM and getattr(each, 'serialize_data',
                                                     True):
            index = sample_index(each)
            if not index.builds:
                index.start()
                started.append(index)
    return started


def start_quarantine(runner: Any, reviewed: Optional[str] = None,
                     path: Optional[str] = None,
                     writes: bool = True) -> Quarantine:
    """The quarantine of ``runner``'s training, installed in its dataloader.

    Args:
        runner (Runner): In ``before_train`` (the dataloader is built).
        reviewed (str, optional): A list to start from (``quarantine=``).
        path (str, optional): Where the run's list is written; defaults to
            ``{work_dir}/nan_quarantine.json`` (read back on resume).
        writes (bool): Whether this process writes it (DDP: the first rank
            of each node).

    Raises:
        QuarantineError: Naming the file.
    """
    from mmengine.dist import get_dist_info
    path = path or osp.join(runner.work_dir, FILE_NAME)
    loader = runner.train_dataloader
    quarantine = Quarantine.start(
        path, loader.dataset, reviewed,
        resume=bool(getattr(runner, '_resume', False)), writes=writes)
    for file in quarantine.gone:
        runner.logger.warning(
            'mmnanhook: quarantined %s is no longer in the train dataset: '
            'nothing of it to block (kept in the list)' % file)
    rank, _ = get_dist_info()
    quarantine.install(runner, seed=(runner.seed or 0) + rank)
    return quarantine
