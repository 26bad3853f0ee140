"""The quarantine of one run: what it holds, where it is written, and the
sampler that keeps its samples out of the dataloader."""
import logging
import os.path as osp

from .._log import log
from ._file import (FILE_NAME, QuarantinedSample, check_writable,
                    read_quarantine, write_quarantine)
from ._sampler import install_sampler


def _img_path(dataset, index):
    info = dataset.get_data_info(index)
    return info.get('img_path') if isinstance(info, dict) else None


class Quarantine(object):
    """The samples a run never loads again.

    Args:
        path (str): Where the list is written (``nan_quarantine.json``).
        dataset: The train dataset (the dataloader's, in this process).
        samples (list[QuarantinedSample]): The list to start from.
    """

    def __init__(self, path, dataset, samples=()):
        self.path = path
        self.dataset = dataset
        self.samples = list(samples)
        self.blocked = set(i for s in self.samples for i in s.indices)
        self._files = None
        self._remove = None

    @classmethod
    def start(cls, path, dataset, reviewed=None, resume=False):
        """The quarantine a run starts with.

        Args:
            path (str): Where the run's list is written; read back when
                ``resume`` and it exists.
            dataset: The train dataset.
            reviewed (str, optional): A list a user reviewed
                (``quarantine=PATH``).
            resume (bool): Whether the run resumes (``resume=True``).

        Raises:
            QuarantineError: Naming the file: unreadable, not a quarantine
                list, an index outside ``dataset``, or ``path`` not
                writable.
        """
        check_writable(path)
        samples = []
        sources = [reviewed] if reviewed else []
        if resume and osp.exists(path) and path not in sources:
            sources.append(path)
        for source in sources:
            samples.extend(read_quarantine(source, len(dataset)))
        return cls(path, dataset, samples)

    def install(self, loader, seed=0):
        """Keep the quarantined samples out of ``loader`` from now on (or
        say why that cannot be: the list is still written)."""
        try:
            self._remove = install_sampler(loader, self.blocked, seed)
        except TypeError as error:
            log('mmnanhook: quarantined samples cannot be kept out of this '
                'dataloader: %s' % error, logging.WARNING)

    def remove(self):
        """Put the loader's own sampler back."""
        if self._remove is not None:
            self._remove()
            self._remove = None

    def indices_of(self, file):
        """Every index of the train dataset that loads ``file``."""
        if self._files is None:
            # Once per run, on the first quarantined sample: the dataset
            # wrappers (Repeat, Concat, ClassBalanced) map indices themselves.
            self._files = {}
            for index in range(len(self.dataset)):
                self._files.setdefault(_img_path(self.dataset, index),
                                       []).append(index)
        return list(self._files.get(file) or [])

    def add(self, file, reason, **where):
        """Quarantine the sample of ``file``.

        Args:
            file (str): Its image file (``img_path`` of its metainfo).
            reason (str): Why.
            **where: ``iter``, ``epoch``, ``rank``, ``source``.

        Returns:
            QuarantinedSample | None: The new entry; ``None`` when the file
            is already quarantined or no dataset index loads it.
        """
        if any(s.file == file for s in self.samples):
            return None
        indices = self.indices_of(file)
        if not indices:
            return None
        sample = QuarantinedSample(indices, file, reason, **where)
        self.samples.append(sample)
        self.blocked.update(indices)
        return sample

    def add_found(self, samples, **where):
        """Quarantine the samples a report names (its ``samples``).

        Args:
            samples (list[dict]): ``report.json`` sample findings: their
                ``img_path`` and ``problems``.
            **where: As :meth:`add`.

        Returns:
            tuple: ``(added, unknown)``: the new entries, and the findings
            no dataset index could be found for (no ``img_path``, or none
            of the dataset's samples loads it).
        """
        added, unknown = [], []
        for finding in samples:
            file = finding.get('img_path')
            reason = '; '.join(finding.get('problems') or []) or \
                'fails on its own in the replay'
            if any(s.file == file for s in self.samples):
                continue
            sample = self.add(file, reason, **where) if file else None
            (added if sample is not None else unknown).append(
                sample if sample is not None else finding)
        return added, unknown

    def record(self, findings, event, source, logger):
        """Quarantine the samples a handled trigger's report names, write
        the list, and log what happened.

        Args:
            findings (list[dict]): The report's sample findings.
            event (NonFiniteEvent): The trigger.
            source (str): The policy that handled it.
            logger (logging.Logger): Where it is said.
        """
        added, unknown = self.add_found(
            findings, iter=event.iter, epoch=event.epoch, rank=event.rank,
            source=source)
        for finding in unknown:
            logger.warning(
                'mmnanhook: sample %s of the batch (%s) cannot be '
                'quarantined: no index of the train dataset loads it' %
                (finding.get('index'), finding.get('img_path')))
        if not added:
            return
        try:
            self.save()
            where = 'listed in %s' % self.path
        except OSError as error:
            where = 'NOT written to %s (%s): quarantined in this run only' % (
                self.path, error)
        for sample in added:
            logger.warning(
                'mmnanhook: quarantined %s (dataset index %s): never loaded '
                'again in this run; %s' % (sample.file, ', '.join(
                    map(str, sample.indices)), where))

    def save(self):
        """Write the list (atomically).

        Raises:
            OSError: It could not be written (the samples stay quarantined
                in this run).
        """
        write_quarantine(self.path, self.samples)


def start_quarantine(runner, reviewed=None, path=None):
    """The quarantine of ``runner``'s training, installed in its dataloader.

    Args:
        runner (Runner): In ``before_train`` (the dataloader is built).
        reviewed (str, optional): A list to start from (``quarantine=``).
        path (str, optional): Where the run's list is written; defaults to
            ``{work_dir}/nan_quarantine.json`` (read back on resume).

    Raises:
        QuarantineError: Naming the file.
    """
    from mmengine.dist import get_dist_info
    path = path or osp.join(runner.work_dir, FILE_NAME)
    loader = runner.train_dataloader
    quarantine = Quarantine.start(
        path, loader.dataset, reviewed,
        resume=bool(getattr(runner, '_resume', False)))
    rank, _ = get_dist_info()
    quarantine.install(loader, seed=(runner.seed or 0) + rank)
    return quarantine
