#!/usr/bin/env python3
"""Microbenchmark of paged decode: gather vs v1 vs v2 (cupaged.decode
methods), plus FlashInfer when ``import flashinfer`` and torch work.

Every method of a cell reads the same cache buffers with the same page table
(random page order by default, out of a pool with 2x slack), so they see an
identical scatter pattern. **All requests start at entry 0 of their first page
(first_page_offset = 0)**: FlashInfer has no first_page_offset, and the
comparison must be like for like. Visible lengths are ``ctx`` minus a random
partial-last-page amount. Cells whose visible KV is smaller than 256 MiB
rotate between several independent cache copies (``replicas``) so that
successive calls do not hit the 60 MiB L2.

Plans (cupaged's v2 plan, FlashInfer's ``plan()``) are built outside the timed
region. Per method and cell:

(a) ``graph_us``: GPU time per call under CUDA-graph replay: after a warm-up
    outside capture, ``max(20, replicas)`` calls are captured into one graph
    on a non-default stream (cupy ``begin_capture`` in its default relaxed
    mode) and replays are timed with CUDA events; if capture fails the
    ``<method>_timing`` column says so and (b) is the primary time;
(b) ``event_us``: CUDA events around ``--iters`` back-to-back launches;
(c) ``host_us``: ``time.perf_counter`` around ``--host-iters`` calls without
    synchronizing (then one sync, outside the timed span).

Each is repeated ``--reps`` times (methods interleaved within a repetition);
the median is reported and ``spread = (max - min) / median`` of the primary
time. Bytes = every visible K and V element once + q + out + the int32 page
table; TB/s and % of the 4.6 TB/s read roofline use the primary time.
Ratios ``v2_over_X = X_us / v2_us`` (> 1: v2 faster). FlashInfer is the better
of its CUDA-core and tensor-core decode (``flashinfer_variant``).

Writes ``microbench.csv``, ``microbench.md`` and ``microbench.png`` into
``--out-dir`` (or the explicit ``--csv/--md/--png`` paths) and prints a short
summary table last.

``--suite issue5`` sweeps the cells of issue #5 instead (:data:`ISSUE5_GROUPS`:
fp16 and bf16, 32 q / 8 kv heads, head_dim 128, page 16 and 32, batch
{1,4,8,32,128} x ctx {1024,4096,16384,32768} plus 131072 for batch <= 8; then
MHA 32q/32kv, 64q/8kv and head_dim 64 at fp16, page 16, batch {1,8,32} x ctx
{1024,4096,16384}). v2 and FlashInfer run in every cell, v1 and gather only
where the issue compares against them (main shape, ctx >= 4096; gather is
skipped where its padded copies would not fit in memory). Timing adapts to
the cell: the graph holds enough calls for ~0.5 ms (at least one per
replica), replays fill ~2 ms per repetition, events replace the graph only
where capture fails, and a repetition above 50 ms runs once. Host time (one
call at a time, median) is measured in :data:`HOST_CELLS` only. Every target
is evaluated per cell (scripts/bench_report.py); the CSV, the meta JSON and
the markdown report are rewritten after every cell, so a run cut short
leaves what it measured; ``--budget-s`` (default 360) skips cells that would
not fit and an alarm stops the run 25 s after it. Writes
``microbench-issue5.{csv,meta.json,md,png}``.

``--kv-dtype fp8`` times an fp8 KV cache next to the 16-bit one, cell by
cell (the sweep and axis flags as above; ``--dtype`` float16 or bfloat16 is
the q/out dtype): v2 over the ``--dtype`` cache and v2 over a uint8 e4m3 copy
of the same values (``cupaged.fp8.to_e4m3`` of ``x / --fp8-scale``, applied
on the GPU through a 65536-entry table), and FlashInfer on both when
available (``plan(..., kv_data_type=torch.float8_e4m3fn)``, ``run(...,
k_scale=, v_scale=)``; it applies a ``v_scale`` other than 1 as a separate
``out *= v_scale`` launch, so the default scale is 1.0). The fp8 rows report
``<method>_16bit_over_fp8`` (16-bit time / fp8 time, > 1: fp8 faster) and
``v2_fp8_over_flashinfer_fp8``; ``*_max_rel_vs_v2`` of the fp8 methods is
their quantization error against the 16-bit v2 output. TB/s of the fp8
methods count one byte per KV element. Writes ``microbench-fp8.{csv,md}``
(:data:`FP8_CSV_COLUMNS`); the other modes' outputs are unchanged.

``--lengths`` times ragged batches instead of the sweep: each cell is
``BATCH:DISTRIBUTION[:SEED]`` (the distributions of scripts/_common.py:
``lognormal:MEDIAN:SIGMA``, ``uniform:LO:HI``, ``bimodal:SHORT:LONG``,
``onelong:LONG:SHORT``, ``zipf:A:UNIT:MAX``; the word ``family`` adds
``_common.RAGGED_FAMILY``), under every ``--dtypes`` choice (``float16``,
``bfloat16``, ``fp8`` = an e4m3 KV cache under a float16 query; default all
three). Per cell: v2 with its default plan and FlashInfer-best on the same
pools (pages in random order, 2x slack, rotated below 256 MiB), adaptive
graph-replay timing as in ``--suite`` (``--reps`` default 5), v2's output
checked against FlashInfer's, and the targets marked: FlashInfer-best / v2
>= 1 in every cell, v2 >= 3.9 TB/s where the cell moves >= 256 MB of KV,
geometric mean of FlashInfer-best / v2 >= 1.3. ``--budget-s`` (default 480)
skips cells that would not fit. Writes ``ragged.{csv,meta.json,md,png}``
(:data:`RAGGED_CSV_COLUMNS`, rewritten after every cell) and prints
``SUMMARY`` lines last.

Exit status: 0 ran, 1 a method failed in some cell (or the run was
interrupted), 2 bad arguments, 3 no CUDA GPU on this machine (message on
stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:  # run as a script (scripts/ is sys.path[0]) or imported with scripts/ on the path
    import _common
    import bench_report
except ImportError:  # imported as scripts.microbench
    from scripts import _common, bench_report

#: The sweeps, declared as data.
DEFAULT_SWEEP = {"batch": (1, 4, 8, 32), "ctx": (1024, 4096, 16384, 32768), "page_size": (16,)}
QUICK_SWEEP = {"batch": (1, 8), "ctx": (1024, 16384), "page_size": (16,)}
AXES = ("batch", "ctx", "page_size")
#: Settings --quick lowers unless given explicitly.
QUICK_SETTINGS = {"reps": 2, "iters": 40, "host_iters": 20}
DEFAULT_SETTINGS = {"reps": 3, "iters": 100, "host_iters": 50}

METHODS = ("gather", "v1", "v2", "flashinfer")
CUPAGED_METHODS = ("gather", "v1", "v2")
FLASHINFER_VARIANTS = (("cuda_cores", False), ("tensor_cores", True))
GRAPH_CALLS = 20  # calls captured per graph (at least; a multiple of replicas)
ROTATE_BYTES = _common.ROTATE_BYTES  # rotate copies until this much visible KV is cycled
MAX_REPLICAS = 64
FLASHINFER_WORKSPACE_BYTES = 256 << 20

#: ``--suite issue5``: (group, dtype, page_size, num_qo_heads, num_kv_heads,
#: head_dim, cells), in run order (most important first: a run short of time
#: skips from the end). Cells: "main" = batch x ctx of ISSUE5_MAIN plus
#: ISSUE5_LONG; "extra" = ISSUE5_EXTRA.
SUITES = ("issue5",)
ISSUE5_MAIN = {"batch": (1, 4, 8, 32, 128), "ctx": (1024, 4096, 16384, 32768)}
ISSUE5_LONG = {"batch": (1, 4, 8), "ctx": (131072,)}
ISSUE5_EXTRA = {"batch": (1, 8, 32), "ctx": (1024, 4096, 16384)}
ISSUE5_GROUPS = (
    ("main-fp16-p16", "float16", 16, 32, 8, 128, "main"),
    ("main-bf16-p16", "bfloat16", 16, 32, 8, 128, "main"),
    ("mha-fp16-p16", "float16", 16, 32, 32, 128, "extra"),
    ("q64kv8-fp16-p16", "float16", 16, 64, 8, 128, "extra"),
    ("d64-fp16-p16", "float16", 16, 32, 8, 64, "extra"),
    ("main-fp16-p32", "float16", 32, 32, 8, 128, "main"),
    ("main-bf16-p32", "bfloat16", 32, 32, 8, 128, "main"),
)
#: Main-group cells whose host time per call is measured (batch, ctx).
HOST_CELLS = ((1, 1024), (8, 4096), (32, 16384), (128, 1024))
HOST_CALLS = 200  # individually timed calls per host measurement
SLOW_METHODS_MIN_CTX = bench_report.SLOW_BASELINE_MIN_CTX  # v1 / gather from this ctx on
SUITE_BUDGET_S = 360.0  # default --budget-s of a suite run (it runs under `timeout 420`)
HARD_STOP_MARGIN_S = 25  # the alarm that ends an overrunning run fires this long after the budget
JIT_ESTIMATE_S = 45.0  # first cell of a (dtype, head_dim): FlashInfer JIT (2 modules) + NVRTC
# adaptive timing (suite mode)
GRAPH_TARGET_US = 500.0  # GPU time one captured graph should span (at least one call per replica)
SAMPLE_US = 2000.0  # GPU time one timed repetition should span
MAX_REPLAYS = 100
MAX_EVENT_ITERS = 200
REP_CAP_US = 50_000.0  # a repetition longer than this runs once (reps = 1)
WARM_REPLAY_MAX_US = 2000.0  # replay once untimed before each repetition when this cheap
# gather's padded copies: skip it where pool + copies would pass this
GATHER_MEM_LIMIT_BYTES = 80 << 30
GATHER_MAX_EST_S = 3.0  # ... or where its estimated calls (~60x v2 each) would take longer
GATHER_SLOWDOWN_EST = 60.0
GATHER_EST_CALLS = 3

#: Per-method fields; the CSV has ``<method>_<field>`` for every method.
METHOD_FIELDS = ("us", "graph_us", "event_us", "host_us", "tbps", "pct_roofline", "spread", "timing", "max_rel_vs_v2")
#: CSV schema: columns are appended, never reordered.
CSV_COLUMNS = (
    (
        "batch",
        "ctx",
        "page_size",
        "num_qo_heads",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "page_order",
        "replicas",
        "graph_calls",
        "reps",
        "kv_bytes",
        "total_bytes",
        "v2_pages_per_chunk",
        "v2_num_chunks",
        "v2_num_ctas",
        "v2_needs_merge",
    )
    + tuple(f"{m}_{f}" for m in METHODS for f in METHOD_FIELDS)
    + ("flashinfer_variant", "v2_over_v1", "v2_over_gather", "v2_over_flashinfer")
    + ("group", "wall_s", "v2_auto_host_us")
    + bench_report.EVAL_COLUMNS
)
MD_COLUMNS = (
    "batch",
    "ctx",
    "v2_pages_per_chunk",
    "v2_num_chunks",
    "v2_needs_merge",
    "gather_us",
    "v1_us",
    "v2_us",
    "flashinfer_us",
    "v2_tbps",
    "v2_pct_roofline",
    "flashinfer_tbps",
    "v2_over_v1",
    "v2_over_gather",
    "v2_over_flashinfer",
)
SUMMARY_COLUMNS = (
    "batch",
    "ctx",
    "v2_us",
    "v2_tbps",
    "v2_pct_roofline",
    "v2_over_v1",
    "v2_over_gather",
    "v2_over_flashinfer",
)
HEADERS = {
    "v2_pages_per_chunk": "c",
    "v2_num_chunks": "chunks",
    "v2_needs_merge": "merge",
    "v2_pct_roofline": "v2 %roof",
    "v2_over_v1": "v2/v1",
    "v2_over_gather": "v2/gather",
    "v2_over_flashinfer": "v2/FI",
}

#: ``--kv-dtype fp8``: the fp8 KV dtype (uint8 e4m3 bits on the GPU), the
#: spellings the flag takes, the default per-tensor scale, and the methods:
#: ``v2``/``flashinfer`` over the 16-bit cache and ``*_fp8`` over its fp8 copy.
FP8_KV_DTYPE = "float8_e4m3fn"
KV_DTYPE_CHOICES = ("fp8", FP8_KV_DTYPE)
FP8_SCALE = 1.0
FP8_Q_DTYPES = ("float16", "bfloat16")
FP8_METHODS = ("v2", "v2_fp8", "flashinfer", "flashinfer_fp8")
#: CSV schema of ``--kv-dtype fp8`` (its own file; appended, never reordered).
FP8_CSV_COLUMNS = (
    (
        "batch",
        "ctx",
        "page_size",
        "num_qo_heads",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "kv_dtype",
        "fp8_scale",
        "page_order",
        "replicas",
        "graph_calls",
        "reps",
        "kv_bytes",
        "kv_bytes_fp8",
        "total_bytes",
        "total_bytes_fp8",
        "v2_pages_per_chunk",
        "v2_num_chunks",
        "v2_needs_merge",
        "v2_fp8_pages_per_chunk",
    )
    + tuple(f"{m}_{f}" for m in FP8_METHODS for f in METHOD_FIELDS)
    + ("flashinfer_variant", "flashinfer_fp8_variant")
    + ("v2_16bit_over_fp8", "flashinfer_16bit_over_fp8", "v2_fp8_over_flashinfer_fp8", "v2_over_flashinfer")
    + ("wall_s",)
)
FP8_MD_COLUMNS = (
    "batch",
    "ctx",
    "v2_pages_per_chunk",
    "v2_needs_merge",
    "v2_us",
    "v2_fp8_us",
    "v2_16bit_over_fp8",
    "v2_fp8_tbps",
    "v2_fp8_pct_roofline",
    "v2_fp8_max_rel_vs_v2",
    "flashinfer_us",
    "flashinfer_fp8_us",
    "flashinfer_16bit_over_fp8",
    "v2_fp8_over_flashinfer_fp8",
)
FP8_HEADERS = {
    **HEADERS,
    "v2_us": "v2 16-bit us",
    "v2_fp8_us": "v2 fp8 us",
    "v2_16bit_over_fp8": "v2 16/8",
    "v2_fp8_tbps": "v2 fp8 TB/s",
    "v2_fp8_pct_roofline": "v2 fp8 %roof",
    "v2_fp8_max_rel_vs_v2": "fp8 max_rel",
    "flashinfer_us": "FI 16-bit us",
    "flashinfer_fp8_us": "FI fp8 us",
    "flashinfer_16bit_over_fp8": "FI 16/8",
    "v2_fp8_over_flashinfer_fp8": "v2/FI fp8",
}

#: ``--lengths``: ragged batches (``BATCH:DISTRIBUTION[:SEED]``, or ``family``
#: = :data:`_common.RAGGED_FAMILY`), each timed under every ``--dtypes``
#: choice. ``fp8`` = an e4m3 KV cache (uint8 bits) under a float16 query.
RAGGED_FAMILY_WORD = "family"
RAGGED_DTYPES = ("float16", "bfloat16", "fp8")
RAGGED_SHORT = {"float16": "fp16", "bfloat16": "bf16", "fp8": "fp8"}
RAGGED_METHODS = ("v2", "flashinfer")
RAGGED_PAGE_SIZE = 16
RAGGED_REPS = 5  # default --reps of a ragged run (adaptive: one where a repetition passes REP_CAP_US)
RAGGED_BUDGET_S = 480.0  # default --budget-s of a ragged run (the alarm fires HARD_STOP_MARGIN_S later)
RAGGED_JIT_ESTIMATE_S = 45.0  # first cell of a dtype: FlashInfer JIT (2 variants) + NVRTC
#: Targets of a ragged run: v2 no slower than FlashInfer-best in every cell;
#: v2 >= 3.9 TB/s where the cell moves >= 256 MB of KV; the geometric mean of
#: FlashInfer-best / v2 over the cells >= 1.3.
RAGGED_TARGET_RATIO = 1.0
RAGGED_TARGET_TBPS = 3.9
RAGGED_LARGE_KV_BYTES = 256e6
RAGGED_GEOMEAN_TARGET = 1.3
#: v2's output against FlashInfer's (max |v2 - FI| / max |v2|, the larger over
#: FlashInfer's two variants): above this the cell counts as a failure.
RAGGED_MAX_REL = 2e-2
#: (column, short header, rule) of the ragged targets, in report order.
RAGGED_TARGETS = (
    ("target_no_slower", ">=FI", f"FlashInfer-best / v2 >= {RAGGED_TARGET_RATIO:g} (every cell)"),
    ("target_tbs", f">={RAGGED_TARGET_TBPS:g}TB/s",
     f"v2 >= {RAGGED_TARGET_TBPS:g} TB/s where the cell moves >= {RAGGED_LARGE_KV_BYTES / 1e6:.0f} MB of KV"),
)
#: CSV schema of ``--lengths`` (its own file; appended, never reordered).
RAGGED_CSV_COLUMNS = (
    "cell",
    "batch",
    "lengths",
    "seed",
    "dtype",
    "kv_dtype",
    "page_size",
    "num_qo_heads",
    "num_kv_heads",
    "head_dim",
    "total_tokens",
    "min_len",
    "median_len",
    "max_len",
    "kv_bytes",
    "total_bytes",
    "replicas",
    "reps",
    "v2_us",
    "v2_spread",
    "v2_tbps",
    "v2_pct_roofline",
    "v2_timing",
    "flashinfer_us",
    "flashinfer_variant",
    "flashinfer_spread",
    "flashinfer_tbps",
    "flashinfer_timing",
    "flashinfer_cuda_cores_us",
    "flashinfer_tensor_cores_us",
    "v2_over_flashinfer",
    "max_rel_vs_fi",
    "v2_pages_per_chunk",
    "v2_num_chunks",
    "v2_num_ctas",
    "v2_needs_merge",
    "v2_path",
    "target_no_slower",
    "target_tbs",
    "wall_s",
)


# ----------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="microbench.py",
        description="Time gather, v1, v2 (cupaged) and FlashInfer paged decode on the same cache buffers. "
        "Lists accept spaces or commas. All requests use first_page_offset=0 (FlashInfer has none). "
        "--suite issue5 sweeps a fixed suite of cells and marks every target met or missed per cell; there the "
        "axis flags, --dtype and --methods filter the suite's cells and methods, and --iters/--host-iters "
        "and the head flags are not used (timing adapts to each cell). --lengths times batches of unequal "
        "request lengths (v2 against FlashInfer, per dtype) and marks its targets per cell.",
        epilog=_common.EXIT_CODES_EPILOG,
    )
    p.add_argument("--batch", nargs="+", help="batch sizes (default 1 4 8 32)")
    p.add_argument("--ctx", nargs="+", help="context lengths (default 1024 4096 16384 32768)")
    p.add_argument("--page-size", nargs="+", help="page sizes (default 16)")
    p.add_argument("--num-qo-heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument(
        "--dtype", nargs="+", default=None, help="float16 (default), bfloat16 or float32; with --suite, a filter"
    )
    p.add_argument("--methods", nargs="+", default=None, help="default gather,v1,v2,flashinfer")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --quick 2)")
    p.add_argument(
        "--iters", type=int, default=None, help="timed calls per repetition for (a) and (b) (default 100; --quick 40)"
    )
    p.add_argument(
        "--host-iters", type=int, default=None, help="calls per repetition for host time (default 50; --quick 20)"
    )
    p.add_argument(
        "--page-order",
        default="random",
        choices=_common.PAGE_ORDERS,
        help="physical page order of each request's pages (default random)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random tables and data (default 0)")
    p.add_argument("--quick", action="store_true", help="small sweep (batch 1 8 x ctx 1024 16384) and fewer iterations")
    p.add_argument(
        "--suite",
        choices=SUITES,
        help="issue5: a fixed suite of cells and performance targets (CSV + report with every target marked per cell)",
    )
    p.add_argument(
        "--groups",
        nargs="+",
        help="with --suite: only these groups (" + ", ".join(g[0] for g in ISSUE5_GROUPS) + ")",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"skip cells that would end after this many seconds (default {SUITE_BUDGET_S:.0f} with --suite, "
        f"{RAGGED_BUDGET_S:.0f} with --lengths, else none; 0 = none); an alarm stops the run 25 s after it",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPE_CHOICES,
        default=None,
        help="fp8: time v2 (and FlashInfer) over an fp8 e4m3 copy of each cell's cache next to the --dtype "
        "(float16 or bfloat16) cache; methods v2 and flashinfer; writes microbench-fp8.{csv,md}",
    )
    p.add_argument(
        "--fp8-scale",
        type=float,
        default=None,
        help=f"with --kv-dtype fp8: per-tensor k_scale = v_scale; the cache holds x / scale (default {FP8_SCALE})",
    )
    p.add_argument(
        "--lengths",
        nargs="+",
        metavar="CELL",
        help="time batches of unequal request lengths instead of the batch x ctx sweep: each CELL is "
        "BATCH:DISTRIBUTION[:SEED] (tokens per request drawn with SEED, default 0), the distribution one of "
        "lognormal:MEDIAN:SIGMA, uniform:LO:HI, bimodal:SHORT:LONG, onelong:LONG:SHORT, zipf:A:UNIT:MAX; "
        f"the word {RAGGED_FAMILY_WORD} adds the standard set of {len(_common.RAGGED_FAMILY)} cells. "
        "Example: --lengths 64:lognormal:1024:1.2:1 family. Times v2 and FlashInfer (the faster of its two "
        "decode kernels) per cell and dtype, pages in random order; --page-size takes one value (default "
        f"{RAGGED_PAGE_SIZE}); writes ragged.{{csv,md,png}}",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        dest="ragged_dtypes",
        metavar="DTYPE",
        help="with --lengths: any of float16, bfloat16, fp8 (an fp8 e4m3 KV cache read by a float16 query); "
        "default all three",
    )
    p.add_argument("--commit", help="commit to print in the report (default: git rev-parse, else $CUPAGED_COMMIT)")
    p.add_argument(
        "--out-dir", default="microbench-out", help="folder for the default output paths (default ./microbench-out)"
    )
    p.add_argument(
        "--csv",
        help="CSV path (default OUT_DIR/microbench.csv; --suite: OUT_DIR/microbench-issue5.csv; "
        "--lengths: OUT_DIR/ragged.csv)",
    )
    p.add_argument("--md", help="markdown path (default OUT_DIR/microbench.md; --suite: ...-issue5.md; "
                   "--lengths: OUT_DIR/ragged.md)")
    p.add_argument("--png", help="plot path (default OUT_DIR/microbench.png; --suite: ...-issue5.png; "
                   "--lengths: OUT_DIR/ragged.png)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    methods_given = args.methods is not None
    try:
        for axis in AXES:
            setattr(args, axis, _common.parse_list(getattr(args, axis), int))
        args.methods = _common.parse_list(args.methods or [",".join(METHODS)], str)
        args.dtypes = _common.parse_list(args.dtype, str)
        args.groups = _common.parse_list(args.groups, str)
    except ValueError as e:
        parser.error(str(e))
    for m in args.methods:
        if m not in METHODS:
            parser.error(f"--methods {m}: choose from {', '.join(METHODS)}")
    for d in args.dtypes or ():
        if d not in _common.DTYPE_NAMES:
            parser.error(f"--dtype {d}: choose from {', '.join(_common.DTYPE_NAMES)}")
    _parse_ragged_args(parser, args, methods_given)
    if args.suite:
        if args.quick:
            parser.error("--quick and --suite do not combine")
        names = [g[0] for g in ISSUE5_GROUPS]
        for g in args.groups or ():
            if g not in names:
                parser.error(f"--groups {g}: choose from {', '.join(names)}")
        if args.budget_s is None:
            args.budget_s = SUITE_BUDGET_S
    else:
        if args.groups:
            parser.error("--groups needs --suite")
        if args.dtypes and len(args.dtypes) > 1:
            parser.error("--dtype takes one value without --suite")
    args.dtype = args.dtypes[0] if args.dtypes and not args.suite else "float16"
    if args.budget_s is not None and args.budget_s < 0:
        parser.error("--budget-s must be >= 0")
    settings = QUICK_SETTINGS if args.quick else DEFAULT_SETTINGS
    for name, value in settings.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("reps", "iters", "host_iters", "num_qo_heads", "num_kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for axis in AXES:
        values = getattr(args, axis)
        if values is not None and min(values) < 1:
            parser.error(f"--{axis.replace('_', '-')} values must be >= 1")
    if args.num_qo_heads % args.num_kv_heads:
        parser.error("--num-qo-heads must be a multiple of --num-kv-heads")
    _parse_fp8_args(parser, args, methods_given)
    out = Path(args.out_dir)
    if args.lengths:
        stem = "ragged"
    else:
        stem = f"microbench-{args.suite}" if args.suite else "microbench-fp8" if args.kv_dtype else "microbench"
    args.csv = args.csv or str(out / f"{stem}.csv")
    args.md = args.md or str(out / f"{stem}.md")
    args.png = args.png or str(out / f"{stem}.png")
    return args


def _parse_fp8_args(parser: argparse.ArgumentParser, args: argparse.Namespace, methods_given: bool) -> None:
    """``--kv-dtype`` / ``--fp8-scale``: canonical ``args.kv_dtype`` (None or
    :data:`FP8_KV_DTYPE`), ``args.fp8_scale``, and the methods of fp8 mode
    (v2 and flashinfer; others are refused when asked for)."""
    if args.kv_dtype is None:
        if args.fp8_scale is not None:
            parser.error("--fp8-scale needs --kv-dtype fp8")
        return
    args.kv_dtype = FP8_KV_DTYPE
    if args.suite:
        parser.error("--kv-dtype and --suite do not combine")
    if args.dtype not in FP8_Q_DTYPES:
        parser.error(f"--kv-dtype fp8 needs --dtype {' or '.join(FP8_Q_DTYPES)} (the q/out dtype), got {args.dtype}")
    if args.fp8_scale is None:
        args.fp8_scale = FP8_SCALE
    if not (math.isfinite(args.fp8_scale) and args.fp8_scale > 0):
        parser.error(f"--fp8-scale must be positive and finite, got {args.fp8_scale}")
    if methods_given:
        other = [m for m in args.methods if m not in ("v2", "flashinfer")]
        if other:
            parser.error(f"--kv-dtype fp8 times v2 and flashinfer only, not {', '.join(other)}")
    else:
        args.methods = ("v2", "flashinfer")


def _parse_ragged_args(parser: argparse.ArgumentParser, args: argparse.Namespace, methods_given: bool) -> None:
    """``--lengths`` / ``--dtypes``: ``args.lengths`` becomes a tuple of
    ``(batch, spec, seed)`` (``family`` expanded to
    :data:`_common.RAGGED_FAMILY`, in order), ``args.ragged_dtypes`` a tuple
    of :data:`RAGGED_DTYPES` names, ``args.ragged_page_size`` an int; the
    methods default to v2 and flashinfer, ``--reps`` to
    :data:`RAGGED_REPS`, ``--budget-s`` to :data:`RAGGED_BUDGET_S`. Flags of
    the other modes are refused (exit 2)."""
    args.ragged_page_size = None
    if args.lengths is None:
        if args.ragged_dtypes is not None:
            parser.error("--dtypes needs --lengths (the sweep takes --dtype)")
        return
    conflicts = (
        ("--suite", args.suite),
        ("--kv-dtype", args.kv_dtype),
        ("--fp8-scale", args.fp8_scale),
        ("--quick", args.quick),
        ("--batch", args.batch),
        ("--ctx", args.ctx),
        ("--groups", args.groups),
        ("--dtype", args.dtype),
        ("--page-order reverse", args.page_order != "random"),
    )
    for flag, given in conflicts:
        if given:
            hint = " (choose dtypes with --dtypes; fp8 is one of them)" if flag in ("--dtype", "--kv-dtype") else ""
            parser.error(f"--lengths and {flag} do not combine{hint}")
    try:  # BATCH:DISTRIBUTION[:SEED], shared with chunk_sweep.py
        from chunk_sweep import parse_ragged
    except ImportError:  # imported as scripts.microbench
        from scripts.chunk_sweep import parse_ragged

    try:
        texts = _common.parse_list(args.lengths, str)
        dtypes = _common.parse_list(args.ragged_dtypes, str) or RAGGED_DTYPES
    except ValueError as e:
        parser.error(f"--lengths/--dtypes: {e}")
    cells = []
    for text in texts:
        if text == RAGGED_FAMILY_WORD:
            cells += [tuple(c) for c in _common.RAGGED_FAMILY]
            continue
        try:
            batch, spec, seed = parse_ragged(text)
            if seed < 0:
                raise ValueError(f"seed must be >= 0, got {seed}")
            _common.ragged_lengths(spec, batch, seed)  # e.g. uniform:5:5 has no values to draw
        except (argparse.ArgumentTypeError, ValueError) as e:
            parser.error(f"--lengths {text}: {e}")
        cells.append((batch, spec, seed))
    args.lengths = tuple(cells)
    for d in dtypes:
        if d not in RAGGED_DTYPES:
            parser.error(f"--dtypes {d}: choose from {', '.join(RAGGED_DTYPES)}")
    args.ragged_dtypes = tuple(dict.fromkeys(dtypes))  # in order, once each
    if args.page_size is not None and len(args.page_size) != 1:
        parser.error("--lengths takes one --page-size")
    args.ragged_page_size = args.page_size[0] if args.page_size else RAGGED_PAGE_SIZE
    if methods_given:
        other = [m for m in args.methods if m not in RAGGED_METHODS]
        if other:
            parser.error(f"--lengths times v2 and flashinfer only, not {', '.join(other)}")
    else:
        args.methods = RAGGED_METHODS
    if args.reps is None:
        args.reps = RAGGED_REPS
    if args.budget_s is None:
        args.budget_s = RAGGED_BUDGET_S


def sweep_axes(args: argparse.Namespace) -> dict:
    return _common.sweep_axes(QUICK_SWEEP if args.quick else DEFAULT_SWEEP, args, AXES)


def cells(args: argparse.Namespace) -> list[dict]:
    if args.lengths:
        return ragged_cells(args)
    if args.suite:
        return suite_cells(args)
    axes = sweep_axes(args)
    return [dict(zip(AXES, values, strict=True)) for values in itertools.product(*(axes[a] for a in AXES))]


def suite_cells(args: argparse.Namespace) -> list[dict]:
    """The ``--suite issue5`` cells in run order, each a dict with the axes,
    the shape (``group``, ``dtype``, heads, ``head_dim``), the ``methods`` to
    time there and ``host`` (measure host time per call). Axis flags,
    ``--dtype``, ``--methods`` and ``--groups`` filter."""
    out = []
    for group, dtype, page_size, hq, hkv, head_dim, kind in ISSUE5_GROUPS:
        if args.groups and group not in args.groups:
            continue
        if args.dtypes and dtype not in args.dtypes:
            continue
        if args.page_size and page_size not in args.page_size:
            continue
        if kind == "main":
            pairs = list(itertools.product(ISSUE5_MAIN["batch"], ISSUE5_MAIN["ctx"]))
            pairs += list(itertools.product(ISSUE5_LONG["batch"], ISSUE5_LONG["ctx"]))
        else:
            pairs = list(itertools.product(ISSUE5_EXTRA["batch"], ISSUE5_EXTRA["ctx"]))
        for batch, ctx in pairs:
            if (args.batch and batch not in args.batch) or (args.ctx and ctx not in args.ctx):
                continue
            methods = ["v2", "flashinfer"]
            if kind == "main" and ctx >= SLOW_METHODS_MIN_CTX:
                methods += ["v1", "gather"]
            methods = tuple(m for m in methods if m in args.methods)
            if not methods:
                continue
            out.append(
                {
                    "batch": batch,
                    "ctx": ctx,
                    "page_size": page_size,
                    "group": group,
                    "dtype": dtype,
                    "num_qo_heads": hq,
                    "num_kv_heads": hkv,
                    "head_dim": head_dim,
                    "methods": methods,
                    "host": kind == "main" and (batch, ctx) in HOST_CELLS,
                }
            )
    return out


def cell_shape(cell: dict, args: argparse.Namespace) -> tuple[str, int, int, int]:
    """``(dtype, num_qo_heads, num_kv_heads, head_dim)`` of a cell (suite
    cells carry their own, sweep cells take the flags)."""
    return (
        cell.get("dtype", args.dtype),
        cell.get("num_qo_heads", args.num_qo_heads),
        cell.get("num_kv_heads", args.num_kv_heads),
        cell.get("head_dim", args.head_dim),
    )


def cell_label(cell: dict, args: argparse.Namespace) -> str:
    dtype, hq, hkv, head_dim = cell_shape(cell, args)
    short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
    return f"{short} {hq}q/{hkv}kv D{head_dim} P{cell['page_size']} b{cell['batch']} ctx{cell['ctx']}"


def estimate_cell_s(cell: dict, args: argparse.Namespace, jit_pending: bool) -> float:
    """Rough wall time of one suite cell, for the budget: fixed host cost,
    filling the pools (2x slack, rotated up to 256 MiB), the timed GPU work,
    gather's few slow calls, and the JIT when the cell's (dtype, head_dim) is
    new in this process.

    Example: fp16 batch 128 x ctx 32768 (17 GB of KV) ~ 2.5 s; batch 1 x
    ctx 1024 ~ 0.4 s; +45 s for the first cell of a dtype/head_dim.
    """
    dtype, _, hkv, head_dim = cell_shape(cell, args)
    itemsize = 4 if dtype == "float32" else 2
    kv = 2 * cell["batch"] * cell["ctx"] * hkv * head_dim * itemsize
    pool = 2 * max(kv, ROTATE_BYTES)
    est = 0.35 + pool / 40e9  # setup, random fill, frees
    methods = cell.get("methods", args.methods)
    v2_s = kv / 3.0e12 + 15e-6
    est += len(methods) * 12 * v2_s  # ~12 calls' worth of GPU time per method (v1 ~3x v2: counted in gather's slack)
    if "gather" in methods:
        est += GATHER_EST_CALLS * (0.001 + kv / 100e9) + 0.05 + cell["batch"] * cell["ctx"] * 3e-8
    if jit_pending:
        est += JIT_ESTIMATE_S
    return est


def num_replicas(kv_bytes: int) -> int:
    """Independent cache copies to rotate through so that the visible KV
    cycled per round reaches :data:`ROTATE_BYTES` (1 when one copy does)."""
    return _common.cache_copies(kv_bytes, 0, MAX_REPLICAS)  # (the suite checks its pools' memory itself)


def graph_calls(replicas: int) -> int:
    """Calls per captured graph: at least GRAPH_CALLS, a multiple of replicas
    (every copy equally often)."""
    return replicas * math.ceil(GRAPH_CALLS / replicas)


# -------------------------------------------------------------------- timing


@dataclass
class Runner:
    """One timed method: ``calls[k]`` runs it on replica ``k``; ``out`` is
    the cupy array it writes; ``context()`` makes the benchmark stream
    current (for cupy, and for torch when it is FlashInfer).

    The schedule (set by :func:`prepare`): ``n_graph`` calls per captured
    graph, ``replays`` timed replays, ``iters`` event-timed calls
    (``events_always``: also when a graph exists), ``host_iters`` calls
    timed together for host time, ``reps`` repetitions; ``host_calls``
    individually timed calls after the repetitions (suite mode), with
    ``host_extra`` = ``{column: call}`` timed the same way."""

    name: str
    calls: list
    out: Any
    context: Callable[[], Any]
    graph: Any = None
    timing: str = ""
    max_rel_vs_v2: float | None = None
    error: str = ""
    samples: dict = field(default_factory=lambda: {"graph": [], "event": [], "host": []})
    n_graph: int = 0
    replays: int = 0
    iters: int = 0
    event_warm: int = 3
    events_always: bool = True
    warm_replay: bool = True
    host_iters: int = 0
    host_calls: int = 0
    host_extra: dict = field(default_factory=dict)
    host_extra_us: dict = field(default_factory=dict)
    reps: int = 1
    est_us: float | None = None


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text[:160]


def _abort_capture(stream) -> None:
    """Leave stream capture after an error. ``end_capture`` also ends an
    invalidated capture (``is_capturing`` raises on one), so call it blindly."""
    with contextlib.suppress(Exception):
        stream.end_capture()
    with contextlib.suppress(Exception):
        stream.synchronize()


def capture_graph(runner: Runner, stream, n_calls: int):
    """Capture ``n_calls`` calls (rotating replicas) into a CUDA graph; check
    it replays. Raises on failure (the stream is left out of capture)."""
    with runner.context():
        stream.begin_capture()
        try:
            for k in range(n_calls):
                runner.calls[k % len(runner.calls)]()
        except BaseException:
            _abort_capture(stream)
            raise
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    return graph


def adaptive_graph_calls(est_us: float, replicas: int) -> int:
    """Calls per captured graph in suite mode: enough for
    :data:`GRAPH_TARGET_US` of GPU time, at most :data:`GRAPH_CALLS`, at
    least one, rounded up to a multiple of ``replicas``.

    >>> adaptive_graph_calls(12.0, 64), adaptive_graph_calls(75.0, 1), adaptive_graph_calls(4000.0, 1)
    (64, 7, 1)
    """
    n = max(1, min(GRAPH_CALLS, math.ceil(GRAPH_TARGET_US / max(est_us, 1e-3))))
    return replicas * math.ceil(n / replicas)


def adaptive_repeats(span_us: float, reps: int, target_us: float = SAMPLE_US, cap: int = MAX_REPLAYS) -> tuple[int, int]:
    """``(repeats, reps)`` for a unit of work taking ``span_us`` (one graph
    replay, or one call when timed with events): repeats fill ``target_us``
    per repetition (1..cap); a repetition longer than :data:`REP_CAP_US`
    runs once.

    >>> adaptive_repeats(768.0, 3), adaptive_repeats(4800.0, 3), adaptive_repeats(150_000.0, 3)
    ((3, 3), (1, 3), (1, 1))
    """
    repeats = max(1, min(cap, math.ceil(target_us / max(span_us, 1e-3))))
    return repeats, (reps if repeats * span_us <= REP_CAP_US else 1)


def _time_calls(runner: Runner, stream, calls) -> float:
    """GPU time (us) of ``calls`` launched back to back, CUDA events."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    with runner.context():
        start.record(stream)
        for call in calls:
            call()
        end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3


