"""What a user does with the wheel, checked in a fresh environment.

Run by scripts/test_wheel.sh with the python of a venv that holds one leg's
pins (torch, mmengine, mmcv with ops, mmdet / mmrotate) and not mmnanhook,
from an empty directory: installs the wheel (non-editable) and checks

1. the wheel's and the sdist's file lists (configs and the ``mmnanhook::``
   hook shipped, no test code, the licence);
2. that installing it changed nothing else of the environment;
3. where ``mmnanhook`` is imported from (the venv, never the source tree);
4. ``mmnan --version``;
5. ``mmnan demo`` (``--dota`` on the DOTA leg), then ``mmnan replay`` and
   ``mmnan inspect`` of the bundle it printed;
6. a zoo config trained by the codebase's own ``tools/train.py`` with the
   README's ``_base_`` snippet (``mmnanhook::_base_/nan_detect.py``,
   ``policy='drop'``) on a synthetic dataset with one planted defect: the
   run must finish, with one bundle (which ``mmnan replay`` reproduces) and
   the planted image alone in its quarantine list.

Any failed check exits non-zero with what it saw.
"""
import argparse
import glob
import importlib
import json
import os
import os.path as osp
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

# leg -> (codebase, zoo config, dataset format, planted defect)
ZOO = {
    'modern': ('mmdet', 'retinanet/retinanet_r50_fpn_1x_coco.py', 'coco',
               'size_mismatch'),
    'dota': ('mmrotate', 'rotated_retinanet/'
             'rotated-retinanet-rbox-le90_r50_fpn_1x_dota.py', 'dota',
             'collinear'),
}
SIDE = 320
# The zoo's train scale (mmdet 1333x800, mmrotate 1024) at SIDE px, and the
# synthetic data: what a user would override to try a zoo config small.
OVERRIDES = {
    'coco': '''
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(data_root={root!r}, ann_file='annotations/train.json',
                 data_prefix=dict(img='images/'),
                 pipeline=[
                     dict(type='LoadImageFromFile'),
                     dict(type='LoadAnnotations', with_bbox=True),
                     dict(type='Resize', scale=(533, 320), keep_ratio=True),
                     dict(type='RandomFlip', prob=0.5),
                     dict(type='PackDetInputs')]))
''',
    'dota': '''
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(data_root={root!r}, ann_file='labelTxt/',
                 data_prefix=dict(img_path='images/'),
                 pipeline=[
                     dict(type='mmdet.LoadImageFromFile'),
                     dict(type='mmdet.LoadAnnotations', with_bbox=True,
                          box_type='qbox'),
                     dict(type='ConvertBoxType',
                          box_type_mapping=dict(gt_bboxes='rbox')),
                     dict(type='mmdet.Resize', scale=(320, 320),
                          keep_ratio=True),
                     dict(type='mmdet.RandomFlip', prob=0.75,
                          direction=['horizontal', 'vertical', 'diagonal']),
                     dict(type='mmdet.PackDetInputs')]))
''',
}
COMMON = '''
model = dict(backbone=dict(init_cfg=None))
train_cfg = dict(max_epochs=2, val_interval=1000)
val_dataloader = None
val_cfg = None
val_evaluator = None
test_dataloader = None
test_cfg = None
test_evaluator = None
randomness = dict(seed=0)
'''


class CheckFailed(Exception):
    pass


def check(ok, what, seen=''):
    if not ok:
        raise CheckFailed('%s\n%s' % (what, seen))
    print('[wheel-check %s] ok: %s' % (ARGS.leg, what), flush=True)


def run(*cmd, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    env.pop('PYTHONPATH', None)
    return subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True,
                          env=env, timeout=1200, **kwargs)


def mmnan(*args):
    return run(osp.join(osp.dirname(sys.executable), 'mmnan'), *args)


def freeze():
    out = run(sys.executable, '-m', 'pip', 'freeze', '--all').stdout
    return set(line for line in out.splitlines() if line.strip())


