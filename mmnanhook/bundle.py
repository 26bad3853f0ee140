"""The replay bundle: an atomically written, self-checking dump directory.

Layout of a bundle directory::

    manifest.json   written last; lists every other file with size and sha256
    report.json     the diagnosis
    <stem>.pth      torch.save'd objects (data_batch, model, optimizer, rng...)
    <name>          text files (config, report.txt)
    history.json    the last iterations' loss / grad norm / lr / loss scale
    history.png     their plot, the failing iteration marked
"""
import datetime
import hashlib
import json
import logging
import math
import numbers
import os
import os.path as osp
import platform
import re
import shutil
import socket
import sys
import tempfile

import numpy as np
import torch
from mmengine.logging import print_log

from .compat import distribution_version, torch_load
from .errors import BundleError
from ._format import one_line as _one_line
from .sentinel import plot_history
from .version import __version__

FORMAT_VERSION = 1

MANIFEST = 'manifest.json'
REPORT = 'report.json'
HISTORY_JSON = 'history.json'
HISTORY_PNG = 'history.png'
TORCH_SUFFIX = '.pth'
_RESERVED = (MANIFEST, REPORT, HISTORY_JSON, HISTORY_PNG)

# A bundle being written lives in '.mmnan-tmp.<pid>.<host>.<random>' inside
# dump_dir, so that a write killed midway is recognisable by its name.
_TMP_PREFIX = '.mmnan-tmp.'

# Module name -> distribution names, for packages not imported yet.
_PACKAGES = (
    ('torch', ('torch', )),
    ('mmengine', ('mmengine', 'mmengine-lite')),
    ('mmcv', ('mmcv', 'mmcv-full', 'mmcv-lite')),
    ('mmdet', ('mmdet', )),
    ('mmrotate', ('mmrotate', )),
)


def versions():
    """Versions of python, torch, the OpenMMLab packages and mmnanhook.

    An imported package reports its ``__version__``; one not imported yet is
    looked up in the installed distributions rather than imported (importing
    mmdet just to read its version costs seconds).

    Returns:
        dict: Package name -> version string, ``None`` when not installed.
    """
    result = {'python': platform.python_version()}
    for module, distributions in _PACKAGES:
        loaded = sys.modules.get(module)
        found = getattr(loaded, '__version__', None)
        result[module] = (str(found) if found is not None else
                          distribution_version(distributions))
    result['mmnanhook'] = __version__
    return result