def _time_replay(graph, stream) -> float:
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3


def prepare(runner: Runner, stream, n_graph: int, anchor, *, adaptive: bool = False, reps: int = 1) -> None:
    """Warm-up outside capture (compiles, caches the device table, fills the
    pools), a sanity check of replica 0 against the v2 output, then capture.

    ``adaptive`` (suite mode): time one call (``est_us``), size the graph
    with :func:`adaptive_graph_calls` (``n_graph`` is ignored), time one
    replay and size replays/reps with :func:`adaptive_repeats`; events only
    where capture failed. Gather warms up on replica 0 only (its calls are
    slow and need no rotation to be warm)."""
    import cupy

    slow = adaptive and runner.name == "gather"
    try:
        with runner.context():
            for call in runner.calls[:1] if slow else runner.calls:
                call()
            if not slow:
                runner.calls[0]()  # out holds replica 0's result for the check
        stream.synchronize()
        if adaptive:
            runner.est_us = _time_calls(runner, stream, runner.calls[:1])
    except Exception as e:
        runner.error = _short(e)
        runner.timing = f"error: {runner.error}"
        _abort_capture(stream)
        return
    if anchor is not None:
        with stream:
            ref = anchor.astype(cupy.float32)
            diff = cupy.abs(runner.out.astype(cupy.float32) - ref).max() / cupy.abs(ref).max()
            runner.max_rel_vs_v2 = float(diff)  # a 0-d device array: one sync
    if adaptive:
        n_graph = adaptive_graph_calls(runner.est_us, len(runner.calls))
    runner.n_graph = n_graph
    try:
        runner.graph = capture_graph(runner, stream, n_graph)
        runner.timing = "graph"
    except Exception as e:
        runner.graph = None
        runner.timing = f"events (capture failed: {_short(e)})"
    if not adaptive:
        return
    runner.events_always = False
    if runner.graph is not None:
        replay_us = _time_replay(runner.graph, stream)
        runner.replays, runner.reps = adaptive_repeats(replay_us, reps)
        runner.warm_replay = replay_us <= WARM_REPLAY_MAX_US
    else:
        runner.iters, runner.reps = adaptive_repeats(runner.est_us, reps, cap=MAX_EVENT_ITERS)
        runner.event_warm = 1 if runner.est_us < 1000.0 else 0


