#!/usr/bin/env bash
# The wheel tier: mmnanhook as a user installs it. Builds the wheel and the
# sdist (`python -m build`, from a copy of the tree, the wheel from the
# sdist), then for each leg makes a fresh venv from that leg's pins (torch,
# mmengine, mmcv with ops, mmdet / mmrotate: scripts/leg.sh, no test pins),
# installs the wheel non-editable into it and runs scripts/wheel_check.py with
# that venv's python from an empty temporary directory: the source tree is
# never on its path. Both legs at once, each on its own core; logs in
# test-logs/wheel/.
#   scripts/test_wheel.sh
set -uo pipefail
export OMP_NUM_THREADS=1
cd "$(dirname "$0")/.."
repo=$PWD
logs=${MMNANHOOK_TEST_LOGS:-test-logs}/wheel
mkdir -p "$logs"
# shellcheck source=scripts/leg.sh
. scripts/leg.sh
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mmnan-wheel.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
pip_flags=(-q --disable-pip-version-check)

begin=$(date +%s)
echo "[wheel] building the sdist and the wheel (log: $logs/build.log)"
if ! {
    py=$(find_python 3.11) &&
    mkdir "$tmp/src" &&
    # The tree as git sees it (tracked and new files, nothing ignored).
    git ls-files -z -co --exclude-standard | xargs -0 cp --parents -t "$tmp/src" &&
    "$py" -m venv "$tmp/builder" &&
    "$tmp/builder/bin/python" -m pip install "${pip_flags[@]}" build &&
    "$tmp/builder/bin/python" -m build --outdir "$tmp/dist" "$tmp/src"
} >"$logs/build.log" 2>&1; then
    tail -30 "$logs/build.log"; echo "[wheel] FAILED: the build"; exit 1
fi
ls -l "$tmp/dist"

one_leg() {  # one_leg LEG: fresh venv, pins, the wheel, the checks
    local leg=$1 venv py start
    start=$(date +%s)
    leg_config "$leg"
    if ! py=$(find_python "$py_minor"); then
        [ "$leg" = dota ] && missing_leg "wheel dota" "no Python $py_minor"
        echo "[wheel $leg] ERROR: no Python $py_minor"; return 1
    fi
    venv=$tmp/venv-$leg
    "$py" -m venv "$venv" || return 1
    local pip=("$venv/bin/python" -m pip install "${pip_flags[@]}")
    "${pip[@]}" "$torch_pin" "$mmengine_pin" || return 1
    scripts/install_mmcv.sh "$venv" "$mmcv_version" || return 1
    "${pip[@]}" "${extra_pins[@]}" || return 1
    echo "[wheel $leg] the leg's pins installed in $(( $(date +%s) - start )) s"
    mkdir "$tmp/run-$leg"
    # From the empty directory, as a user would: nothing of the tree in reach.
    (cd "$tmp/run-$leg" && "$venv/bin/python" "$tmp/check/wheel_check.py" \
        --leg "$leg" --dist "$tmp/dist" --source "$repo")
}

mkdir "$tmp/check" && cp scripts/wheel_check.py "$tmp/check/"
declare -A pid
for leg in modern dota; do
    ( one_leg "$leg" ) >"$logs/$leg.log" 2>&1 &
    pid[$leg]=$!
    echo "[wheel] $leg leg started, log: $logs/$leg.log"
done
status=0
for leg in modern dota; do
    if wait "${pid[$leg]}"; then
        echo "[wheel] $leg: passed"
    else
        status=1
        tail -40 "$logs/$leg.log"
        echo "[wheel] $leg: FAILED"
    fi
done
grep -h '^\[wheel-check' "$logs"/modern.log "$logs"/dota.log
echo "[wheel] $([ "$status" -eq 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - begin )) s"
exit "$status"
