#!/usr/bin/env bash
# Create / update one test leg's virtualenv. Idempotent: a stamp holding the
# pins is written last, and a leg whose stamp matches is left alone.
#   scripts/setup_leg.sh modern   -> .venv      (py3.11, torch 2.13, mmcv 2.1.0, mmdet 3.3.0)
#   scripts/setup_leg.sh dota     -> .venv-dota (pins from docker/versions.env, = the Docker image minus CUDA)
set -euo pipefail
cd "$(dirname "$0")/.."
leg=${1:?usage: setup_leg.sh modern|dota}

# shellcheck source=scripts/leg.sh
. scripts/leg.sh
leg_config "$leg"

if ! py=$(find_python "$py_minor"); then
    if [ "$leg" = dota ]; then
        missing_leg "setup dota" "no Python $py_minor (pyenv or python$py_minor on PATH)"
    fi
    echo "[setup $leg] ERROR: no Python $py_minor found (pyenv or python$py_minor on PATH)" >&2
    exit 1
fi

stamp="$venv/.mmnanhook-setup"
want="$py_minor $torch_pin $mmengine_pin mmcv==$mmcv_version ${extra_pins[*]} ${nodeps_pins[*]} ${test_pins[*]} $(cat setup.py | cksum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[setup $leg] $venv is up to date"
    exit 0
fi

echo "[setup $leg] preparing $venv with $py"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "$torch_pin" "$mmengine_pin"
scripts/install_mmcv.sh "$venv" "$mmcv_version"
"${pip[@]}" "${extra_pins[@]}"
[ ${#nodeps_pins[@]} -eq 0 ] || "${pip[@]}" --no-deps "${nodeps_pins[@]}"
"${pip[@]}" "${test_pins[@]}"
"${pip[@]}" --no-deps -e .
"$venv/bin/python" - "$mmcv_version" <<'PY'
import sys
import mmcv, mmcv.ops, mmengine, torch  # noqa: F401
import mmnanhook  # noqa: F401
assert mmcv.__version__ == sys.argv[1], mmcv.__version__
print('[setup] python %s, torch %s, mmengine %s, mmcv %s (ops ok)' % (
    sys.version.split()[0], torch.__version__, mmengine.__version__, mmcv.__version__))
PY
echo "$want" > "$stamp"
echo "[setup $leg] done"