def to_strict_json(obj):
    """Convert ``obj`` into plain data that :func:`json.dumps` writes as
    strict JSON.

    Non-finite floats become the strings ``"nan"``, ``"inf"`` and ``"-inf"``;
    numpy and torch scalars become python numbers, arrays and tensors
    (nested) lists, tuples and sets lists, mapping keys strings. Anything
    else is written as its ``str``, so that a report never fails to save.

    Args:
        obj: The object to convert.

    Returns:
        The converted object.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (np.ndarray, np.generic, torch.Tensor)):
        obj = obj.tolist() if not isinstance(obj, np.generic) else obj.item()
        return to_strict_json(obj)
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        value = float(obj)
        if math.isnan(value):
            return 'nan'
        if math.isinf(value):
            return 'inf' if value > 0 else '-inf'
        return value
    if isinstance(obj, dict):
        return {str(key): to_strict_json(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_strict_json(value) for value in obj]
    return str(obj)


def bundle_name(iter, rank, when=None):
    """Directory name of a bundle, e.g. ``20261130T214500_iter000123_rank0``.

    The local timestamp comes first so that a plain listing of ``dump_dir``
    shows bundles in the order they were written.

    Args:
        iter (int): Global iteration of the trigger.
        rank (int): Rank writing the bundle.
        when (datetime.datetime, optional): Time stamp; now by default.
    """
    when = when or datetime.datetime.now()
    return '{}_iter{:06d}_rank{}'.format(
        when.strftime('%Y%m%dT%H%M%S'), int(iter), int(rank))


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path):
    # Makes a rename / a new directory entry durable; not possible on Windows.
    if os.name != 'posix':
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _RecordingFile(object):
    """File wrapper that remembers an I/O error.

    torch.save reports a failed write (disk full) as a RuntimeError of its
    zip writer, indistinguishable from an object that cannot be pickled; the
    recorded OSError tells the two apart.
    """

    def __init__(self, f):
        self._f = f
        self.error = None

    def write(self, data):
        try:
            return self._f.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self):
        self._f.flush()


def _write_file(path, write):
    with open(path, 'wb') as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path, obj):
    text = json.dumps(to_strict_json(obj), indent=2, allow_nan=False)
    _write_file(path, lambda f: f.write(text.encode('utf-8')))


def _save_torch(path, obj):
    """torch.save ``obj`` into ``path``; the error if it cannot be pickled.

    Returns:
        str | None: Why ``obj`` was not saved, ``None`` when it was.

    Raises:
        OSError: When the file cannot be written.
    """
    with open(path, 'wb') as f:
        recorder = _RecordingFile(f)
        try:
            torch.save(obj, recorder)
        except OSError:
            raise
        except Exception as error:  # noqa: BLE001 - any pickling failure
            if recorder.error is not None:
                raise recorder.error
            reason = '{}: {}'.format(type(error).__name__, error)
        else:
            f.flush()
            os.fsync(f.fileno())
            return None
    os.remove(path)
    return ' '.join(reason.split())


def _check_name(name):
    if not name or name != osp.basename(name) or name in ('.', '..'):
        raise ValueError('not a plain file name: {!r}'.format(name))


def _tmp_owner(entry):
    """(pid, host) that owns a temp dir named by :func:`write_bundle`."""
    parts = entry[len(_TMP_PREFIX):].split('.')
    if not entry.startswith(_TMP_PREFIX) or len(parts) != 3:
        return None
    if not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1]


def _host():
    return re.sub(r'[^A-Za-z0-9-]', '-', socket.gethostname()) or 'host'


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_tmp_dirs(dump_dir, log):
    """Remove temp dirs left by killed writers of this host."""
    # os.kill(pid, 0) terminates the process on Windows: POSIX only.
    if os.name != 'posix':
        return
    host = _host()
    for entry in os.listdir(dump_dir):
        owner = _tmp_owner(entry)
        if owner is None or owner[1] != host or _pid_alive(owner[0]):
            continue
        shutil.rmtree(osp.join(dump_dir, entry), ignore_errors=True)
        log('mmnanhook: removed {}, left by an interrupted bundle write.'
            .format(osp.join(dump_dir, entry)))


def _read_manifest(path):
    """The manifest of bundle directory ``path``, ``None`` if it has none
    that parses as a bundle manifest of a known format."""
    try:
        with open(osp.join(path, MANIFEST), 'rb') as f:
            manifest = json.loads(f.read().decode('utf-8'))
    except (OSError, ValueError):
        return None
    if (not isinstance(manifest, dict)
            or manifest.get('format_version') != FORMAT_VERSION
            or not isinstance(manifest.get('files'), list)):
        return None
    return manifest


def _age_key(path, manifest):
    try:
        created = datetime.datetime.fromisoformat(manifest['created'])
        stamp = created.timestamp()
    except (KeyError, TypeError, ValueError):
        stamp = os.path.getmtime(osp.join(path, MANIFEST))
    return stamp, osp.basename(path)


def _prune(dump_dir, rank, max_dumps, log):
    """Delete the oldest bundles of ``rank`` beyond ``max_dumps``.

    Only directories with a valid manifest of this rank are candidates, so
    foreign directories and other ranks' bundles (written concurrently into
    a shared dump_dir) are never touched.
    """
    bundles = []
    for entry in os.listdir(dump_dir):
        path = osp.join(dump_dir, entry)
        if entry.startswith('.') or not osp.isdir(path):
            continue
        manifest = _read_manifest(path)
        if manifest is not None and manifest.get('rank') == rank:
            bundles.append((_age_key(path, manifest), path))
    bundles.sort()
    for _, path in bundles[:max(len(bundles) - max_dumps, 0)]:
        try:
            shutil.rmtree(path)
        except OSError as error:
            log('mmnanhook: could not remove old bundle {}: {}'.format(
                path, error))
        else:
            log('mmnanhook: removed old bundle {} (max_dumps={}).'.format(
                path, max_dumps))


def write_bundle(dump_dir, name, manifest, tensors, texts, report,
                 history_records, max_dumps=5, logger=None):
    """Write a bundle atomically into ``dump_dir/name``.

    Everything is written and fsynced in a hidden temp dir inside
    ``dump_dir``, ``manifest.json`` last, then the directory is renamed: a
    killed process leaves only a hidden temp dir that :func:`load_bundle`
    rejects (and the next write on the same host removes). When ``name``
    exists already, a numeric suffix is added.

    Args:
        dump_dir (str): Directory holding the bundles; created if missing.
        name (str): Bundle directory name, see :func:`bundle_name`.
        manifest (dict): Manifest content from the caller (``iter``,
            ``epoch``, ``rank``, ``world_size``, ``trigger``, ``losses``...);
            ``format_version``, ``created``, ``versions``, ``files`` and,
            if any object could not be pickled, ``unsaved`` are added.
        tensors (dict): File stem -> object saved with :func:`torch.save`
            as ``<stem>.pth``. An object that cannot be pickled is left out
            and listed in the manifest's ``unsaved`` with the reason.
        texts (dict): File name -> text, written as UTF-8.
        report (dict): The diagnosis, written as ``report.json``.
        history_records (list[dict], optional): History records, written as
            ``history.json`` and plotted into ``history.png`` with
            ``manifest['iter']`` marked.
        max_dumps (int, optional): How many bundles of this rank
            (``manifest['rank']``) to keep in ``dump_dir``, newest first;
            ``None`` keeps all.
        logger (logging.Logger, optional): Where to log; the current
            MMLogger by default.

    Returns:
        str | None: Path of the bundle; ``None`` when it could not be
        written (disk full, unwritable directory), after logging why.
    """
    for entry in list(tensors) + list(texts):
        _check_name(entry)
    names = [stem + TORCH_SUFFIX for stem in tensors] + list(texts)
    clashes = set(names) & set(_RESERVED)
    if clashes or len(set(names)) != len(names):
        raise ValueError('bundle file names clash: {}'.format(
            sorted(clashes) or names))
    if max_dumps is not None and max_dumps < 1:
        raise ValueError('max_dumps must be >= 1 or None, got {}'.format(
            max_dumps))

    def log(message, level=logging.INFO):
        print_log(message, logger=logger or 'current', level=level)

    tmp = None
    try:
        if not osp.isdir(dump_dir):
            os.makedirs(dump_dir)
        _remove_stale_tmp_dirs(dump_dir, log)
        tmp = tempfile.mkdtemp(
            prefix='{}{}.{}.'.format(_TMP_PREFIX, os.getpid(), _host()),
            dir=dump_dir)
        unsaved = {}
        for stem, obj in tensors.items():
            reason = _save_torch(osp.join(tmp, stem + TORCH_SUFFIX), obj)
            if reason is not None:
                unsaved[stem] = reason
                log('mmnanhook: {} is left out of the bundle: {}'.format(
                    stem, reason), logging.WARNING)
        for file_name, text in texts.items():
            data = text.encode('utf-8')
            _write_file(osp.join(tmp, file_name), lambda f: f.write(data))
        _write_json(osp.join(tmp, REPORT), report)
        if history_records is not None:
            _write_json(osp.join(tmp, HISTORY_JSON), history_records)
            _plot(history_records, osp.join(tmp, HISTORY_PNG),
                  manifest.get('iter'), log)

        full = dict(manifest)
        full['format_version'] = FORMAT_VERSION
        full['created'] = datetime.datetime.now().astimezone().isoformat()
        full['versions'] = versions()
        if unsaved:
            full['unsaved'] = unsaved
        full['files'] = [{
            'name': entry,
            'size': osp.getsize(osp.join(tmp, entry)),
            'sha256': _sha256(osp.join(tmp, entry)),
        } for entry in sorted(os.listdir(tmp))]
        _write_json(osp.join(tmp, MANIFEST), full)
        _fsync_dir(tmp)

        final = osp.join(dump_dir, name)
        suffix = 1
        while osp.exists(final):
            suffix += 1
            final = osp.join(dump_dir, '{}_{}'.format(name, suffix))
        os.rename(tmp, final)
        tmp = None
        _fsync_dir(dump_dir)
    except OSError as error:
        log('mmnanhook: the bundle was NOT written to {}: {}'.format(
            dump_dir, error), logging.ERROR)
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if max_dumps is not None:
        try:
            _prune(dump_dir, full.get('rank'), max_dumps, log)
        except OSError as error:
            log('mmnanhook: could not prune old bundles in {}: {}'.format(
                dump_dir, error), logging.WARNING)
    log('mmnanhook: bundle written to {}'.format(final))
    return final


def _plot(records, path, fail_iter, log):
    try:
        plot_history(records, path, fail_iter)
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001 - a plot never costs a bundle
        if osp.exists(path):
            os.remove(path)
        log('mmnanhook: history.png is left out of the bundle: {}: {}'.format(
            type(error).__name__, error), logging.WARNING)


class Bundle(object):
    """A bundle directory that passed :func:`load_bundle`'s checks.

    Attributes:
        path (str): The bundle directory.
        manifest (dict): ``manifest.json``.
        report (dict): ``report.json``.
        files (dict): File name -> manifest entry (name, size, sha256).
    """

    def __init__(self, path, manifest, report, map_location):
        self.path = path
        self.manifest = manifest
        self.report = report
        self.files = {entry['name']: entry for entry in manifest['files']}
        self._map_location = map_location
        self._loaded = {}

    def __repr__(self):
        return 'Bundle({!r})'.format(self.path)

    def has(self, stem):
        """Whether the torch file ``<stem>.pth`` is in the bundle."""
        return stem + TORCH_SUFFIX in self.files

    def load(self, stem):
        """Unpickle ``<stem>.pth`` (once; later calls return the same object).

        Args:
            stem (str): e.g. ``'data_batch'``, ``'model'``, ``'rng'``.

        Raises:
            BundleError: The file is absent or cannot be unpickled (e.g. the
                classes of the data samples are not importable here).
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
        try:
            obj = torch_load(osp.join(self.path, file_name),
                             map_location=self._map_location)
        except Exception as error:  # noqa: BLE001 - any unpickling failure
            raise BundleError(_one_line('cannot load {}: {}: {}'.format(
                osp.join(self.path, file_name), type(error).__name__,
                error)))
        self._loaded[stem] = obj
        return obj

    def text(self, file_name):
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


def load_bundle(path, map_location='cpu', load=()):
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
        if _sha256(file_path) != entry['sha256']:
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
