#!/usr/bin/env bash
# One benchmark, run beside an earlier commit in one run: the rounds alternate
# (earlier, this tree, earlier, ...) so that the machine's drift hits both.
#   benchmarks/beside.sh REV ROUNDS PYTHON BENCHMARK [ARGS...]
# e.g. benchmarks/beside.sh HEAD~1 2 .venv/bin/python benchmarks/overhead.py --models tiny_retinanet
# REV's tree is checked out into a temporary worktree; each run imports the
# mmnanhook of its own tree (PYTHONPATH first), and its output is prefixed
# with the tree it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: beside.sh REV ROUNDS PYTHON BENCHMARK [ARGS...]}
rounds=${2:?rounds}
py=${3:?python}
bench=${4:?benchmark}
shift 4
before=$(mktemp -d)
trap 'git worktree remove --force "$before" >/dev/null 2>&1 || rm -rf "$before"' EXIT
git worktree add --detach -q "$before" "$rev"
here=$(pwd)
for round in $(seq "$rounds"); do
    for tree in "$before" "$here"; do
        name=$([ "$tree" = "$here" ] && echo "this tree" || echo "$rev ($(git rev-parse --short "$rev"))")
        echo "[beside] round $round: $name"
        ( cd "$tree" && PYTHONPATH="$tree" "$here/$py" -c \
            'import mmnanhook, sys; print("[beside] mmnanhook from", mmnanhook.__file__)' &&
          PYTHONPATH="$tree:$tree/tests" "$here/$py" "$bench" "$@" ) 2>&1 | sed "s|^|[$name] |"
    done
done
