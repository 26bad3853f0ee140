"""Opening a bundle: every file verified against the manifest first."""
from __future__ import annotations

import json
import os.path as osp
from typing import Any, Dict, Optional, Sequence

from .._format import one_line as _one_line
from ._unpickle import ForeignObjectError, torch_load_allowlisted
from ..errors import BundleError
from ..version import __version__
from ._content import BUILT, content_problem, find_allowed
from ._layout import FORMAT_VERSION, MANIFEST, MODEL, OPTIMIZER, REPORT, \
    STATE_FROM, TORCH_SUFFIX, _TMP_PREFIX, sha256
from ._state import StateRef


class Bundle(object):
    """A bundle directory that passed :func:`load_bundle`'s checks.

    Attributes:
        path (str): The bundle directory.
        manifest (dict): ``manifest.json``.
        report (dict): ``report.json``.
        files (dict): File name -> manifest entry (name, size, sha256).
    """

    def __init__(self, path: str, manifest: Dict[str, Any],
                 report: Dict[str, Any], map_location: Any) -> None:
        self.path = path
        self.manifest = manifest
        self.report = report
        self.files = {entry['name']: entry for entry in manifest['files']}
        self._map_location = map_location
        self._loaded = {}

    def __repr__(self):
        return 'Bundle({!r})'.format(self.path)

    def has(self, stem: str) -> bool:
        """Whether the torch file ``<stem>.pth`` is in the bundle."""
        return stem + TORCH_SUFFIX in self.files

    def load(self, stem: str) -> Any:
        """Load ``<stem>.pth`` (once; later calls return the same object).

        Nothing in it runs: only tensors, plain containers and the classes
        of :mod:`._content`'s allowlist load, and the content must be what
        the stem names (a batch, a state dict, an RNG state).

        Args:
            stem (str): e.g. ``'data_batch'``, ``'model'``, ``'rng'``.

        Raises:
            BundleError: The file is absent, names a global outside the
                allowlist, cannot be unpickled (e.g. the classes of the data
                samples are not importable here) or holds something else.
        """
        if stem in self._loaded:
            return self._loaded[stem]
        file_name = stem + TORCH_SUFFIX
        if file_name not in self.files:
            reason = self.manifest.get('unsaved', {}).get(stem)
            raise BundleError(_one_line(
                '{} has no {}{}'.format(
                    self.path, file_name,
                    ' (it could not be saved: {})'.format(reason)
                    if reason else '')))
        path = osp.join(self.path, file_name)
        try:
            obj = torch_load_allowlisted(path, find_allowed, BUILT,
                                         map_location=self._map_location)
        except ForeignObjectError as error:
            raise BundleError(_one_line(
                'refused {}: it names {}, which no bundle holds (nothing of '
                'it was run)'.format(path, error)))
        except Exception as error:  # noqa: BLE001 - any unpickling failure
            raise BundleError(_one_line('cannot load {}: {}: {}'.format(
                path, type(error).__name__, error)))
        try:
            problem = content_problem(stem, obj)
        except Exception as error:  # noqa: BLE001 - ill-formed content
            problem = 'not what {} holds ({}: {})'.format(
                stem + TORCH_SUFFIX, type(error).__name__, error)
        if problem is not None:
            raise BundleError(_one_line('{}: {}'.format(path, problem)))
        self._loaded[stem] = obj
        return obj

    @property
    def state_ref(self) -> Optional[StateRef]:
        """The :class:`StateRef` of the bundle this one replays its model
        (and optimizer) state from; ``None`` when it holds its own.

        Raises:
            BundleError: The manifest's reference is ill-formed.
        """
        data = self.manifest.get(STATE_FROM)
        if data is None or self.has(MODEL):
            return None
        try:
            return StateRef.from_dict(data)
        except ValueError as error:
            raise BundleError(_one_line('corrupt {} in {}: {}'.format(
                STATE_FROM, osp.join(self.path, MANIFEST), error)))

    def state_bundle(self) -> Bundle:
        """The bundle holding the state this one replays from: itself, or
        the verified bundle its :attr:`state_ref` names beside it.

        Raises:
            BundleError: That bundle is not beside it (pruned, moved, or its
                write failed) or does not verify.
        """
        ref = self.state_ref
        if ref is None:
            return self
        problems = []
        for candidate in ref.candidates(osp.dirname(self.path)):
            try:
                other = load_bundle(candidate, self._map_location)
            except BundleError as error:
                problems.append(str(error))
                continue
            if other.has(MODEL) and StateRef.of(other.manifest) == ref:
                return other
        raise BundleError(_one_line(
            '{} holds no model state: it replays from the bundle of iteration '
            '{} written by rank {}, which is not beside it in {}{}'.format(
                self.path, ref.iter, ref.rank, osp.dirname(self.path),
                ' ({})'.format('; '.join(problems)) if problems else
                ' (moved, or its write failed)')))

    def state_note(self) -> str:
        """What this bundle replays on, in one line (``mmnan inspect`` and
        the replayed report say it)."""
        ref = self.state_ref
        if ref is None:
            held = [stem for stem in (MODEL, OPTIMIZER) if self.has(stem)]
            return 'state: {} in this bundle'.format(
                ' and '.join(held) if held else 'none')
        if ref.iter == self.manifest.get('iter'):
            # Another rank's bundle of the same incident: DDP's weights.
            return ('state: not in this bundle (rank {} wrote the state of '
                    'this incident; dump_state=\'per_kind\'): its batch '
                    'replays on the state of that bundle beside it, the same '
                    'weights and optimizer state; buffers DDP does not share '
                    '(BN statistics) are rank {}\'s'.format(ref.rank,
                                                            ref.rank))
        return ('state: not in this bundle (a later incident of a kind the '
                'run had seen; dump_state=\'per_kind\'): its batch replays on '
                'the state of the bundle of iteration {} (rank {}) beside it. '
                'The data checks, the sample findings and the fixes replay as '
                'in the run; the forward and backward run on the weights of '
                'iteration {}, not of iteration {}, so a failure the weights '
                'made rather than the samples may not reproduce'.format(
                    ref.iter, ref.rank, ref.iter, self.manifest.get('iter')))

    def text(self, file_name: str) -> str:
        """The content of a text file of the bundle (e.g. the config)."""
        if file_name not in self.files:
            raise BundleError('{} has no {}'.format(self.path, file_name))
        with open(osp.join(self.path, file_name), 'rb') as f:
            return f.read().decode('utf-8')


