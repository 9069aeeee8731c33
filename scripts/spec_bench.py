#!/usr/bin/env python3
"""Speculative-decoding shapes (several query tokens per request): cupaged against FlashInfer's paged prefill.

Per cell (q_len x batch x ctx; every request sees ctx tokens; 32 q / 8 kv
heads, head_dim 128, page 16, fp16) it times with held plans, under CUDA-graph
replay (cupaged.testing.GraphTimer): v2 (cupaged.decode with qo_indptr, the
default plan), v2_groups (planned with group_tokens=True: a request's rows in
groups that read each chunk's K/V once), v2_rows (group_tokens=False: one KV
read per query row; the default picks one of the two), v2_q1
(one-token decode of each request's last token) and, when flashinfer and torch
import, fa2 / fa3 (flashinfer.BatchPrefillWithPagedKVCacheWrapper, causal, on
the same CUDA stream; a call that cannot be captured is timed with events).
A cell whose K/V is under 256 MiB rotates every method's calls over copies of
its caches (one table; at most --max-copies) so that no call reads K/V the L2
still holds, as a server's next layer reads another cache.
Every output is checked once first (outputs start as NaN) against v2's:
max |a - b| / max |v2| <= 0.02. Methods take turns over --rounds rounds; the
table gives median µs, v2's spread ((max - min) / median), v2 TB/s, v2 / v2_q1
and FlashInfer-best / v2 (>= 1: v2 as fast or faster). MB = 2^20 bytes.
Targets: (a) q_len 4 at most 1.15x q_len 1 on cells moving >= 256 MB of KV;
(b) v2 at least as fast as FlashInfer's best prefill on every cell.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import math
import os
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402
import microbench  # noqa: E402

HQ, HKV, D, P, ITEMSIZE = 32, 8, 128, 16, 2  # fp16
QLENS, BATCHES, CTXS = (2, 4, 8), (1, 8, 64), (1024, 8192, 32768)
BACKENDS = ("fa2", "fa3")
REPS = 3  # timed graph replays per method and round
EVENT_CALLS = 50  # back-to-back calls per timing when graph capture fails
WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace, as scripts/microbench.py
TOL = 2e-2  # max relative error allowed between two methods' outputs
Q1_TARGET, Q1_MIN_KV = 1.15, 256 << 20  # target (a)
NOISY_PCT = 10.0  # a method whose rounds spread more than this gets a note
MAX_COPIES = microbench.MAX_REPLICAS  # cache copies a small cell rotates over, at most (64, as microbench)
CSV_COLUMNS = ("q_len", "batch", "ctx", "kv_mb", "copies", "v2_us", "v2_spread_pct", "v2_groups_us", "v2_rows_us",
               "v2_q1_us", "ratio_q1", "fa2_us", "fa3_us", "fi_best_us", "fi_best_over_v2", "max_rel_err_vs_fi", "note")
SHOW_COLUMNS = CSV_COLUMNS[:6] + ("v2_tbps",) + CSV_COLUMNS[6:]
#: the terminal table: short header per row key
TEXT_COLUMNS = {"q_len": "q_len", "batch": "batch", "ctx": "ctx", "kv_mb": "KV MB", "copies": "copies",
                "v2_us": "v2 us", "v2_tbps": "TB/s",
                "v2_spread_pct": "spread%", "v2_groups_us": "groups us", "v2_rows_us": "rows us", "v2_q1_us": "q1 us",
                "ratio_q1": "v2/q1",
                "fa2_us": "fa2 us", "fa3_us": "fa3 us", "fi_best_over_v2": "fi/v2", "max_rel_err_vs_fi": "rel err"}


# ------------------------------------------------------- pure helpers (no GPU)
def kv_bytes(batch: int, ctx: int) -> int:
    """K and V of every request read once: 2 * batch * ctx * Hkv * D * 2 bytes."""
    return 2 * batch * ctx * HKV * D * ITEMSIZE


def spread_pct(times) -> float:
    """(max - min) / median of the rounds, in %."""
    return 100.0 * (max(times) - min(times)) / statistics.median(times)


def max_rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| in float32 (NumPy or CuPy arrays); NaN when out has one."""
    out, ref = out.astype("float32"), ref.astype("float32")
    return float(abs(out - ref).max() / abs(ref).max())


