#!/usr/bin/env bash
# Paired A/B of two commits: bench_pp.py and bench_tp.py of REV (a temporary git worktree)
# and of this checkout, alternated for ROUNDS rounds on the same machine; each run's ratio
# is against torch measured in the same run, so a slower machine moves both sides alike.
# Usage: benchmarks/ab.sh REV [ROUNDS]   (run from the repository root, on a quiet machine)
set -euo pipefail
rev=${1:?usage: benchmarks/ab.sh REV [ROUNDS]}
rounds=${2:-2}
here=$(pwd)
old=$(mktemp -d)
trap 'git worktree remove --force "$old"' EXIT
git worktree add -f --detach "$old" "$rev" >/dev/null
for round in $(seq "$rounds"); do
  for side in "$rev" HEAD; do
    tree=$here; [ "$side" = HEAD ] || tree=$old
    echo "== round $round: $side"
    (cd "$tree" && PYTHONPATH=$tree "$here/.venv/bin/python" benchmarks/bench_pp.py \
        --img-dir "$(mktemp -d)" | grep -E "^\| (gpipe|1f1b|interleaved|zb-h1) \| shardfn")
    (cd "$tree" && PYTHONPATH=$tree "$here/.venv/bin/python" benchmarks/bench_tp.py \
        | grep -E "autograd step \|")
  done
done
