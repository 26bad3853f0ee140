"""Bundles from someone else: ``mmnan inspect`` reads JSON only, ``mmnan
replay`` loads the ``.pth`` files through an allowlist and checks what they
hold. Hostile and ill-formed files are real bundles of a toy run with one
file replaced and its manifest entry rewritten, so only the content is
wrong."""
import io
import os.path as osp
import sys

import pytest
import torch

from mmnanhook.bundle import ALLOWLIST_FALLBACK
from mmnan_testing import legs
from mmnan_testing.bundles import (copy_bundle, hostile_config,
                                       hostile_torch_file, replace_listed_file)
from mmnan_testing.cli import (FALLBACK_WARNING, PROJECT_DIR,
                                   assert_bad_input, message_lines, mmnan,
                                   toy_config, train_to_bundle)

if PROJECT_DIR not in sys.path:
    sys.path.insert(0, PROJECT_DIR)
import replay_toys  # noqa: E402,F401 - registers the toy model and data

STEMS = ('data_batch', 'model', 'optimizer', 'rng')


@pytest.fixture(scope='module')
def toy_bundle(tmp_path_factory):
    work_dir = str(tmp_path_factory.mktemp('toy'))
    return train_to_bundle(toy_config(work_dir,
                                      'RandomSubsetRegressor')).bundle


def _torch_bytes(obj):
    data = io.BytesIO()
    torch.save(obj, data)
    return data.getvalue()


def _hostile_copy(toy_bundle, tmp_path, names):
    """A copy whose files ``names`` (``.pth`` stems, ``'config'``) run code
    when loaded; name -> the file that code would create."""
    bundle = copy_bundle(toy_bundle, tmp_path)
    markers = dict((name, str(tmp_path / ('ran_' + name))) for name in names)
    for stem in set(names) - {'config'}:
        replace_listed_file(bundle, stem + '.pth',
                            hostile_torch_file(markers[stem]))
    if 'config' in names:
        with open(osp.join(bundle, 'config.py')) as f:
            config = f.read()
        replace_listed_file(bundle, 'config.py', hostile_config(
            config, markers['config']).encode('utf-8'))
    return bundle, markers


@pytest.mark.parametrize('flags', [[], ['--html']], ids=['text', 'html'])
def test_inspect_runs_nothing_of_a_hostile_bundle(toy_bundle, tmp_path,
                                                  flags):
    bundle, markers = _hostile_copy(toy_bundle, tmp_path,
                                    STEMS + ('config', ))
    result = mmnan('inspect', bundle, *flags)
    assert result.returncode == 0, result.stderr
    assert not [m for m in markers.values() if osp.exists(m)]


@pytest.mark.parametrize('stem', STEMS)
def test_replay_refuses_a_torch_file_that_would_run_code(toy_bundle, tmp_path,
                                                         stem):
    bundle, markers = _hostile_copy(toy_bundle, tmp_path, (stem, 'config'))
    result = mmnan('replay', bundle)
    assert_bad_input(result, 'replay', 'refused {}: it names builtins.exec'
                     .format(osp.join(bundle, stem + '.pth')))
    assert 'nothing of it was run' in result.stderr
    # Refused before the config (which replay executes) ran.
    assert not [m for m in markers.values() if osp.exists(m)]


def _rng_of_the_wrong_size(bundle):
    state = legs.torch_load(osp.join(bundle, 'rng.pth'))
    state['torch'] = state['torch'][:10]
    return state


# case -> (stem, the content from the bundle, what the error says)
WRONG_CONTENT = {
    'rng not a dict': ('rng', lambda b: [1, 2, 3], 'not an RNG state'),
    'rng of the wrong size': ('rng', _rng_of_the_wrong_size,
                              'not an RNG state (RuntimeError'),
    'rng with an empty numpy state': ('rng', lambda b: dict(
        legs.torch_load(osp.join(b, 'rng.pth')), numpy=()),
        'not an RNG state (its numpy state is not a legacy MT19937 state)'),
    'rng with cuda states that are no list': ('rng', lambda b: dict(
        legs.torch_load(osp.join(b, 'rng.pth')), cuda=5),
        'not an RNG state (its cuda states are not a list)'),
    'batch without inputs': ('data_batch', lambda b: {
        'data_samples': [torch.zeros(())]}, 'not a batch'),
    'model not a state dict': ('model', lambda b: {'weight': [1.0]},
                               'not a state dict'),
    'optimizer not one': ('optimizer', lambda b: {'lr': 0.1},
                          'not an optimizer state dict'),
}


