"""Every fenced block of README.md and docs/*.md, checked the way a user
would use it.

* ``python``: a config snippet. Loaded by mmengine (``mmdet::`` and
  ``mmnanhook::`` bases resolved as installed) and its hook built, options
  validated. The wheel tier (scripts/wheel_check.py) trains the README's
  ``_base_`` snippet through ``tools/train.py`` from the installed wheel.
* ``json``: parsed; a quarantine list is read by mmnanhook's own reader.
* ``bash``: every command. ``mmnan`` commands run here in a fresh process
  (``BUNDLE`` and ``CONFIG`` stand for a bundle of a real run and a config of
  a real dataset), but ``mmnan demo``, which tests/cli/test_demo.py and the
  wheel tier run; ``make`` targets exist in the Makefile; ``python -m
  build`` and ``pip install`` of the wheel are what scripts/test_wheel.sh
  runs; ``docker`` commands are the image's (no Docker on the test machine:
  docker/Dockerfile is linted by ``make lint`` and its pins checked by
  tests/test_versions.py); ``torchrun ... mmnan drill`` is what
  tests/zoo/test_zoo_drill.py launches.
* ``text``: output and pictures; the README's demo output is compared with a
  real demo's in tests/cli/test_demo.py.

Inline code in the prose, too: every ``make`` target named exists; every
``mmnan`` usage names the parser's commands and options; every pytest, script
and benchmark command names files, tests, flags and variables that exist;
every config line (``dict(type='NanDetectHook')``, ``runner_type = ...``,
``custom_imports = ...``, a pipeline step) is built.
"""
import argparse
import glob
import importlib
import json
import os.path as osp
import re
import shlex
import sys

import pytest

from mmnanhook.quarantine import flight_dir
from mmnan_testing import testbed
from mmnan_testing.cli import PROJECT_DIR, mmnan, toy_config, train_to_bundle

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
PAGES = ['README.md'] + sorted(
    osp.relpath(p, ROOT) for p in glob.glob(osp.join(ROOT, 'docs', '*.md')))
_FENCE = re.compile(r'^```([\w-]*)\n(.*?)^```[ \t]*$', re.M | re.S)
KINDS = ('python', 'bash', 'json', 'text')


def _blocks():
    """``(page, index on the page, language, text)`` of every fenced block."""
    found = []
    for page in PAGES:
        with open(osp.join(ROOT, page)) as f:
            for i, m in enumerate(_FENCE.finditer(f.read())):
                found.append((page, i, m.group(1), m.group(2)))
    return found


BLOCKS = _blocks()


def _of(kind):
    return [pytest.param(text, id='%s#%d' % (page, i))
            for page, i, lang, text in BLOCKS if lang == kind]


def _commands():
    """Every command line of the bash blocks, comments dropped."""
    lines = []
    for page, i, lang, text in BLOCKS:
        if lang != 'bash':
            continue
        for line in text.splitlines():
            line = line.split(' #')[0].strip()
            if line and not line.startswith('#'):
                lines.append(pytest.param(line, id='%s#%d: %s' % (
                    page, i, line)))
    return lines


def test_every_block_says_what_it_is():
    assert len(PAGES) > 1 and BLOCKS
    untyped = [(page, text[:60]) for page, _, lang, text in BLOCKS
               if lang not in KINDS]
    assert not untyped, untyped


def test_no_page_has_indented_code():
    """An indented block would escape the checks of this file."""
    for page in PAGES:
        with open(osp.join(ROOT, page)) as f:
            text = _FENCE.sub('', f.read())
        blocks = re.findall(r'(?:^|\n\n)((?: {4}[^ *\-\d|][^\n]*\n)+)', text)
        assert not blocks, (page, blocks)


@pytest.mark.parametrize('text', _of('python'))
def test_config_snippet_loads_and_builds_the_hook(tmp_path, text):
    from mmengine.config import Config
    from mmengine.registry import HOOKS

    import _mmnanhook_scope
    from mmnanhook import NanDetectHook
    from mmnanhook.runner import OPTIONS_KEY
    if 'mmdet::' in text:
        pytest.importorskip('mmdet')
    _mmnanhook_scope.install()
    path = tmp_path / 'snippet.py'
    path.write_text(text)
    cfg = Config.fromfile(str(path))
    if cfg.get('runner_type'):
        assert cfg.runner_type == 'mmnanhook.NanDetectRunner'
        hook = NanDetectHook(**dict(cfg.get(OPTIONS_KEY) or {}))
    else:
        hook = HOOKS.build(cfg.default_hooks.nan_detect)
    assert isinstance(hook, NanDetectHook)