def schedule_text(runner: Runner) -> str:
    """What was timed, for the CSV's ``*_timing`` column in suite mode."""
    if runner.graph is not None:
        text = f"{runner.replays} replays of {runner.n_graph} calls"
    else:
        text = f"{runner.iters} calls"
    text += f", {runner.reps} reps"
    if runner.est_us is not None:
        text += f", first call {runner.est_us:.4g} us"
    return text


def sample(runner: Runner, stream) -> None:
    """One repetition of (a) graph replay, (b) events (``runner.iters``
    calls; in suite mode only without a graph), (c) host time
    (``runner.host_iters`` calls without a sync)."""
    import cupy

    calls = runner.calls
    r = len(calls)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    if runner.graph is not None and runner.replays:
        replays = runner.replays
        if runner.warm_replay:
            runner.graph.launch(stream)
        start.record(stream)
        for _ in range(replays):
            runner.graph.launch(stream)
        end.record(stream)
        end.synchronize()
        runner.samples["graph"].append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / (replays * runner.n_graph))
    with runner.context():
        if runner.iters and (runner.events_always or runner.graph is None):
            for k in range(min(r, runner.event_warm)):
                calls[k]()
            start.record(stream)
            for k in range(runner.iters):
                calls[k % r]()
            end.record(stream)
            end.synchronize()
            runner.samples["event"].append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / runner.iters)
        if runner.host_iters:
            stream.synchronize()
            t0 = time.perf_counter()
            for k in range(runner.host_iters):
                calls[k % r]()
            t1 = time.perf_counter()
            stream.synchronize()
            runner.samples["host"].append((t1 - t0) * 1e6 / runner.host_iters)


def sample_interleaved(runners: list[Runner], stream) -> None:
    """Up to ``runner.reps`` repetitions of :func:`sample` per runner,
    interleaved within a repetition. A runner that raises keeps the error (its
    ``timing`` says so) and is not sampled again."""
    for rep in range(max([r.reps for r in runners] + [0])):
        for runner in runners:
            if runner.error or rep >= runner.reps:
                continue
            try:
                sample(runner, stream)
            except Exception as e:
                runner.error = _short(e)
                runner.timing = f"error: {runner.error}"
                _abort_capture(stream)


def host_call_times(call, stream, n: int) -> list[float]:
    """Host time (us) of ``n`` calls timed one at a time, each launched onto
    an idle stream (synchronized before, outside the timed span)."""
    out = []
    for _ in range(n):
        stream.synchronize()
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e6)
    stream.synchronize()
    return out


def measure_host(runner: Runner, stream) -> None:
    """Suite mode: median host time of ``runner.host_calls`` single calls
    (replica 0) into ``samples["host"]``, and of each ``host_extra`` call."""
    if not runner.host_calls or runner.error:
        return
    with runner.context():
        runner.samples["host"] = host_call_times(runner.calls[0], stream, runner.host_calls)
        for column, call in runner.host_extra.items():
            call()
            runner.host_extra_us[column] = statistics.median(host_call_times(call, stream, runner.host_calls))


