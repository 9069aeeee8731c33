#!/usr/bin/env bash
# One H200 session's worth of checks, results packed into OUT/results.tgz
# (the device tool returns at most 8 files). Usage: scripts/gpu_run.sh OUT [steps...]
# steps: tests sanitize tune bench full profile soak (default: tests sanitize bench)
set -uo pipefail
out=$1; shift
steps=${*:-tests sanitize bench}
work=$(mktemp -d)
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
peer=""; [ -f .peer/activate.sh ] && peer="source .peer/activate.sh;"
run() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" bash -c "$*" > "$work/$name.log" 2>&1; echo "=== $name exit $?"; tail -n 12 "$work/$name.log"; }
for s in $steps; do case $s in
  tests) run pytest 240 "python3 -m pytest -m gpu -q -p no:cacheprovider --benchmark-disable tests" ;;
  sanitize)
    run memcheck 200 "compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_decode.py -k 'v2_matches_reference or empty_requests or page_sizes or merge_closed or graph or front_trimmed or baselines_match_reference and float16'"
    run racecheck 200 "compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_decode.py -k 'v2_matches_reference and float16 or merge_closed'"
    run initcheck 200 "compute-sanitizer --tool initcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_decode.py -k 'v2_matches_reference and float16 or empty_requests'" ;;
  tune) run autotune 200 "python3 scripts/autotune.py --no-store --csv $work/autotune.csv" ;;
  bench) run microbench 330 "$peer python3 scripts/microbench.py --out-dir $work/bench" ;;
  full) run correctness_full 400 "python3 scripts/correctness.py --full --csv $work/correctness_full.csv"
        run correctness_merge 200 "python3 scripts/correctness.py --force-merge --csv $work/correctness_merge.csv" ;;
  soak) run soak 300 "python3 scripts/soak.py --backend gpu --json $work/soak.json" ;;
  profile) run ncu 150 "ncu --clock-control none -k regex:paged_decode_partial --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats python3 scripts/microbench.py --batch 8 --ctx 32768 --methods v2 --reps 1 --iters 4 --host-iters 1 --out-dir $work/prof" ;;
esac; done
tar czf "$out/results.tgz" -C "$work" .
