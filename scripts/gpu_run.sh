#!/usr/bin/env bash
# One H200 session's worth of checks, results packed into OUT/results.tgz
# (the device tool returns at most 8 files). Usage: scripts/gpu_run.sh OUT [steps...]
# steps: tests sanitize sanitize6 host tune bench issue5 full features cascade fp8 profile soak notebook
#        check ragged ragged_bench large sweep sweep8 check8 runtime occupancy ab features2 roofline ncu_compare
#        ncu_sectors variants spec windows pdl pdl_dims pdl_ab suite_ab precompile headdims
# (default: tests sanitize bench)
# (carry .peer for bench/issue5/ragged_bench/large/ncu_compare/spec/windows, .nbpeer for notebook, .ab for ab and the
#  variant trees named in AB_TREES;
#  keep one call under 10 minutes)
set -uo pipefail
usage() {
  cat <<'EOF'
usage: scripts/gpu_run.sh OUT [STEP ...]

Runs the named GPU steps, each under a time limit, and packs their logs and
outputs into OUT/results.tgz (default steps: tests sanitize bench).

steps:
  precompile  every kernel module compiled in parallel into CuPy's cache (first,
              on a fresh machine: the later steps then load them)
  tests       the GPU test suite (pytest -m gpu), in three processes side by side
  sanitize    compute-sanitizer memcheck, racecheck and initcheck of the core kernels
  sanitize6   memcheck and racecheck of the fp8, head_dim 96, soft-cap and HND
              instances, append_kv and cascade
  host        host time of one decode call (host_profile.py)
  tune        chunk-size autotune sweep (autotune.py)
  bench       microbenchmark: gather, v1, v2 and FlashInfer if installed
  issue5      the microbenchmark's fixed suite of cells and targets
  full        correctness sweep --full and --force-merge
  features    correctness sweep --features
  cascade     cascade benchmark
  fp8         fp16 vs fp8 KV microbenchmark
  profile     Nsight Compute profile of the partial kernel
  soak        serving-loop soak test on the GPU
  notebook    execute examples/quickstart.ipynb (needs nbclient and ipykernel)
  check       correctness sweep, default configurations and --force-merge
  ragged      correctness sweep --ragged and --ragged --force-merge, and
              compute-sanitizer memcheck of the ragged-batch GPU tests
  ragged_bench  the ragged-batch family against FlashInfer (fp16, bf16, fp8)
  large       issue 20's targets: the issue-5 suite's v2 and FlashInfer columns (env LARGE_GROUPS,
              default main-fp16-p16 main-bf16-p16 mha-fp16-p16), then scripts/large_report.py
              (env LARGE_BASELINE: another run's microbench-issue5.csv for the no-slower check)
  sweep       chunk sweep of the ragged family, fp16 (the planner check)
  sweep8      chunk sweep of the ragged family, fp8 (every second knob; env SWEEP_HALF=1: the other half;
              SWEEP_CTAS_PER_SM=2: plans and launches held to 2 CTAs per SM)
  check8      the fp8 planner check re-timed in one run: each ragged cell's default plan beside the best
              knob at 3 and at 2 CTAs per SM of the committed fp8 sweeps (chunk_sweep.py --check-against)
  runtime     GPU tests of the serving runtime, the kernels it changed, sinks,
              windows, several query tokens per request and the serving loop;
              memcheck of the runner, hot-path, sinks/window and multi-token tests
  features2   GPU time of sinks, sliding windows and 2-8 query tokens per request
              against the plain call
              (feature_cost.py)
  pdl         programmatic dependent launch (on by default): the decode, hot-path and runner GPU
              tests under CUPAGED_PDL=0 (the opt-out and pre-sm_90 path; the step tests runs the
              default), then the main-fp16 issue-5 cells with CUPAGED_PDL=0 and with the default,
              and large_report.py of the default against 0
  suite_ab    the main-fp16 issue-5 cells (v2, small cells over rotating caches) for each kernel
              source tree in env AB_TREES (default: this tree's cuda_src), then large_report.py of
              each later tree against the first (e.g. AB_TREES="cuda_src .variants/no_prefetch",
              carry .variants)
  windows     sliding windows against the full call and FlashInfer's window_left decode
              (window_bench.py; ctx 32768, batch 1/8/32, W 1024/4096/16384)
  spec        speculative-decode shapes (q_len 2-8) against FlashInfer's paged prefill
              (spec_bench.py; env SPEC_ARGS adds options, e.g. "--backends fa2")
  roofline    HBM read roofline: 8 GB read with int4 loads and with
              cp.async.bulk into an mbarrier ring (roofline.py)
  ncu_compare Nsight Compute of v2 and of FlashInfer's tensor-core and CUDA-core
              decode kernels on 128 x 16384 (FlashInfer's profiles need FlashInfer)
  ncu_sectors L2 requests and sectors of v2's partial kernel on 128 x 16384, for each
              kernel source tree in env AB_TREES (default: this tree's cuda_src)
  variants    scripts/ab_sources.py for each kernel source tree in env AB_TREES
              (cuda_src folders), AB_ROUNDS interleaved rounds (default 2), KV dtype
              env AB_KV (fp16 or fp8), cells env AB_CELLS (BATCHxCTX[xQLEN])
  occupancy   registers, spills and CTAs per SM of the head_dim 64/128 partial
              instances (driver occupancy API) against the planner's
  pdl_dims    programmatic dependent launch on and off (CUPAGED_PDL=1/0, alternated, two rounds)
              at head_dim 64, 80, 96, 128, 192 and 256, fp16, four uniform cells each
              (ab_trees.py); B/A > 1 where PDL is slower
  pdl_ab      PDL off (A) against the default (B) on tensor-core (head_dim 64/128) and
              CUDA-core (head_dim 256, group 8, float32) cells, two interleaved rounds
              (docs/benchmarks/h200-pdl-residency-2026-12-02.md)
  headdims    head_dim 80 and 192 (issue 19): their GPU tests, memcheck, the driver's occupancy
              against the planner's, and v2 (with gather, and FlashInfer where installed, not at 80)
              at 80/128/192, fp8 at 128/192
  ab          default plans of .ab/old (another tree's cupaged/ and cuda_src/)
              and of this tree on uniform cells, two interleaved rounds
EOF
}
case ${1:-} in
  -h|--help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
esac
out=$1; shift
mkdir -p "$out"  # (a fresh subfolder of the device tool's OUT is fine)
steps=${*:-tests sanitize bench}
work=$(mktemp -d)
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
peer=""; [ -f .peer/activate.sh ] && peer="source .peer/activate.sh;"
ncu_l2="dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,l1tex__m_xbar2l1tex_read_sectors.sum,smsp__inst_executed.sum,gpu__time_duration.sum"
ncu_bench="python3 scripts/microbench.py --batch 128 --ctx 16384 --reps 1 --iters 2 --host-iters 1"
run() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" bash -c "$*" > "$work/$name.log" 2>&1; echo "=== $name exit $?"; tail -n 12 "$work/$name.log"; }
for s in $steps; do case $s in
  precompile) run precompile 150 "python3 scripts/precompile.py" ;;
  tests)  # three pytest processes side by side on the one GPU (serially the suite outgrew one 10-minute call;
          # 475 tests in ~165 s this way on the H200 after precompile)
    pt="python3 -m pytest -m gpu -q -p no:cacheprovider --benchmark-disable"
    big="tests/test_gpu_decode.py tests/test_features_gpu.py tests/test_multi_token.py"
    run pytest_a 300 "$pt tests/test_gpu_decode.py" &
    run pytest_b 300 "$pt tests/test_features_gpu.py tests/test_multi_token.py" &
    run pytest_c 300 "$pt tests $(printf -- '--ignore=%s ' $big)" &
    wait ;;
  sanitize)
    # a representative subset per kernel: partial (MMA and SIMT cores, single chunk and fused
    # merge, page sizes 1-256, graph replay), v1, gather, the standalone merge
    sel="v2_matches_reference or both_cores or empty_requests or page_sizes or merge_closed or graph or front_trimmed or baselines_match_reference"
    run memcheck 170 "compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_decode.py -k '$sel'"
    run racecheck 120 "compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_decode.py -k 'v2_matches_reference or both_cores_match_reference and 128 or merge_closed or baselines_match_reference and v1'"
    run initcheck 120 "compute-sanitizer --tool initcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_decode.py -k 'v2_matches_reference or both_cores_match_reference and 128 or empty_requests or merge_closed or baselines_match_reference and v1'" ;;
  sanitize6)
    # issue-6 kernels: fp8/head_dim-96/soft-cap/HND partial instances, append_kv, cascade's merges
    sel6="fp8_kv_matches_reference and (128 or 96) or head_dim_96 or page_sizes or gqa_groups_fp8 or soft_cap_every_method or hnd_layout"
    run memcheck6 220 "compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_append.py tests/test_features_gpu.py -k 'not features_gpu or $sel6'"
    run racecheck6 100 "compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_features_gpu.py -k 'fp8_kv_matches_reference and 128 and head or head_dim_96 and v2'" ;;
  host) run host_profile 90 "python3 scripts/host_profile.py" ;;
  tune) run autotune 200 "python3 scripts/autotune.py --no-store --csv $work/autotune.csv" ;;
  bench) run microbench 330 "$peer python3 scripts/microbench.py --out-dir $work/bench" ;;
  issue5) run microbench_issue5 415 "$peer python3 scripts/microbench.py --suite issue5 --out-dir $work/issue5 ${CUPAGED_COMMIT:+--commit $CUPAGED_COMMIT}"; sed -n '/^SUMMARY/,/host us/p' "$work/microbench_issue5.log" ;;
  full) run correctness_full 400 "python3 scripts/correctness.py --full --csv $work/correctness_full.csv"
        run correctness_merge 200 "python3 scripts/correctness.py --force-merge --csv $work/correctness_merge.csv" ;;
  features) run correctness_features 300 "python3 scripts/correctness.py --features --csv $work/correctness_features.csv" ;;
  cascade) run cascade_bench 200 "$peer python3 scripts/cascade_bench.py --out-dir $work/cascade" ;;
  fp8) run microbench_fp8 230 "$peer python3 scripts/microbench.py --kv-dtype fp8 --batch 1 8 32 128 --ctx 1024 32768 --out-dir $work/fp8" ;;
  soak) run soak 140 "python3 scripts/soak.py --backend gpu --json $work/soak.json" ;;
  notebook) run notebook 150 "if [ -f .nbpeer/activate.sh ]; then source .nbpeer/activate.sh; fi; python3 scripts/run_notebook.py examples/quickstart.ipynb $work/quickstart.ipynb --timeout 240 --no-skips" ;;  # set CUPAGED_COMMIT for the stamp
  check) run correctness 150 "python3 scripts/correctness.py --csv $work/correctness.csv"
         run correctness_merge 150 "python3 scripts/correctness.py --force-merge --csv $work/correctness_merge.csv" ;;
  ragged) run correctness_ragged 90 "python3 scripts/correctness.py --ragged --csv $work/correctness_ragged.csv"
          run correctness_ragged_merge 90 "python3 scripts/correctness.py --ragged --force-merge --csv $work/correctness_ragged_merge.csv"
          run memcheck_ragged 110 "compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_decode.py -k 'ragged'" ;;
  ragged_bench) run ragged_bench 330 "$peer python3 scripts/microbench.py --lengths family --out-dir $work/ragged ${CUPAGED_COMMIT:+--commit $CUPAGED_COMMIT}" ;;
  large)  # issue 20: the issue-5 suite's v2 and FlashInfer columns, then its targets per cell
    run large_suite 420 "$peer python3 scripts/microbench.py --suite issue5 --methods v2 flashinfer --groups ${LARGE_GROUPS:-main-fp16-p16 main-bf16-p16 mha-fp16-p16} --out-dir $work/large ${CUPAGED_COMMIT:+--commit $CUPAGED_COMMIT}"
    run large_report 60 "python3 scripts/large_report.py $work/large/microbench-issue5.csv --out $work/large/h200-large ${LARGE_BASELINE:+--baseline $LARGE_BASELINE --baseline-label ${LARGE_BASELINE_LABEL:-baseline}}"
    cat "$work/large_report.log" ;;
  sweep) run sweep_ragged16 200 "python3 scripts/chunk_sweep.py --cells --csv $work/sweep_ragged16.csv" ;;
  check8)  # the fp8 planner check in one run: each default beside the best knob per CTAs-per-SM count of the sweeps
    H=docs/benchmarks/chunk-sweep-ragged-fp8
    run check_ragged8 420 "python3 scripts/chunk_sweep.py --cells --kv-dtype fp8 --check-against $H-h200-2026-12-02-half0.csv $H-h200-2026-12-02-half1.csv $H-2cta-h200-2026-12-02-half0.csv --csv $work/check_ragged8.csv" ;;
  sweep8) run sweep_ragged8 420 "python3 scripts/chunk_sweep.py --cells --kv-dtype fp8 --quick ${SWEEP_HALF:-0} --rounds ${SWEEP_ROUNDS:-2} ${SWEEP_CTAS_PER_SM:+--ctas-per-sm $SWEEP_CTAS_PER_SM} --csv $work/sweep_ragged8.csv" ;;
  runtime) run runtime_tests 480 "python3 -m pytest -m gpu -q -p no:cacheprovider --benchmark-disable tests/test_runner.py tests/test_serving_loop.py tests/test_hot_path.py tests/test_sinks_window.py tests/test_multi_token.py tests/test_gpu_decode.py tests/test_append.py tests/test_features_gpu.py tests/test_cascade.py"
           # (not 'freed': under compute-sanitizer decode()'s returned frames stay referenced from
           # outside Python's gc, so the plans they hold do too; the test passes without the sanitizer)
           run memcheck_runtime 230 "compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_runner.py tests/test_sinks_window.py tests/test_multi_token.py tests/test_hot_path.py -k 'not two_devices and not freed'" ;;
  pdl)  # programmatic dependent launch (on by default): the opt-out's GPU tests, then the main-fp16 cells
        # without (CUPAGED_PDL=0) and with it
    run pdl0_tests 200 "CUPAGED_PDL=0 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pdl.py tests/test_hot_path.py tests/test_runner.py tests/test_gpu_decode.py -k 'pdl or hot or runner or v2_matches_reference or ragged or graph'"
    for v in 0 1; do
      run "pdl_ab_$v" 150 "CUPAGED_PDL=$v python3 scripts/microbench.py --suite issue5 --groups main-fp16-p16 --methods v2 --budget-s 100 --out-dir $work/pdl_$v"
    done
    run pdl_compare 30 "python3 scripts/large_report.py $work/pdl_1/microbench-issue5.csv --baseline $work/pdl_0/microbench-issue5.csv --baseline-label CUPAGED_PDL=0 --out $work/pdl_report"
    cat "$work/pdl_compare.log"; grep "^| main" "$work/pdl_report.md" ;;
  suite_ab)  # issue-5 main-fp16 cells per kernel source tree, each against the first
    i=0; first=""; first_tree=""
    for tree in ${AB_TREES:-cuda_src}; do
      run "suite_ab_$i" 150 "CUPAGED_CUDA_SRC='$(realpath "$tree")' python3 scripts/microbench.py --suite issue5 --groups main-fp16-p16 --methods v2 --budget-s 100 --out-dir $work/suite_$i"
      if [ -z "$first" ]; then first=$work/suite_$i/microbench-issue5.csv; first_tree=$tree; else
        run "suite_ab_report_$i" 30 "python3 scripts/large_report.py $work/suite_$i/microbench-issue5.csv --baseline $first --baseline-label '$first_tree' --out $work/suite_ab_$i"
        echo "== $tree against $first_tree"; grep SUMMARY "$work/suite_ab_report_$i.log"
        grep "^| main" "$work/suite_ab_$i.md" | awk -F'|' '{print $3,$4,$8,$16,$17,$21}'
      fi
      i=$((i + 1))
    done ;;
  windows) run window_bench 330 "$peer python3 scripts/window_bench.py --csv $work/windows.csv --md $work/windows.md ${CUPAGED_COMMIT:+--commit $CUPAGED_COMMIT}" ;;
  spec) run spec_bench 330 "$peer python3 scripts/spec_bench.py ${SPEC_ARGS:-} --csv $work/spec.csv --md $work/spec.md" ;;
  features2) run feature_cost 220 "python3 scripts/feature_cost.py --csv $work/feature_cost.csv" ;;
  roofline) run roofline 120 "python3 scripts/roofline.py --csv $work/roofline.csv" ;;
  ncu_compare)  # v2's partial kernel and FlashInfer's two decode kernels on 128 x 16384 (carry .peer), one profile each
    ncu_args="--clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --metrics $ncu_l2"
    run ncu_v2 200 "ncu $ncu_args -k regex:paged_decode_partial --launch-count 1 $ncu_bench --methods v2 --out-dir $work/ncu_v2"
    run ncu_fi 300 "$peer ncu $ncu_args -k regex:Prefill --launch-count 1 $ncu_bench --methods flashinfer --out-dir $work/ncu_fi_tc; $peer ncu $ncu_args -k regex:BatchDecode --launch-count 1 $ncu_bench --methods flashinfer --out-dir $work/ncu_fi_cc" ;;
  ncu_sectors)  # the L2 request shape of v2's partial kernel (the metrics of ncu_compare) for each tree in AB_TREES
    for tree in ${AB_TREES:-cuda_src}; do
      run "ncu_sectors_$(basename "$tree")" 90 "CUPAGED_CUDA_SRC=$(realpath "$tree") ncu --clock-control none --metrics $ncu_l2 -k regex:paged_decode_partial --launch-count 1 $ncu_bench --methods v2 --out-dir $work/ncu_s"
    done ;;
  variants)  # kernel source trees A/B: scripts/ab_sources.py per tree of AB_TREES, interleaved, AB_ROUNDS rounds
    for r in $(seq "${AB_ROUNDS:-2}"); do for tree in ${AB_TREES:-cuda_src}; do
      lab=$(printf %s "${tree%/}" | tr -c 'A-Za-z0-9_.-' '_')  # (the whole path: trees are often */cuda_src)
      run "variants_${lab}_$r" 150 "CUPAGED_CUDA_SRC=$(realpath "$tree") python3 scripts/ab_sources.py ${AB_KV:-fp16}"
      sed "s|^|$lab r$r |" "$work/variants_${lab}_$r.log" >> "$work/variants.log"
    done; done
    sort -k3,3 -k4,4 -k1,1 "$work/variants.log" ;;
  occupancy) run occupancy 150 "python3 scripts/occupancy.py --head-dims 64 128 --csv $work/occupancy.csv" ;;
  pdl_ab)  # the residency cap's A/B (2026-12-02): PDL off vs the default, both cores
    cells="$(for d in 64 256; do for c in 8x1024 8x8192 32x8192 128x4096; do printf '%sx16x32x8x%s ' "$c" "$d"; done; done)"
    cells="$cells 8x1024 8x8192 128x4096 32x8192x16x64x8x256 32x4096x16x64x8x128xfloat32 8x1024x16x32x8x128xfloat32 128x4096x16x32x8x128xfloat32"
    for r in 1 2; do
      run "pdl_on_$r" 150 "python3 scripts/ab_trees.py --label cap --cells $cells --csv $work/cap_$r.csv"
      run "pdl_off_$r" 150 "CUPAGED_PDL=0 python3 scripts/ab_trees.py --label off --cells $cells --csv $work/off_$r.csv"
    done
    run pdl_ab_compare 30 "python3 scripts/ab_trees.py --compare $work/off_*.csv -- $work/cap_*.csv"
    cat "$work/pdl_ab_compare.log" ;;
  pdl_dims)  # PDL per head dim: head_dim 64 lost 14-30 % with it (2026-12-02); which dims win?
    cells=$(for d in 64 80 96 128 192 256; do for c in 8x1024 8x8192 32x8192 128x4096; do printf '%sx16x32x8x%s ' "$c" "$d"; done; done)
    for r in 1 2; do for pdl in 1 0; do
      run "pdl${pdl}_$r" 150 "CUPAGED_PDL=$pdl python3 scripts/ab_trees.py --label pdl$pdl --cells $cells --csv $work/pdl${pdl}_$r.csv"
    done; done
    run pdl_compare 30 "python3 scripts/ab_trees.py --compare $work/pdl0_*.csv -- $work/pdl1_*.csv"
    cat "$work/pdl_compare.log" ;;
  headdims)  # issue 19's head dims 80 and 192: GPU tests, memcheck, the driver's occupancy and a v2 benchmark
    run headdim_tests 200 "python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_decode.py tests/test_features_gpu.py tests/test_multi_token.py -k '80 or 192'"
    run memcheck_headdims 200 "compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_decode.py tests/test_multi_token.py -k '80 or 192'"
    run occupancy_headdims 100 "python3 scripts/occupancy.py --head-dims 80 128 192 --csv $work/occupancy_headdims.csv"
    # (no FlashInfer at 80 or fp8 192: its JIT instances hit an illegal address, 2026-12-02)
    for d in 80 128 192; do
      fi=""; [ "$d" != 80 ] && fi=flashinfer
      run "headdim_bench_$d" 100 "$peer python3 scripts/microbench.py --batch 8 32 --ctx 4096 16384 --head-dim $d --methods v2 gather $fi --reps 2 --out-dir $work/hd$d"
    done
    for d in 128 192; do
      run "headdim_bench_fp8_$d" 100 "python3 scripts/microbench.py --batch 8 32 --ctx 16384 --head-dim $d --kv-dtype fp8 --methods v2 --reps 2 --out-dir $work/hd${d}fp8"
    done ;;
  ab) cells="1x1024 1x4096 1x131072 4x4096 4x16384 4x131072 8x1024 8x32768 32x1024 32x32768 128x1024 128x32768 4x4096x16x32x32x128 8x8192x16x64x8x128 8x8192x16x32x8x64 32x16384x32x32x8x128xbfloat16"
      for r in $(seq "${AB_ROUNDS:-2}"); do
        run ab_old$r 150 "PYTHONPATH=$PWD/.ab/old python3 .ab/old/scripts/ab_trees.py --label old --cells $cells --csv $work/ab_old$r.csv"
        run ab_new$r 150 "python3 scripts/ab_trees.py --label new --cells $cells --csv $work/ab_new$r.csv"
      done
      run ab_compare 30 "python3 scripts/ab_trees.py --compare $work/ab_old*.csv -- $work/ab_new*.csv"
      cat "$work/ab_compare.log" ;;
  profile) run ncu 150 "ncu --clock-control none -k regex:paged_decode_partial --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats python3 scripts/microbench.py --batch 8 --ctx 32768 --methods v2 --reps 1 --iters 4 --host-iters 1 --out-dir $work/prof" ;;
esac; done
tar czf "$out/results.tgz" -C "$work" .
