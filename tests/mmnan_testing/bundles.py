"""Bundles made corrupt, partial, foreign or hostile in every way the loader
rejects."""
import hashlib
import io
import json
import os
import os.path as osp
import shutil

import torch


def _rewrite_manifest(path, edit):
    manifest_path = osp.join(path, 'manifest.json')
    with open(manifest_path) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(manifest_path, 'w') as f:
        json.dump(manifest, f)


def copy_bundle(bundle, tmp_path):
    """A copy of ``bundle`` in the directory ``tmp_path`` (a ``pathlib``
    path), to alter."""
    path = str(tmp_path / osp.basename(bundle))
    shutil.copytree(bundle, path)
    return path


def replace_listed_file(path, name, data):
    """Replace a file and its manifest entry: only its content is wrong."""
    with open(osp.join(path, name), 'wb') as f:
        f.write(data)

    def edit(manifest):
        for entry in manifest['files']:
            if entry['name'] == name:
                entry['size'] = len(data)
                entry['sha256'] = hashlib.sha256(data).hexdigest()

    _rewrite_manifest(path, edit)


def drop_listed_file(path, name):
    """Remove a file and its manifest entry, as a bundle written without it
    (by an older mmnanhook) would be."""
    os.remove(osp.join(path, name))

    def edit(manifest):
        manifest['files'] = [e for e in manifest['files'] if e['name'] != name]

    _rewrite_manifest(path, edit)


def _replace_text(file_path, text):
    with open(file_path, 'w') as f:
        f.write(text)


def _truncate(file_path):
    with open(file_path, 'rb') as f:
        data = f.read()
    with open(file_path, 'wb') as f:
        f.write(data[:len(data) // 2])
    return file_path


def _flip_byte(file_path):
    with open(file_path, 'r+b') as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xff]))
    return file_path


def _set_version(manifest):
    manifest['format_version'] = 99


def _escape_files(manifest):
    manifest['files'][0]['name'] = '../outside.txt'


# Case -> (corrupt(bundle path) -> path to load, what the error names:
# {manifest}, {model}, {report} stand for those files' paths).
CORRUPTIONS = {
    'missing path': (lambda p: p + '_nope', 'not found'),
    'a file': (lambda p: osp.join(p, 'config.py'), 'not a directory'),
    'foreign empty dir':
    (lambda p: (os.mkdir(p + '_x'), p + '_x')[1], 'no manifest.json'),
    'foreign dir': (lambda p: (os.remove(osp.join(p, 'manifest.json')), p)[1],
                    'no manifest.json'),
    'truncated manifest':
    (lambda p: (_truncate(osp.join(p, 'manifest.json')), p)[1],
     'corrupt {manifest}'),
    'manifest not an object':
    (lambda p: (_replace_text(osp.join(p, 'manifest.json'), '[1]'), p)[1],
     'no format_version'),
    'unknown format_version':
    (lambda p: (_rewrite_manifest(p, _set_version), p)[1],
     'format_version 99'),
    'bad files list': (lambda p: (_rewrite_manifest(p, _escape_files), p)[1],
                       'bad "files" list'),
    'missing file': (lambda p: (os.remove(osp.join(p, 'model.pth')), p)[1],
                     'missing file {model}'),
    'truncated file': (lambda p: (_truncate(osp.join(p, 'model.pth')), p)[1],
                       'truncated or altered file {model}'),
    'sha256 mismatch':
    (lambda p: (_flip_byte(osp.join(p, 'model.pth')), p)[1],
     'altered file {model}: sha256'),
    'corrupt report':
    (lambda p: (replace_listed_file(p, 'report.json', b'{"kind": '), p)[1],
     'corrupt {report}'),
}


class _RunsCode(object):
    """Unpickles by calling ``exec``: a hostile bundle's payload, which
    creates the file ``marker`` if it ever runs."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, ("open({!r}, 'w').close()".format(self.marker), )


def hostile_torch_file(marker):
    """The bytes of a torch file that creates ``marker`` when unpickled,
    its payload inside what looks like an RNG state."""
    data = io.BytesIO()
    torch.save({'torch': _RunsCode(marker), 'numpy': None, 'random': None},
               data)
    return data.getvalue()


def hostile_config(text, marker):
    """A config ``text`` that creates ``marker`` when executed."""
    return "open({!r}, 'w').close()\n{}".format(marker, text)
