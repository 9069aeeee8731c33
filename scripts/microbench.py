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

Exit status: 0 ran, 1 a method failed in some cell, 2 bad arguments, 3 no
CUDA GPU on this machine (message on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:  # run as a script (scripts/ is sys.path[0]) or imported with scripts/ on the path
    import _common
except ImportError:  # imported as scripts.microbench
    from scripts import _common

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
ROTATE_BYTES = 256 << 20  # rotate copies until this much visible KV is cycled
MAX_REPLICAS = 64
FLASHINFER_WORKSPACE_BYTES = 128 << 20

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


# ----------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="microbench.py",
        description="Time gather, v1, v2 (cupaged) and FlashInfer paged decode on the same cache buffers. "
        "Lists accept spaces or commas. All requests use first_page_offset=0 (FlashInfer has none).",
        epilog=_common.EXIT_CODES_EPILOG,
    )
    p.add_argument("--batch", nargs="+", help="batch sizes (default 1 4 8 32)")
    p.add_argument("--ctx", nargs="+", help="context lengths (default 1024 4096 16384 32768)")
    p.add_argument("--page-size", nargs="+", help="page sizes (default 16)")
    p.add_argument("--num-qo-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=_common.DTYPE_NAMES)
    p.add_argument("--methods", nargs="+", default=[",".join(METHODS)], help="default gather,v1,v2,flashinfer")
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
        help="physical page order (default random, as in SPEC's FlashInfer table)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sweep (batch 1 8 x ctx 1024 16384) and fewer iterations")
    p.add_argument(
        "--out-dir", default="microbench-out", help="folder for the default output paths (default ./microbench-out)"
    )
    p.add_argument("--csv", help="CSV path (default OUT_DIR/microbench.csv)")
    p.add_argument("--md", help="markdown path (default OUT_DIR/microbench.md)")
    p.add_argument("--png", help="plot path (default OUT_DIR/microbench.png)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for axis in AXES:
            setattr(args, axis, _common.parse_list(getattr(args, axis), int))
        args.methods = _common.parse_list(args.methods, str)
    except ValueError as e:
        parser.error(str(e))
    for m in args.methods:
        if m not in METHODS:
            parser.error(f"--methods {m}: choose from {', '.join(METHODS)}")
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
    out = Path(args.out_dir)
    args.csv = args.csv or str(out / "microbench.csv")
    args.md = args.md or str(out / "microbench.md")
    args.png = args.png or str(out / "microbench.png")
    return args


def sweep_axes(args: argparse.Namespace) -> dict:
    return _common.sweep_axes(QUICK_SWEEP if args.quick else DEFAULT_SWEEP, args, AXES)


def cells(args: argparse.Namespace) -> list[dict]:
    axes = sweep_axes(args)
    return [dict(zip(AXES, values, strict=True)) for values in itertools.product(*(axes[a] for a in AXES))]


def num_replicas(kv_bytes: int) -> int:
    """Independent cache copies to rotate through so that the visible KV
    cycled per round reaches :data:`ROTATE_BYTES` (1 when one copy does)."""
    return max(1, min(MAX_REPLICAS, math.ceil(ROTATE_BYTES / max(kv_bytes, 1))))


def graph_calls(replicas: int) -> int:
    """Calls per captured graph: at least GRAPH_CALLS, a multiple of replicas."""
    return replicas * math.ceil(GRAPH_CALLS / replicas)


# -------------------------------------------------------------------- timing


@dataclass
class Runner:
    """One timed method: ``calls[k]`` runs it on replica ``k``; ``out`` is
    the cupy array it writes; ``context()`` makes the benchmark stream
    current (for cupy, and for torch when it is FlashInfer)."""

    name: str
    calls: list
    out: Any
    context: Callable[[], Any]
    graph: Any = None
    timing: str = ""
    max_rel_vs_v2: float | None = None
    error: str = ""
    samples: dict = field(default_factory=lambda: {"graph": [], "event": [], "host": []})


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


def prepare(runner: Runner, stream, n_graph: int, anchor) -> None:
    """Warm-up outside capture (compiles, caches the device table, fills the
    pools), a sanity check of replica 0 against the v2 output, then capture."""
    import cupy

    try:
        with runner.context():
            for call in runner.calls:
                call()
            runner.calls[0]()
        stream.synchronize()
    except Exception as e:
        runner.error = _short(e)
        runner.timing = f"error: {runner.error}"
        _abort_capture(stream)
        return
    if anchor is not None:
        with stream:
            ref = anchor.astype(cupy.float32)
            diff = cupy.abs(runner.out.astype(cupy.float32) - ref).max() / cupy.abs(ref).max()
            runner.max_rel_vs_v2 = float(diff.get())
    try:
        runner.graph = capture_graph(runner, stream, n_graph)
        runner.timing = "graph"
    except Exception as e:
        runner.graph = None
        runner.timing = f"events (capture failed: {_short(e)})"


def sample(runner: Runner, stream, n_graph: int, iters: int, host_iters: int) -> None:
    """One repetition of (a) graph replay, (b) events, (c) host time."""
    import cupy

    calls = runner.calls
    r = len(calls)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    if runner.graph is not None:
        replays = max(3, math.ceil(iters / n_graph))
        runner.graph.launch(stream)
        start.record(stream)
        for _ in range(replays):
            runner.graph.launch(stream)
        end.record(stream)
        end.synchronize()
        runner.samples["graph"].append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / (replays * n_graph))
    with runner.context():
        for k in range(min(r, 3)):
            calls[k]()
        start.record(stream)
        for k in range(iters):
            calls[k % r]()
        end.record(stream)
        end.synchronize()
        runner.samples["event"].append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / iters)
        stream.synchronize()
        t0 = time.perf_counter()
        for k in range(host_iters):
            calls[k % r]()
        t1 = time.perf_counter()
        stream.synchronize()
        runner.samples["host"].append((t1 - t0) * 1e6 / host_iters)


