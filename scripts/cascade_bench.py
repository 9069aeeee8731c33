#!/usr/bin/env python3
"""Benchmark of cascade decode: requests that share a long prefix.

Default cell (issue #6 item 6): 64 requests sharing a 32768-token prefix, 256
tokens of their own each; 32 q / 8 kv heads, head_dim 128, float16, page 16.
Three ways to decode the same batch, reading the same cache buffers:

* ``cascade``: :func:`cupaged.cascade_decode`: one pass over the prefix pages
  for all 64 x 32 query heads (a pseudo-request with 256 query heads per KV
  head), one decode of the 64 suffixes, one merge;
* ``plain``: :func:`cupaged.decode` of the concatenated per-request tables
  (request ``b`` lists the 2048 shared prefix pages, then its own 16): every
  request reads the prefix;
* ``flashinfer_cuda_cores`` / ``flashinfer_tensor_cores``: FlashInfer's
  ``BatchDecodeWithPagedKVCacheWrapper`` on the concatenated tables (the
  wrapper of scripts/microbench.py), when ``import flashinfer`` and torch work.

The prefix must be a whole number of pages so that the concatenation is a
valid CSR table. Physical pages are a random permutation of a pool with 2x
slack. Plans are built outside the timed region.

Timing (scripts/microbench.py's machinery): per method, ``--graph-calls``
calls captured into one CUDA graph on a non-default stream, replays timed
with CUDA events (``graph_us``, the primary time); events around ``--iters``
back-to-back calls (``event_us``); host time per call without a sync
(``host_us``). ``--reps`` repetitions, methods interleaved; the median is
reported with ``spread = (max - min) / median``. Bytes: ``min_bytes`` = the
prefix's K and V once + every suffix's K and V + q + out (what a perfect
cascade moves); ``plain_bytes`` = what a decode reading the prefix once per
request moves. ``min_tbps`` = min_bytes / time. ``max_rel_vs_plain`` compares
each method's output with the plain decode's.

Writes ``cascade-<gpu>-<date>.csv`` and ``.md`` (command, GPU, date, commit,
versions, spread) into ``--out-dir`` (default docs/benchmarks) and prints a
summary table.

Exit status: 0 ran, 1 a cupaged method failed, 2 bad arguments, 3 no CUDA GPU
on this machine (message on stderr).
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:  # run as a script (scripts/ is sys.path[0]) or imported with scripts/ on the path
    import _common
    import bench_report
    import microbench
except ImportError:  # imported as scripts.cascade_bench
    from scripts import _common, bench_report, microbench

METHODS = ("cascade", "plain", "flashinfer")
DEFAULTS = {
    "num_requests": 64,
    "prefix_len": 32768,
    "suffix_len": 256,
    "num_qo_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "page_size": 16,
    "dtype": "float16",
    "reps": 5,
    "iters": 30,
    "host_iters": 20,
    "graph_calls": 10,
}
#: CSV schema: columns are appended, never reordered.
CSV_COLUMNS = (
    "method",
    "num_requests",
    "prefix_len",
    "suffix_len",
    "page_size",
    "num_qo_heads",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "page_order",
    "graph_calls",
    "reps",
    "us",
    "graph_us",
    "event_us",
    "host_us",
    "spread",
    "timing",
    "min_bytes",
    "plain_bytes",
    "min_tbps",
    "min_pct_roofline",
    "speedup_vs_plain",
    "speedup_vs_flashinfer",
    "max_rel_vs_plain",
    "plan",
)
MD_COLUMNS = ("method", "us", "spread", "host_us", "min_tbps", "min_pct_roofline", "speedup_vs_plain",
              "speedup_vs_flashinfer", "max_rel_vs_plain", "plan")
HEADERS = {
    "us": "µs (graph)",
    "host_us": "host µs",
    "min_tbps": "TB/s (min bytes)",
    "min_pct_roofline": "% roofline",
    "speedup_vs_plain": "plain / this",
    "speedup_vs_flashinfer": "FI-best / this",
    "max_rel_vs_plain": "max rel vs plain",
}


# ----------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog="cascade_bench.py",
        description="Time cupaged.cascade_decode against plain cupaged.decode and FlashInfer's plain decode of "
        "the concatenated tables, on requests sharing one prefix.",
        epilog=_common.EXIT_CODES_EPILOG,
    )
    p.add_argument("--num-requests", type=int, default=d["num_requests"], help="requests sharing the prefix (64)")
    p.add_argument("--prefix-len", type=int, default=d["prefix_len"],
                   help="shared prefix tokens, a multiple of the page size (32768)")
    p.add_argument("--suffix-len", type=int, default=d["suffix_len"], help="unique tokens per request (256)")
    p.add_argument("--num-qo-heads", type=int, default=d["num_qo_heads"], help=f"query heads ({d['num_qo_heads']})")
    p.add_argument("--num-kv-heads", type=int, default=d["num_kv_heads"], help=f"KV heads ({d['num_kv_heads']})")
    p.add_argument("--head-dim", type=int, default=d["head_dim"], help=f"head dimension ({d['head_dim']})")
    p.add_argument("--page-size", type=int, default=d["page_size"], help=f"tokens per page ({d['page_size']})")
    p.add_argument("--dtype", default=d["dtype"], choices=("float16", "bfloat16"), help=f"q and KV dtype ({d['dtype']})")
    p.add_argument("--methods", nargs="+", default=None, help="default cascade,plain,flashinfer")
    p.add_argument("--reps", type=int, default=d["reps"], help="repetitions, methods interleaved (5)")
    p.add_argument("--iters", type=int, default=d["iters"], help="event-timed calls per repetition (30)")
    p.add_argument("--host-iters", type=int, default=d["host_iters"], help="host-timed calls per repetition (20)")
    p.add_argument("--graph-calls", type=int, default=d["graph_calls"], help="calls per captured graph (10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random data (0)")
    p.add_argument("--commit", help="commit to print in the report (default: git rev-parse, else $CUPAGED_COMMIT)")
    p.add_argument("--out-dir", default="docs/benchmarks", help="folder of the CSV and report (docs/benchmarks)")
    p.add_argument("--stem", help="file name stem (default cascade-<gpu>-<UTC date>, e.g. cascade-h200-2026-11-29)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.methods = _common.parse_list(args.methods or [",".join(METHODS)], str)
    except ValueError as e:
        parser.error(str(e))
    for m in args.methods:
        if m not in METHODS:
            parser.error(f"--methods {m}: choose from {', '.join(METHODS)}")
    for name in ("num_requests", "prefix_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "reps",
                 "iters", "host_iters", "graph_calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.suffix_len < 0:
        parser.error("--suffix-len must be >= 0")
    if args.prefix_len % args.page_size:
        parser.error(
            f"--prefix-len ({args.prefix_len}) must be a multiple of --page-size ({args.page_size}): the plain "
            "baselines read the concatenated tables, which must be valid CSR tables"
        )
    if args.num_qo_heads % args.num_kv_heads:
        parser.error("--num-qo-heads must be a multiple of --num-kv-heads")
    if args.stem is not None and not re.fullmatch(r"[\w.-]+", args.stem):
        parser.error("--stem: letters, digits, '.', '_' and '-' only")
    return args


def gpu_tag(name: str) -> str:
    """Short file-name tag of a GPU name.

    >>> gpu_tag("NVIDIA H200"), gpu_tag("NVIDIA H100 80GB HBM3"), gpu_tag("NVIDIA GeForce RTX 4090")
    ('h200', 'h100', 'nvidia-geforce-rtx-4090')
    """
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]?)\b", name)
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def output_paths(args: argparse.Namespace, gpu_name: str, date: str) -> tuple[Path, Path]:
    """``(csv, md)`` paths: ``OUT_DIR/<stem>.csv|.md``, stem ``cascade-<gpu tag>-<date>``."""
    stem = args.stem or f"cascade-{gpu_tag(gpu_name)}-{date}"
    out = Path(args.out_dir)
    return out / f"{stem}.csv", out / f"{stem}.md"


# ------------------------------------------------------------- batch (NumPy)
@dataclass(frozen=True)
class CascadeLayout:
    """Host description of the batch: ``prefix_pages`` (shared, in token
    order) and ``suffix_pages[b]`` (request ``b``'s own) are physical ids of
    a pool of ``num_pages`` pages, a random permutation with 2x slack."""

    num_requests: int
    prefix_len: int
    suffix_len: int
    page_size: int
    prefix_pages: np.ndarray  # int32 [prefix_len / P]
    suffix_pages: np.ndarray  # int32 [B, ceil(suffix_len / P)]
    num_pages: int


def plan_layout(num_requests: int, prefix_len: int, suffix_len: int, page_size: int, *, seed: int,
                slack: int = 2) -> CascadeLayout:
    """The batch's pages (NumPy only). ``prefix_len`` must be a multiple of
    ``page_size``."""
    if prefix_len % page_size:
        raise ValueError(f"prefix_len {prefix_len} is not a multiple of page_size {page_size}")
    n_prefix = prefix_len // page_size
    n_suffix = -(-suffix_len // page_size)
    total = n_prefix + num_requests * n_suffix
    num_pages = slack * total
    ids = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    return CascadeLayout(num_requests, prefix_len, suffix_len, page_size, ids[:n_prefix],
                         ids[n_prefix:total].reshape(num_requests, n_suffix), int(num_pages))


def layout_tables(layout: CascadeLayout):
    """``(shared, unique, group_indptr, concat)``: the prefix as one request,
    the suffixes, one group of every request, and each request's prefix +
    suffix pages as one table (the plain baselines')."""
    import cupaged

    b, p = layout.num_requests, layout.page_size
    shared = cupaged.PageTable.from_seq_lens([layout.prefix_len], p, page_ids=layout.prefix_pages)
    unique = cupaged.PageTable.from_seq_lens([layout.suffix_len] * b, p, page_ids=layout.suffix_pages.reshape(-1))
    group_indptr = np.array([0, b], dtype=np.int32)
    pages = np.concatenate([np.concatenate([layout.prefix_pages, layout.suffix_pages[i]]) for i in range(b)])
    concat = cupaged.PageTable.from_seq_lens([layout.prefix_len + layout.suffix_len] * b, p, page_ids=pages)
    for t in (shared, unique, concat):
        t.check_page_ids(layout.num_pages)
    return shared, unique, group_indptr, concat


def byte_counts(layout: CascadeLayout, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                itemsize: int) -> tuple[int, int]:
    """``(min_bytes, plain_bytes)``: K and V of the prefix once + every suffix
    (+ q and out), and of the prefix once per request (+ q and out).

    >>> lay = CascadeLayout(64, 32768, 256, 16, np.zeros(2048, np.int32), np.zeros((64, 16), np.int32), 6144)
    >>> [round(x / 2**20, 2) for x in byte_counts(lay, 32, 8, 128, 2)]  # MiB
    [193.0, 8257.0]
    """
    per_token = 2 * num_kv_heads * head_dim * itemsize
    qo = 2 * layout.num_requests * num_qo_heads * head_dim * itemsize
    suffixes = layout.num_requests * layout.suffix_len * per_token
    return (layout.prefix_len * per_token + suffixes + qo,
            layout.num_requests * layout.prefix_len * per_token + suffixes + qo)


# ------------------------------------------------------------------ measuring
def plan_text_cascade(plan) -> str:
    passes = "; ".join(
        f"prefix pass {p.plan.num_kv_heads}x{p.heads_per_kv_head} heads, c={p.plan.pages_per_chunk}, "
        f"{p.plan.num_ctas} CTAs" for p in plan.prefix_passes
    )
    s = plan.suffix_plan
    return f"{passes}; suffix c={s.pages_per_chunk}, {s.num_ctas} CTAs"


def measure(args: argparse.Namespace, stream, flashinfer) -> tuple[list[dict], list[str], list[str]]:
    """Rows (one per method), failures of cupaged methods, notes."""
    import cupy

    import cupaged

    dtype = _common.resolve_dtype(args.dtype)
    hq, hkv, d = args.num_qo_heads, args.num_kv_heads, args.head_dim
    layout = plan_layout(args.num_requests, args.prefix_len, args.suffix_len, args.page_size, seed=args.seed)
    shared, unique, gi, concat = layout_tables(layout)
    rs = cupy.random.RandomState(args.seed)
    shape = (layout.num_pages, layout.page_size, hkv, d)
    k, v = _common.fill_random(shape, dtype, rs), _common.fill_random(shape, dtype, rs)
    q = _common.fill_random((layout.num_requests, hq, d), dtype, rs)
    cplan = cupaged.plan_cascade(shared, unique, gi, hq, hkv, d, dtype)
    pplan = cupaged.plan_decode(concat, hq, hkv, d, dtype)
    min_bytes, plain_bytes = byte_counts(layout, hq, hkv, d, dtype.itemsize)
    failures, notes = [], []

    with stream:
        anchor = cupaged.decode(q, k, v, concat, pplan)  # plain output: every method is compared with it
    stream.synchronize()

    runners, plans = [], {}
    if "cascade" in args.methods:
        out = _common.nan_like(q)
        runners.append(microbench.Runner(
            "cascade", [lambda: cupaged.cascade_decode(q, k, v, shared, unique, gi, cplan, out=out)], out,
            lambda: stream))
        plans["cascade"] = plan_text_cascade(cplan)
    if "plain" in args.methods:
        out = _common.nan_like(q)
        runners.append(microbench.Runner("plain", [lambda: cupaged.decode(q, k, v, concat, pplan, out=out)], out,
                                         lambda: stream))
        plans["plain"] = f"c={pplan.pages_per_chunk}, {pplan.num_ctas} CTAs"
    if "flashinfer" in args.methods:
        if flashinfer is not None and flashinfer.available:
            base = _common.BatchLayout(
                page_size=layout.page_size, seq_lens=concat.seq_lens.astype(np.int64),
                first_page_offset=np.zeros(layout.num_requests, np.int64),
                request_pages=concat.request_pages.astype(np.int64), page_ids=concat.indices,
                num_pages=layout.num_pages)
            batch = _common.DeviceBatch(base, concat, q, [(k, v)], hq, hkv, d, dtype)
            try:
                runners += flashinfer.runners(batch, stream)
            except Exception as e:
                notes.append(f"flashinfer setup: {microbench._short(e)}")
        else:
            notes.append(f"flashinfer unavailable: {flashinfer.reason if flashinfer else 'not loaded'}")

    for runner in runners:
        if not runner.error:
            microbench.prepare(runner, stream, args.graph_calls, anchor)
            runner.replays = max(3, math.ceil(args.iters / args.graph_calls))
            runner.iters, runner.host_iters, runner.reps = args.iters, args.host_iters, args.reps
    for _ in range(args.reps):
        for runner in runners:
            if runner.error:
                continue
            try:
                microbench.sample(runner, stream)
            except Exception as e:
                runner.error = microbench._short(e)
                runner.timing = f"error: {runner.error}"
                microbench._abort_capture(stream)

    rows = []
    for runner in runners:
        res = microbench.summarize_runner(runner, min_bytes)
        if runner.error:
            (notes if runner.name.startswith("flashinfer") else failures).append(f"{runner.name}: {runner.error}")
        us = res.get("us")
        rows.append({
            "method": runner.name,
            "num_requests": layout.num_requests,
            "prefix_len": layout.prefix_len,
            "suffix_len": layout.suffix_len,
            "page_size": layout.page_size,
            "num_qo_heads": hq,
            "num_kv_heads": hkv,
            "head_dim": d,
            "dtype": args.dtype,
            "page_order": "random",
            "graph_calls": runner.n_graph or None,
            "reps": args.reps,
            "us": us,
            "graph_us": res.get("graph_us"),
            "event_us": res.get("event_us"),
            "host_us": res.get("host_us"),
            "spread": res.get("spread"),
            "timing": res.get("timing"),
            "min_bytes": min_bytes,
            "plain_bytes": plain_bytes,
            "min_tbps": res.get("tbps"),
            "min_pct_roofline": res.get("pct_roofline"),
            "max_rel_vs_plain": res.get("max_rel_vs_v2"),
            "plan": plans.get(runner.name, ""),
        })
        if runner.name == "cascade" and res.get("max_rel_vs_v2") is not None and res["max_rel_vs_v2"] > 2e-2:
            failures.append(f"cascade differs from plain decode: max_rel {res['max_rel_vs_v2']:.3g} > 2e-2")
    add_speedups(rows)
    for runner in runners:
        runner.graph = None  # graphs go before the memory they point into
    return rows, failures, notes


def add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_plain`` = plain µs / this µs; ``speedup_vs_flashinfer`` =
    the faster FlashInfer variant's µs / this µs (> 1: this is faster).

    >>> rows = [{"method": "cascade", "us": 50.0}, {"method": "plain", "us": 400.0},
    ...         {"method": "flashinfer_cuda_cores", "us": 500.0}, {"method": "flashinfer_tensor_cores", "us": 300.0}]
    >>> add_speedups(rows)
    >>> [(r["speedup_vs_plain"], r["speedup_vs_flashinfer"]) for r in rows]
    [(8.0, 6.0), (1.0, 0.75), (0.8, 0.6), (1.3333333333333333, 1.0)]
    """
    def us_of(name):
        return next((r["us"] for r in rows if r["method"] == name and r.get("us")), None)

    plain = us_of("plain")
    fi = [r["us"] for r in rows if r["method"].startswith("flashinfer") and r.get("us")]
    fi_best = min(fi) if fi else None
    for r in rows:
        if r.get("us"):
            r["speedup_vs_plain"] = plain / r["us"] if plain else None
            r["speedup_vs_flashinfer"] = fi_best / r["us"] if fi_best else None


# -------------------------------------------------------------------- outputs
def run_meta(args: argparse.Namespace, argv, flashinfer) -> dict:
    import cupy

    argv = list(sys.argv[1:] if argv is None else argv)
    versions = [f"CuPy {cupy.__version__}", f"NumPy {np.__version__}"]
    if flashinfer is not None:
        versions.append(f"torch {flashinfer.torch.__version__}, FlashInfer {flashinfer.version}"
                        if flashinfer.available else f"FlashInfer unavailable ({flashinfer.reason})")
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "command": "python3 scripts/cascade_bench.py " + " ".join(shlex.quote(a) for a in argv),
        "gpu": microbench.device_name(),
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "day": now.strftime("%Y-%m-%d"),
        "commit": args.commit or bench_report.git_commit(),
        "versions": ", ".join(versions),
    }


def markdown_report(rows: list[dict], meta: dict, args: argparse.Namespace, notes: list[str]) -> str:
    spreads = [r["spread"] for r in rows if r.get("spread") is not None]
    head = [
        "# Cascade decode: requests sharing a prefix",
        "",
        f"- command: `{meta['command']}`",
        f"- GPU: {meta['gpu']}; date: {meta['date']}; commit: {meta['commit']}; {meta['versions']}",
        f"- batch: {args.num_requests} requests sharing a {args.prefix_len}-token prefix, {args.suffix_len} "
        f"unique tokens each; {args.dtype}, {args.num_qo_heads} q / {args.num_kv_heads} kv heads, head_dim "
        f"{args.head_dim}, page {args.page_size}, physical pages in random order (pool with 2x slack)",
        "- cascade = `cupaged.cascade_decode` (one pass over the prefix for every request's heads, a decode of "
        "the suffixes, a merge); plain = `cupaged.decode` of the concatenated tables (every request lists the "
        "prefix pages); flashinfer_* = FlashInfer's BatchDecodeWithPagedKVCacheWrapper on the same tables",
        f"- time: µs per call, GPU time under CUDA-graph replay ({args.graph_calls} calls per graph), median of "
        f"{args.reps} repetitions, methods interleaved; spread = (max - min) / median"
        + (f" (largest here {max(spreads):.1%})" if spreads else ""),
        f"- bytes: min = prefix K+V once + suffixes + q + out = {rows[0]['min_bytes'] / 2**20:.1f} MiB; plain "
        f"(prefix once per request) = {rows[0]['plain_bytes'] / 2**20:.1f} MiB; TB/s from min bytes, roofline "
        f"{_common.ROOFLINE_BPS / 1e12:.1f} TB/s" if rows else "- no rows",
        "",
        "",
    ]
    body = _common.markdown_table(MD_COLUMNS, rows, HEADERS)
    tail = ["", *(f"- note: {n}" for n in notes)] if notes else []
    return "\n".join(head) + body + "\n".join(tail) + ("\n" if tail else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    _common.require_gpu()
    import cupy

    flashinfer = microbench.FlashInfer() if "flashinfer" in args.methods else None
    meta = run_meta(args, argv, flashinfer)
    csv_path, md_path = output_paths(args, meta["gpu"], meta["day"])
    print(f"cascade_bench: {args.num_requests} requests x ({args.prefix_len} shared + {args.suffix_len} own) "
          f"tokens; methods {', '.join(args.methods)}; {meta['gpu']}", flush=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        rows, failures, notes = measure(args, stream, flashinfer)
    finally:
        _common.free_gpu_memory(microbench.peer_torch(flashinfer))
    _common.write_csv(csv_path, CSV_COLUMNS, rows)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown_report(rows, meta, args, notes + [f"failure: {f}" for f in failures]))
    print(_common.text_table(("method", "us", "spread", "min_tbps", "speedup_vs_plain", "speedup_vs_flashinfer",
                              "max_rel_vs_plain"), rows, HEADERS))
    for n in notes:
        print(f"note: {n}")
    for f in failures:
        print(f"failure: {f}")
    print(f"wrote {csv_path}, {md_path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