def summarize_runner(runner: Runner, total_bytes: int) -> dict:
    """Medians and spread of one runner -> ``{field: value}`` (no prefix)."""
    out = {"timing": runner.timing, "max_rel_vs_v2": runner.max_rel_vs_v2}
    if runner.error:
        return out
    med = {k: statistics.median(v) for k, v in runner.samples.items() if v}
    primary_key = "graph" if runner.samples["graph"] else "event"
    primary = runner.samples[primary_key]
    if not primary:
        return out
    us = med[primary_key]
    tbps = total_bytes / (us * 1e-6) / 1e12
    out.update(
        us=us,
        graph_us=med.get("graph"),
        event_us=med.get("event"),
        host_us=med.get("host"),
        tbps=tbps,
        pct_roofline=100.0 * tbps * 1e12 / _common.ROOFLINE_BPS,
        spread=(max(primary) - min(primary)) / us if len(primary) > 1 else None,
    )
    return out


# ------------------------------------------------------------------ runners


def cupaged_runner(method: str, batch: _common.DeviceBatch, plan, stream, *, name: str | None = None,
                   caches: list | None = None, **decode_kwargs) -> Runner:
    """Runner of ``cupaged.decode(..., method=method)`` over ``caches``
    (default ``batch.caches``); extra keywords go to ``decode`` (``k_scale``,
    ``v_scale`` for an fp8 cache)."""
    import cupaged

    out = _common.nan_like(batch.q)
    calls = [
        (lambda k=k, v=v: cupaged.decode(batch.q, k, v, batch.table, plan, method=method, out=out, **decode_kwargs))
        for k, v in (batch.caches if caches is None else caches)
    ]
    return Runner(name or method, calls, out, lambda: stream)


def v2_anchor(batch: _common.DeviceBatch, plan, stream, failures: list[str]):
    """v2's output on replica 0 of ``batch``, the reference the other methods
    are compared with; None, and a ``v2 anchor`` failure appended to
    ``failures``, when the call raises."""
    import cupaged

    anchor = None
    try:
        with stream:
            anchor = cupaged.decode(batch.q, batch.k_cache, batch.v_cache, batch.table, plan, method="v2")
        stream.synchronize()
    except Exception as e:
        failures.append(f"v2 anchor: {_short(e)}")
    return anchor


class FlashInfer:
    """FlashInfer state kept across cells: module, torch, one workspace per
    variant. ``reason`` says why it is unavailable."""

    def __init__(self) -> None:
        self.reason = ""
        try:
            import flashinfer
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            self.torch, self.flashinfer = torch, flashinfer
            # FlashInfer wants its float workspace zeroed before first use
            self.workspaces = {
                name: torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
                for name, _ in FLASHINFER_VARIANTS
            }
            self.version = getattr(flashinfer, "__version__", "?")
        except Exception as e:
            self.reason = _short(e)

    @property
    def available(self) -> bool:
        return not self.reason

    def tensor(self, arr):
        """Zero-copy cupy -> torch (bfloat16 through an int16 view when DLPack
        refuses it)."""
        torch = self.torch
        try:
            return torch.from_dlpack(arr)
        except Exception:
            if arr.dtype.itemsize != 2:
                raise
            import cupy

            return torch.from_dlpack(arr.view(cupy.int16)).view(torch.bfloat16)

    def torch_dtype(self, dtype: np.dtype):
        torch = self.torch
        return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[np.dtype(dtype).name]

    def runners(self, batch: _common.DeviceBatch, stream, *, caches: list | None = None, kv_dtype: str | None = None,
                k_scale: float | None = None, v_scale: float | None = None,
                prefix: str = "flashinfer") -> list[Runner]:
        """One runner per decode variant, named ``<prefix>_<variant>``.
        Default: q's dtype over ``batch.caches``. With ``kv_dtype``
        ``"float8_e4m3fn"``: ``caches`` are uint8 e4m3 bits, viewed as
        ``torch.float8_e4m3fn``, and ``k_scale``/``v_scale`` go to ``run``
        (None: not passed)."""
        torch = self.torch
        table = batch.table
        dev = dict(dtype=torch.int32, device="cuda")
        indptr = torch.tensor(np.array(table.indptr), **dev)
        indices = torch.tensor(np.array(table.indices), **dev)
        last = torch.tensor(np.array(table.last_page_len), **dev)
        tdtype = self.torch_dtype(batch.dtype)
        q = self.tensor(batch.q)
        kv_tdtype = tdtype
        scales = {k: s for k, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None}
        if kv_dtype is None:
            caches = [(self.tensor(k), self.tensor(v)) for k, v in batch.caches]
        else:
            kv_tdtype = getattr(torch, kv_dtype)
            caches = [(self.tensor(k).view(kv_tdtype), self.tensor(v).view(kv_tdtype)) for k, v in caches]
        external = torch.cuda.ExternalStream(stream.ptr)

        @contextlib.contextmanager
        def context():
            with stream, torch.cuda.stream(external):
                yield

        runners = []
        for name, tensor_cores in FLASHINFER_VARIANTS:
            out = _common.nan_like(batch.q)
            out_t = self.tensor(out)
            try:
                wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspaces[name], "NHD", use_tensor_cores=tensor_cores
                )
                wrapper.plan(
                    indptr,
                    indices,
                    last,
                    batch.num_qo_heads,
                    batch.num_kv_heads,
                    batch.head_dim,
                    batch.layout.page_size,
                    q_data_type=tdtype,
                    kv_data_type=kv_tdtype,
                )
                torch.cuda.synchronize()
                calls = [
                    (lambda k=k, v=v, w=wrapper, o=out_t: w.run(q, (k, v), out=o, **scales)) for k, v in caches
                ]
                runners.append(Runner(f"{prefix}_{name}", calls, out, context))
            except Exception as e:
                r = Runner(f"{prefix}_{name}", [], out, context)
                r.error = _short(e)
                r.timing = f"error: {r.error}"
                runners.append(r)
        return runners


# --------------------------------------------------------------------- cells


def run_cell(
    cell: dict, args: argparse.Namespace, stream, flashinfer: FlashInfer | None
) -> tuple[dict, list[str], list[str]]:
    """Benchmark every method on one cell -> (CSV row, failures of cupaged
    methods, notes about the FlashInfer peer). GPU memory of the cell is
    released before returning, also when it raises."""
    try:
        return _measure_cell(cell, args, stream, flashinfer)
    finally:
        _common.free_gpu_memory(peer_torch(flashinfer))


def peer_torch(flashinfer: FlashInfer | None):
    """The FlashInfer peer's torch when it runs (its cache is freed with ours), else None."""
    return flashinfer.torch if flashinfer is not None and flashinfer.available else None


def pool_bytes(layout: _common.BatchLayout, num_kv_heads: int, head_dim: int, itemsize: int, replicas: int) -> int:
    """K and V pools of every replica (the whole pool, slack included)."""
    return 2 * replicas * layout.num_pages * layout.page_size * num_kv_heads * head_dim * itemsize


def gather_skip_reason(kv: int, pools: int, dtype: str, v2_est_us: float | None = None) -> str:
    """Why the gather path is not timed in a cell ("" = time it): its padded
    copies (~1.5x the visible KV, 3x for bfloat16, computed in float32) on
    top of the pools would pass :data:`GATHER_MEM_LIMIT_BYTES`, or its
    estimated calls (:data:`GATHER_SLOWDOWN_EST` x v2 each) would take
    longer than :data:`GATHER_MAX_EST_S`.

    Example: fp16 batch 128 x ctx 32768 (17.2 GB KV, 34.4 GB pools) needs
    ~61 GB: timed; bfloat16 ~87 GB: skipped.
    """
    widen = 2.0 if dtype == "bfloat16" else 1.0
    need = pools + 1.5 * widen * kv + (1 << 30)
    if need > GATHER_MEM_LIMIT_BYTES:
        return f"skipped: memory (pools + padded copies ~{need / 2**30:.0f} GiB > {GATHER_MEM_LIMIT_BYTES >> 30} GiB)"
    if v2_est_us is not None:
        est_s = GATHER_EST_CALLS * GATHER_SLOWDOWN_EST * v2_est_us * 1e-6
        if est_s > GATHER_MAX_EST_S:
            return f"skipped: time (~{est_s:.1f} s estimated > {GATHER_MAX_EST_S:.0f} s)"
    return ""


def _measure_cell(
    cell: dict, args: argparse.Namespace, stream, flashinfer: FlashInfer | None
) -> tuple[dict, list[str], list[str]]:
    import cupaged

    dtype_name, num_qo_heads, num_kv_heads, head_dim = cell_shape(cell, args)
    methods = tuple(cell.get("methods", args.methods))
    adaptive = bool(args.suite)
    dtype = _common.resolve_dtype(dtype_name)
    layout = _common.plan_layout(
        cell["batch"], cell["ctx"], cell["page_size"], seed=args.seed, mid_page=False, page_order=args.page_order
    )
    kv = _common.kv_bytes(layout, num_kv_heads, head_dim, dtype.itemsize)
    total = _common.decode_bytes(layout, num_qo_heads, num_kv_heads, head_dim, dtype.itemsize)
    replicas = num_replicas(kv)
    n_graph = graph_calls(replicas)
    batch = _common.make_device_batch(
        layout, num_qo_heads, num_kv_heads, head_dim, dtype, seed=args.seed, replicas=replicas
    )
    plan = cupaged.plan_decode(batch.table, num_qo_heads, num_kv_heads, head_dim, dtype)
    row = {
        **{a: cell[a] for a in AXES},
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": dtype_name,
        "page_order": args.page_order,
        "replicas": replicas,
        "graph_calls": n_graph,
        "reps": args.reps,
        "kv_bytes": kv,
        "total_bytes": total,
        "v2_pages_per_chunk": int(plan.pages_per_chunk),
        "v2_num_chunks": int(plan.num_chunks),
        "v2_num_ctas": int(plan.num_ctas),
        "v2_needs_merge": bool(plan.needs_merge),
        "group": cell.get("group", ""),
    }
    if adaptive:
        row["graph_calls"] = None  # per method, adaptive (see the docstring)
    failures, notes = [], []

    # v2 output of replica 0: sanity check of every method
    anchor = v2_anchor(batch, plan, stream, failures) if "v2" in methods else None

    # v2 first: in suite mode its time estimate decides whether gather runs
    order = sorted(methods, key=lambda m: ("v2", "flashinfer", "v1", "gather").index(m))
    runners = []
    for method in order:
        if method == "flashinfer":
            if flashinfer is not None and flashinfer.available:
                try:
                    new = flashinfer.runners(batch, stream)
                except Exception as e:
                    notes.append(f"flashinfer setup: {_short(e)}")
                    continue
            else:
                continue
        else:
            if adaptive and method == "gather":
                v2_est = next((r.est_us for r in runners if r.name == "v2"), None)
                pools = pool_bytes(layout, num_kv_heads, head_dim, dtype.itemsize, replicas)
                reason = gather_skip_reason(kv, pools, dtype_name, v2_est)
                if reason:
                    row["gather_timing"] = reason
                    notes.append(f"gather {reason}")
                    continue
            new = [cupaged_runner(method, batch, plan, stream)]
        for runner in new:
            if adaptive and cell.get("host") and runner.name in ("v2", "flashinfer_cuda_cores", "flashinfer_tensor_cores"):
                runner.host_calls = HOST_CALLS
                if runner.name == "v2":
                    runner.host_extra["v2_auto_host_us"] = lambda out=runner.out: cupaged.decode(
                        batch.q, batch.k_cache, batch.v_cache, batch.table, plan, out=out
                    )
            if not runner.error:
                prepare(runner, stream, n_graph, anchor, adaptive=adaptive, reps=args.reps)
                if not adaptive:
                    runner.replays = max(3, math.ceil(args.iters / n_graph))
                    runner.iters, runner.host_iters, runner.reps = args.iters, args.host_iters, args.reps
            runners.append(runner)
    sample_interleaved(runners, stream)
    for runner in runners:
        try:
            measure_host(runner, stream)
        except Exception as e:
            notes.append(f"{runner.name} host time: {_short(e)}")
    for runner in runners:
        if runner.error:
            # the peer failing is a note; a cupaged method failing is a failure
            (notes if runner.name.startswith("flashinfer") else failures).append(f"{runner.name}: {runner.error}")
        for column, value in runner.host_extra_us.items():
            row[column] = value

    results = {r.name: summarize_runner(r, total) for r in runners}
    fi = [(name, results[f"flashinfer_{name}"]) for name, _ in FLASHINFER_VARIANTS if f"flashinfer_{name}" in results]
    if fi:
        timed = [(name, res) for name, res in fi if res.get("us") is not None]
        name, best = min(timed, key=lambda x: x[1]["us"]) if timed else fi[0]
        best = dict(best)
        others = "; ".join(f"{n}: {_common.format_value(res.get('us'))} us ({res['timing']})" for n, res in fi)
        best["timing"] = f"{best['timing']} [{others}]"
        results["flashinfer"] = best
        row["flashinfer_variant"] = name
    elif "flashinfer" in methods:
        row["flashinfer_timing"] = f"unavailable: {flashinfer.reason if flashinfer else 'not loaded'}"
    for method in METHODS:
        for key, value in results.get(method, {}).items():
            row[f"{method}_{key}"] = value
    if adaptive:
        for runner in runners:
            key = "flashinfer" if runner.name == f"flashinfer_{row.get('flashinfer_variant')}" else runner.name
            if key in METHODS and not runner.error:
                row[f"{key}_timing"] = f"{row.get(f'{key}_timing', '')} <{schedule_text(runner)}>"
    v2_us = row.get("v2_us")
    for other in ("v1", "gather", "flashinfer"):
        if v2_us and row.get(f"{other}_us"):
            row[f"v2_over_{other}"] = row[f"{other}_us"] / v2_us
    for runner in runners:
        runner.graph = None  # graphs go before the memory they point into
    return row, failures, notes


# ------------------------------------------------------------ fp8 KV cache


def e4m3_lut(dtype: np.dtype, scale: float, to_e4m3=None) -> np.ndarray:
    """uint8 ``[65536]``: the float8 e4m3fn bits of ``x / scale`` for every
    bit pattern ``x`` of the 16-bit ``dtype`` (float16 or bfloat16), so that
    ``lut[cache.view(uint16)]`` quantizes a whole cache on the GPU exactly as
    ``cupaged.fp8.to_e4m3(cache, scale)`` would (it is elementwise).
    ``to_e4m3``: the quantizer (default ``cupaged.fp8.to_e4m3``, else the
    same rule with ml_dtypes: clip ``x / scale`` to +-448, round to nearest
    even).

    >>> lut = e4m3_lut(np.dtype(np.float16), 1.0)
    >>> [hex(lut[np.array(x, np.float16).view(np.uint16)]) for x in (1.0, -2.0, 448.0, 1000.0)]
    ['0x38', '0xc0', '0x7e', '0x7e']
    """
    values = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.dtype(dtype))
    if to_e4m3 is None:
        try:
            from cupaged.fp8 import to_e4m3
        except ImportError:  # no cupaged.fp8: the same rule, spelled out
            to_e4m3 = _to_e4m3_ml_dtypes
    return np.ascontiguousarray(to_e4m3(values, scale), dtype=np.uint8)


