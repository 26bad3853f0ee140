import os
import os.path as osp
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

here = osp.dirname(osp.abspath(__file__))
version = {}
with open(osp.join(here, 'mmnanhook', 'version.py')) as f:
    exec(f.read(), version)

# Interpreter-start hook that teaches mmengine `mmnanhook::` (see the module).
SCOPE_PTH = '_mmnanhook_scope.pth'


def add_mim_extension():
    """Put ``configs/`` where mmengine looks for ``mmnanhook::`` configs.

    As OpenMMLab's own setup.py files do: ``mmnanhook/.mim/configs`` is a
    symlink for an editable install, a copy when a wheel or sdist is built.
    """
    if {'develop', 'editable_wheel'} & set(sys.argv):
        mode = 'symlink'
    elif {'sdist', 'bdist_wheel', 'build', 'install'} & set(sys.argv):
        mode = 'copy'
    else:
        return
    mim = osp.join(here, 'mmnanhook', '.mim')
    os.makedirs(mim, exist_ok=True)
    for name in ('configs', 'model-index.yml'):
        src, dst = osp.join(here, name), osp.join(mim, name)
        if osp.islink(dst) or osp.isfile(dst):
            os.remove(dst)
        elif osp.isdir(dst):
            shutil.rmtree(dst)
        if mode == 'symlink':
            os.symlink(osp.relpath(src, mim), dst)
        elif osp.isdir(src):
            shutil.copytree(src, dst)
        else:
            shutil.copyfile(src, dst)


class BuildWithScope(build_py):
    """build_py that also puts the scope ``.pth`` at the wheel's root."""

    def run(self):
        super().run()
        self.copy_file(osp.join(here, SCOPE_PTH),
                       osp.join(self.build_lib, SCOPE_PTH))


add_mim_extension()
setup(
    name='mmnanhook',
    version=version['__version__'],
    description='NaN/Inf debugger for MMEngine-based training '
    '(MMDetection 3.x, MMRotate 1.x)',
    long_description=open(osp.join(here, 'README.md')).read(),
    long_description_content_type='text/markdown',
    license_expression='Apache-2.0',
    license_files=['LICENSE'],
    keywords='nan, inf, debugging, mmengine, mmdetection, mmrotate',
    classifiers=[
        'Development Status :: 4 - Beta',
        'Intended Audience :: Developers',
        'Intended Audience :: Science/Research',
        'Operating System :: OS Independent',
        'Programming Language :: Python :: 3',
        'Programming Language :: Python :: 3.7',
        'Programming Language :: Python :: 3.8',
        'Programming Language :: Python :: 3.9',
        'Programming Language :: Python :: 3.10',
        'Programming Language :: Python :: 3.11',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
        'Topic :: Software Development :: Debuggers',
    ],
    packages=find_packages(include=['mmnanhook', 'mmnanhook.*']),
    py_modules=['_mmnanhook_scope'],
    include_package_data=True,
    python_requires='>=3.7',
    # Lower bounds only: installing into a working OpenMMLab environment must
    # never up- or downgrade its torch, mmcv or mmengine (the tested ranges
    # are in docs/compatibility.md).
    install_requires=['torch>=1.7', 'mmengine>=0.7.1'],
    extras_require={
        'mmdet': ['mmdet>=3.0.0'],
        'mmrotate': ['mmrotate>=1.0.0rc1'],
    },
    entry_points={'console_scripts': ['mmnan=mmnanhook.cli:run']},
    cmdclass={'build_py': BuildWithScope},
    zip_safe=False,
)
