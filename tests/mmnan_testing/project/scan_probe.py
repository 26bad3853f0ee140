"""A pipeline step of a user's project that the ``mmnan scan`` tests put
first in a train pipeline: it records each sample the pipeline runs on, and
can make the pipeline slow enough to interrupt a scan midway.

``custom_imports=['scan_probe']`` registers it in mmengine's root registry,
which every codebase's ``TRANSFORMS`` falls back to (the tests put this
directory on PYTHONPATH).
"""
import os.path as osp
import time

import cv2
import torch
from mmcv.transforms import BaseTransform
from mmengine.registry import TRANSFORMS

# The samples this process's pipelines ran on (one process: no workers).
SEEN = []
# OpenCV's thread count as each of them ran.
OPENCV_THREADS = []
# torch's thread count as each of them ran.
TORCH_THREADS = []
# Seconds a held sample waits for its release at most.
HOLD_LIMIT = 600.0


@TRANSFORMS.register_module()
class RecordSample(BaseTransform):
    """Record ``sample_idx``, then wait ``delay`` seconds.

    Args:
        log (str, optional): Also append each index to this file, one a line
            (the scan may run in another process).
        delay (float): Seconds each sample takes.
        hold_from (int, optional): Samples from this index on wait until
            ``release`` exists (at most :data:`HOLD_LIMIT` seconds), so a
            test can interrupt a scan midway however loaded the machine.
        release (str, optional): The file that lets them go on.
    """

    def __init__(self, log=None, delay=0.0, hold_from=None, release=None):
        self.log = log
        self.delay = delay
        self.hold_from = hold_from
        self.release = release

    def transform(self, results):
        SEEN.append(results['sample_idx'])
        OPENCV_THREADS.append(cv2.getNumThreads())
        TORCH_THREADS.append(torch.get_num_threads())
        if self.log is not None:
            with open(self.log, 'a') as f:
                f.write('%d\n' % results['sample_idx'])
        time.sleep(self.delay)
        if self.hold_from is not None and \
                results['sample_idx'] >= self.hold_from:
            # Bounded: a failing test must not leave a scan's orphaned
            # workers waiting for ever.
            deadline = time.time() + HOLD_LIMIT
            while not osp.exists(self.release) and time.time() < deadline:
                time.sleep(0.02)
        return results