def _load_json(path):
    try:
        with open(path, 'rb') as f:
            return json.loads(f.read().decode('utf-8'))
    except (OSError, ValueError) as error:
        raise BundleError(_one_line('corrupt {}: {}'.format(path, error)))


def load_bundle(path: str, map_location: Any = 'cpu',
                load: Sequence[str] = ()) -> Bundle:
    """Open and verify a bundle written by :func:`write_bundle`.

    Every file listed in the manifest is checked for presence, size and
    sha256, so a truncated or altered bundle is rejected before use.

    Args:
        path (str): Bundle directory.
        map_location: Where tensors go; ``'cpu'`` so that a bundle written
            on a GPU loads on a CPU-only machine.
        load (Sequence[str]): Torch file stems to unpickle right away, so
            that their errors surface here; the others load on
            :meth:`Bundle.load`.

    Returns:
        Bundle: The verified bundle.

    Raises:
        BundleError: With a one-line message naming the problem and the file.
    """
    if not osp.exists(path):
        raise BundleError('bundle not found: {}'.format(path))
    if not osp.isdir(path):
        raise BundleError('not a bundle (not a directory): {}'.format(path))
    path = osp.normpath(path)
    if osp.basename(path).startswith(_TMP_PREFIX):
        raise BundleError(
            'partial bundle (its write was interrupted): {}'.format(path))
    manifest_path = osp.join(path, MANIFEST)
    if not osp.isfile(manifest_path):
        raise BundleError('not an mmnanhook bundle (no {}): {}'.format(
            MANIFEST, path))
    manifest = _load_json(manifest_path)
    if not isinstance(manifest, dict) or 'format_version' not in manifest:
        raise BundleError(
            'corrupt {}: no format_version'.format(manifest_path))
    if manifest['format_version'] != FORMAT_VERSION:
        raise BundleError(_one_line(
            'unknown bundle format_version {!r} in {} (this mmnanhook {} '
            'reads {})'.format(manifest['format_version'], manifest_path,
                               __version__, FORMAT_VERSION)))
    files = manifest.get('files')
    if not isinstance(files, list) or not all(
            isinstance(entry, dict) and isinstance(entry.get('name'), str)
            and osp.basename(entry['name']) == entry['name']
            and entry['name'] not in ('', '.', '..', MANIFEST)
            and isinstance(entry.get('size'), int)
            and isinstance(entry.get('sha256'), str) for entry in files):
        raise BundleError(
            'corrupt {}: bad "files" list'.format(manifest_path))
    for entry in files:
        file_path = osp.join(path, entry['name'])
        if not osp.isfile(file_path):
            raise BundleError('missing file {} (listed in {})'.format(
                file_path, MANIFEST))
        size = osp.getsize(file_path)
        if size != entry['size']:
            raise BundleError(
                'truncated or altered file {}: {} bytes, the manifest says {}'
                .format(file_path, size, entry['size']))
        if sha256(file_path) != entry['sha256']:
            raise BundleError(
                'altered file {}: sha256 differs from the manifest'.format(
                    file_path))
    if REPORT not in {entry['name'] for entry in files}:
        raise BundleError('corrupt {}: {} is not listed'.format(
            manifest_path, REPORT))
    report = _load_json(osp.join(path, REPORT))
    bundle = Bundle(path, manifest, report, map_location)
    for stem in load:
        bundle.load(stem)
    return bundle