def summarize_runner(runner: Runner, total_bytes: int) -> dict:
    """Medians and spread of one runner -> ``{field: value}`` (no prefix)."""
    out = {"timing": runner.timing, "max_rel_vs_v2": runner.max_rel_vs_v2}
    if runner.error:
        return out
    med = {k: statistics.median(v) for k, v in runner.samples.items() if v}
    primary_key = "graph" if runner.samples["graph"] else "event"
    primary = runner.samples[primary_key]
    us = med[primary_key]
    tbps = total_bytes / (us * 1e-6) / 1e12
    out.update(
        us=us,
        graph_us=med.get("graph"),
        event_us=med.get("event"),
        host_us=med.get("host"),
        tbps=tbps,
        pct_roofline=100.0 * tbps * 1e12 / _common.ROOFLINE_BPS,
        spread=(max(primary) - min(primary)) / us,
    )
    return out


# ------------------------------------------------------------------ runners


def cupaged_runner(method: str, batch: _common.DeviceBatch, plan, stream) -> Runner:
    import cupaged

    out = _common.nan_like(batch.q)
    calls = [
        (lambda k=k, v=v: cupaged.decode(batch.q, k, v, batch.table, plan, method=method, out=out))
        for k, v in batch.caches
    ]
    return Runner(method, calls, out, lambda: stream)


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

    def runners(self, batch: _common.DeviceBatch, stream) -> list[Runner]:
        torch = self.torch
        table = batch.table
        dev = dict(dtype=torch.int32, device="cuda")
        indptr = torch.tensor(np.array(table.indptr), **dev)
        indices = torch.tensor(np.array(table.indices), **dev)
        last = torch.tensor(np.array(table.last_page_len), **dev)
        tdtype = self.torch_dtype(batch.dtype)
        q = self.tensor(batch.q)
        caches = [(self.tensor(k), self.tensor(v)) for k, v in batch.caches]
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
                    kv_data_type=tdtype,
                )
                torch.cuda.synchronize()
                calls = [(lambda k=k, v=v, w=wrapper, o=out_t: w.run(q, (k, v), out=o)) for k, v in caches]
                runners.append(Runner(f"flashinfer_{name}", calls, out, context))
            except Exception as e:
                r = Runner(f"flashinfer_{name}", [], out, context)
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
        if flashinfer is not None and flashinfer.available:
            flashinfer.torch.cuda.empty_cache()
        _common.free_gpu_memory()


