#!/usr/bin/env bash
# The one prepared CUDA check, run on a device machine from the repository
# root (run tool: carry .device), or here as a CPU dry run (the CUDA tests
# skip, the rest of the script runs the same):
#   scripts/device_check.sh            # writes into $OUT (default: a temp dir)
# $OUT/summary.json: versions, GPU, the test outcomes, the overhead figure;
# $OUT/log.txt: everything printed; $OUT/cuda_bundle: the fp16-range bundle.
# Hard limit: 8 minutes for the tests and the benchmark together.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
py=${DEVICE_PYTHON:-python3}
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
deadline=$(( $(date +%s) + 480 ))

timeout 360 "$py" -m pytest -q -p no:cacheprovider -rs tests/sentinel/test_cuda.py \
    --junitxml="$OUT/junit.xml"
tests_rc=$?
left=$(( deadline - $(date +%s) ))
bench_rc=skipped
if "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' && [ "$left" -gt 30 ]; then
    timeout "$left" "$py" benchmarks/cuda_overhead.py --json "$OUT/overhead.json"
    bench_rc=$?
fi
"$py" - "$OUT" "$tests_rc" "$bench_rc" <<'PY'
import json, os, platform, sys
import xml.etree.ElementTree as ET
import torch, mmengine
out, tests_rc, bench_rc = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cases = []
junit = os.path.join(out, 'junit.xml')
if os.path.exists(junit):
    for case in ET.parse(junit).iter('testcase'):
        outcome = 'passed'
        for tag in ('failure', 'error', 'skipped'):
            if case.find(tag) is not None:
                outcome = tag
        cases.append(dict(name=case.get('name'), outcome=outcome,
                          seconds=float(case.get('time') or 0)))
overhead = None
if os.path.exists(os.path.join(out, 'overhead.json')):
    with open(os.path.join(out, 'overhead.json')) as f:
        overhead = json.load(f)
summary = dict(python=platform.python_version(), torch=torch.__version__,
               mmengine=mmengine.__version__,
               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               tests_rc=tests_rc, bench_rc=bench_rc, cases=cases,
               overhead=overhead,
               cuda_bundle=os.path.isdir(os.path.join(out, 'cuda_bundle')))
with open(os.path.join(out, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=2)
print(json.dumps(summary, indent=2))
PY
exit "$tests_rc"