@pytest.mark.parametrize('case', sorted(WRONG_CONTENT))
def test_replay_of_a_file_with_the_wrong_content_exits_2(toy_bundle, tmp_path,
                                                         case):
    stem, content, expected = WRONG_CONTENT[case]
    bundle = copy_bundle(toy_bundle, tmp_path)
    replace_listed_file(bundle, stem + '.pth', _torch_bytes(content(bundle)))
    assert_bad_input(mmnan('replay', bundle), 'replay', '{}: {}'.format(
        osp.join(bundle, stem + '.pth'), expected))


def test_replay_of_the_state_dict_of_another_model_exits_2(toy_bundle,
                                                           tmp_path):
    # The toy's own: fc.weight (1x4) and fc.bias.
    bundle = copy_bundle(toy_bundle, tmp_path)
    replace_listed_file(bundle, 'model.pth', _torch_bytes(
        {'fc.weight': torch.zeros(2, 4), 'bias': torch.zeros(2)}))
    assert_bad_input(mmnan('replay', bundle), 'replay', (
        '{}: not the state dict of the model its config.py builds: 1 missing '
        '(fc.bias); 1 unexpected (bias); 1 of another shape (fc.weight)'
    ).format(osp.join(bundle, 'model.pth')))


def test_replay_says_how_it_loads_where_torch_cannot_allowlist(toy_bundle):
    result = mmnan('replay', toy_bundle)
    assert result.returncode == 0, result.stderr
    said = FALLBACK_WARNING in message_lines(result.stderr)
    assert said == (ALLOWLIST_FALLBACK is not None)
    if said:
        assert "mmnanhook's own restricted unpickler" in result.stderr


def test_replay_help_says_that_it_executes_the_config():
    result = mmnan('replay', '--help')
    assert result.returncode == 0, result.stderr
    text = ' '.join(result.stdout.split())
    assert "It executes the bundle's config.py" in text
    assert 'as tools/train.py would' in text
    assert 'weights_only=True' in text


def test_replay_reads_no_sample_file_the_manifest_does_not_list(toy_bundle,
                                                                tmp_path):
    # The fixes read an implicated sample's image from the bundle: a
    # manifest naming a path outside it is refused, not followed.
    import json
    bundle = copy_bundle(toy_bundle, tmp_path)
    outside = str(tmp_path / 'secret.jpg')
    with open(outside, 'wb') as f:
        f.write(b'not for the replay')
    path = osp.join(bundle, 'manifest.json')
    with open(path) as f:
        manifest = json.load(f)
    manifest['sources'] = {'0': dict(info='config.py',
                                     image=osp.relpath(outside, bundle))}
    with open(path, 'w') as f:
        json.dump(manifest, f)
    assert_bad_input(mmnan('replay', bundle), 'replay',
                     'corrupt "sources" entry')


def test_replay_refuses_a_tar_with_a_zip_appended_untouched(toy_bundle,
                                                            tmp_path):
    # zipfile finds the zip at the end; torch would read the tar in front
    # (pre-1.6 format) and extract its members: a hard link to a file
    # outside the bundle would get the member's mode and time.
    import os
    import tarfile
    victim = tmp_path / 'victim'
    victim.write_bytes(b'outside the bundle')
    os.chmod(str(victim), 0o600)
    before = os.stat(str(victim))
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode='w') as archive:
        member = tarfile.TarInfo('storages')
        member.type, member.linkname = tarfile.LNKTYPE, str(victim)
        member.mode, member.mtime = 0o666, 0
        archive.addfile(member)
    bundle = copy_bundle(toy_bundle, tmp_path)
    replace_listed_file(bundle, 'rng.pth', tar.getvalue() + _torch_bytes(
        {'torch': torch.get_rng_state()}))
    assert_bad_input(mmnan('replay', bundle), 'replay', 'not a torch zip file')
    after = os.stat(str(victim))
    assert (after.st_mode, after.st_mtime) == (before.st_mode, before.st_mtime)
