#!/usr/bin/env bash
# Run the whole pytest suite in one leg's venv.  pytest's own exit code is kept,
# so "no tests ran" (5) fails like any other failure.
set -euo pipefail
cd "$(dirname "$0")/.."
leg=${1:?usage: test_leg.sh modern|dota [pytest args]}
shift
# shellcheck source=scripts/leg.sh
. scripts/leg.sh
leg_config "$leg"
if [ ! -x "$venv/bin/python" ]; then
    # setup_leg.sh leaves no DOTA venv only when it said the leg is skipped.
    if [ "$leg" = dota ]; then missing_leg "test dota" "$venv is missing (no Python $py_minor)"; fi
    echo "[test $leg] ERROR: $venv is missing; run make setup" >&2; exit 1
fi
echo "[test $leg] $("$venv/bin/python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)')"
# The leg's own stack must import (tests/conftest.py fails the run otherwise).
export MMNANHOOK_LEG_REQUIRES=$requires
# Tests marked everyday_leg(...) are in this leg's make test only where named.
export MMNANHOOK_LEG=$leg
export MMNANHOOK_LEG_ONLY=${only:-}
exec "$venv/bin/python" -m pytest "$@"
