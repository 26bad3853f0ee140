#!/usr/bin/env bash
# `make test` and `make test-zoo`: every leg, two at a time, each on its own
# core (the tier is the pytest args' -m selection).
#
# The legs are independent venvs and every test runs one torch thread: the
# modern and DOTA legs start at once, and the codebases leg (its packages'
# tests only, the shortest) takes the first core one of them leaves, so on
# 2 cores the suite takes about as long as its slower leg.  Each leg writes its own
# log; at the end each log is printed whole (it ends with pytest's own
# closing line), then one line per leg.  Either leg failing fails the run.
# An interrupted run takes every process of every leg with it (each leg is a
# session of its own: DDP workers, Chromium, subprocess tests included).
# A leg still running after MMNANHOOK_LEG_TIMEOUT seconds (default 3600) is
# stopped and fails, its log printed as any leg's: a hang outside a test (a
# test's own hang is pytest-timeout's, pytest.ini) never holds the run.
#   scripts/test_all.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${MMNANHOOK_TEST_LOGS:-test-logs}
mkdir -p "$logs"
legs=(modern dota codebases)
# Legs running at once: one a core.
slots=2
declare -A pid started rc

bound=${MMNANHOOK_LEG_TIMEOUT:-3600}

stop_legs() {  # stop_legs [LEG...]: those legs (default: all)
    local leg
    for leg in "${@:-${legs[@]}}"; do
        [ -n "${pid[$leg]:-}" ] && kill -TERM -- -"${pid[$leg]}" 2>/dev/null
    done
    sleep 2
    for leg in "${@:-${legs[@]}}"; do
        [ -n "${pid[$leg]:-}" ] && kill -KILL -- -"${pid[$leg]}" 2>/dev/null
    done
}
trap 'echo "[test] interrupted: stopping every leg" >&2; stop_legs; exit 130' INT TERM HUP

# A leg alone on its core: the zoo tests' two threads would take the other
# leg's core, until the last leg runs alone (tests/zoo reads the file per test).
export MMNANHOOK_TEST_THREADS=1
export MMNANHOOK_TEST_THREADS_FILE=$logs/threads
echo 1 >"$MMNANHOOK_TEST_THREADS_FILE"
start_leg() {
    local leg=$1
    shift
    # setsid: the leg leads a process group of its own, so `kill -- -PID`
    # reaches everything it started.
    rm -f "$logs/$leg.rc"
    setsid bash -c 'scripts/test_leg.sh "$@"; echo $? >"$0"' "$logs/$leg.rc" \
        "$leg" "$@" >"$logs/$leg.log" 2>&1 &
    pid[$leg]=$!
    started[$leg]=$(date +%s)
    echo "[test] $leg leg started (pid ${pid[$leg]}), log: $logs/$leg.log"
}
queued=("${legs[@]}")
for _ in $(seq "$slots"); do
    start_leg "${queued[0]}" "$@"
    queued=("${queued[@]:1}")
done

progress() {  # the last "[ NN%]" pytest printed, or what the leg is doing
    local p
    p=$(grep -o '\[ *[0-9]*%\]' "$logs/$1.log" 2>/dev/null | tail -1 | tr -d '[] ')
    echo "${p:-starting}"
}

alive() {  # a zombie still answers kill -0
    case $(ps -o stat= -p "$1" 2>/dev/null) in ''|Z*) return 1 ;; esac
}

elapsed() { echo $(( $(date +%s) - ${started[$1]} )); }

running=${#legs[@]}
declare -A took
beat=$(date +%s)
while [ "$running" -gt 0 ]; do
    for leg in "${legs[@]}"; do
        [ -n "${rc[$leg]:-}" ] || [ -z "${pid[$leg]:-}" ] && continue
        if [ "$(elapsed "$leg")" -ge "$bound" ] && [ ! -s "$logs/$leg.rc" ]; then
            echo "[test] FAILED: the $leg leg ran over its bound of $bound s" \
                "(MMNANHOOK_LEG_TIMEOUT): stopped (its log's end says where)" >&2
            stop_legs "$leg"
            echo 124 >"$logs/$leg.rc"
        fi
        if [ -s "$logs/$leg.rc" ] || ! alive "${pid[$leg]}"; then
            wait "${pid[$leg]}" 2>/dev/null
            # No exit code written: the leg was killed from outside.
            rc[$leg]=$(cat "$logs/$leg.rc" 2>/dev/null || echo 1)
            took[$leg]=$(elapsed "$leg")
            running=$((running - 1))
            echo "[test] $leg leg finished (exit ${rc[$leg]}, ${took[$leg]} s)"
            if [ ${#queued[@]} -gt 0 ]; then
                start_leg "${queued[0]}" "$@"
                queued=("${queued[@]:1}")
            elif [ "$running" -eq 1 ]; then
                # The last leg has both cores.
                echo 2 >"$MMNANHOOK_TEST_THREADS_FILE"
            fi
        fi
    done
    [ "$running" -gt 0 ] || break
    sleep 5
    if [ $(( $(date +%s) - beat )) -ge 60 ]; then
        beat=$(date +%s)
        line="[test] $(( $(elapsed modern) / 60 )) min:"
        for leg in "${legs[@]}"; do
            [ -z "${rc[$leg]:-}" ] && [ -n "${pid[$leg]:-}" ] &&
                line+=" $leg $(progress "$leg")"
        done
        echo "$line"
    fi
done

status=0
for leg in "${legs[@]}"; do
    echo
    echo "================================ $leg leg ($logs/$leg.log) ================================"
    cat "$logs/$leg.log"
    [ "${rc[$leg]}" -eq 0 ] || status=1
done
echo
for leg in "${legs[@]}"; do
    closing=$(grep -E '^=+ .*(passed|failed|error|no tests ran).* =+$' "$logs/$leg.log" | tail -1)
    [ -n "$closing" ] || closing=$(tail -1 "$logs/$leg.log")
    echo "[test] $leg: exit ${rc[$leg]} in ${took[$leg]} s: $closing"
    # A selection that left nothing to run but skips exits 0: a tier that ran
    # no test has proved nothing (a leg skipped by design said so loudly).
    if [ "${rc[$leg]}" -eq 0 ] && ! echo "$closing" | grep -qE '[0-9]+ passed' &&
            ! grep -q '] SKIPPED: ' "$logs/$leg.log"; then
        echo "[test] FAILED: the $leg leg passed no test ($*)" >&2
        status=1
    fi
done
[ "$status" -eq 0 ] || echo "[test] FAILED: see the failing leg's output above" >&2
exit "$status"
