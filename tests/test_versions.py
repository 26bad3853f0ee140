"""docker/versions.env is the one source of the DOTA stack's pins.

The Docker image (ARG defaults of docker/Dockerfile) and its CPU twin, the
DOTA leg (.venv-dota), must both be exactly what it says.  ARG defaults cannot
be read from a file, so they are written out in the Dockerfile and these tests
are what keeps the two from drifting.
"""
import importlib
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSIONS_ENV = os.path.join(ROOT, 'docker', 'versions.env')
DOCKERFILE = os.path.join(ROOT, 'docker', 'Dockerfile')
DOTA_VENV = os.path.join(ROOT, '.venv-dota')

# Every key of versions.env is checked somewhere: pins of Python packages that
# the CPU twin installs too (key -> module whose __version__ must match) ...
TWIN_MODULES = {
    'TORCH_VERSION': 'torch',
    'TORCHVISION_VERSION': 'torchvision',
    'NUMPY_VERSION': 'numpy',
    'PILLOW_VERSION': 'PIL',
    'MMENGINE_VERSION': 'mmengine',
    'MMCV_VERSION': 'mmcv',
    'MMDET_VERSION': 'mmdet',
    'MMROTATE_VERSION': 'mmrotate',
}
# ... the interpreter, and what only the image has (the twin has no CUDA); the
# image's build-time self-check compares those against what got installed.
IMAGE_ONLY = {'BASE_IMAGE', 'TORCH_CUDA_SUFFIX', 'CUDA_TOOLKIT_VERSION'}

# One value that bash `.`, GNU make `include` and `docker --env-file` all read
# the same way: no quotes, spaces, `$` or `;`.
_ENV_LINE = re.compile(r'^([A-Z][A-Z0-9_]*)=([A-Za-z0-9._:/+-]+)$')
_ARG_LINE = re.compile(r'^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(.*?))?\s*$',
                       re.IGNORECASE)


def read_versions_env():
    path = VERSIONS_ENV
    pins = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            # Not stripped: make keeps trailing blanks in a value, bash a '\r'.
            line = line.rstrip('\n')
            if not line.strip() or line.startswith('#'):
                continue
            match = _ENV_LINE.match(line)
            assert match, '%s:%d: not a plain KEY=VALUE line: %r' % (
                path, lineno, line)
            key, value = match.groups()
            assert key not in pins, '%s:%d: %s set twice' % (path, lineno,
                                                            key)
            pins[key] = value
    return pins


def read_dockerfile_args():
    """Map each ARG name to the list of defaults it is declared with."""
    args = {}
    with open(DOCKERFILE) as f:
        for line in f:
            match = _ARG_LINE.match(line)
            if match:
                name, default = match.groups()
                defaults = args.setdefault(name, [])
                if default is not None:
                    defaults.append(default.strip('"\''))
    return args


def test_every_pin_is_checked():
    keys = set(read_versions_env())
    known = set(TWIN_MODULES) | IMAGE_ONLY | {'PYTHON_VERSION'}
    assert keys == known, (
        'docker/versions.env and tests/test_versions.py disagree on the pins: '
        'unchecked %s, missing %s' % (sorted(keys - known),
                                      sorted(known - keys)))


def test_dockerfile_arg_defaults_equal_versions_env():
    pins = read_versions_env()
    args = read_dockerfile_args()
    drift = []
    for key, value in sorted(pins.items()):
        defaults = args.get(key, [])
        if not defaults or any(d != value for d in defaults):
            drift.append('%s: Dockerfile ARG default %s, versions.env %s' %
                         (key, defaults or 'missing', value))
    # A version ARG added to the Dockerfile alone would escape the twin.
    drift += [
        '%s: Dockerfile ARG not in versions.env' % name
        for name in sorted(args) if name.endswith('_VERSION')
        and name not in pins
    ]
    assert not drift, 'docker/Dockerfile drifted from docker/versions.env:\n' \
        + '\n'.join(drift)


def test_dockerfile_installs_from_the_pins():
    # Each pin reaches its install through ${KEY}; an unused ARG or a version
    # written out again would pass the test above and drift later.
    with open(DOCKERFILE) as f:
        body = '\n'.join(
            line for line in f.read().splitlines()
            if not _ARG_LINE.match(line) and not line.lstrip().startswith('#'))
    pins = read_versions_env()
    unused = [key for key in sorted(pins) if '${%s}' % key not in body]
    literal = [
        '%s (%s)' % (key, value) for key, value in sorted(pins.items())
        if re.search(r'(?<![\w.])%s(?![\w.])' % re.escape(value), body)
    ]
    assert not unused and not literal, (
        'docker/Dockerfile: pins never used as ${KEY}: %s; pins written out '
        'literally instead of ${KEY}: %s' % (unused, literal))


def _in_dota_venv():
    return os.path.realpath(sys.prefix) == os.path.realpath(DOTA_VENV)


@pytest.mark.skipif(
    not _in_dota_venv(),
    reason='not the DOTA leg: this interpreter (%s) is not %s, the CPU twin '
    'of the Docker image whose installed versions this checks' %
    (sys.prefix, DOTA_VENV))
def test_dota_venv_has_exactly_the_pinned_versions():
    pins = read_versions_env()
    wrong = []
    python = '%d.%d' % sys.version_info[:2]
    if python != pins['PYTHON_VERSION']:
        wrong.append('python: %s, want %s' % (python,
                                              pins['PYTHON_VERSION']))
    for key, module in sorted(TWIN_MODULES.items()):
        try:
            version = importlib.import_module(module).__version__
        except ImportError as e:
            wrong.append('%s: not importable (%s), want %s' %
                         (module, e, pins[key]))
            continue
        # The twin's PyPI torch 1.7.1 is the CUDA 10.2 build without a local
        # '+cu...' tag; the image's is '+cu110', which its self-check checks.
        if version.split('+')[0] != pins[key]:
            wrong.append('%s: %s, want %s' % (module, version, pins[key]))
    try:
        importlib.import_module('mmcv.ops')
    except ImportError as e:
        wrong.append('mmcv.ops: compiled ops missing (%s)' % e)
    assert not wrong, '.venv-dota differs from docker/versions.env:\n' + \
        '\n'.join(wrong)
