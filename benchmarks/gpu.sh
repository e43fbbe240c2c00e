#!/usr/bin/env bash
# One GPU, at most 10 minutes: the CUDA-only tests, then the eager and compiled pure steps
# on the GPU (bench_compile.py --device cuda --world 1), each stage under its own timeout,
# and a summary. For sessions lent a GPU machine (`make bench-gpu`).
#
#   bash benchmarks/gpu.sh             # run it (from the repository root or anywhere)
#   bash benchmarks/gpu.sh --dry-run   # print the plan, run nothing (works on a CPU machine)
#
# The GPU machine cannot reach a package registry: the script uses the Python it finds
# ($PYTHON, else .venv/bin/python, else python3) and checks first that its torch is a CUDA
# build that sees a GPU. Results go under $OUT when it is set (the device tool returns what
# is written there), else benchmarks/gpu_results/: one log per stage, bench_compile's JSON
# (its table: python benchmarks/report.py --from-results needs the whole results file, so
# the JSON is the record to paste from) and summary.md.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
  esac
done

TOTAL_BUDGET_S=${GPU_BUDGET_S:-570}  # the whole run, under the 10 minutes a session gets
RESULTS_DIR="${OUT:-$ROOT/benchmarks/gpu_results}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY="python3"; fi
# shardfn from this checkout even when it is not pip-installed (a copied working tree)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# The tests that skip without CUDA: every `skipif(not torch.cuda.is_available()` and the
# test function it decorates, as pytest node ids.
cuda_tests() {
  grep -rln --include='test_*.py' 'skipif(not torch.cuda.is_available()' tests | sort |
    while read -r file; do
      awk -v file="$file" '
        /skipif\(not torch\.cuda\.is_available\(\)/ { armed = 1; next }
        armed && /^[[:space:]]*(async[[:space:]]+)?def[[:space:]]+test_/ {
          name = $0; sub(/^[[:space:]]*(async[[:space:]]+)?def[[:space:]]+/, "", name)
          sub(/\(.*/, "", name); print file "::" name; armed = 0 }' "$file"
    done
}

# stage name | timeout (s) | command
STAGES=(
  "env|30|$PY benchmarks/gpu_env.py"
  "cuda-tests|150|$PY -m pytest -q -p no:cacheprovider -rs $(cuda_tests | tr '\n' ' ')"
  "bench-compile|360|$PY benchmarks/bench_compile.py --device cuda --world 1 --systems pmean dp dp-pure zero1 zero3 pmean-autocast --steps 10 --warmup 2 --results $RESULTS_DIR/bench_compile_cuda.json"
)

plan() {
  echo "gpu.sh plan (budget ${TOTAL_BUDGET_S} s in all; results in $RESULTS_DIR):"
  local i=1
  for stage in "${STAGES[@]}"; do
    IFS='|' read -r name seconds command <<< "$stage"
    printf '  %d. %-14s timeout %4s s: %s\n' "$i" "$name" "$seconds" "$command"
    i=$((i + 1))
  done
  echo "  then: summary.md (each stage's status and time, bench_compile's table)"
  echo "  (CUDA autocast: bench_compile's pmean-autocast row; offload: the CUDA tests above"
  echo "   (shard_params offload, remat's offload of saved activations); no benchmark has a"
  echo "   storage-release row)"
}

if [ "$DRY_RUN" = 1 ]; then
  plan
  exit 0
fi

mkdir -p "$RESULTS_DIR"
plan | tee "$RESULTS_DIR/plan.txt"
START=$(date +%s)
SUMMARY=()
FAILED=0
for stage in "${STAGES[@]}"; do
  IFS='|' read -r name seconds command <<< "$stage"
  left=$((TOTAL_BUDGET_S - ($(date +%s) - START)))
  if [ "$left" -lt 10 ]; then
    SUMMARY+=("| $name | skipped: the budget is spent | 0 |")
    FAILED=1
    continue
  fi
  [ "$seconds" -gt "$left" ] && seconds=$left
  echo "== $name (timeout ${seconds} s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$seconds" bash -c "$command" 2>&1 | tee "$RESULTS_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  took=$(($(date +%s) - t0))
  case "$rc" in
    0) status="ok" ;;
    124|137) status="timed out after ${seconds} s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  SUMMARY+=("| $name | $status | $took |")
  if [ "$name" = "env" ] && [ "$rc" != 0 ]; then
    echo "gpu.sh: stopped: $PY has no usable CUDA torch (above: why). The GPU machine" \
         "cannot install one: run with PYTHON=<a python whose torch is a CUDA build>." |
      tee -a "$RESULTS_DIR/env.log"
    FAILED=1
    break
  fi
  [ "$rc" != 0 ] && FAILED=1
done

{
  echo "# gpu.sh summary"
  echo
  echo "$($PY -c 'import sys; sys.path.insert(0, "benchmarks"); from _common import machine_info; print(machine_info())' 2>/dev/null)"
  [ -x "$(command -v nvidia-smi)" ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo
  echo "| stage | status | seconds |"
  echo "|---|---|---:|"
  printf '%s\n' "${SUMMARY[@]}"
  echo
  echo "Total: $(($(date +%s) - START)) s."
  if [ -f "$RESULTS_DIR/bench_compile_cuda.json" ]; then
    echo
    $PY -c 'import json, sys
r = json.load(open(sys.argv[1]))
for t in r["tables"]:
    print("| " + " | ".join(t["header"]) + " |")
    print("|" + "---|" * len(t["header"]))
    for row in t["rows"]:
        print("| " + " | ".join(row) + " |")' "$RESULTS_DIR/bench_compile_cuda.json"
  fi
} | tee "$RESULTS_DIR/summary.md"
exit "$FAILED"