def _to_e4m3_ml_dtypes(x: np.ndarray, scale: float) -> np.ndarray:
    import ml_dtypes

    with np.errstate(invalid="ignore", over="ignore"):
        y = np.clip(x.astype(np.float64) / scale, -448.0, 448.0)
    return y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def fp8_caches(caches: list, dtype: np.dtype, scale: float) -> list:
    """uint8 e4m3 copies (``x / scale``) of the 16-bit ``(k, v)`` cupy
    caches, quantized on the GPU through :func:`e4m3_lut` in chunks (no
    full-size temporary)."""
    import cupy

    lut = cupy.asarray(e4m3_lut(dtype, scale))
    out = []
    for pair in caches:
        converted = []
        for a in pair:
            src = cupy.ascontiguousarray(a).reshape(-1).view(cupy.uint16)
            dst = cupy.empty(a.shape, dtype=cupy.uint8)
            flat = dst.reshape(-1)
            for start in range(0, src.size, _common.FILL_CHUNK):
                stop = min(src.size, start + _common.FILL_CHUNK)
                flat[start:stop] = cupy.take(lut, src[start:stop])
            converted.append(dst)
        out.append(tuple(converted))
    cupy.cuda.Device().synchronize()
    return out


def run_fp8_cell(cell: dict, args: argparse.Namespace, stream, flashinfer: FlashInfer | None):
    """:func:`run_cell` of ``--kv-dtype fp8``: (row, failures, notes); GPU
    memory released before returning."""
    try:
        return _measure_fp8_cell(cell, args, stream, flashinfer)
    finally:
        _common.free_gpu_memory(peer_torch(flashinfer))


def _best_flashinfer(results: dict, prefix: str) -> tuple[str | None, dict | None]:
    """(variant, result) of the faster FlashInfer variant under ``prefix``
    (the first when neither has a time); (None, None) when none ran."""
    fi = [(name, results[f"{prefix}_{name}"]) for name, _ in FLASHINFER_VARIANTS if f"{prefix}_{name}" in results]
    if not fi:
        return None, None
    timed = [(name, res) for name, res in fi if res.get("us") is not None]
    name, best = min(timed, key=lambda x: x[1]["us"]) if timed else fi[0]
    best = dict(best)
    others = "; ".join(f"{n}: {_common.format_value(res.get('us'))} us ({res['timing']})" for n, res in fi)
    best["timing"] = f"{best['timing']} [{others}]"
    return name, best


def _measure_fp8_cell(cell: dict, args: argparse.Namespace, stream, flashinfer: FlashInfer | None):
    import cupaged

    dtype_name, num_qo_heads, num_kv_heads, head_dim = cell_shape(cell, args)
    dtype = _common.resolve_dtype(dtype_name)
    scale = float(args.fp8_scale)
    layout = _common.plan_layout(
        cell["batch"], cell["ctx"], cell["page_size"], seed=args.seed, mid_page=False, page_order=args.page_order
    )
    kv = _common.kv_bytes(layout, num_kv_heads, head_dim, dtype.itemsize)
    kv8 = _common.kv_bytes(layout, num_kv_heads, head_dim, 1)
    total = _common.decode_bytes(layout, num_qo_heads, num_kv_heads, head_dim, dtype.itemsize)
    total8 = total - kv + kv8
    replicas = num_replicas(kv8)  # sized on the smaller cache: neither runs from L2
    n_graph = graph_calls(replicas)
    batch = _common.make_device_batch(
        layout, num_qo_heads, num_kv_heads, head_dim, dtype, seed=args.seed, replicas=replicas
    )
    caches8 = fp8_caches(batch.caches, dtype, scale)
    plan = cupaged.plan_decode(batch.table, num_qo_heads, num_kv_heads, head_dim, dtype)
    plan8 = cupaged.plan_decode(batch.table, num_qo_heads, num_kv_heads, head_dim, dtype, kv_dtype=FP8_KV_DTYPE)
    row = {
        **{a: cell[a] for a in AXES},
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": dtype_name,
        "kv_dtype": FP8_KV_DTYPE,
        "fp8_scale": scale,
        "page_order": args.page_order,
        "replicas": replicas,
        "graph_calls": n_graph,
        "reps": args.reps,
        "kv_bytes": kv,
        "kv_bytes_fp8": kv8,
        "total_bytes": total,
        "total_bytes_fp8": total8,
        "v2_pages_per_chunk": int(plan.pages_per_chunk),
        "v2_num_chunks": int(plan.num_chunks),
        "v2_needs_merge": bool(plan.needs_merge),
        "v2_fp8_pages_per_chunk": int(plan8.pages_per_chunk),
    }
    failures, notes = [], []
    anchor = v2_anchor(batch, plan, stream, failures)  # 16-bit v2 output: every method is compared with it

    runners = []
    if "v2" in args.methods:
        runners.append(cupaged_runner("v2", batch, plan, stream))
        runners.append(cupaged_runner("v2", batch, plan8, stream, name="v2_fp8", caches=caches8,
                                      k_scale=scale, v_scale=scale))
    if "flashinfer" in args.methods:
        if flashinfer is not None and flashinfer.available:
            fi_scale = None if scale == 1.0 else scale  # FlashInfer applies v_scale as a separate launch
            for kw in ({}, dict(caches=caches8, kv_dtype=FP8_KV_DTYPE, k_scale=fi_scale, v_scale=fi_scale,
                                prefix="flashinfer_fp8")):
                try:
                    runners += flashinfer.runners(batch, stream, **kw)
                except Exception as e:
                    notes.append(f"{kw.get('prefix', 'flashinfer')} setup: {_short(e)}")
        else:
            row["flashinfer_timing"] = f"unavailable: {flashinfer.reason if flashinfer else 'not loaded'}"
    for runner in runners:
        if not runner.error:
            prepare(runner, stream, n_graph, anchor)
            runner.replays = max(3, math.ceil(args.iters / n_graph))
            runner.iters, runner.host_iters, runner.reps = args.iters, args.host_iters, args.reps
    sample_interleaved(runners, stream)
    for runner in runners:
        if runner.error:
            (notes if runner.name.startswith("flashinfer") else failures).append(f"{runner.name}: {runner.error}")

    results = {r.name: summarize_runner(r, total8 if "fp8" in r.name else total) for r in runners}
    for prefix in ("flashinfer", "flashinfer_fp8"):
        variant, best = _best_flashinfer(results, prefix)
        if best is not None:
            results[prefix] = best
            row[f"{prefix}_variant"] = variant
    for method in FP8_METHODS:
        for key, value in results.get(method, {}).items():
            row[f"{method}_{key}"] = value
    for column, num, den in (
        ("v2_16bit_over_fp8", "v2", "v2_fp8"),
        ("flashinfer_16bit_over_fp8", "flashinfer", "flashinfer_fp8"),
        ("v2_fp8_over_flashinfer_fp8", "flashinfer_fp8", "v2_fp8"),
        ("v2_over_flashinfer", "flashinfer", "v2"),
    ):
        if row.get(f"{num}_us") and row.get(f"{den}_us"):
            row[column] = row[f"{num}_us"] / row[f"{den}_us"]
    for runner in runners:
        runner.graph = None  # graphs go before the memory they point into
    return row, failures, notes


def fp8_markdown_report(rows: list[dict], args: argparse.Namespace, flashinfer: FlashInfer | None) -> str:
    fi = "not requested"
    if "flashinfer" in args.methods:
        fi = (
            f"FlashInfer {flashinfer.version}"
            if flashinfer and flashinfer.available
            else f"unavailable ({flashinfer.reason if flashinfer else '?'})"
        )
    head = [
        "# cupaged paged-decode microbenchmark: fp8 (e4m3) KV cache vs 16-bit",
        "",
        f"- device: {device_name()}; q/out {args.dtype}, KV {args.dtype} vs {FP8_KV_DTYPE} (uint8 bits, "
        f"the 16-bit values / {args.fp8_scale:g}, k_scale = v_scale = {args.fp8_scale:g}); {args.num_qo_heads} q / "
        f"{args.num_kv_heads} kv heads, head_dim {args.head_dim}, page order {args.page_order}, "
        "first_page_offset = 0 for every request",
        f"- peer: {fi} (better of CUDA-core and tensor-core decode, per KV dtype)",
        f"- time: µs per call, median of {args.reps} repetitions, GPU time under CUDA-graph replay; "
        "16/8 = 16-bit time / fp8 time (> 1: fp8 faster); v2/FI fp8 = FlashInfer fp8 time / v2 fp8 time",
        "- TB/s of fp8 counts one byte per KV element; fp8 max_rel = the fp8 output against the 16-bit v2 "
        "output (quantization error)",
        "",
        "",
    ]
    return "\n".join(head) + _common.markdown_table(FP8_MD_COLUMNS, rows, FP8_HEADERS)


def _load_flashinfer() -> FlashInfer:
    """:class:`FlashInfer`, its version (or why it is unavailable) printed."""
    flashinfer = FlashInfer()
    status = f"FlashInfer {flashinfer.version}" if flashinfer.available else f"unavailable: {flashinfer.reason}"
    print(f"flashinfer: {status}", flush=True)
    return flashinfer


