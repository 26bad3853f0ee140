#!/usr/bin/env bash
# `make test-mmengine`: a core subset of the suite on older mmengine releases.
#
# Each mmengine version is laid over a leg's venv in a directory of its own
# (.mmengine/<leg>-<version>, `pip install --target`, put first on PYTHONPATH),
# so the legs' venvs stay as `make setup` built them; the suite itself tests
# mmengine 0.10.7 (the legs' own).  The wheels are pure Python, downloaded once
# into ${MMNANHOOK_CACHE:-~/.cache/mmnanhook}/wheels/mmengine<version>-py<python>/
# next to the mmcv wheels.  The two legs run at the same time, one core each;
# each (leg, version) writes test-logs/mmengine-<leg>-<version>.log, and a table
# of pass/fail and seconds ends the output.  Any failure fails the run.
#   scripts/test_mmengine.sh [pytest args]
#   MMNANHOOK_MMENGINE_VERSIONS="0.7.1 0.9.1"   the versions (default below)
#   MMNANHOOK_MMENGINE_LEGS="modern dota"        the legs
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/leg.sh
. scripts/leg.sh

# 0.7.1: the oldest mmengine mmdet 3.0-3.3 accept (mmdet/__init__.py asserts
# mmengine >= 0.7.1; mmrotate 1.0.0rc1 accepts >= 0.3.0); 0.9.1 lies between
# it and the legs' own 0.10.7.
versions=(${MMNANHOOK_MMENGINE_VERSIONS:-0.7.1 0.9.1})
legs=(${MMNANHOOK_MMENGINE_LEGS:-modern dota})
logs=${MMNANHOOK_TEST_LOGS:-test-logs}
mkdir -p "$logs"
# One torch thread per test process, whatever a caller's make test left set.
unset MMNANHOOK_TEST_THREADS_FILE

# What a version needs beside itself, pure-Python wheels only (their other
# requirements are the legs' own).  mmengine 0.7.x calls yapf's
# FormatCode(verify=True), which yapf >= 0.40.2 removed: its users pin yapf
# 0.40.1, which imports importlib_metadata (neither leg has it).
extra_wheels() {
    case $1 in
    0.7.*) echo "yapf==0.40.1 importlib-metadata==6.8.0 zipp==3.17.0" ;;
    esac
}

# The core subset, per leg: the zoo tier's clean run equal to the plain run
# (through the `_base_` snippet's runner_type), a planted fault caught and
# diagnosed, 'skip' (zoo and bitwise), the snippet forms merging and the
# config forms a user writes (dotted type, custom_imports) in a fresh process,
# the scheduler binding and the bypass guard, recovery under DDP (the toy
# scenarios: one decision, drop on every rank, SyncBN replays kept local), the
# documented config snippets (`mmnanhook::` and `mmdet::` bases included) and
# the doctor's config rules, alone and in the hook.
subset() {
    local zoo_name
    case $1 in
    modern) zoo_name=retinanet_r50 ;;
    dota) zoo_name=rotated_retinanet ;;
    esac
    echo "tests/zoo/test_zoo.py::test_clean_run_is_the_run_without_the_hook[$zoo_name]"
    echo "tests/zoo/test_zoo.py::test_real_fault_is_caught_before_it_reaches_the_weights[$zoo_name]"
    echo "tests/zoo/test_zoo.py::test_skip_finishes_the_epoch[$zoo_name]"
    echo "tests/zoo/test_zoo.py::test_snippet_merges_with_a_config_that_has_custom_imports"
    echo "tests/sentinel/test_schedulers_and_guard.py"
    echo "tests/sentinel/test_toy_runner.py::test_skip_leaves_parameters_and_optimizer_state_bitwise"
    echo "tests/test_config_forms.py"
    echo "tests/sentinel/test_ddp.py"
    echo "tests/test_docs.py::test_config_snippet_loads_and_builds_the_hook"
    echo "tests/doctor/test_rules.py"
    echo "tests/doctor/test_hook.py"
}

# overlay LEG VERSION: prints the overlay directory, (re)building it when its
# stamp differs.
overlay() {
    local leg=$1 version=$2 dir pyver cache want wheels
    leg_config "$leg"
    dir=.mmengine/$leg-$version
    pyver=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    cache="${MMNANHOOK_CACHE:-$HOME/.cache/mmnanhook}/wheels/mmengine$version-py$pyver"
    wheels=("mmengine==$version" $(extra_wheels "$version"))
    want="$pyver ${wheels[*]}"
    if [ -f "$dir/.mmnanhook-overlay" ] && [ "$(cat "$dir/.mmnanhook-overlay")" = "$want" ]; then
        echo "$dir"; return 0
    fi
    rm -rf "$dir"
    # From the cache alone; what it lacks is downloaded once.
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-index \
            --find-links "$cache" --no-warn-conflicts --target "$dir" "${wheels[@]}" >/dev/null 2>&1; then
        mkdir -p "$cache"
        rm -rf "$dir"
        "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
            --only-binary=:all: -d "$cache" "${wheels[@]}" >&2 || return 1
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-index \
            --find-links "$cache" --no-warn-conflicts --target "$dir" "${wheels[@]}" >&2 || return 1
    fi
    echo "$want" >"$dir/.mmnanhook-overlay"
    echo "$dir"
}