def finish_row(row: dict) -> dict:
    """Fill the derived columns of a row holding q_len, batch, ctx and the
    measured ``*_us`` (missing or None: not measured)."""
    kv = kv_bytes(row["batch"], row["ctx"])
    v2, q1 = row.get("v2_us"), row.get("v2_q1_us")
    fi = [row[f"{b}_us"] for b in BACKENDS if row.get(f"{b}_us")]
    row["kv_mb"] = kv / 2**20
    row["v2_tbps"] = kv / (v2 * 1e-6) / 1e12 if v2 else None
    row["ratio_q1"] = v2 / q1 if v2 and q1 else None
    row["fi_best_us"] = min(fi) if fi else None
    row["fi_best_over_v2"] = min(fi) / v2 if fi and v2 else None
    return row


def verdicts(rows) -> tuple[list, tuple[int, int, int]]:
    """Target (a): [(cell, ratio_q1, met)] of the q_len-4 cells moving >=
    256 MB of KV; target (b): (met, missed, without data) counts of
    fi_best_over_v2 >= 1."""
    a = [(f"batch {r['batch']} ctx {r['ctx']}", r.get("ratio_q1"),
          r.get("ratio_q1") is not None and r["ratio_q1"] <= Q1_TARGET)
         for r in rows if r["q_len"] == 4 and kv_bytes(r["batch"], r["ctx"]) >= Q1_MIN_KV]
    vs = [r.get("fi_best_over_v2") for r in rows]
    b = (sum(v is not None and v >= 1.0 for v in vs), sum(v is not None and v < 1.0 for v in vs),
         sum(v is None for v in vs))
    return a, b


def markdown_report(rows, gpu: str, date: str, command: str, commit: str | None = None, peer: str = "") -> str:
    """The markdown file: what ran where (``peer``: FlashInfer's version or
    why it is missing), the two targets' verdicts, the table."""
    a, (met, missed, nodata) = verdicts(rows)
    lines = ["# Speculative-decode shapes: cupaged vs FlashInfer paged prefill", "",
             f"GPU: {gpu}; date: {date}" + (f"; cupaged commit: {commit}" if commit else "")
             + (f"; FlashInfer: {peer}" if peer else ""),
             f"Command: `{command}`",
             "Cache copies: a cell under 256 MiB of K/V rotates every method's calls over `copies` copies of its "
             "caches (cold L2); 1 = one cache replayed.", ""]
    if not a:
        head = "not measured"
    else:
        head = "met" if all(ok for _, _, ok in a) else f"missed on {sum(not ok for _, _, ok in a)} of {len(a)} cells"
    lines.append(f"- (a) q_len 4 <= {Q1_TARGET}x q_len 1 on cells >= 256 MB: {head}")
    lines += [f"  - {cell}: " + ("no data" if r is None else f"{r:.3f}x") + (" met" if ok else " missed")
              for cell, r, ok in a]
    head = "missed" if missed else "not fully measured" if nodata else "met"
    head += f": met on {met}, missed on {missed}" + (f", no FlashInfer data on {nodata}" if nodata else "") + " cells"
    lines += [f"- (b) v2 >= 1.0x FlashInfer-best prefill on every cell: {head}", "",
              _common.markdown_table(SHOW_COLUMNS, rows)]
    return "\n".join(lines)


def csv_rows(rows) -> list[dict]:
    """The rows restricted to CSV_COLUMNS (the display-only v2_tbps dropped)."""
    return [{c: r.get(c) for c in CSV_COLUMNS} for r in rows]


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:160]


