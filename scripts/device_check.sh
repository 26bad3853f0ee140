#!/usr/bin/env bash
# The one prepared CUDA check, run on a device machine from the repository
# root (run tool: carry .device, timeout_s 600), or here as a CPU dry run:
#   scripts/device_check.sh                          # writes into $OUT (default: a temp dir)
#   MMNAN_DEVICE_DRYRUN=cpu scripts/device_check.sh  # no GPU: the zoo tests and benchmark on the CPU, small
# The steps, in order, each bounded, none started past $DEVICE_BUDGET_S
# (540 s from the start: the device tool's 10-minute command less the
# install, the summary and a margin; the dry run's limits are 3 times the
# device's, DEVICE_DRYRUN_FACTOR):
#  1. toy_tests: tests/sentinel/test_cuda.py (SmallResNet, AmpOptimWrapper);
#  2. zoo_amp, zoo_clean, zoo_compile: tests/zoo/test_zoo_cuda.py, mmdet's
#     zoo RetinaNet R50 on the GPU (mmdet's py_sigmoid_focal_loss standing
#     in for mmcv's CUDA focal loss where this mmcv has none);
#  3. zoo_replay: zoo_amp's bundle replayed on this machine's CPU
#     (tests/zoo/test_zoo_cuda_replay.py), beside zoo_clean and zoo_compile:
#     with its 300 MB of state it cannot come back whole;
#  4. zoo_bench: benchmarks/cuda_zoo_overhead.py (tier 1 at batch 2 and 8,
#     the input check on a float batch);
#  5. toy_bench: benchmarks/cuda_overhead.py.
# $OUT, 7 files (the device tool brings back 8, none in a folder deeper
# than 2): summary.json (versions, GPU, each step's exit code and seconds,
# each test's outcome and properties, the figures), log.txt (everything
# printed), results.tar.gz (the JUnit files, steps.txt, the benchmarks'
# JSON), overhead.json, zoo_overhead.json, cuda_bundle.tar.gz (the toy's
# fp16-range bundle, for tests/data/cuda_bundle) and zoo_amp_bundle.tar.gz
# (the zoo's, without model.pth and optimizer.pth).
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
py=${DEVICE_PYTHON:-python3}
# The dry run's limits (and budget) are these times the device's: this CPU
# does the GPU's work, at 64 px.
factor=1
if [ "${MMNAN_DEVICE_DRYRUN:-}" = cpu ] &&
        ! "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    factor=${DEVICE_DRYRUN_FACTOR:-3}
fi
budget=${DEVICE_BUDGET_S:-$(( 540 * factor ))}
exec > >(tee "$OUT/log.txt") 2>&1

