#!/usr/bin/env bash
# Install mmcv with compiled ops into a venv, building the wheel at most once.
# mmcv 2.x is sdist-only: a CPU-ops build takes ~25 min (2.1.0 / torch 2.x) or
# ~6 min (2.0.1 / torch 1.7) on 2 cores.  The wheel is cached outside the repo,
# keyed by python + torch + mmcv version, so later setups and CI install it in
# seconds.
# Usage: scripts/install_mmcv.sh VENV MMCV_VERSION
set -euo pipefail
venv=$1
mmcv=$2
py="$venv/bin/python"
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
torchver=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')
cache="${MMNANHOOK_CACHE:-$HOME/.cache/mmnanhook}/wheels/py${pyver}-torch${torchver}-mmcv${mmcv}"

if "$py" -c "import mmcv, mmcv.ops, sys; sys.exit(mmcv.__version__ != '$mmcv')" 2>/dev/null; then
    echo "[mmcv $mmcv] $mmcv with compiled ops already installed in $venv"
    exit 0
fi
if ! ls "$cache"/mmcv-"$mmcv"-*.whl >/dev/null 2>&1; then
    # --all: plain nproc honours OMP_NUM_THREADS, which the Makefile sets to 1.
    jobs=$(nproc --all 2>/dev/null || echo 2)
    echo "[mmcv $mmcv] no cached wheel for py$pyver torch$torchver mmcv$mmcv"
    echo "[mmcv $mmcv] compiling mmcv $mmcv with CPU ops (MAX_JOBS=$jobs): this happens ONCE per machine"
    echo "[mmcv $mmcv] and takes ~6-30 min on 2 cores; the wheel is then cached in $cache"
    mkdir -p "$cache"
    tmp=$(mktemp -d "$cache/.build.XXXXXX")
    log="$tmp/build.log"
    echo "[mmcv $mmcv] full compiler log: $log"
    start=$(date +%s)
    # A heartbeat, so the long compile does not look like a hang.
    ( while sleep 60; do
        step=$(grep -o '\[[0-9]*/[0-9]*\]' "$log" 2>/dev/null | tail -1 || true)
        echo "[mmcv $mmcv] still compiling... $(( ($(date +%s) - start) / 60 )) min, ninja step ${step:-?}"
      done ) &
    beat=$!
    trap 'kill $beat 2>/dev/null || true' EXIT
    # mmcv's setup.py needs pkg_resources (setuptools<70) while torch>=2.6
    # requires setuptools>=77: put an old setuptools (with wheel, for
    # bdist_wheel, and ninja, for parallel compiles) first on the build's path
    # instead of downgrading the venv's.
    "$py" -m pip install -q --disable-pip-version-check --no-warn-conflicts \
        --target "$tmp/setuptools" 'setuptools<70' wheel ninja
    build=(env PYTHONPATH="$tmp/setuptools" PATH="$tmp/setuptools/bin:$PATH"
           "$py" -m pip --disable-pip-version-check)
    # The sdist, unpacked: built from its directory, so that its C++
    # standard can follow torch's. mmcv asks for C++17; torch >= 2.14's
    # headers stop on anything below C++20 ("#error C++20 or later
    # compatible compiler is required to use ATen"), and mmcv's sources
    # compile as C++20 (the codebases leg's torch 2.14.1, seen here).
    "${build[@]}" download -q --no-deps --no-binary mmcv --no-build-isolation \
        -d "$tmp/sdist" "mmcv==$mmcv" >>"$log" 2>&1
    tar -xzf "$tmp"/sdist/mmcv-"$mmcv".tar.gz -C "$tmp/sdist"
    src="$tmp/sdist/mmcv-$mmcv"
    headers=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')/include/ATen/ATen.h
    if grep -q '#error C++20' "$headers"; then
        echo "[mmcv $mmcv] torch's headers require C++20: mmcv built as C++20"
        sed -i "s/-std=c++1[47]'/-std=c++20'/g" "$src/setup.py"
    fi
    # --no-cache-dir: pip's own wheel cache knows the sdist, not the torch
    # it was built against; it handed the torch 2.14 leg the ops built for
    # torch 2.13 (seen here).
    # -g0: no debug info. With torch's headers it is ~40% of each object's
    # compile time (measured: 29 s instead of 50 s for a file including
    # torch/extension.h) and nothing reads it; the optimisation (-O3) stays.
    if ! CFLAGS="${CFLAGS:-} -g0" CXXFLAGS="${CXXFLAGS:-} -g0" \
            MMCV_WITH_OPS=1 FORCE_CUDA=0 MAX_JOBS=$jobs "${build[@]}" wheel -v --no-deps --no-cache-dir \
            --no-build-isolation -w "$tmp" "$src" >>"$log" 2>&1; then
        tail -40 "$log"
        echo "[mmcv $mmcv] ERROR: building mmcv $mmcv failed (log above, full log in $log)" >&2
        exit 1
    fi
    kill $beat 2>/dev/null || true
    mv "$tmp"/mmcv-"$mmcv"-*.whl "$cache"/
    rm -rf "$tmp"
    echo "[mmcv $mmcv] built in $(( ($(date +%s) - start) / 60 )) min, cached in $cache"
fi
# With its runtime deps (addict, yapf, opencv, ...); torch is not among them.
"$py" -m pip install -q "$cache"/mmcv-"$mmcv"-*.whl
if ! "$py" -c 'import mmcv.ops' ; then
    echo "[mmcv $mmcv] ERROR: 'import mmcv.ops' fails in $venv: mmcv $mmcv was installed without working compiled ops" >&2
    exit 1
fi
echo "[mmcv $mmcv] $mmcv with compiled ops installed in $venv"