# ------------------------------------------------------------------- GPU side
class EventTimer:
    """Fallback for a call that cannot be captured into a CUDA graph: CUDA
    events around EVENT_CALLS back-to-back calls on a stream of its own."""

    def __init__(self, fn):
        import cupy

        self.fn, self.stream = fn, cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            fn()  # raises here, not in the timing rounds, when fn cannot run after the failed capture
        self.stream.synchronize()

    def time_us(self, reps: int) -> float:
        import cupy

        start, stop, times = cupy.cuda.Event(), cupy.cuda.Event(), []
        for _ in range(reps):
            with self.stream:
                start.record(self.stream)
                for _ in range(EVENT_CALLS):
                    self.fn()
                stop.record(self.stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / EVENT_CALLS)
        return statistics.median(times)


def on_cupy_stream(torch, fn):
    """``fn`` wrapped so torch's current stream is cupy's current one (the
    GraphTimer's stream while it captures): both libraries on one stream."""
    import cupy

    externals = {}

    def call():
        stream = cupy.cuda.get_current_stream()
        if stream.ptr not in externals:
            externals[stream.ptr] = torch.cuda.ExternalStream(stream.ptr)
        with stream, torch.cuda.stream(externals[stream.ptr]):
            fn()
    return call


def flashinfer_calls(fi, table_t, kv_t, q, outs, ptr, notes: list) -> dict:
    """One planned call per backend of ``fi``, rotating over the cache copies
    ``kv_t`` (``notes`` gets the backends that fail)."""
    flashinfer, torch, workspaces = fi
    qo = torch.tensor(ptr, dtype=torch.int32, device="cuda")
    q_t, calls = torch.from_dlpack(q), {}
    for backend in workspaces:
        try:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspaces[backend], "NHD", backend=backend)
            w.plan(qo, *table_t, HQ, HKV, D, P, causal=True, q_data_type=torch.float16, kv_data_type=torch.float16)
            torch.cuda.synchronize()  # plan's copies ran on torch's stream, the calls run on cupy's
            o_t = torch.from_dlpack(outs[backend])
            calls[backend] = _common.rotating([
                on_cupy_stream(torch, lambda w=w, o_t=o_t, kv=kv: w.run(q_t, kv, out=o_t)) for kv in kv_t])
        except Exception as e:
            notes.append(f"{backend}: {_short(e)}")
    return calls


def check_outputs(calls: dict, outs: dict, q_len: int, notes: list) -> tuple[dict, bool]:
    """One call of each method outside any graph (a method that raises is
    dropped), then every output against v2's -> ({method: max rel err}, failed)."""
    import cupy

    failed, stream = False, cupy.cuda.Stream(non_blocking=True)
    for name in list(calls):
        try:
            with stream:
                calls[name]()
            stream.synchronize()
        except Exception as e:
            notes.append(f"{name} error: {_short(e)}")
            failed |= name.startswith("v2")
            del calls[name]
    if "v2" not in calls:
        return {}, True
    ref = outs["v2"]  # v2_q1 decodes each request's last token: v2's rows q_len-1, 2*q_len-1, ...
    if not math.isfinite(float(abs(ref).max())):  # NaN left over, or inf: every comparison below is void
        notes.append("v2 output is not finite")
        failed = True
    refs = {"v2_q1": ref[q_len - 1::q_len]}
    errs = {n: max_rel_err(outs[n], refs.get(n, ref)) for n in calls if n != "v2"}
    for name, err in errs.items():
        if not err <= TOL:  # NaN too
            notes.append(f"{name} differs from v2: max rel err {err:.3g} > {TOL}")
            failed = True
    return errs, failed


