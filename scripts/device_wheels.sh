#!/usr/bin/env bash
# Wheels the device machine lacks (Python 3.12, torch with CUDA, no network,
# no mmengine; opencv-python-headless, numpy, scipy, matplotlib, rich, pyyaml,
# tqdm, six and pytest are there, see the device tool's KINDS.md), into
# .device/wheels (ignored by git, carried by the run):
# * mmengine and the pure-Python dependencies it is missing; mmdet 3.3.0 and
#   what it needs beyond those (pycocotools, shapely, terminaltables);
# * mmcv 2.1.0 with its CPU ops, compiled HERE for the device's Python and
#   torch (the device cannot build; mmdet's zoo detectors need mmcv.ops): in
#   .device/build-venv, a venv of that Python with PyPI's torch of that
#   version (a CUDA build: about 4 GB with its nvidia wheels, which
#   `import torch` needs), by scripts/install_mmcv.sh, which caches the wheel
#   in ~/.cache/mmnanhook/wheels (about 20 min on 2 cores the first time).
#   The torch it was built against is written beside it (mmcv-torch.txt);
#   scripts/device_check.sh compares it with the device's.
# Everything is installed there with --no-deps: mmengine and mmcv ask for
# opencv-python, and the machine has the headless build.
#   DEVICE_TORCH=2.11.0 DEVICE_PYTHON_MINOR=3.12 scripts/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/leg.sh
. scripts/leg.sh
dest=.device/wheels
device_torch=${DEVICE_TORCH:-2.11.0}         # KINDS.md: torch 2.11.0+cu130
device_minor=${DEVICE_PYTHON_MINOR:-3.12}    # KINDS.md: Python 3.12.3
mmcv_version=2.1.0                           # the newest mmdet 3.3 accepts
pins=(mmengine==0.10.7 addict==2.4.0 termcolor==3.3.0 yapf==0.43.0 platformdirs==4.14.9
      mmdet==3.3.0 pycocotools==2.0.11 shapely==2.1.2 terminaltables==3.1.10)
mkdir -p "$dest"
python3 -m pip download -q --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version "$device_minor" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d "$dest" "${pins[@]}"

py=$(find_python "$device_minor") || {
    echo "[device-wheels] ERROR: no Python $device_minor here to build mmcv for the device" >&2; exit 1; }
venv=.device/build-venv
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$device_torch"
scripts/install_mmcv.sh "$venv" "$mmcv_version"
cache="${MMNANHOOK_CACHE:-$HOME/.cache/mmnanhook}/wheels/py$device_minor-torch$device_torch-mmcv$mmcv_version"
cp "$cache"/mmcv-"$mmcv_version"-*.whl "$dest"/
echo "$device_torch" >"$dest/mmcv-torch.txt"
du -sh "$dest"
ls "$dest"