def check_files(wheel, sdist):
    names = zipfile.ZipFile(wheel).namelist()
    test_code = [n for n in names if re.search(
        r'(^|/)(tests?|testing|mmnan_testing)/|conftest', n)]
    check(not test_code, 'the wheel holds no test code', test_code)
    for needed in ('mmnanhook/.mim/configs/_base_/nan_detect.py',
                   'mmnanhook/.mim/model-index.yml',
                   'mmnanhook/demo/synthetic.py', '_mmnanhook_scope.py',
                   '_mmnanhook_scope.pth'):
        check(needed in names, 'the wheel holds ' + needed)
    dist_info = [n for n in names if '.dist-info/' in n]
    check(any(n.endswith('/LICENSE') for n in dist_info),
          'the wheel holds the licence', dist_info)
    meta = zipfile.ZipFile(wheel).read(
        [n for n in dist_info if n.endswith('/METADATA')][0]).decode()
    for field in ('License-Expression: Apache-2.0', 'Requires-Python: >=3.7',
                  'Requires-Dist: torch>=1.7',
                  'Requires-Dist: mmengine>=0.7.1',
                  'Classifier: Programming Language :: Python :: 3.8',
                  'Classifier: Programming Language :: Python :: 3.11'):
        check(field in meta, 'METADATA: ' + field)
    members = tarfile.open(sdist).getnames()
    for needed in ('LICENSE', 'CHANGELOG.md', 'configs/_base_/nan_detect.py',
                   '_mmnanhook_scope.pth', 'model-index.yml'):
        check(any(m.endswith('/' + needed) for m in members),
              'the sdist holds ' + needed)


def check_install(wheel, source):
    before = freeze()
    result = run(sys.executable, '-m', 'pip', 'install', '-q',
                 '--disable-pip-version-check', wheel)
    check(result.returncode == 0, 'pip install ' + osp.basename(wheel),
          result.stdout)
    after = freeze()
    added, removed = after - before, before - after
    # `pip freeze` writes `name==version`, or `name @ url` for a file.
    check(not removed and [re.split(r'==| @ ', a)[0] for a in added]
          == ['mmnanhook'],
          'installing changed nothing but adding mmnanhook',
          'added %s, removed %s' % (sorted(added), sorted(removed)))
    where = run(sys.executable, '-c',
                'import mmnanhook; print(mmnanhook.__file__)').stdout.strip()
    site = osp.realpath(sysconfig.get_paths()['purelib'])
    check(osp.realpath(where).startswith(site + os.sep)
          and not osp.realpath(where).startswith(osp.realpath(source)),
          'mmnanhook is imported from the venv (%s)' % where)
    version = mmnan('--version')
    # stdout and stderr together: torch 1.7's CUDA warning may come first.
    line = re.search(r'^mmnanhook \S+ \(python .*\)$', version.stdout, re.M)
    check(version.returncode == 0 and line, 'mmnan --version',
          version.stdout)
    print(line.group(0), flush=True)


def replay(bundle, what):
    result = mmnan('replay', bundle)
    check(result.returncode == 0, 'mmnan replay reproduces ' + what,
          result.stdout[-3000:])
    inspected = mmnan('inspect', bundle)
    check(inspected.returncode == 0, 'mmnan inspect of ' + what,
          inspected.stdout[-2000:])


def check_demo(work):
    flags = ['--dota'] if ARGS.leg == 'dota' else []
    result = mmnan('demo', '--work-dir', osp.join(work, 'demo'), *flags)
    check(result.returncode == 0, 'mmnan demo ' + ' '.join(flags),
          result.stdout[-4000:])
    found = re.search(r'^== bundle:\s+(\S+)', result.stdout, re.M)
    check(found and osp.isdir(found.group(1)),
          'the demo printed its bundle', result.stdout[-2000:])
    replay(found.group(1), "the demo's bundle")