# run_leg LEG [pytest args]: every version in turn; a line per version into
# $logs/mmengine-LEG.results ("LEG VERSION pass|FAIL SECONDS").
run_leg() {
    local leg=$1 version dir start rc log cpu
    shift
    : >"$logs/mmengine-$leg.results"
    for version in "${versions[@]}"; do
        log=$logs/mmengine-$leg-$version.log
        cpu=
        start=$(date +%s)
        if ! dir=$(overlay "$leg" "$version" 2>"$log"); then
            echo "[test-mmengine] ERROR: could not lay mmengine $version over $leg (see $log)" >>"$log"
            echo "$leg $version FAIL $(( $(date +%s) - start )) -" >>"$logs/mmengine-$leg.results"
            continue
        fi
        leg_config "$leg"
        # The overlay's mmengine is the one imported, and mmdet accepts it.
        PYTHONPATH="$PWD/$dir${PYTHONPATH:+:$PYTHONPATH}" \
            "$venv/bin/python" - "$version" >>"$log" 2>&1 <<'PY'
import sys
import mmdet, mmengine, torch
assert mmengine.__version__ == sys.argv[1], (mmengine.__file__, mmengine.__version__)
print('[test-mmengine] python %s, torch %s, mmengine %s (%s), mmdet %s' % (
    sys.version.split()[0], torch.__version__, mmengine.__version__,
    mmengine.__file__, mmdet.__version__))
PY
        rc=$?
        if [ "$rc" -eq 0 ]; then
            # CPU seconds (user + sys, the test processes included): what
            # the subset costs, whatever else the machine runs meanwhile.
            # shellcheck disable=SC2046 - one node id a line
            # A hang (torch 1.7's exit race) fails this version in 20 min
            # instead of running out CI's time.
            cpu=$( { TIMEFORMAT='%U %S'; time PYTHONPATH="$PWD/$dir${PYTHONPATH:+:$PYTHONPATH}" \
                MMNANHOOK_LEG_REQUIRES=$requires MMNANHOOK_TEST_THREADS=1 \
                timeout 1200 "$venv/bin/python" -m pytest -p no:cacheprovider "$@" $(subset "$leg") >>"$log" 2>&1; } 2>&1 )
            rc=$?
            cpu=$(echo "$cpu" | awk '{printf "%d", $1 + $2}')
        fi
        echo "$leg $version $([ "$rc" -eq 0 ] && echo pass || echo "FAIL(exit=$rc)") $(( $(date +%s) - start )) ${cpu:--}" \
            >>"$logs/mmengine-$leg.results"
    done
}

for leg in "${legs[@]}"; do
    leg_config "$leg"
    if [ ! -x "$venv/bin/python" ]; then
        if [ "$leg" = dota ]; then missing_leg "test-mmengine dota" "$venv is missing (no Python $py_minor)"; fi
        echo "[test-mmengine] ERROR: $venv is missing; run make setup" >&2; exit 1
    fi
done

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; exit 130' INT TERM HUP
start=$(date +%s)
for leg in "${legs[@]}"; do
    echo "[test-mmengine] $leg leg: mmengine ${versions[*]}, logs: $logs/mmengine-$leg-<version>.log"
    run_leg "$leg" "$@" &
    pids+=($!)
done
wait
status=0
for leg in "${legs[@]}"; do
    for version in "${versions[@]}"; do
        echo
        echo "================================ mmengine $version on the $leg leg ================================"
        tail -n 25 "$logs/mmengine-$leg-$version.log" 2>/dev/null
    done
done
echo
printf '%-8s %-9s %-14s %-8s %s\n' leg mmengine result wall_s cpu_s
passed=0
while read -r leg version result seconds cpu; do
    printf '%-8s %-9s %-14s %-8s %s\n' "$leg" "$version" "$result" "$seconds" "$cpu"
    if [ "$result" = pass ]; then passed=$((passed + 1)); fi
done < <(for leg in "${legs[@]}"; do cat "$logs/mmengine-$leg.results" 2>/dev/null; done)
# A (leg, version) without a line never finished: a failure too.
[ "$passed" -eq $(( ${#legs[@]} * ${#versions[@]} )) ] || status=1
echo "[test-mmengine] $(( $(date +%s) - start )) s in all"
[ "$status" -eq 0 ] || echo "[test-mmengine] FAILED: see the logs above" >&2
exit "$status"