@pytest.mark.parametrize('text', _of('json'))
def test_json_block_is_what_mmnanhook_reads(tmp_path, text):
    from mmnanhook.quarantine import read_quarantine
    data = json.loads(text)
    if data.get('format') == 'mmnanhook-quarantine':
        path = tmp_path / 'list.json'
        path.write_text(text)
        assert len(read_quarantine(str(path))) == len(data['samples'])


@pytest.fixture(scope='module')
def placeholders(tmp_path_factory):
    """What ``BUNDLE`` and ``CONFIG`` stand for: a bundle of a real run, the
    tiny RetinaNet's config on a synthetic dataset with one bad box."""
    root = tmp_path_factory.mktemp('docs')
    if PROJECT_DIR not in sys.path:  # the toy's project, as a user's is
        sys.path.insert(0, PROJECT_DIR)
    importlib.import_module('replay_toys')  # registers the toy model
    error = train_to_bundle(toy_config(str(root / 'toy'),
                                       'RandomSubsetRegressor'))
    data = testbed.make_dataset('retinanet_voc', str(root / 'data'),
                                num_images=4, defects={1: 'zero_size'})
    config = str(root / 'config.py')
    testbed.tiny_config('retinanet_voc', data, str(root / 'run')).dump(config)
    # The toy run's work dir: the one above its bundle that holds its
    # record of the steps in flight.
    work_dir = error.bundle
    while not osp.isdir(flight_dir(work_dir)) and work_dir != '/':
        work_dir = osp.dirname(work_dir)
    return dict(BUNDLE=error.bundle, CONFIG=config, DIR=str(root / 'show'),
                OUT=str(root / 'quarantine.json'), WORK_DIR=work_dir)


def _makefile_targets():
    with open(osp.join(ROOT, 'Makefile')) as f:
        return set(re.findall(r'^([\w-]+):', f.read(), re.M))


# Exit codes a documented command may end with (mmnan's contract: 1 is
# ``scan`` or ``doctor`` having found something, or a ``drill`` verdict that
# does not hold on the config with a bad box: what they are shown for).
_OK = {'replay': (0, ), 'inspect': (0, ), 'scan': (0, 1),
       'doctor': (0, 1), 'drill': (0, 1)}


# A training and fresh processes: in make test on the DOTA leg, whose share
# of the everyday tier has room; on the modern leg in make test-zoo.
@pytest.mark.everyday_leg('dota')
@pytest.mark.parametrize('line', _commands())
def test_command(line, placeholders):
    words = shlex.split(line)
    if words[0] == 'make':
        assert set(words[1:]) <= _makefile_targets(), line
    elif words[0] == 'mmnan' and words[1] == '--version':
        result = mmnan('--version')
        assert result.returncode == 0 and result.stdout.startswith(
            'mmnanhook '), result.stdout + result.stderr
    elif words[0] == 'mmnan' and words[1] == 'demo':
        assert osp.isfile(osp.join(ROOT, 'tests', 'cli', 'test_demo.py'))
    elif words[0] == 'mmnan':
        if words[1] in ('scan', 'doctor', 'drill'):
            pytest.importorskip('mmdet')
        args = [placeholders.get(w, w) for w in words[1:]]
        result = mmnan(*args)
        assert result.returncode in _OK[words[1]], (
            line, result.stdout[-2000:] + result.stderr[-2000:])
    elif words[:3] == ['python', '-m', 'build'] or words[:2] == [
            'pip', 'install']:
        with open(osp.join(ROOT, 'scripts', 'test_wheel.sh')) as f:
            wheel_tier = f.read()
        assert '-m build' in wheel_tier, line
        from mmnanhook import __version__
        assert words[0] == 'python' or words[2:] == [
            'dist/mmnanhook-%s-py3-none-any.whl' % __version__], line
    elif words[0] == 'docker':
        assert words[1] in ('build', 'run'), line
    elif words[0] == 'torchrun':
        # tests/zoo/test_zoo_drill.py runs it under torch's launcher.
        assert words[1:6] == ['--nproc_per_node', '2', '-m', 'mmnanhook',
                              'drill'] and '--launcher' in words, line
    else:
        raise AssertionError('a command no test runs: %s' % line)