def time_calls(calls: dict, rounds: int, notes: list, launches: int = microbench.GRAPH_CALLS) -> dict:
    """{method: [µs per round]}; replays of a graph of ``launches`` calls,
    CUDA events where capture fails."""
    from cupaged.testing import GraphTimer

    timers = {}
    for name, fn in calls.items():
        try:
            timers[name] = GraphTimer(fn, launches)
        except Exception as e:
            try:
                timers[name] = EventTimer(fn)
                notes.append(f"{name} timed with events ({EVENT_CALLS} calls; capture failed: {_short(e)})")
            except Exception as e2:
                notes.append(f"{name} error: {_short(e2)}")
    times = {name: [] for name in timers}
    for timer in timers.values():  # one untimed replay each: the first method timed in a large cell's first round
        timer.time_us(1)           # met low clocks after the captures (q_len 2 x 64 x 32768: 9-15 % spreads)
    for _ in range(rounds):  # interleaved: drifts (clocks, heat) hit every method alike
        for name, timer in timers.items():
            times[name].append(timer.time_us(REPS))
    return times


def measure(batch: int, ctx: int, qlens, rounds: int, fi, seed: int, max_copies: int = MAX_COPIES):
    """Yield (row, spreads, failed) per q_len of one batch x ctx (one KV, and
    its copies, for all)."""
    import cupy
    import numpy as np

    import cupaged
    from cupaged.testing import make_paged_batch

    b = make_paged_batch([ctx] * batch, HQ, HKV, D, "float16", page_size=P, seed=seed)
    table = b.table
    copies = _common.cache_copies(kv_bytes(batch, ctx), b.k_cache.nbytes + b.v_cache.nbytes, max_copies)
    caches = [(b.k_cache, b.v_cache)] + [(b.k_cache.copy(), b.v_cache.copy()) for _ in range(copies - 1)]
    plan1 = cupaged.plan_decode(table, HQ, HKV, D, np.float16)
    if fi is not None:
        torch = fi[1]
        table_t = [torch.tensor(np.asarray(a), dtype=torch.int32, device="cuda")
                   for a in (table.indptr, table.indices, table.last_page_len)]
        kv_t = [(torch.from_dlpack(k), torch.from_dlpack(v)) for k, v in caches]  # zero-copy views
    for q_len in qlens:
        ptr = np.arange(batch + 1, dtype=np.int32) * q_len
        q = cupy.random.RandomState(seed + q_len).standard_normal((batch * q_len, HQ, D), dtype=cupy.float32)
        q = q.astype(cupy.float16)
        q1 = cupy.ascontiguousarray(q[q_len - 1::q_len])  # the last token sees the whole ctx, as q_len 1 does
        outs = {name: _common.nan_like(q) for name in ("v2", "v2_groups", "v2_rows", *BACKENDS)}
        outs["v2_q1"] = _common.nan_like(q1)
        calls, notes = {}, []
        for name, grouped in (("v2", None), ("v2_groups", True), ("v2_rows", False)):
            plan = cupaged.plan_decode(table, HQ, HKV, D, np.float16, qo_indptr=ptr, group_tokens=grouped)
            calls[name] = _common.rotating([lambda q=q, plan=plan, o=outs[name], ptr=ptr, k=k, v=v: cupaged.decode(
                q, k, v, table, plan, out=o, qo_indptr=ptr) for k, v in caches])
        calls["v2_q1"] = _common.rotating([lambda q1=q1, o=outs["v2_q1"], k=k, v=v: cupaged.decode(
            q1, k, v, table, plan1, out=o) for k, v in caches])
        if fi is not None:
            calls.update(flashinfer_calls(fi, table_t, kv_t, q, outs, ptr, notes))
        # q, outs and the plans' uploads are on the legacy default stream, which the
        # non-blocking check and timing streams do not wait for
        cupy.cuda.Device().synchronize()
        errs, failed = check_outputs(calls, outs, q_len, notes)
        times = time_calls(calls, rounds, notes, microbench.graph_calls(copies))
        failed |= any(n.startswith("v2") and n not in times for n in calls)
        spreads = {name: spread_pct(t) for name, t in times.items()}
        notes += [f"{n} noisy: spread {s:.0f}%" for n, s in spreads.items() if s > NOISY_PCT]
        fi_errs = [errs[n] for n in BACKENDS if n in errs]
        row = {"q_len": q_len, "batch": batch, "ctx": ctx, "copies": copies, "v2_spread_pct": spreads.get("v2"),
               "note": "; ".join(notes),
               "max_rel_err_vs_fi": max(fi_errs, key=lambda e: math.inf if math.isnan(e) else e, default=None)}
        row.update({f"{name}_us": statistics.median(t) for name, t in times.items()})
        yield finish_row(row), spreads, failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG)
    p.add_argument("--qlen", nargs="+", help="query tokens per request (default 2 4 8; comma lists too)")
    p.add_argument("--batch", nargs="+", help="requests per batch (default 1 8 64)")
    p.add_argument("--ctx", nargs="+", help="tokens of KV per request (default 1024 8192 32768)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                   help="FlashInfer prefill backends to time (default fa2 fa3; each JIT-builds on first use)")
    p.add_argument("--seed", type=int, default=0, help="seed of the pages, caches and queries (default 0)")
    p.add_argument("--max-copies", type=int, default=MAX_COPIES,
                   help=f"cache copies a cell under 256 MiB of K/V rotates over, at most (default {MAX_COPIES}; "
                        "1: one cache replayed, which the L2 may hold)")
    p.add_argument("--csv", help="write one row per cell to this CSV file")
    p.add_argument("--md", help="write a markdown report (GPU, date, command, targets, table) to this file")
    args = p.parse_args(argv)
    try:
        qlens, batches, ctxs = (_common.parse_list(v, int) or d for v, d in
                                ((args.qlen, QLENS), (args.batch, BATCHES), (args.ctx, CTXS)))
    except ValueError as e:
        p.error(f"--qlen, --batch and --ctx take integers: {e}")
    if min(args.rounds, args.max_copies) < 1 or min(qlens + batches + ctxs) < 1:
        p.error("--rounds, --max-copies, --qlen, --batch and --ctx must be >= 1")
    _common.require_gpu()
    import cupy

    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    gpu = gpu.decode() if isinstance(gpu, bytes) else gpu
    fi, peer = None, ""
    try:
        import flashinfer
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        # zeroed: FlashInfer wants its float workspace zeroed before first use
        fi = (flashinfer, torch, {b: torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
                                  for b in args.backends})
        peer = getattr(flashinfer, "__version__", "?")
    except Exception as e:
        peer = f"unavailable, its columns are empty ({_short(e)})"
    print(f"{gpu}; FlashInfer: {peer}")
    print(" ".join(f"{h:>9}" for h in TEXT_COLUMNS.values()))
    rows, failed = [], False
    for batch, ctx in itertools.product(batches, ctxs):
        for row, spreads, bad in measure(batch, ctx, qlens, args.rounds, fi, args.seed, args.max_copies):
            rows.append(row)
            failed |= bad
            print(" ".join(f"{_common.format_value(row.get(c)):>9}" for c in TEXT_COLUMNS))
            print("  spread%: " + ", ".join(f"{n} {s:.1f}" for n, s in spreads.items())
                  + (f"  note: {row['note']}" if row["note"] else ""), flush=True)
        gc.collect()  # the cell's arrays went with measure()'s frame; drop any cycle too
        # (and wait out what the driver does with the freed pools: the next cell's first column, v2's, once
        # ran up to 12 % slow after a large cell; docs/architecture.md "Benchmarks wait out freed memory")
        _common.free_gpu_memory(fi[1] if fi is not None else None)
    if args.csv:
        _common.write_csv(args.csv, CSV_COLUMNS, csv_rows(rows))
    if args.md:
        argv = sys.argv[1:] if argv is None else argv
        command = " ".join(shlex.quote(a) for a in ["python", "scripts/spec_bench.py", *argv])
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        text = markdown_report(rows, gpu, date, command, os.environ.get("CUPAGED_COMMIT"), peer)
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
