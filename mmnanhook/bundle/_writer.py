"""Writing a bundle atomically, and keeping at most ``max_dumps`` of them."""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import os.path as osp
import re
import shutil
import socket
import tempfile
from typing import Any, Callable, Collection, Dict, List, Optional

import torch
from .._log import log as _log

from ._layout import (_RESERVED, _TMP_PREFIX, FORMAT_VERSION, HISTORY_JSON,
                      HISTORY_PNG, MANIFEST, REPORT, TORCH_SUFFIX,
                      to_strict_json, versions)
from ._plot import plot_history
from ._state import StateRef


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
    """File wrapper that digests what is written, and remembers an I/O
    error.

    The manifest's sizes and sha256 come from the bytes as they are written:
    reading a multi-GB state back to hash it would double a bundle's I/O.
    torch.save reports a failed write (disk full) as a RuntimeError of its
    zip writer, indistinguishable from an object that cannot be pickled; the
    recorded OSError tells the two apart.
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error = None
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        try:
            written = self._f.write(data)
        except OSError as error:
            self.error = error
            raise
        # torch's zip writer hands over memoryviews of tensor storages.
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self._f.flush()

    def entry(self, name: str) -> Dict[str, Any]:
        """The manifest's entry of the file written."""
        return dict(name=name, size=self.size,
                    sha256=self.digest.hexdigest())


def _write_file(path, write):
    """Write and fsync ``path`` by ``write(f)``; its manifest entry."""
    with open(path, 'wb') as f:
        recorder = _RecordingFile(f)
        write(recorder)
        f.flush()
        os.fsync(f.fileno())
    return recorder.entry(osp.basename(path))


def _write_json(path, obj):
    text = json.dumps(to_strict_json(obj), indent=2, allow_nan=False)
    return _write_file(path, lambda f: f.write(text.encode('utf-8')))


