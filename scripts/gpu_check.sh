#!/usr/bin/env bash
# Runs every GPU check of cupaged in one go on the H200 machine and prints a
# short summary last.
#
#   scripts/gpu_check.sh OUTDIR
#
# Steps (each one runs even when an earlier one failed; logs go to OUTDIR):
#   1. GPU tests:   python3 -m pytest -m gpu -q -x tests  -> OUTDIR/pytest.log
#      (pytest-benchmark's timing is disabled here: the bench suite runs once
#      as a smoke test; time it with `pytest -m gpu --benchmark-only tests/bench`)
#   2. correctness sweep, default 24 configs -> OUTDIR/correctness.csv/.log
#   3. correctness sweep, --force-merge      -> OUTDIR/correctness_merge.csv/.log
#   4. correctness sweep, --single-chunk     -> OUTDIR/correctness_single.csv/.log
#      (no merge: the default plan splits every default configuration)
#   4b. correctness sweep, --features (fp8, head_dim 96/256, GQA 3-16, page
#      1/256, soft cap, HND, scales: 121 configs) -> OUTDIR/correctness_features.csv/.log
#   5. microbenchmark --quick                -> OUTDIR/microbench.{csv,md,png,log}
#      (FlashInfer joins when .peer/activate.sh exists; set CUPAGED_NO_PEER=1
#      to skip it)
# Exit status: 0 when every step passed, 1 otherwise (the scripts exit 3 on a
# machine without a GPU, which shows in the summary table).
set -uo pipefail

usage() {
  cat <<'EOF'
usage: scripts/gpu_check.sh OUTDIR

Runs every GPU check of cupaged in one go and prints a summary last; each
step runs even when an earlier one failed, with its log in OUTDIR:
  1. the GPU tests (pytest -m gpu)
  2. the correctness sweep (24 configurations), then with --force-merge,
     --single-chunk and --features
  3. a quick microbenchmark (with FlashInfer when it is installed; env
     CUPAGED_NO_PEER=1 leaves it out)

exit status: 0 when every step passed, 1 otherwise (on a machine without a
GPU the scripts exit 3, which shows in the summary)
EOF
}
case ${1:-} in
  -h|--help) usage; exit 0 ;;
esac
if [ $# -ne 1 ]; then
  usage >&2
  exit 2
fi
mkdir -p "$1"
outdir=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

names=()
codes=()
secs=()

# step NAME LOG COMMAND...: run, tee the output to LOG, remember status and time
step() {
  local name=$1 log=$2
  shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$log"
  local rc=$?
  names+=("$name")
  codes+=("$rc")
  secs+=("$((SECONDS - t0))")
  echo "=== $name: exit $rc ($((SECONDS - t0)) s)"
  return 0
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
  | tee "$outdir/gpu.txt"

bench_flag=()
if python3 -c "import pytest_benchmark" 2>/dev/null; then
  bench_flag=(--benchmark-disable)
fi
step pytest "$outdir/pytest.log" \
  python3 -m pytest -m gpu -q -x ${bench_flag[@]+"${bench_flag[@]}"} tests
step correctness "$outdir/correctness.log" \
  python3 scripts/correctness.py --csv "$outdir/correctness.csv"
step correctness-merge "$outdir/correctness_merge.log" \
  python3 scripts/correctness.py --force-merge --csv "$outdir/correctness_merge.csv"
step correctness-single "$outdir/correctness_single.log" \
  python3 scripts/correctness.py --single-chunk --csv "$outdir/correctness_single.csv"
step correctness-features "$outdir/correctness_features.log" \
  python3 scripts/correctness.py --features --csv "$outdir/correctness_features.csv"

peer=""
if [ -f .peer/activate.sh ] && [ -z "${CUPAGED_NO_PEER:-}" ]; then
  peer="source .peer/activate.sh; "
fi
step microbench "$outdir/microbench.log" \
  bash -c "${peer}exec python3 scripts/microbench.py --quick --out-dir '$outdir'"

echo
echo "================ gpu_check summary ($outdir)"
cat "$outdir/gpu.txt" 2>/dev/null
printf '%-18s %6s %7s\n' step exit seconds
status=0
for i in "${!names[@]}"; do
  printf '%-18s %6s %7s\n' "${names[$i]}" "${codes[$i]}" "${secs[$i]}"
  if [ "${codes[$i]}" -ne 0 ]; then
    status=1
  fi
done
echo "--- pytest:      $(tail -n 1 "$outdir/pytest.log" 2>/dev/null)"
echo "--- correctness: $(grep -h '^SUMMARY' "$outdir/correctness.log" 2>/dev/null)"
echo "--- force-merge: $(grep -h '^SUMMARY' "$outdir/correctness_merge.log" 2>/dev/null)"
echo "--- single-chunk: $(grep -h '^SUMMARY' "$outdir/correctness_single.log" 2>/dev/null)"
echo "--- microbench:"
sed -n '/^SUMMARY/,$p' "$outdir/microbench.log" 2>/dev/null
exit "$status"