def _measure_cell(
    cell: dict, args: argparse.Namespace, stream, flashinfer: FlashInfer | None
) -> tuple[dict, list[str], list[str]]:
    import cupaged

    dtype = _common.resolve_dtype(args.dtype)
    layout = _common.plan_layout(
        cell["batch"], cell["ctx"], cell["page_size"], seed=args.seed, mid_page=False, page_order=args.page_order
    )
    kv = _common.kv_bytes(layout, args.num_kv_heads, args.head_dim, dtype.itemsize)
    total = _common.decode_bytes(layout, args.num_qo_heads, args.num_kv_heads, args.head_dim, dtype.itemsize)
    replicas = num_replicas(kv)
    n_graph = graph_calls(replicas)
    batch = _common.make_device_batch(
        layout, args.num_qo_heads, args.num_kv_heads, args.head_dim, dtype, seed=args.seed, replicas=replicas
    )
    plan = cupaged.plan_decode(batch.table, args.num_qo_heads, args.num_kv_heads, args.head_dim, dtype)
    row = {
        **cell,
        "num_qo_heads": args.num_qo_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
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
    }
    failures, notes = [], []

    anchor = None  # v2 output of replica 0: sanity check of every method
    if "v2" in args.methods:
        try:
            with stream:
                anchor = cupaged.decode(batch.q, batch.k_cache, batch.v_cache, batch.table, plan, method="v2")
            stream.synchronize()
        except Exception as e:
            failures.append(f"v2 anchor: {_short(e)}")

    runners = []
    for method in args.methods:
        if method == "flashinfer":
            if flashinfer is not None and flashinfer.available:
                try:
                    runners += flashinfer.runners(batch, stream)
                except Exception as e:
                    notes.append(f"flashinfer setup: {_short(e)}")
        else:
            runners.append(cupaged_runner(method, batch, plan, stream))
    for runner in runners:
        if not runner.error:
            prepare(runner, stream, n_graph, anchor)
    for _ in range(args.reps):
        for runner in runners:
            if runner.error:
                continue
            try:
                sample(runner, stream, n_graph, args.iters, args.host_iters)
            except Exception as e:
                runner.error = _short(e)
                runner.timing = f"error: {runner.error}"
                _abort_capture(stream)
    for runner in runners:
        if runner.error:
            # the peer failing is a note; a cupaged method failing is a failure
            (notes if runner.name.startswith("flashinfer") else failures).append(f"{runner.name}: {runner.error}")

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
    elif "flashinfer" in args.methods:
        row["flashinfer_timing"] = f"unavailable: {flashinfer.reason if flashinfer else 'not loaded'}"
    for method in METHODS:
        for key, value in results.get(method, {}).items():
            row[f"{method}_{key}"] = value
    v2_us = row.get("v2_us")
    for other in ("v1", "gather", "flashinfer"):
        if v2_us and row.get(f"{other}_us"):
            row[f"v2_over_{other}"] = row[f"{other}_us"] / v2_us
    for runner in runners:
        runner.graph = None  # graphs go before the memory they point into
    return row, failures, notes


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
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_lines(rows: list[dict]) -> list[str]:
    lines = []
    for other, cmp in (("v1", ">="), ("gather", ">"), ("flashinfer", ">=")):
        vals = [r[f"v2_over_{other}"] for r in rows if r.get(f"v2_over_{other}") is not None]
        if vals:
            ok = sum(v >= 1.0 if cmp == ">=" else v > 1.0 for v in vals)
            lines.append(f"  v2/{other}: {cmp} 1 in {ok}/{len(vals)} cells (min {min(vals):.2f}, max {max(vals):.2f})")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    _common.require_gpu()
    import cupy

    the_cells = cells(args)
    flashinfer = None
    if "flashinfer" in args.methods:
        flashinfer = FlashInfer()
        status = f"FlashInfer {flashinfer.version}" if flashinfer.available else f"unavailable: {flashinfer.reason}"
        print(f"flashinfer: {status}", flush=True)
    print(
        f"microbench: {len(the_cells)} cells x methods {', '.join(args.methods)}; {args.dtype} "
        f"{args.num_qo_heads}q/{args.num_kv_heads}kv D{args.head_dim}; reps {args.reps}, iters {args.iters}, "
        f"host iters {args.host_iters}; first_page_offset = 0 (FlashInfer has none)",
        flush=True,
    )
    stream = cupy.cuda.Stream(non_blocking=True)
    rows, failures = [], []
    try:
        for cell in the_cells:
            t0 = time.perf_counter()
            where = f"batch {cell['batch']} ctx {cell['ctx']} P {cell['page_size']}"
            try:
                row, fails, notes = run_cell(cell, args, stream, flashinfer)
            except Exception as e:  # e.g. out of memory building the cell: keep going
                failures.append(f"{where}: {_short(e)}")
                print(f"{where}: FAILED {_short(e)}", flush=True)
                continue
            rows.append(row)
            failures += [f"{where}: {f}" for f in fails]
            parts = [
                f"{m} {_common.format_value(row.get(f'{m}_us'))}us" for m in METHODS if row.get(f"{m}_us") is not None
            ]
            print(
                f"batch {cell['batch']:>3} ctx {cell['ctx']:>6} P {cell['page_size']:>3} "
                f"c={row['v2_pages_per_chunk']} chunks={row['v2_num_chunks']} "
                f"merge={'yes' if row['v2_needs_merge'] else 'no'} "
                f"x{row['replicas']}: {'  '.join(parts)}  ({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
            for f in fails:
                print(f"  ! {f}", flush=True)
            for n in notes:
                print(f"  note: {n}", flush=True)
    finally:
        if rows:
            _common.write_csv(args.csv, CSV_COLUMNS, rows)
            Path(args.md).parent.mkdir(parents=True, exist_ok=True)
            Path(args.md).write_text(markdown_report(rows, args, flashinfer))
            try:
                title = (
                    f"{device_name()}: {args.dtype}, {args.num_qo_heads}q/{args.num_kv_heads}kv heads, "
                    f"head_dim {args.head_dim}; GPU time per call (graph replay), first_page_offset 0"
                )
                plot(rows, [m for m in METHODS if m in args.methods], args.png, title)
            except Exception as e:  # a plot problem must not lose the numbers
                print(f"plot failed: {_short(e)}", file=sys.stderr)
            print(f"wrote {args.csv}, {args.md}, {args.png}")
    timing = sorted(
        {
            f"{m}: {row[f'{m}_timing']}"
            for row in rows
            for m in METHODS
            if row.get(f"{m}_timing") and not row[f"{m}_timing"].startswith("graph")
        }
    )
    for t in timing:
        print(f"timing note: {t}")
    for f in failures:
        print(f"failure: {f}")
    print(f"SUMMARY: {len(rows)}/{len(the_cells)} cells measured, {len(failures)} failures")
    for line in summary_lines(rows):
        print(line)
    print(_common.text_table(SUMMARY_COLUMNS, rows, HEADERS))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
