"""``python -m mmnanhook.drill SPEC``: the drill's runs (:mod:`._runs`), in
the process ``mmnan drill`` starts for them."""
import json
import sys

from .. import compat
from ._runs import run_all

if __name__ == '__main__':
    with open(sys.argv[1]) as spec:
        run_all(json.load(spec))
    # The results are written: no interpreter finalization, which gloo's
    # threads can abort after DDP (tests/mmnan_testing/ddp.py's _leave).
    compat.leave(0)
