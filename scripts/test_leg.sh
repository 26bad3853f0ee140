#!/usr/bin/env bash
# Run the whole pytest suite in one leg's venv.  pytest's own exit code is kept,
# so "no tests ran" (5) fails like any other failure.
set -euo pipefail
cd "$(dirname "$0")/.."
leg=${1:?usage: test_leg.sh modern|dota [pytest args]}
shift
case $leg in
modern) venv=.venv ;;
dota) venv=.venv-dota ;;
*) echo "unknown leg $leg" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
    # setup_leg.sh leaves no DOTA venv only when it printed "skipped: no Python 3.8".
    if [ "$leg" = dota ]; then echo "[test dota] skipped: no Python 3.8"; exit 0; fi
    echo "[test $leg] ERROR: $venv is missing; run make setup" >&2; exit 1
fi
echo "[test $leg] $("$venv/bin/python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)')"
exec "$venv/bin/python" -m pytest "$@"
