"""The bundle: an atomically written, self-checking dump of one trigger.

* :mod:`._layout`: file names, format version, directory names; how the
  manifest and the JSON files render what was recorded.
* :mod:`._writer`: atomic writes, retention (``max_dumps``).
* :mod:`._reader`: verified loading (:func:`load_bundle`).
* :mod:`._content`: what the torch files may hold (the allowlist) and
  whether they hold it; :mod:`._unpickle`: loading them under it.
* :mod:`._plot`: ``history.png``.
* :mod:`._state`: which bundles hold the model and optimizer state, and
  which name the one that does.
"""
from ._content import state_dict_mismatch
from ._layout import (AMP_DTYPES, CONFIG_FILE, DATA_BATCH, FORMAT_VERSION,
                      HISTORY_JSON, HISTORY_PNG, MANIFEST, MODEL, OPTIMIZER,
                      REPORT, REPORT_HTML, REPORT_TEXT, RNG, STATE_FROM,
                      TORCH_SUFFIX, amp_dtype_name, bundle_name,
                      render_manifest, sample_image_name, sample_info_name,
                      to_strict_json, versions)
from ._plot import plot_history
from ._reader import Bundle, load_bundle
from ._state import StateLedger, StatePlan, StateRef
from ._unpickle import ALLOWLIST_FALLBACK
from ._writer import write_bundle

__all__ = [
    'ALLOWLIST_FALLBACK', 'AMP_DTYPES', 'Bundle', 'CONFIG_FILE', 'DATA_BATCH', 'FORMAT_VERSION',
    'HISTORY_JSON', 'HISTORY_PNG', 'MANIFEST', 'MODEL', 'OPTIMIZER', 'REPORT',
    'REPORT_HTML', 'REPORT_TEXT', 'RNG', 'STATE_FROM', 'StateLedger',
    'StatePlan', 'StateRef', 'TORCH_SUFFIX', 'amp_dtype_name',
    'bundle_name', 'load_bundle', 'plot_history', 'render_manifest',
    'sample_image_name', 'sample_info_name', 'state_dict_mismatch',
    'to_strict_json', 'versions', 'write_bundle'
]
