#!/usr/bin/env bash
# Create / update one test leg's virtualenv. Idempotent: a stamp holding the
# pins is written last, and a leg whose stamp matches is left alone.
#   scripts/setup_leg.sh modern   -> .venv      (py3.11, torch 2.13, mmcv 2.1.0, mmdet 3.3.0)
#   scripts/setup_leg.sh dota     -> .venv-dota (pins from docker/versions.env, = the Docker image minus CUDA)
set -euo pipefail
cd "$(dirname "$0")/.."
leg=${1:?usage: setup_leg.sh modern|dota}

find_python() {  # find_python MAJOR.MINOR
    local v=$1 p
    if command -v pyenv >/dev/null 2>&1; then
        for p in $(pyenv versions --bare 2>/dev/null | grep -E "^$v(\.[0-9]+)?$" | sort -V -r); do
            if [ -x "$(pyenv prefix "$p")/bin/python" ]; then
                echo "$(pyenv prefix "$p")/bin/python"; return 0
            fi
        done
    fi
    command -v "python$v" 2>/dev/null || return 1
}

case $leg in
modern)
    venv=.venv
    py_minor=3.11
    torch_pin=torch==2.13.0           # the CPU build that lies on this machine's disk
    mmengine_pin=mmengine==0.10.7
    mmcv_version=2.1.0                # newest mmcv mmdet 3.3 accepts (<2.2); compiles with C++17
    # mmseg imports ftfy and regex unconditionally (its tokenizer). mmpretrain
    # cannot be installed in either leg (see tests/conftest.py).
    extra_pins=(mmdet==3.3.0 mmsegmentation==1.2.2 ftfy==6.3.1 regex==2026.11.19)
    test_pins=(pytest tensorboard==2.21.0)
    ;;
dota)
    # shellcheck disable=SC1091
    . docker/versions.env
    venv=.venv-dota
    py_minor=$PYTHON_VERSION
    torch_pin=torch==$TORCH_VERSION   # PyPI wheel (CUDA 10.2 build), runs on CPU
    mmengine_pin=mmengine==$MMENGINE_VERSION
    mmcv_version=$MMCV_VERSION
    # numpy pinned (1.23.x): e2cnn, an mmrotate 1.0.0rc1 dependency, still uses the
    # np.float alias that numpy 1.24 removed.
    extra_pins=("torchvision==$TORCHVISION_VERSION" "numpy==$NUMPY_VERSION" "pillow==$PILLOW_VERSION"
                "mmdet==$MMDET_VERSION" "mmrotate==$MMROTATE_VERSION")
    # The newest tensorboard for Python 3.8 (tests read event files back).
    test_pins=(pytest tensorboard==2.14.0)
    ;;
*) echo "unknown leg $leg (modern|dota)" >&2; exit 2 ;;
esac

if ! py=$(find_python "$py_minor"); then
    if [ "$leg" = dota ]; then
        echo "[setup dota] skipped: no Python $py_minor (pyenv or python$py_minor on PATH); the DOTA leg does not run"
        exit 0
    fi
    echo "[setup $leg] ERROR: no Python $py_minor found (pyenv or python$py_minor on PATH)" >&2
    exit 1
fi

stamp="$venv/.mmnanhook-setup"
want="$py_minor $torch_pin $mmengine_pin mmcv==$mmcv_version ${extra_pins[*]} ${test_pins[*]} $(cat setup.py | cksum)"
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