def readme_base_snippet(source):
    """The README's ``_base_`` block (this check runs what it shows)."""
    with open(osp.join(source, 'README.md')) as f:
        blocks = re.findall(r'```python\n(.*?)```', f.read(), re.S)
    snippets = [b for b in blocks if 'mmnanhook::_base_/nan_detect.py' in b]
    check(len(snippets) == 1, "the README has one mmnanhook:: _base_ snippet")
    return snippets[0]


def ensure_pkg_resources():
    """mmengine <= 0.10.7 resolves ``package::`` with pkg_resources, gone
    from setuptools >= 82; torch >= 2.6 pulls setuptools >= 77.0.3 in.
    docs/configuration.md tells users the fix; this does what it says."""
    if run(sys.executable, '-c', 'import pkg_resources').returncode == 0:
        return
    fix = 'setuptools>=77.0.3,<82'
    print('[wheel-check %s] note: no pkg_resources here (mmengine needs it '
          "for every package:: config): pip install '%s', as "
          'docs/configuration.md says' % (ARGS.leg, fix), flush=True)
    result = run(sys.executable, '-m', 'pip', 'install', '-q',
                 '--disable-pip-version-check', fix)
    check(result.returncode == 0, 'pip install ' + fix, result.stdout)


def check_zoo(work, source):
    importlib.invalidate_caches()  # mmnanhook was installed after our start
    from mmnanhook.demo import synthetic
    ensure_pkg_resources()
    package, config, kind, defect = ZOO[ARGS.leg]
    make = getattr(synthetic, 'make_%s_dataset' % kind)
    data = make(osp.join(work, 'data'), num_images=4, image_size=SIDE,
                defects={1: defect})
    snippet = readme_base_snippet(source)
    if ARGS.leg == 'dota':
        snippet = snippet.replace(
            "'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py'",
            "'mmrotate::%s'" % config)
    check("'%s::%s'" % (package, config) in snippet,
          'the snippet names %s::%s' % (package, config), snippet)
    path = osp.join(work, 'my_config.py')
    with open(path, 'w') as f:
        f.write(snippet + OVERRIDES[kind].format(root=data['data_root'])
                + COMMON)
    spec = __import__(package).__file__
    train = osp.join(osp.dirname(spec), '.mim', 'tools', 'train.py')
    run_dir = osp.join(work, 'zoo')
    result = run(sys.executable, train, path, '--work-dir', run_dir)
    # The snippet's policy='drop': the run completes without the bad image.
    check(result.returncode == 0, '%s tools/train.py with the mmnanhook:: '
          'base trains to the end' % package, result.stdout[-5000:])
    bundles = sorted(osp.dirname(p) for p in glob.glob(
        osp.join(run_dir, '**', 'manifest.json'), recursive=True))
    check(len(bundles) == 1, 'the planted defect triggered once: one bundle',
          bundles)
    with open(osp.join(run_dir, 'nan_quarantine.json')) as f:
        quarantined = [s['file'] for s in json.load(f)['samples']]
    bad = data['defect_images'][0]
    check(len(quarantined) == 1 and osp.basename(quarantined[0]).startswith(
        osp.splitext(bad)[0]), 'the quarantine names the planted image %s '
          'alone' % bad, quarantined)
    replay(bundles[0], "the zoo run's bundle")


def main():
    wheel, = glob.glob(osp.join(ARGS.dist, '*.whl'))
    sdist, = glob.glob(osp.join(ARGS.dist, '*.tar.gz'))
    work = os.getcwd()
    try:
        check(not os.listdir(work), 'runs from an empty directory')
        check_files(wheel, sdist)
        check_install(wheel, ARGS.source)
        check_demo(work)
        check_zoo(work, ARGS.source)
    except CheckFailed as failure:
        print('[wheel-check %s] FAILED: %s' % (ARGS.leg, failure), flush=True)
        return 1
    print('[wheel-check %s] all checks passed' % ARGS.leg, flush=True)
    return 0


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--leg', choices=sorted(ZOO), required=True)
    parser.add_argument('--dist', required=True)
    parser.add_argument('--source', required=True,
                        help='the source tree (its README is read, never '
                        'imported from)')
    ARGS = parser.parse_args()
    sys.exit(main())
