"""Puts ``tests/`` on the path of a benchmark and of the processes it starts:
the test beds (``mmnan_testing``) live there, not in the wheel."""
import os
import os.path as osp
import sys

TESTS = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'tests')
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
os.environ['PYTHONPATH'] = os.pathsep.join(
    [TESTS] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep)
               if p])