# -- inline code in the prose ------------------------------------------------

_SPAN = re.compile(r'(?<!`)`([^`\n]+)`(?!`)')


def _spans():
    """Every inline code span of the pages' prose (fenced blocks left
    out): ``(page, text)``."""
    found = []
    for page in PAGES:
        with open(osp.join(ROOT, page)) as f:
            prose = _FENCE.sub('', f.read())
        found.extend((page, m.group(1)) for m in _SPAN.finditer(prose))
    return found


SPANS = _spans()


def _spans_like(pattern):
    return sorted(set(pytest.param(text, id='%s: %s' % (page, text))
                      for page, text in SPANS if re.match(pattern, text)),
                  key=lambda p: p.id)


def test_every_make_target_named_in_the_prose_exists():
    named = set(text.split()[1] for _, text in SPANS
                if re.match(r'make [\w-]+$', text))
    assert named and named <= _makefile_targets(), named - \
        _makefile_targets()


def _subcommands():
    from mmnanhook.cli import build_parser
    parser = build_parser()
    action = next(a for a in parser._actions
                  if isinstance(a, argparse._SubParsersAction))
    return parser, action.choices


@pytest.mark.parametrize('text', _spans_like(r'mmnan (-|[a-z])'))
def test_every_mmnan_usage_in_the_prose_is_the_parser_s(text):
    parser, commands = _subcommands()
    words = text.split()
    if words[1].startswith('--'):
        options = parser._option_string_actions
    else:
        # `mmnan replay / inspect / scan`: each named command exists.
        named = [w for w in words[1:] if re.match(r'[a-z]+$', w)]
        assert named and set(named) <= set(commands), text
        options = commands[words[1]]._option_string_actions
    flags = re.findall(r'(?<![\w-])(--[a-z][\w-]*)', text)
    assert set(flags) <= set(options), (text, sorted(options))


@pytest.mark.parametrize('text', _spans_like(r'\.venv/bin/python -m pytest '))
def test_every_pytest_command_in_the_prose_names_real_tests(text):
    words = text.split()
    path = osp.join(ROOT, words[3])
    with open(path) as f:
        source = f.read()
    if '-k' in words:
        pattern = words[words.index('-k') + 1]
        assert re.search(r'def test_\w*%s' % pattern, source), text


@pytest.mark.parametrize('text', _spans_like(
    r'(\w+=\S+ )?(scripts|benchmarks)/\S+'))
def test_every_script_in_the_prose_exists_with_what_it_is_given(text):
    words = text.split()
    env = [w.split('=')[0] for w in words if re.match(r'[A-Z_]+=', w)]
    script = next(w for w in words if '/' in w)
    with open(osp.join(ROOT, script)) as f:
        source = f.read()
    for name in env:
        assert name in source, text
    for flag in re.findall(r'--[a-z][\w-]*', text):
        assert flag in source, text


@pytest.mark.parametrize('text', _spans_like(
    r"(\w+ = )?\[?dict\(type='(mmnanhook\.)?NanDetect|"
    r"(runner_type|custom_imports) = "))
def test_every_config_line_in_the_prose_builds(text):
    from mmengine.config import Config
    from mmengine.registry import HOOKS, RUNNERS

    from mmnanhook import NanDetectHook, NanDetectRunner
    source = text if '=' in text.split('(')[0] else 'value = ' + text
    cfg = Config.fromstring(source + '\n', '.py')
    for key, value in cfg.items():
        if key == 'runner_type':
            assert RUNNERS.get(value) is NanDetectRunner
        elif key == 'custom_imports':
            assert value['imports'] == ['mmnanhook']
        else:
            for hook in value if isinstance(value, list) else [value]:
                assert isinstance(HOOKS.build(hook), NanDetectHook), text


@pytest.mark.mmdet
@pytest.mark.parametrize('text',
                         _spans_like(r"dict\(type='FilterAnnotations'"))
def test_every_pipeline_step_in_the_prose_builds(text):
    from mmengine.registry import TRANSFORMS, init_default_scope
    init_default_scope('mmdet')
    assert TRANSFORMS.build(eval(text)) is not None
