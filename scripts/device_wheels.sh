#!/usr/bin/env bash
# Wheels the device machine lacks (Python 3.12, torch with CUDA, no network,
# no mmengine; opencv-python-headless, numpy, matplotlib, rich, pyyaml and
# pytest are there, see the device tool's KINDS.md): mmengine and the pure-
# Python dependencies it is missing, into .device/wheels (ignored by git,
# carried by the run).  mmengine is installed there with --no-deps: it asks
# for opencv-python, and the machine has the headless build.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.device/wheels
pins=(mmengine==0.10.7 addict==2.4.0 termcolor==3.3.0 yapf==0.43.0 platformdirs==4.14.9)
mkdir -p "$dest"
python3 -m pip download -q --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d "$dest" "${pins[@]}"
du -sh "$dest"
ls "$dest"
