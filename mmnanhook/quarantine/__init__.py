"""The data side of recovery: samples that a run never loads again.

* :mod:`._file`: ``nan_quarantine.json``, its records and atomic writes.
* :mod:`._sampler`: :class:`QuarantineSampler`, a good index in place of a
  quarantined one, in the main process (worker processes included).
* :mod:`._stream`: the index stream of a dataloader iterator already
  running (``IterBasedTrainLoop``'s) wrapped the same way.
* :mod:`._inflight`: a quarantined sample left out of a batch sampled
  before the decision, before the forward.
* :mod:`._flight`: the samples of each step recorded, so that a process
  that dies inside one (SIGSEGV, SIGKILL) leaves them named.
* :mod:`._list`: :class:`Quarantine`, one run's list, read back on resume,
  keyed by file.
* :mod:`._index`: :class:`SampleIndex`, a dataset's indices by image file,
  one per dataset, which the quarantine, the composed guard and the
  diagnosis share.
* :mod:`._identity`: :class:`SampleTracker`, the dataset index of each
  sample of each batch the train dataloader yields (what every part above
  goes by; the file a label).
* :mod:`._trial`: the samples of a step a process died in, each tried alone
  in a child process at the next start.
"""
from ._file import (FILE_NAME, FORMAT, QuarantinedSample, QuarantineError,
                    read_quarantine, write_json_atomically, write_quarantine)
from ._composed import PARTS, mixers, part_image
from ._flight import (Flight, FlightRecorder, flight_dir, read_flights,
                      start_flight)
from ._identity import (SampleTracker, info_path, name_samples,
                        track_samples)
from ._index import SampleIndex, sample_index
from ._inflight import call_with
from ._list import Quarantine, prepare_index, start_quarantine
from ._stream import live_iterators
from ._trial import TrialResult, try_alone
from ._sampler import QuarantineSampler, install_sampler

__all__ = [
    'call_with', 'FILE_NAME', 'Flight', 'FlightRecorder', 'flight_dir', 'mixers', 'part_image', 'PARTS', 'FORMAT',
    'Quarantine', 'QuarantineError', 'QuarantineSampler', 'QuarantinedSample',
    'SampleIndex', 'SampleTracker', 'TrialResult', 'info_path',
    'install_sampler', 'live_iterators', 'name_samples', 'prepare_index',
    'read_quarantine', 'read_flights', 'sample_index', 'start_flight',
    'start_quarantine', 'track_samples', 'try_alone',
    'write_json_atomically', 'write_quarantine'
]
