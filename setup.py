import os.path as osp

from setuptools import find_packages, setup

here = osp.dirname(osp.abspath(__file__))
version = {}
with open(osp.join(here, 'mmnanhook', 'version.py')) as f:
    exec(f.read(), version)

setup(
    name='mmnanhook',
    version=version['__version__'],
    description='NaN/Inf debugger for MMEngine-based training '
    '(MMDetection 3.x, MMRotate 1.x)',
    long_description=open(osp.join(here, 'README.md')).read(),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['mmnanhook', 'mmnanhook.*']),
    python_requires='>=3.7',
    install_requires=['torch>=1.7', 'mmengine>=0.7.1'],
    extras_require={
        'mmdet': ['mmdet>=3.0.0'],
        'mmrotate': ['mmrotate>=1.0.0rc1'],
        'tests': ['pytest', 'vermin'],
    },
    entry_points={'console_scripts': ['mmnan=mmnanhook.cli:run']},
)