def _save_torch(path, obj):
    """torch.save ``obj`` into ``path``; the error if it cannot be pickled.

    Returns:
        tuple: ``(entry, None)`` with the file's manifest entry, or
        ``(None, why)`` when ``obj`` was not saved.

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
            return recorder.entry(osp.basename(path)), None
    os.remove(path)
    return None, ' '.join(reason.split())


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


def _prune(dump_dir, newest, rank, max_dumps, keep, log):
    """Delete the oldest bundles of ``rank`` beyond ``max_dumps``.

    Only directories with a valid manifest of this rank are candidates, so
    foreign directories and other ranks' bundles (written concurrently into
    a shared dump_dir) are never touched; nor is ``newest`` (the bundle just
    written), nor those ``keep`` names (:class:`~._state.StateRef`: their
    state is what later bundles replay from), which count towards
    ``max_dumps`` all the same.
    """
    bundles, kept = [], 0
    for entry in os.listdir(dump_dir):
        path = osp.join(dump_dir, entry)
        if entry.startswith('.') or not osp.isdir(path):
            continue
        manifest = _read_manifest(path)
        if manifest is None or manifest.get('rank') != rank:
            continue
        if path == newest or StateRef.of(manifest) in keep:
            kept += 1
        else:
            bundles.append((_age_key(path, manifest), path))
    bundles.sort()
    for _, path in bundles[:max(len(bundles) + kept - max_dumps, 0)]:
        try:
            shutil.rmtree(path)
        except OSError as error:
            log('mmnanhook: could not remove old bundle {}: {}'.format(
                path, error))
        else:
            log('mmnanhook: removed old bundle {} (max_dumps={}).'.format(
                path, max_dumps))


def write_bundle(dump_dir: str, name: str, manifest: Dict[str, Any],
                 tensors: Dict[str, Any], texts: Dict[str, str],
                 report: Dict[str, Any],
                 history_records: Optional[List[Dict[str, Any]]],
                 max_dumps: Optional[int] = 5,
                 logger: Optional[logging.Logger] = None,
                 blobs: Optional[Dict[str, bytes]] = None,
                 render: Optional[Callable[..., Dict[str, bytes]]] = None,
                 keep: Collection[StateRef] = ()) -> Optional[str]:
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
        blobs (dict, optional): File name -> bytes written as they are
            (pictures).
        render (callable, optional): ``render(history_png, versions)`` ->
            file name -> bytes, called once everything else is written
            (``report.html`` inlines the history plot); a failure costs
            only its files.
        keep (set[StateRef]): Bundles pruning leaves, beyond
            ``max_dumps``: those holding a state other bundles name.

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

    def log(message: str, level: int = logging.INFO) -> None:
        _log(message, level, logger)

    tmp = None
    try:
        # Every rank of a DDP run may create it at the same moment.
        os.makedirs(dump_dir, exist_ok=True)
        _remove_stale_tmp_dirs(dump_dir, log)
        tmp = tempfile.mkdtemp(
            prefix='{}{}.{}.'.format(_TMP_PREFIX, os.getpid(), _host()),
            dir=dump_dir)
        unsaved, entries = {}, []
        for stem, obj in tensors.items():
            entry, reason = _save_torch(osp.join(tmp, stem + TORCH_SUFFIX),
                                        obj)
            if reason is not None:
                unsaved[stem] = reason
                log('mmnanhook: {} is left out of the bundle: {}'.format(
                    stem, reason), logging.WARNING)
            else:
                entries.append(entry)
        for file_name, text in texts.items():
            data = text.encode('utf-8')
            entries.append(_write_file(osp.join(tmp, file_name),
                                       lambda f: f.write(data)))
        entries.append(_write_json(osp.join(tmp, REPORT), report))
        history_png = None
        if history_records is not None:
            entries.append(_write_json(osp.join(tmp, HISTORY_JSON),
                                       history_records))
            history_png = _plot(history_records, osp.join(tmp, HISTORY_PNG),
                                manifest.get('iter'), log)
            if history_png is not None:
                entries.append(_entry(HISTORY_PNG, history_png))
        for file_name, data in (blobs or {}).items():
            _check_name(file_name)
            entries.append(_write_file(osp.join(tmp, file_name),
                                       lambda f, data=data: f.write(data)))
        if render is not None:
            entries.extend(_render(render, tmp, history_png, log))

        full = dict(manifest)
        full['format_version'] = FORMAT_VERSION
        full['created'] = datetime.datetime.now().astimezone().isoformat()
        full['versions'] = versions()
        if unsaved:
            full['unsaved'] = unsaved
        full['files'] = sorted(entries, key=lambda e: e['name'])
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
            _prune(dump_dir, final, full.get('rank'), max_dumps, keep, log)
        except OSError as error:
            log('mmnanhook: could not prune old bundles in {}: {}'.format(
                dump_dir, error), logging.WARNING)
    log('mmnanhook: bundle written to {}'.format(final))
    return final


def _plot(records, path, fail_iter, log):
    """Write the history plot; return its bytes (``None`` if it failed)."""
    try:
        plot_history(records, path, fail_iter)
        with open(path, 'rb') as f:
            return f.read()
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001 - a plot never costs a bundle
        if osp.exists(path):
            os.remove(path)
        log('mmnanhook: history.png is left out of the bundle: {}: {}'.format(
            type(error).__name__, error), logging.WARNING)
        return None


def _entry(name, data):
    # history.png is written by matplotlib and read back whole anyway.
    return dict(name=name, size=len(data),
                sha256=hashlib.sha256(data).hexdigest())


def _render(render, tmp, history_png, log):
    """Write what ``render`` makes; their manifest entries."""
    try:
        files = render(history_png, versions())
    except Exception as error:  # noqa: BLE001 - it never costs a bundle
        log('mmnanhook: report.html is left out of the bundle: {}: {}'.format(
            type(error).__name__, error), logging.WARNING)
        return []
    entries = []
    for file_name, data in files.items():
        _check_name(file_name)
        entries.append(_write_file(osp.join(tmp, file_name),
                                   lambda f, data=data: f.write(data)))
    return entries