def _sweep(
    args: argparse.Namespace,
    the_cells: list[dict],
    header: str,
    *,
    run: Callable[..., tuple[dict, list[str], list[str]]],
    csv_columns: tuple[str, ...],
    cell_line: Callable[[str, dict, dict, float], str],
    markdown: Callable[[list[dict], argparse.Namespace, FlashInfer | None], str],
    tail: Callable[[list[dict]], Iterable[str]],
    evaluate: Callable[[dict], dict] | None = None,
    figure: Callable[[list[dict], argparse.Namespace], str] | None = None,
    timing_notes: Callable[[list[dict]], list[str]] | None = None,
) -> int:
    """The cell loop of the plain sweep and of ``--kv-dtype fp8``.

    ``run(cell, args, stream, flashinfer)`` measures a cell -> ``(row,
    failures, notes)``; a cell that raises an ``Exception`` is a failure and
    the loop goes on. ``evaluate(row)`` adds columns before ``wall_s``;
    ``cell_line(where, cell, row, seconds)`` is the line printed per cell.
    The CSV (``csv_columns``) is rewritten after every cell; the CSV, the
    ``markdown(rows, args, flashinfer)`` report and ``figure(rows, args)``
    (which returns its path) are written at the end even when the loop is cut
    short. Then ``timing_notes(rows)``, the failures, a ``SUMMARY`` line and
    ``tail(rows)`` are printed. Returns 1 when anything failed, else 0.
    """
    import cupy

    flashinfer = _load_flashinfer() if "flashinfer" in args.methods else None
    print(header, flush=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows, failures = [], []
    try:
        for cell in the_cells:
            t0 = time.perf_counter()
            where = f"batch {cell['batch']} ctx {cell['ctx']} P {cell['page_size']}"
            try:
                row, fails, notes = run(cell, args, stream, flashinfer)
            except Exception as e:  # e.g. out of memory building the cell: keep going
                failures.append(f"{where}: {_short(e)}")
                print(f"{where}: FAILED {_short(e)}", flush=True)
                continue
            if evaluate is not None:
                row.update(evaluate(row))
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            _common.write_csv(args.csv, csv_columns, rows)  # after every cell: a run cut short keeps them
            failures += [f"{where}: {f}" for f in fails]
            print(cell_line(where, cell, row, time.perf_counter() - t0), flush=True)
            for f in fails:
                print(f"  ! {f}", flush=True)
            for n in notes:
                print(f"  note: {n}", flush=True)
    finally:
        if rows:
            _common.write_csv(args.csv, csv_columns, rows)
            Path(args.md).parent.mkdir(parents=True, exist_ok=True)
            Path(args.md).write_text(markdown(rows, args, flashinfer))
            written = [args.csv, args.md] + ([figure(rows, args)] if figure is not None else [])
            print(f"wrote {', '.join(written)}")
    if timing_notes is not None:
        for line in timing_notes(rows):
            print(line)
    for f in failures:
        print(f"failure: {f}")
    print(f"SUMMARY: {len(rows)}/{len(the_cells)} cells measured, {len(failures)} failures")
    for line in tail(rows):
        print(line)
    return 1 if failures else 0


def _fp8_cell_line(where: str, cell: dict, row: dict, seconds: float) -> str:
    """The line printed per ``--kv-dtype fp8`` cell: the times and v2's 16/8."""
    parts = [f"{m} {_common.format_value(row.get(f'{m}_us'))}us" for m in FP8_METHODS if row.get(f"{m}_us")]
    ratio = row.get("v2_16bit_over_fp8")
    return f"{where}: {'  '.join(parts)}" + (f"  v2 16/8 {ratio:.2f}" if ratio else "") + f"  ({seconds:.1f} s)"


def main_fp8(args: argparse.Namespace) -> int:
    """``--kv-dtype fp8``: the sweep's cells, 16-bit and fp8 caches side by side."""
    the_cells = cells(args)
    return _sweep(
        args,
        the_cells,
        f"microbench --kv-dtype fp8: {len(the_cells)} cells x {', '.join(args.methods)} over {args.dtype} and "
        f"{FP8_KV_DTYPE} caches (scale {args.fp8_scale:g}); {args.num_qo_heads}q/{args.num_kv_heads}kv "
        f"D{args.head_dim}; reps {args.reps}, iters {args.iters}",
        run=run_fp8_cell,
        csv_columns=FP8_CSV_COLUMNS,
        cell_line=_fp8_cell_line,
        markdown=fp8_markdown_report,
        tail=lambda rows: [_common.text_table(FP8_MD_COLUMNS, rows, FP8_HEADERS)],
    )


# ------------------------------------------------------------------- outputs


def device_name() -> str:
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return "?"


def markdown_report(rows: list[dict], args: argparse.Namespace, flashinfer: FlashInfer | None) -> str:
    fi = "not requested"
    if "flashinfer" in args.methods:
        fi = (
            f"FlashInfer {flashinfer.version}"
            if flashinfer and flashinfer.available
            else f"unavailable ({flashinfer.reason if flashinfer else '?'})"
        )
    head = [
        "# cupaged paged-decode microbenchmark",
        "",
        f"- device: {device_name()}; {args.dtype}, {args.num_qo_heads} q / {args.num_kv_heads} kv heads, "
        f"head_dim {args.head_dim}, page order {args.page_order}, first_page_offset = 0 for every request "
        "(FlashInfer has no first_page_offset)",
        f"- methods: {', '.join(args.methods)}; peer: {fi} (better of CUDA-core and tensor-core decode)",
        f"- time: µs per call, median of {args.reps} repetitions; GPU time under CUDA-graph replay "
        "(events around launches where capture failed: see the CSV's *_timing columns)",
        f"- TB/s from visible K+V once + q + out + page table; roofline {_common.ROOFLINE_BPS / 1e12:.1f} TB/s; "
        "v2/X = time of X / time of v2 (> 1: v2 faster)",
        "",
        "",
    ]
    return "\n".join(head) + _common.markdown_table(MD_COLUMNS, rows, HEADERS)


def plot(rows: list[dict], methods: list[str], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    pages = sorted({r["page_size"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches, strict=True):
        for method in methods:
            for p in pages:
                pts = sorted(
                    (r["ctx"], r.get(f"{method}_tbps")) for r in rows if r["batch"] == b and r["page_size"] == p
                )
                pts = [(c, t) for c, t in pts if t is not None]
                if pts:
                    label = method if len(pages) == 1 else f"{method} P{p}"
                    ctxs, tbps = zip(*pts, strict=True)
                    ax.plot(ctxs, tbps, marker="o", label=label)
        ax.axhline(_common.ROOFLINE_BPS / 1e12, color="k", linestyle="--", linewidth=1, label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("TB/s (visible KV + q + out)")
    axes[0][-1].legend(fontsize=8)
    _save_figure(fig, path, title, dpi=120)


def _save_figure(fig, path: str, title: str, dpi: int) -> None:
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def summary_lines(rows: list[dict]) -> list[str]:
    lines = []
    for other, cmp in (("v1", ">="), ("gather", ">"), ("flashinfer", ">=")):
        vals = [r[f"v2_over_{other}"] for r in rows if r.get(f"v2_over_{other}") is not None]
        if vals:
            ok = sum(v >= 1.0 if cmp == ">=" else v > 1.0 for v in vals)
            lines.append(f"  v2/{other}: {cmp} 1 in {ok}/{len(vals)} cells (min {min(vals):.2f}, max {max(vals):.2f})")
    return lines


def plot_suite(rows: list[dict], path: str, title: str = "") -> None:
    """TB/s vs context of v2, FlashInfer-best and v1, one row of panels per
    main group (one panel per batch), roofline and the 4.2 TB/s target drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(k, g) for k, g in bench_report.group_rows(rows) if bench_report.is_main_shape(g[0])]
    if not groups:
        return
    batches = sorted({r["batch"] for _, g in groups for r in g})
    fig, axes = plt.subplots(
        len(groups), len(batches), figsize=(3.6 * len(batches), 2.9 * len(groups)), squeeze=False, sharey=True
    )
    for i, (key, grows) in enumerate(groups):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            for method, label in (("v2", "v2"), ("flashinfer", "FlashInfer-best"), ("v1", "v1")):
                pts = sorted((r["ctx"], r.get(f"{method}_tbps")) for r in grows if r["batch"] == b)
                pts = [(c, t) for c, t in pts if t is not None]
                if pts:
                    ctxs, tbps = zip(*pts, strict=True)
                    ax.plot(ctxs, tbps, marker="o", label=label)
            ax.axhline(_common.ROOFLINE_BPS / 1e12, color="k", linestyle="--", linewidth=1, label="roofline")
            ax.axhline(bench_report.TARGET_TBPS, color="g", linestyle=":", linewidth=1, label="4.2 TB/s")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{key} b{b}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if i == len(groups) - 1:
                ax.set_xlabel("context (tokens)")
        axes[i][0].set_ylabel("TB/s")
    axes[0][-1].legend(fontsize=7)
    _save_figure(fig, path, title, dpi=100)


def gpu_uuid(props: dict) -> str:
    """``", GPU-<uuid>"`` (nvidia-smi's form) from CUDA device properties, or
    "" without one: two H200s of one morning streamed 2-3 % apart
    (docs/architecture.md "Benchmarks wait out freed memory"), so a report
    names its GPU.

    >>> gpu_uuid({"uuid": bytes(range(16))})
    ', GPU-00010203-0405-0607-0809-0a0b0c0d0e0f'
    >>> gpu_uuid({})
    ''
    """
    u = props.get("uuid")
    if not isinstance(u, (bytes, bytearray)) or len(u) != 16:
        return ""
    h = bytes(u).hex()
    return f", GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def run_meta(args: argparse.Namespace, argv, flashinfer: FlashInfer | None, planned: int) -> dict:
    """Header facts of a suite report: command, GPU, date, commit, versions."""
    import datetime

    import cupy

    argv = list(sys.argv[1:] if argv is None else argv)
    gpu = device_name()
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        gpu += (
            f" ({props['multiProcessorCount']} SMs, {props['totalGlobalMem'] / 2**30:.0f} GiB, "
            f"driver {cupy.cuda.runtime.driverGetVersion()}, runtime {cupy.cuda.runtime.runtimeGetVersion()}"
            f"{gpu_uuid(props)})"
        )
    except Exception:
        pass
    versions = [f"CuPy {cupy.__version__}", f"NumPy {np.__version__}"]
    if flashinfer is not None:
        if flashinfer.available:
            versions += [f"torch {flashinfer.torch.__version__}", f"FlashInfer {flashinfer.version}"]
        else:
            versions.append(f"FlashInfer unavailable ({flashinfer.reason})")
    return {
        "command": "python3 scripts/microbench.py " + " ".join(shlex.quote(a) for a in argv),
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": args.commit or bench_report.git_commit(),
        "versions": ", ".join(versions),
        "timing": f"Up to {args.reps} repetitions per method, adaptive (graph of >= ~{GRAPH_TARGET_US:.0f} µs, "
        f"~{SAMPLE_US / 1000:.0f} ms of replays per repetition, one repetition where it would pass "
        f"{REP_CAP_US / 1000:.0f} ms); the CSV's *_timing columns say what was timed per method and cell. "
        "FlashInfer-best = the faster of BatchDecodeWithPagedKVCacheWrapper with use_tensor_cores False/True. "
        "Physical pages in random order out of a pool with 2x slack, first_page_offset 0 (FlashInfer has "
        "none); cells under 256 MiB of KV rotate between cache copies so no call runs from L2.",
        "planned": planned,
        "elapsed_s": None,
        "skipped": [],
        "notes": [],
    }


def write_suite_outputs(rows: list[dict], meta: dict, args: argparse.Namespace) -> None:
    """CSV, meta JSON and markdown report of a suite run (called after every
    cell, so a run cut short still leaves them)."""
    _common.write_csv(args.csv, CSV_COLUMNS, rows)
    bench_report.meta_path(args.csv).write_text(json.dumps(meta, indent=1))
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text(bench_report.markdown_report(rows, meta))


class _Progress:
    """tqdm on stderr when installed (refreshed every 30 s when stderr is not
    a terminal, cell lines then printed plainly), else a counter line every
    10 cells."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.n = total, 0
        # not a terminal (a log file): a bar refresh every 30 s, lines printed plainly
        self.tty = sys.stderr.isatty()
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, unit="cell", mininterval=0.5 if self.tty else 30)
        except ImportError:
            self.bar = None

    def write(self, text: str) -> None:
        if self.bar is not None and self.tty:
            self.bar.write(text, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(text, flush=True)

    def update(self, label: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.n % 10 == 0 or self.n == self.total:  # no tqdm: a line every 10 cells
            print(f"[{self.n}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Interrupted(BaseException):
    """SIGTERM (``timeout``) or the hard-stop alarm: end the run cleanly."""


def _interrupt(signum, frame):  # pragma: no cover - signal handler
    raise Interrupted(signal.Signals(signum).name)


def _cell_line(cell: dict, row: dict, args: argparse.Namespace, seconds: float) -> str:
    parts = [f"{m} {_common.format_value(row.get(f'{m}_us'))}" for m in METHODS if row.get(f"{m}_us") is not None]
    missed = [t[1] for t in bench_report.TARGETS if row.get(t[0]) == bench_report.MISSED]
    ratio = row.get("v2_over_flashinfer")
    return (
        f"{cell_label(cell, args):<34} c={row['v2_pages_per_chunk']} ctas={row['v2_num_ctas']} x{row['replicas']}: "
        f"{'  '.join(parts)} us"
        + (f"  FI/v2 {ratio:.2f}" if ratio else "")
        + (f"  missed: {','.join(missed)}" if missed else "")
        + f"  ({seconds:.1f} s)"
    )


def _budgeted_run(
    args: argparse.Namespace,
    argv,
    *,
    desc: str,
    wants_flashinfer: Callable[[list[dict]], bool],
    what: Callable[[list[dict]], str],
    label: Callable[[dict], str],
    warm_key: Callable[[dict], Any],
    estimate: Callable[[dict, argparse.Namespace, bool], float],
    run: Callable[..., tuple[dict, list[str], list[str]]],
    write_outputs: Callable[[list[dict], dict, argparse.Namespace], None],
    cell_line: Callable[[str, dict, dict, float], str],
    draw: Callable[[list[dict], str, str], None],
    title: str,
    summary: str,
    tail: Callable[[list[dict]], Iterable[str]],
    evaluate: Callable[[dict], dict] | None = None,
    timing: str | None = None,
) -> int:
    """The cell loop of ``--suite`` and ``--lengths``: ``cells(args)`` within
    ``--budget-s``, outputs rewritten after every cell.

    FlashInfer is loaded when ``wants_flashinfer(cells)``; the header line is
    ``microbench {what(cells)}; budget ...``; ``timing``, when given, replaces
    the run metadata's ``timing``. ``label(cell)`` names a cell in every line.
    A cell whose ``estimate(cell, args, jit_pending)`` (``jit_pending``: no
    cell of its ``warm_key(cell)`` measured yet) would end past the budget is
    skipped; SIGTERM and the alarm HARD_STOP_MARGIN_S after the budget end the
    loop (:class:`Interrupted`), as does KeyboardInterrupt. ``run(cell, args,
    stream, flashinfer)`` measures a cell -> ``(row, failures, notes)``; a cell
    that raises an ``Exception`` is a failure and the loop goes on.
    ``evaluate(row)`` adds columns after ``wall_s``; ``write_outputs(rows,
    meta, args)`` writes the CSV, meta JSON and report; ``cell_line(where,
    cell, row, seconds)`` is the line printed per cell; ``draw(rows, path,
    title)`` plots at the end (titled ``{device}: {title}``). Then the
    failures, a ``{summary}: ...`` line and ``tail(rows)`` are printed.
    Returns 1 when anything failed or the run was interrupted, else 0.
    """
    import cupy

    t_start = time.perf_counter()
    the_cells = cells(args)
    flashinfer = _load_flashinfer() if wants_flashinfer(the_cells) else None
    meta = run_meta(args, argv, flashinfer, len(the_cells))
    if timing is not None:
        meta["timing"] = timing
    budget = args.budget_s or 0.0
    print(
        f"microbench {what(the_cells)}; budget {budget:.0f} s; reps {args.reps}; "
        f"commit {meta['commit']}; {meta['gpu']}",
        flush=True,
    )
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    old_alarm = signal.signal(signal.SIGALRM, _interrupt)
    if budget:
        signal.alarm(int(budget + HARD_STOP_MARGIN_S))
    stream = cupy.cuda.Stream(non_blocking=True)
    rows, failures, notes = [], [], meta["notes"]
    warmed = set()  # warm keys of the cells measured (their JIT is done)
    finished = set()  # indices of cells measured, skipped or failed
    interrupted = ""
    progress = _Progress(len(the_cells), desc)
    try:
        for i, cell in enumerate(the_cells):
            where = label(cell)
            elapsed = time.perf_counter() - t_start
            key = warm_key(cell)
            est = estimate(cell, args, key not in warmed)
            if budget and elapsed + est > budget:
                meta["skipped"].append(f"{where}: time budget ({est:.0f} s estimated, {budget - elapsed:.0f} s left)")
                finished.add(i)
                progress.update(f"{where} skipped")
                continue
            t0 = time.perf_counter()
            try:
                row, fails, cell_notes = run(cell, args, stream, flashinfer)
            except Exception as e:  # e.g. out of memory building the cell: keep going
                failures.append(f"{where}: {_short(e)}")
                finished.add(i)
                progress.write(f"{where}: FAILED {_short(e)}")
                _common.free_gpu_memory()
                progress.update(f"{where} failed")
                continue
            warmed.add(key)
            row["wall_s"] = time.perf_counter() - t0
            if evaluate is not None:
                row.update(evaluate(row))
            rows.append(row)
            finished.add(i)
            failures += [f"{where}: {f}" for f in fails]
            notes += [f"{where}: {n}" for n in cell_notes]
            meta["elapsed_s"] = time.perf_counter() - t_start
            write_outputs(rows, meta, args)
            progress.write(cell_line(where, cell, row, row["wall_s"]))
            for f in fails:
                progress.write(f"  ! {f}")
            progress.update(where)
    except (Interrupted, KeyboardInterrupt) as e:
        interrupted = f"{type(e).__name__} {e} after {time.perf_counter() - t_start:.0f} s"
        meta["skipped"] += [
            f"{label(c)}: interrupted ({interrupted})" for j, c in enumerate(the_cells) if j not in finished
        ]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGALRM, old_alarm)
        progress.close()
    meta["elapsed_s"] = time.perf_counter() - t_start
    if failures:
        notes += [f"failure: {f}" for f in failures]
    if rows:
        write_outputs(rows, meta, args)
        try:
            draw(rows, args.png, f"{device_name()}: {title}")
        except Exception as e:  # a plot problem must not lose the numbers
            print(f"plot failed: {_short(e)}", file=sys.stderr)
        print(f"wrote {args.csv}, {bench_report.meta_path(args.csv)}, {args.md}, {args.png}")
    for f in failures:
        print(f"failure: {f}")
    if interrupted:
        print(f"INTERRUPTED: {interrupted}")
    print(
        f"{summary}: {len(rows)}/{len(the_cells)} cells measured, {len(meta['skipped'])} not run, "
        f"{len(failures)} failures, {meta['elapsed_s']:.0f} s"
    )
    for line in tail(rows):
        print(line)
    return 1 if failures or interrupted else 0


def main_suite(args: argparse.Namespace, argv=None) -> int:
    """``--suite``: the issue's cells within ``--budget-s``, outputs rewritten
    after every cell, the target summary printed last."""
    return _budgeted_run(
        args,
        argv,
        desc="issue5",
        wants_flashinfer=lambda the_cells: any("flashinfer" in c["methods"] for c in the_cells),
        what=lambda the_cells: f"--suite {args.suite}: {len(the_cells)} cells",
        label=lambda cell: cell_label(cell, args),
        warm_key=lambda cell: (cell["dtype"], cell["head_dim"]),
        estimate=estimate_cell_s,
        run=run_cell,
        evaluate=bench_report.evaluate_row,
        write_outputs=write_suite_outputs,
        cell_line=lambda where, cell, row, seconds: _cell_line(cell, row, args, seconds),
        draw=plot_suite,
        title="GPU time per call under graph replay -> TB/s",
        summary="SUMMARY",
        tail=lambda rows: [bench_report.summary_text(rows)],
    )


# ---------------------------------------------------------- ragged batches


def ragged_cells(args: argparse.Namespace) -> list[dict]:
    """The ``--lengths`` cells in run order: every ``--dtypes`` choice (outer)
    x every ragged cell (inner). Each is a dict: ``cell`` (label
    ``BATCH:SPEC:SEED``), ``batch``, ``lengths`` (the distribution spec),
    ``seed``, ``choice`` (the ``--dtypes`` word), ``dtype`` (q/out),
    ``kv_dtype`` (cache), ``page_size``."""
    out = []
    for choice in args.ragged_dtypes:
        dtype = "float16" if choice == "fp8" else choice
        kv_dtype = FP8_KV_DTYPE if choice == "fp8" else choice
        for batch, spec, seed in args.lengths:
            out.append(
                {
                    "cell": f"{batch}:{spec}:{seed}",
                    "batch": int(batch),
                    "lengths": spec,
                    "seed": int(seed),
                    "choice": choice,
                    "dtype": dtype,
                    "kv_dtype": kv_dtype,
                    "page_size": args.ragged_page_size,
                }
            )
    return out


def ragged_choice(row: dict) -> str:
    """The ``--dtypes`` word of a row: ``fp8`` for an fp8 cache, else its dtype."""
    return "fp8" if row.get("kv_dtype") == FP8_KV_DTYPE else str(row.get("dtype"))


def ragged_label(cell: dict) -> str:
    return f"{RAGGED_SHORT.get(cell['choice'], cell['choice'])} {cell['cell']}"


def length_stats(seq_lens) -> dict:
    """``total_tokens``, ``min_len``, ``median_len``, ``max_len`` of a batch.

    >>> length_stats([1, 4, 10])
    {'total_tokens': 15, 'min_len': 1, 'median_len': 4.0, 'max_len': 10}
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    return {
        "total_tokens": int(lens.sum()),
        "min_len": int(lens.min()),
        "median_len": float(np.median(lens)),
        "max_len": int(lens.max()),
    }


def estimate_ragged_cell_s(cell: dict, args: argparse.Namespace, jit_pending: bool) -> float:
    """Rough wall time of one ragged cell, for the budget: fixed host cost,
    filling the 16-bit pools (2x slack, rotated up to 256 MiB; fp8 converts
    them once more), up to ``--reps`` ~2 ms repetitions plus warm-up and
    capture per runner (v2 and FlashInfer's two variants), and the JIT when
    the cell's dtype is new in this process.

    Example: fp16 ``64:bimodal:256:16384`` (2.2 GB of KV) ~ 0.8 s; +45 s for
    the first cell of a dtype.
    """
    lens = _common.ragged_lengths(cell["lengths"], cell["batch"], cell["seed"])
    kv16 = 2 * int(lens.sum()) * args.num_kv_heads * args.head_dim * 2
    kv = kv16 // 2 if cell["kv_dtype"] == FP8_KV_DTYPE else kv16
    replicas = num_replicas(kv)
    pools = 2 * replicas * kv16
    est = 0.4 + pools / 40e9 * (2 if cell["kv_dtype"] == FP8_KV_DTYPE else 1)
    call_us = kv / 3.0e12 * 1e6 + 15.0
    graph = adaptive_graph_calls(call_us, replicas)
    runner_us = args.reps * max(SAMPLE_US, graph * call_us) + (2 * replicas + 3 + 2 * graph) * call_us
    est += (1 + 2 * ("flashinfer" in args.methods)) * runner_us * 1e-6
    if jit_pending:
        est += RAGGED_JIT_ESTIMATE_S
    return est


def run_ragged_cell(cell: dict, args: argparse.Namespace, stream, flashinfer: FlashInfer | None):
    """:func:`run_cell` of ``--lengths``: (row, failures, notes); GPU memory
    released before returning, also when it raises."""
    try:
        return _measure_ragged_cell(cell, args, stream, flashinfer)
    finally:
        _common.free_gpu_memory(peer_torch(flashinfer))


def _measure_ragged_cell(cell: dict, args: argparse.Namespace, stream, flashinfer: FlashInfer | None):
    import cupaged

    hq, hkv, head_dim = args.num_qo_heads, args.num_kv_heads, args.head_dim
    dtype = _common.resolve_dtype(cell["dtype"])
    fp8 = cell["kv_dtype"] == FP8_KV_DTYPE
    seq_lens = _common.ragged_lengths(cell["lengths"], cell["batch"], cell["seed"])
    layout = _common.lengths_layout(seq_lens, cell["page_size"], seed=cell["seed"])
    kv16 = _common.kv_bytes(layout, hkv, head_dim, dtype.itemsize)
    kv = _common.kv_bytes(layout, hkv, head_dim, 1) if fp8 else kv16
    total = _common.decode_bytes(layout, hq, hkv, head_dim, dtype.itemsize) - kv16 + kv
    replicas = num_replicas(kv)
    batch = _common.make_device_batch(layout, hq, hkv, head_dim, dtype, seed=cell["seed"], replicas=replicas)
    if fp8:  # the e4m3 copies replace the 16-bit caches (scale 1: no k_scale/v_scale to either side)
        batch.caches = fp8_caches(batch.caches, dtype, 1.0)
        _common.free_gpu_memory()
    plan = cupaged.plan_decode(batch.table, hq, hkv, head_dim, dtype, kv_dtype=np.uint8 if fp8 else None)
    row = {
        "cell": cell["cell"],
        "batch": cell["batch"],
        "lengths": cell["lengths"],
        "seed": cell["seed"],
        "dtype": cell["dtype"],
        "kv_dtype": cell["kv_dtype"],
        "page_size": cell["page_size"],
        "num_qo_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": head_dim,
        **length_stats(seq_lens),
        "kv_bytes": kv,
        "total_bytes": total,
        "replicas": replicas,
        "reps": args.reps,
        "v2_pages_per_chunk": int(plan.pages_per_chunk),
        "v2_num_chunks": int(plan.num_chunks),
        "v2_num_ctas": int(plan.num_ctas),
        "v2_needs_merge": bool(plan.needs_merge),
    }
    failures, notes = [], []
    anchor = None  # v2's output on replica 0: FlashInfer's outputs are compared with it
    if "v2" in args.methods:
        try:
            sel = cupaged.select_method(batch.q, batch.k_cache, batch.v_cache, batch.table, plan, method="v2")
            row["v2_path"] = sel.method if sel.method == "v2" else f"{sel.method} ({sel.reason})"
            if sel.method != "v2":
                failures.append(f"v2 does not run its kernel here: {sel.reason}")
        except Exception as e:
            notes.append(f"v2 path not checked: {_short(e)}")
        anchor = v2_anchor(batch, plan, stream, failures)

    runners = []
    if "v2" in args.methods:
        runners.append(cupaged_runner("v2", batch, plan, stream))
    if "flashinfer" in args.methods:
        if flashinfer is not None and flashinfer.available:
            kw = dict(caches=batch.caches, kv_dtype=FP8_KV_DTYPE) if fp8 else {}
            try:
                runners += flashinfer.runners(batch, stream, **kw)
            except Exception as e:
                notes.append(f"flashinfer setup: {_short(e)}")
        else:
            row["flashinfer_timing"] = f"unavailable: {flashinfer.reason if flashinfer else 'not loaded'}"
    for runner in runners:
        if not runner.error:
            prepare(runner, stream, 0, anchor, adaptive=True, reps=args.reps)
    sample_interleaved(runners, stream)
    for runner in runners:
        if runner.error:
            (notes if runner.name.startswith("flashinfer") else failures).append(f"{runner.name}: {runner.error}")

    results = {r.name: summarize_runner(r, total) for r in runners}
    for name, _ in FLASHINFER_VARIANTS:
        row[f"flashinfer_{name}_us"] = results.get(f"flashinfer_{name}", {}).get("us")
    variant, best = _best_flashinfer(results, "flashinfer")
    if best is not None:
        results["flashinfer"] = best
        row["flashinfer_variant"] = variant
    for method in RAGGED_METHODS:
        for key in ("us", "spread", "tbps", "timing"):
            if key in results.get(method, {}):
                row[f"{method}_{key}"] = results[method][key]
    if "v2" in results:
        row["v2_pct_roofline"] = results["v2"].get("pct_roofline")
    for runner in runners:
        key = "flashinfer" if runner.name == f"flashinfer_{row.get('flashinfer_variant')}" else runner.name
        if key in RAGGED_METHODS and not runner.error:
            row[f"{key}_timing"] = f"{row.get(f'{key}_timing', '')} <{schedule_text(runner)}>"
    if row.get("v2_us") and row.get("flashinfer_us"):
        row["v2_over_flashinfer"] = row["flashinfer_us"] / row["v2_us"]

    # v2 against FlashInfer: the larger error over the variants goes in the CSV;
    # the cell fails when v2 agrees with neither
    errors = {
        r.name: (r.max_rel_vs_v2 if math.isfinite(r.max_rel_vs_v2) else math.inf)
        for r in runners
        if r.name.startswith("flashinfer_") and r.max_rel_vs_v2 is not None
    }
    if errors:
        row["max_rel_vs_fi"] = max(errors.values())
        if min(errors.values()) > RAGGED_MAX_REL:
            failures.append(
                "v2 differs from FlashInfer: max_rel "
                + ", ".join(f"{n} {_common.format_value(v)}" for n, v in errors.items())
                + f" > {RAGGED_MAX_REL:g}"
            )
        elif max(errors.values()) > RAGGED_MAX_REL:
            notes.append(
                "FlashInfer's variants disagree: max_rel vs v2 "
                + ", ".join(f"{n} {_common.format_value(v)}" for n, v in errors.items())
            )
    row.update(ragged_marks(row))
    for runner in runners:
        runner.graph = None  # graphs go before the memory they point into
    return row, failures, notes


def _number(row: dict, key: str) -> float | None:
    """``row[key]`` as a float (CSV strings too); None when missing, empty or NaN."""
    value = row.get(key)
    if value is None or value == "":
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _target_mark(applies: bool, ok: bool | None) -> str:
    if not applies:
        return ""
    if ok is None:
        return bench_report.UNMEASURED
    return bench_report.MET if ok else bench_report.MISSED


def ragged_marks(row: dict) -> dict:
    """The ragged targets of one cell -> ``{target column: mark}`` (``met``,
    ``missed``, ``not measured``, or empty where it does not apply).

    >>> ragged_marks({"v2_us": 100.0, "flashinfer_us": 120.0, "v2_tbps": 3.7, "kv_bytes": 4e8})
    {'target_no_slower': 'met', 'target_tbs': 'missed'}
    >>> ragged_marks({"v2_us": 10.0, "kv_bytes": 1e8})
    {'target_no_slower': 'not measured', 'target_tbs': ''}
    """
    v2, fi, tbps = _number(row, "v2_us"), _number(row, "flashinfer_us"), _number(row, "v2_tbps")
    kv = _number(row, "kv_bytes") or 0.0
    return {
        "target_no_slower": _target_mark(True, None if not (v2 and fi) else fi / v2 >= RAGGED_TARGET_RATIO),
        "target_tbs": _target_mark(kv >= RAGGED_LARGE_KV_BYTES, None if tbps is None else tbps >= RAGGED_TARGET_TBPS),
    }


def ragged_geomeans(rows: list[dict]) -> list[tuple[str, float | None, int]]:
    """``[("all", geomean, cells), (choice, geomean, cells), ...]``: the
    geometric mean of FlashInfer-best / v2 over every cell timed by both,
    then per ``--dtypes`` choice in order of appearance."""
    out = [("all", *bench_report.geomean_fi_over_v2(rows, main_only=False))]
    for choice in dict.fromkeys(ragged_choice(r) for r in rows):
        out.append((choice, *bench_report.geomean_fi_over_v2([r for r in rows if ragged_choice(r) == choice],
                                                             main_only=False)))
    return out


def _geomean_mark(gm: float | None) -> str:
    return "" if gm is None else bench_report.MET if gm >= RAGGED_GEOMEAN_TARGET else bench_report.MISSED


def _fmt(value: Any, digits: int = 4) -> str:
    """A number with ``digits`` significant digits ("" for None/NaN)."""
    if value is None or value == "":
        return ""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(value):
        return ""
    if math.isinf(value):
        return "inf"
    if abs(value) >= 10**digits:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _show(mark: str) -> str:
    return {bench_report.MET: "met", bench_report.MISSED: "**missed**", bench_report.UNMEASURED: "n/m"}.get(
        mark or "", "–"
    )


RAGGED_CELL_HEADERS = (
    "cell",
    "batch",
    "lengths",
    "seed",
    "tokens",
    "min len",
    "median len",
    "max len",
    "KV MB",
    "v2 µs",
    "v2 spread %",
    "v2 TB/s",
    "FI-best µs",
    "FI variant",
    "FI TB/s",
    "FI/v2",
    "max_rel vs FI",
    "chunk pages",
    "chunks",
    "CTAs",
    "≥FI",
    f"≥{RAGGED_TARGET_TBPS:g} TB/s",
)


def _ragged_cell_line(row: dict) -> str:
    kv = _number(row, "kv_bytes")
    spread = _number(row, "v2_spread")
    cells = [
        str(row.get("cell", "")),
        str(row.get("batch", "")),
        str(row.get("lengths", "")),
        str(row.get("seed", "")),
        str(row.get("total_tokens", "")),
        str(row.get("min_len", "")),
        _fmt(row.get("median_len"), 6),
        str(row.get("max_len", "")),
        _fmt(None if kv is None else kv / 1e6),
        _fmt(row.get("v2_us")),
        _fmt(None if spread is None else 100.0 * spread, 2),
        _fmt(row.get("v2_tbps"), 3),
        _fmt(row.get("flashinfer_us")),
        {"tensor_cores": "TC", "cuda_cores": "CC"}.get(str(row.get("flashinfer_variant") or ""), ""),
        _fmt(row.get("flashinfer_tbps"), 3),
        _fmt(row.get("v2_over_flashinfer"), 3),
        _fmt(row.get("max_rel_vs_fi"), 2),
        str(row.get("v2_pages_per_chunk", "")),
        str(row.get("v2_num_chunks", "")),
        str(row.get("v2_num_ctas", "")),
        _show(row.get("target_no_slower", "")),
        _show(row.get("target_tbs", "")),
    ]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _md_table(headers, lines) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|", *lines]


def ragged_markdown_report(rows: list[dict], meta: dict) -> str:
    """The ``--lengths`` report: header (command, GPU, date, commit, software,
    timing, spread, the output check), target counts and the geometric
    means, then one table per dtype with both targets marked per cell.
    ``meta``: as :func:`run_meta` returns (``planned``, ``elapsed_s``,
    ``skipped``, ``notes`` included)."""
    lines = bench_report.report_header("cupaged paged decode vs FlashInfer: ragged batches", meta)
    lines.append(f"- **Time**: {meta.get('timing', '')}")
    lines.append(
        "- **Bytes**: every visible K and V element once (one byte each for fp8) + q + out + int32 page table; "
        f"TB/s and % of the {_common.ROOFLINE_BPS / 1e12:.1f} TB/s read roofline from them. KV MB (the "
        f"{RAGGED_LARGE_KV_BYTES / 1e6:.0f} MB size class) counts K and V only."
    )
    spreads = []
    for method, name in (("v2", "v2"), ("flashinfer", "FlashInfer-best")):
        s = bench_report.spread_stats(rows, method)
        if s:
            spreads.append(f"{name} max {s[0]:.1f} % (median {s[1]:.1f} %, {s[2]} cells > 5 %)")
    if spreads:
        lines.append("- **Spread** (max − min) / median over repetitions: " + "; ".join(spreads))
    errors = [v for r in rows if (v := _number(r, "max_rel_vs_fi")) is not None]
    if errors:
        lines.append(
            f"- **Check**: v2's output against FlashInfer's, max |v2 − FI| / max |v2| (the larger over FlashInfer's "
            f"two variants): at most {_fmt(max(errors), 3)} over {len(errors)} cells (a cell fails where v2 agrees "
            f"with neither variant to {RAGGED_MAX_REL:g})"
        )
    planned = meta.get("planned")
    run = f"{len(rows)}" + (f"/{planned}" if planned else "") + " cells measured"
    if meta.get("elapsed_s") is not None:
        run += f" in {float(meta['elapsed_s']):.0f} s"
    skipped = list(meta.get("skipped") or [])
    if skipped:
        run += f"; {len(skipped)} not run (see Notes)"
    lines += [f"- **Run**: {run}", "", "## Targets", ""]
    body = []
    for column, _, rule in RAGGED_TARGETS:
        marks = [r.get(column) or "" for r in rows]
        counts = [sum(bool(m) for m in marks)] + [marks.count(m) for m in
                                                   (bench_report.MET, bench_report.MISSED, bench_report.UNMEASURED)]
        body.append(f"| {rule} | " + " | ".join(str(c) for c in counts) + " |")
    lines += _md_table(("target", "cells", "met", "missed", "not measured"), body)
    (_, gm, n), *per_choice = ragged_geomeans(rows)
    lines += [
        "",
        f"**Geometric mean of FlashInfer-best / v2 over the cells** ({n} cells): **{_fmt(gm, 3) or 'n/a'}** "
        f"(target ≥ {RAGGED_GEOMEAN_TARGET:g}: {_show(_geomean_mark(gm))})",
        "",
    ]
    if per_choice:
        lines += ["Per dtype: " + "; ".join(f"{c}: {_fmt(g, 3) or 'n/a'} ({k} cells)" for c, g, k in per_choice)
                  + ".", ""]
    lines += [
        "## Cells",
        "",
        "Lengths: tokens per request drawn from the distribution with the seed (scripts/_common.py). Marks: met, "
        "**missed**, n/m = applies but not measured (see Notes), – = does not apply. FI variant: CC = CUDA cores "
        "(use_tensor_cores=False), TC = tensor cores. Chunk pages / chunks / CTAs: v2's default plan.",
        "",
    ]
    for choice in dict.fromkeys(ragged_choice(r) for r in rows):
        crows = [r for r in rows if ragged_choice(r) == choice]
        lines += [f"### {choice}: q/out {crows[0].get('dtype')}, KV {crows[0].get('kv_dtype')}", ""]
        lines += _md_table(RAGGED_CELL_HEADERS, (_ragged_cell_line(r) for r in crows))
        lines.append("")
    notes = list(meta.get("notes") or []) + [f"not run: {s}" for s in skipped]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def plot_ragged(rows: list[dict], path: str, title: str = "") -> None:
    """Per dtype one panel: v2 and FlashInfer-best TB/s per cell (bars), the
    ratio FlashInfer-best / v2 written over each pair, the roofline and the
    TB/s target drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    choices = list(dict.fromkeys(ragged_choice(r) for r in rows))
    if not choices:
        return
    width = max(len([r for r in rows if ragged_choice(r) == c]) for c in choices)
    fig, axes = plt.subplots(len(choices), 1, figsize=(max(6.0, 1.1 * width + 2.0), 3.6 * len(choices)),
                             squeeze=False)
    for ax, choice in zip(axes[:, 0], choices, strict=True):
        crows = [r for r in rows if ragged_choice(r) == choice]
        x = np.arange(len(crows))
        v2 = [_number(r, "v2_tbps") or 0.0 for r in crows]
        fi = [_number(r, "flashinfer_tbps") or 0.0 for r in crows]
        ax.bar(x - 0.2, v2, 0.4, label="v2")
        ax.bar(x + 0.2, fi, 0.4, label="FlashInfer-best")
        for i, r in enumerate(crows):
            ratio = _number(r, "v2_over_flashinfer")
            if ratio is not None:
                ax.text(i, max(v2[i], fi[i]) + 0.05, f"{ratio:.2f}x", ha="center", va="bottom", fontsize=7)
        ax.axhline(_common.ROOFLINE_BPS / 1e12, color="k", linestyle="--", linewidth=1, label="roofline")
        ax.axhline(RAGGED_TARGET_TBPS, color="g", linestyle=":", linewidth=1, label=f"{RAGGED_TARGET_TBPS:g} TB/s")
        ax.set_xticks(x)
        ax.set_xticklabels([str(r.get("cell", "")) for r in crows], rotation=30, ha="right", fontsize=7)
        ax.set_ylim(0, max([_common.ROOFLINE_BPS / 1e12 * 1.2] + [1.15 * t for t in v2 + fi]))
        ax.set_ylabel("TB/s")
        ax.set_title(f"{choice}: FlashInfer-best / v2 over the bars", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    _save_figure(fig, path, title, dpi=100)


def write_ragged_outputs(rows: list[dict], meta: dict, args: argparse.Namespace) -> None:
    """CSV, meta JSON and markdown report of a ragged run (after every cell,
    so a run cut short still leaves them)."""
    _common.write_csv(args.csv, RAGGED_CSV_COLUMNS, rows)
    bench_report.meta_path(args.csv).write_text(json.dumps(meta, indent=1))
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text(ragged_markdown_report(rows, meta))


def ragged_summary_lines(rows: list[dict]) -> list[str]:
    """``SUMMARY`` lines: a header, one per cell, the geometric means."""
    lines = [
        "SUMMARY cell dtype v2_us fi_us fi_variant fi/v2 v2_TB/s fi_TB/s max_rel "
        f">=FI >={RAGGED_TARGET_TBPS:g}TB/s"
    ]
    for r in rows:
        variant = {"tensor_cores": "TC", "cuda_cores": "CC"}.get(str(r.get("flashinfer_variant") or ""), "-")
        values = " ".join(_fmt(r.get(k)) or "-" for k in ("v2_us", "flashinfer_us"))
        values += f" {variant} " + " ".join(
            _fmt(r.get(k), 3) or "-" for k in ("v2_over_flashinfer", "v2_tbps", "flashinfer_tbps")
        )
        marks = " ".join(r.get(c) or "-" for c, _, _ in RAGGED_TARGETS).replace("not measured", "n/m")
        lines.append(
            f"SUMMARY {r.get('cell')} {RAGGED_SHORT.get(ragged_choice(r), ragged_choice(r))} {values} "
            f"{_fmt(r.get('max_rel_vs_fi'), 2) or '-'} {marks}"
        )
    for column, short, _ in RAGGED_TARGETS:
        marks = [r.get(column) or "" for r in rows]
        lines.append(
            f"SUMMARY target {short}: {marks.count(bench_report.MET)} met, {marks.count(bench_report.MISSED)} missed, "
            f"{marks.count(bench_report.UNMEASURED)} not measured (of {sum(bool(m) for m in marks)})"
        )
    (_, gm, n), *per_choice = ragged_geomeans(rows)
    for choice, g, k in per_choice:
        lines.append(f"SUMMARY geomean fi/v2 {RAGGED_SHORT.get(choice, choice)}: {_fmt(g, 3) or 'n/a'} ({k} cells)")
    verdict = _geomean_mark(gm) or "n/a"
    lines.append(
        f"SUMMARY geomean fi/v2 all: {_fmt(gm, 3) or 'n/a'} ({n} cells; target >= {RAGGED_GEOMEAN_TARGET:g}: {verdict})"
    )
    return lines


def _ragged_timing(args: argparse.Namespace) -> str:
    """The ``timing`` paragraph of a ``--lengths`` report."""
    return (
        f"GPU µs per call under CUDA-graph replay, median of up to {args.reps} repetitions (v2 and FlashInfer's "
        f"two variants interleaved, same cache buffers and page table); a graph holds >= ~{GRAPH_TARGET_US:.0f} µs "
        f"of calls (at least one per cache copy), ~{SAMPLE_US / 1000:.0f} ms of replays per repetition, one "
        f"repetition where it would pass {REP_CAP_US / 1000:.0f} ms; the CSV's *_timing columns say what was timed. "
        "FlashInfer-best = the faster of BatchDecodeWithPagedKVCacheWrapper with use_tensor_cores False/True. "
        f"{args.num_qo_heads} q / {args.num_kv_heads} kv heads, head_dim {args.head_dim}, page "
        f"{args.ragged_page_size}; physical pages in random order out of a pool with 2x slack, first_page_offset 0; "
        "cells under 256 MiB of KV rotate between cache copies so no call runs from L2. fp8 = float8 e4m3 KV "
        "cache under a float16 query, scale 1, v2 and FlashInfer reading the same bytes."
    )


def _ragged_progress_line(where: str, cell: dict, row: dict, seconds: float) -> str:
    """The line printed per ``--lengths`` cell: v2's plan, v2 and FlashInfer-best, FI/v2."""
    ratio = row.get("v2_over_flashinfer")
    return (
        f"{where:<36} c={row['v2_pages_per_chunk']} ctas={row['v2_num_ctas']} x{row['replicas']}: "
        f"v2 {_fmt(row.get('v2_us')) or '-'} us {_fmt(row.get('v2_tbps'), 3) or '-'} TB/s  "
        f"FI {_fmt(row.get('flashinfer_us')) or '-'} us"
        + (f"  FI/v2 {ratio:.2f}" if ratio else "")
        + f"  ({seconds:.1f} s)"
    )


def main_ragged(args: argparse.Namespace, argv=None) -> int:
    """``--lengths``: every (dtype, ragged cell) within ``--budget-s``,
    outputs rewritten after every cell, ``SUMMARY`` lines printed last."""
    return _budgeted_run(
        args,
        argv,
        desc="ragged",
        wants_flashinfer=lambda the_cells: "flashinfer" in args.methods,
        what=lambda the_cells: (
            f"--lengths: {len(the_cells)} cells ({len(args.lengths)} batches x "
            f"{', '.join(args.ragged_dtypes)}) x {', '.join(args.methods)}"
        ),
        timing=_ragged_timing(args),
        label=ragged_label,
        warm_key=lambda cell: cell["choice"],
        estimate=estimate_ragged_cell_s,
        run=run_ragged_cell,
        write_outputs=write_ragged_outputs,
        cell_line=_ragged_progress_line,
        draw=plot_ragged,
        title="ragged batches, GPU time per call under graph replay -> TB/s",
        summary="SUMMARY ragged",
        tail=ragged_summary_lines,
    )


def _sweep_cell_line(where: str, cell: dict, row: dict, seconds: float) -> str:
    """The line printed per cell of the plain sweep: axes padded to align, v2's plan, the times."""
    parts = [f"{m} {_common.format_value(row.get(f'{m}_us'))}us" for m in METHODS if row.get(f"{m}_us") is not None]
    return (
        f"batch {cell['batch']:>3} ctx {cell['ctx']:>6} P {cell['page_size']:>3} "
        f"c={row['v2_pages_per_chunk']} chunks={row['v2_num_chunks']} "
        f"merge={'yes' if row['v2_needs_merge'] else 'no'} "
        f"x{row['replicas']}: {'  '.join(parts)}  ({seconds:.1f} s)"
    )


def _sweep_figure(rows: list[dict], args: argparse.Namespace) -> str:
    """The plain sweep's plot at ``args.png`` -> that path; a failure is
    reported on stderr, not raised."""
    try:
        title = (
            f"{device_name()}: {args.dtype}, {args.num_qo_heads}q/{args.num_kv_heads}kv heads, "
            f"head_dim {args.head_dim}; GPU time per call (graph replay), first_page_offset 0"
        )
        plot(rows, [m for m in METHODS if m in args.methods], args.png, title)
    except Exception as e:  # a plot problem must not lose the numbers
        print(f"plot failed: {_short(e)}", file=sys.stderr)
    return args.png


def _timing_notes(rows: list[dict]) -> list[str]:
    """A ``timing note:`` line per method and timing other than graph replay."""
    timing = sorted(
        {
            f"{m}: {row[f'{m}_timing']}"
            for row in rows
            for m in METHODS
            if row.get(f"{m}_timing") and not row[f"{m}_timing"].startswith("graph")
        }
    )
    return [f"timing note: {t}" for t in timing]


def _sweep_tail(rows: list[dict]) -> Iterator[str]:
    """The plain sweep's lines after ``SUMMARY``: v2 against each method, then the table."""
    yield from summary_lines(rows)
    yield _common.text_table(SUMMARY_COLUMNS, rows, HEADERS)


def main(argv=None) -> int:
    args = parse_args(argv)
    _common.require_gpu()
    if args.suite:
        return main_suite(args, argv)
    if args.lengths:
        return main_ragged(args, argv)
    if args.kv_dtype:
        return main_fp8(args)
    the_cells = cells(args)
    return _sweep(
        args,
        the_cells,
        f"microbench: {len(the_cells)} cells x methods {', '.join(args.methods)}; {args.dtype} "
        f"{args.num_qo_heads}q/{args.num_kv_heads}kv D{args.head_dim}; reps {args.reps}, iters {args.iters}, "
        f"host iters {args.host_iters}; first_page_offset = 0 (FlashInfer has none)",
        run=run_cell,
        evaluate=bench_report.evaluate_row,
        csv_columns=CSV_COLUMNS,
        cell_line=_sweep_cell_line,
        markdown=markdown_report,
        figure=_sweep_figure,
        timing_notes=_timing_notes,
        tail=_sweep_tail,
    )


if __name__ == "__main__":
    sys.exit(main())