if ! "$py" -c 'import mmengine, mmdet, mmcv.ops' 2>/dev/null; then
    "$py" -m pip install -q --no-index --no-deps .device/wheels/*.whl || exit 2
fi
# mmcv's ops load only beside the torch they were compiled against.
if [ -f .device/wheels/mmcv-torch.txt ]; then
    "$py" - "$(cat .device/wheels/mmcv-torch.txt)" <<'PY'
import sys
import torch
here = torch.__version__.split('+')[0]
print('[device] mmcv built for torch %s; this torch %s%s' % (
    sys.argv[1], torch.__version__, '' if here == sys.argv[1] else
    ': MISMATCH, rebuild with DEVICE_TORCH=%s make device-wheels' % here))
PY
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} MMNAN_DEVICE_OUT=$OUT
work=$OUT/work
scratch=$(mktemp -d)
mkdir -p "$work"
: >"$work/steps.txt"
cuda=0
"$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' && cuda=1
per_test=
"$py" -c 'import pytest_timeout' 2>/dev/null && per_test=1
if [ "$cuda" = 1 ]; then
    unset MMNAN_DEVICE_DRYRUN
    echo "[device] CUDA: the GPU checks"
elif [ "${MMNAN_DEVICE_DRYRUN:-}" = cpu ]; then
    echo "[device] no CUDA device: dry run on the CPU (MMNAN_DEVICE_DRYRUN=cpu)"
else
    echo "[device] no CUDA device: the CUDA tests skip (MMNAN_DEVICE_DRYRUN=cpu dry-runs the zoo's)"
fi

# step NAME LIMIT CMD...: CMD for at most LIMIT seconds and never past the
# budget; "NAME RC SECONDS" into steps.txt (124: stopped at its limit;
# skipped: under 30 s were left).
step() {
    local name=$1 limit=$2 left t0 rc
    shift 2
    limit=$(( limit * factor ))
    left=$(( start + budget - $(date +%s) ))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 30 ]; then
        echo "[device] $name: skipped, ${left} s left of ${budget} s"
        echo "$name skipped 0" >>"$work/steps.txt"
        return 0
    fi
    echo "[device] $name: at most ${limit} s"
    t0=$(date +%s)
    # A test that hangs fails alone (pytest-timeout), so that its JUnit file
    # is written before the step's own limit.
    PYTEST_ADDOPTS=${per_test:+--timeout=$(( limit - 15 ))} \
        timeout -k 10 "$limit" "$@"
    rc=$?
    echo "[device] $name: exit $rc after $(( $(date +%s) - t0 )) s"
    echo "$name $rc $(( $(date +%s) - t0 ))" >>"$work/steps.txt"
}

# A pytest step: its JUnit file (with the tests' properties) in $work.
tests() {
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" "$py" -m pytest -q -rs -p no:cacheprovider \
        -o junit_family=xunit1 --basetemp="$scratch/$name" \
        --junitxml="$work/junit_$name.xml" "$@"
}

zoo=tests/zoo/test_zoo_cuda.py
tests toy_tests 90 tests/sentinel/test_cuda.py
tests zoo_amp 150 "$zoo" -k fp16_range
replay_pid=
if [ -d "$OUT/zoo_amp_bundle" ]; then
    # On the CPU while the GPU tests go on; half the cores, the rest for
    # inductor's compile workers.
    [ "$cuda" = 1 ] && export OMP_NUM_THREADS=${DEVICE_REPLAY_THREADS:-8}
    (export MMNAN_ZOO_BUNDLE=$OUT/zoo_amp_bundle
     tests zoo_replay 240 tests/zoo/test_zoo_cuda_replay.py) &
    replay_pid=$!
    [ "$cuda" = 1 ] && unset OMP_NUM_THREADS
fi
tests zoo_clean 120 "$zoo" -k clean_amp
tests zoo_compile 240 "$zoo" -k compile
[ -n "$replay_pid" ] && wait "$replay_pid"

# The zoo's benchmark: what is left but a minute for the toy's, at most 3
# minutes; it starts no set of runners it would not finish 40 s before.
left=$(( (start + budget - $(date +%s)) / factor ))
limit=$(( left - 60 < 180 ? left - 60 : 180 ))
if [ "$cuda" = 1 ]; then
    step zoo_bench "$limit" "$py" benchmarks/cuda_zoo_overhead.py \
        --budget-s $(( limit - 40 )) --json "$work/zoo_overhead.json"
    step toy_bench 90 "$py" benchmarks/cuda_overhead.py \
        --json "$work/overhead.json"
elif [ "${MMNAN_DEVICE_DRYRUN:-}" = cpu ]; then
    # Its code, not figures: one set of each kind of run, 3 iterations.
    step zoo_bench "$limit" "$py" benchmarks/cuda_zoo_overhead.py \
        --batches 2 --iters 2 --warmup 1 --repeats 1 --check-calls 5 \
        --budget-s $(( (limit - 40) * factor )) --json "$work/zoo_overhead.json"
fi

# At most 8 files come back: the bundles as archives, the zoo's without
# the state (model.pth and optimizer.pth: 150 MB each).
if [ -d "$OUT/cuda_bundle" ]; then
    tar -C "$OUT" -czf "$OUT/cuda_bundle.tar.gz" cuda_bundle &&
        rm -rf "$OUT/cuda_bundle"
fi
if [ -d "$OUT/zoo_amp_bundle" ]; then
    tar -C "$OUT" --exclude=zoo_amp_bundle/model.pth \
        --exclude=zoo_amp_bundle/optimizer.pth \
        -czf "$OUT/zoo_amp_bundle.tar.gz" zoo_amp_bundle &&
        rm -rf "$OUT/zoo_amp_bundle"
fi
for figures in overhead.json zoo_overhead.json; do
    [ -f "$work/$figures" ] && cp "$work/$figures" "$OUT/"
done
"$py" - "$OUT" "$work" "$cuda" "$budget" "$start" "$factor" <<'PY'
import glob, json, os, platform, sys, time
import xml.etree.ElementTree as ET
import torch, mmengine
out, work, cuda, budget, start, factor = sys.argv[1:]
versions = dict(python=platform.python_version(), torch=torch.__version__,
                mmengine=mmengine.__version__)
for name in ('mmcv', 'mmdet'):
    try:
        versions[name] = __import__(name).__version__
    except ImportError:
        versions[name] = None
steps = {}
with open(os.path.join(work, 'steps.txt')) as f:
    for line in f:
        name, rc, seconds = line.split()
        steps[name] = dict(rc=rc, seconds=int(seconds))
cases = []
for junit in sorted(glob.glob(os.path.join(work, 'junit_*.xml'))):
    for case in ET.parse(junit).iter('testcase'):
        outcome, message = 'passed', None
        for tag in ('failure', 'error', 'skipped'):
            found = case.find(tag)
            if found is not None:
                outcome, message = tag, found.get('message')
        cases.append(dict(
            step=os.path.basename(junit)[len('junit_'):-len('.xml')],
            name=case.get('name'), outcome=outcome, message=message,
            seconds=float(case.get('time') or 0),
            properties=dict((p.get('name'), p.get('value'))
                            for p in case.iter('property'))))
figures = {}
for name in ('overhead', 'zoo_overhead'):
    path = os.path.join(work, name + '.json')
    if os.path.exists(path):
        with open(path) as f:
            figures[name] = json.load(f)
failed = sorted(n for n, s in steps.items() if s['rc'] not in ('0', 'skipped'))
summary = dict(
    versions, gpu=torch.cuda.get_device_name(0) if cuda == '1' else None,
    dry_run=cuda != '1' and os.environ.get('MMNAN_DEVICE_DRYRUN') == 'cpu',
    budget_s=int(budget), limit_factor=int(factor),
    elapsed_s=int(time.time()) - int(start),
    failed_steps=failed, steps=steps, cases=cases, **figures,
    bundles=sorted(os.path.basename(p)
                   for p in glob.glob(os.path.join(out, '*_bundle.tar.gz'))))
with open(os.path.join(out, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=2)
print(json.dumps(dict((k, v) for k, v in summary.items()
                      if k not in ('overhead', 'zoo_overhead')), indent=2))
sys.exit(1 if failed else 0)
PY
rc=$?
tar -C "$work" -czf "$OUT/results.tar.gz" . && rm -rf "$work"
rm -rf "$scratch"
exit "$rc"
