#!/usr/bin/env bash
# `make test-all` (what .ci/run runs): every tier, one after the other, each
# timed; a tier's failure does not stop the others (their results are worth
# having), but fails the run at the end.
#   everyday  make test's suite: both legs, -m "not zoo_full"
#   zoo       the full zoo tier: both legs, -m zoo_full (its own logs)
#   mmengine  the core subset on older mmengine releases (test_mmengine.sh)
#   wheel     the built wheel in fresh venvs of both legs (test_wheel.sh)
#   scripts/test_tiers.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${MMNANHOOK_TEST_LOGS:-test-logs}
status=0
summary=()
tier() {  # tier NAME COMMAND...
    local name=$1 start rc
    shift
    start=$(date +%s)
    echo "[tiers] $name tier started"
    "$@"
    rc=$?
    summary+=("$(printf '[tiers] %-8s %s in %d s' "$name" \
        "$([ "$rc" -eq 0 ] && echo passed || echo "FAILED (exit $rc)")" $(( $(date +%s) - start )))")
    [ "$rc" -eq 0 ] || status=1
}
start=$(date +%s)
# Each leg's bound: the Makefile's (exported), 30 and 60 min outside make.
tier everyday env MMNANHOOK_TEST_LOGS="$logs" \
    MMNANHOOK_LEG_TIMEOUT="${EVERYDAY_BOUND:-1800}" scripts/test_all.sh -m 'not zoo_full' "$@"
tier zoo env MMNANHOOK_TEST_LOGS="$logs/zoo" \
    MMNANHOOK_LEG_TIMEOUT="${ZOO_BOUND:-3600}" scripts/test_all.sh -m zoo_full "$@"
tier mmengine env MMNANHOOK_TEST_LOGS="$logs" scripts/test_mmengine.sh "$@"
tier wheel env MMNANHOOK_TEST_LOGS="$logs" scripts/test_wheel.sh
echo
printf '%s\n' "${summary[@]}"
echo "[tiers] all tiers in $(( $(date +%s) - start )) s: $([ "$status" -eq 0 ] && echo passed || echo FAILED)"
exit "$status"
