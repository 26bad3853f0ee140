#!/usr/bin/env bash
# `make setup`: the three legs and the browser at the same time.  A leg's pip
# installs wait on the network while another compiles mmcv, so together
# they take little more than the compiles.  Every line says whose it is
# ([setup modern], [mmcv 2.1.0], [setup dota], [mmcv 2.0.1], [setup codebases],
# [setup browser]);
# the first part to fail fails the setup, after all have ended.
set -uo pipefail
cd "$(dirname "$0")/.."
parts=("scripts/setup_leg.sh modern" "scripts/setup_leg.sh dota" "scripts/setup_leg.sh codebases"
       "scripts/setup_browser.sh")
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; exit 130' INT TERM HUP
for part in "${parts[@]}"; do
    # shellcheck disable=SC2086 - a part is a command and its argument
    $part &
    pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "[setup] FAILED: ${parts[$i]}" >&2
        status=1
    fi
done
exit "$status"
