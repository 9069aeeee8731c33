#!/usr/bin/env python3
"""Sliding windows: cupaged's windowed decode against the full call and against FlashInfer's window_left decode.

Per cell (batch x ctx; every request sees ctx tokens; 32 q / 8 kv heads,
head_dim 128, page 16, fp16, shuffled pages) it times, with held plans under
CUDA-graph replay (cupaged.testing.GraphTimer): v2 without a window
(``plain``), v2 with ``window_left=W`` for each --window (its own
``plan_decode(window_left=W)`` plan) and, when flashinfer and torch import,
FlashInfer's decode (``BatchDecodeWithPagedKVCacheWrapper``, CUDA cores and
tensor cores, ``plan(..., window_left=W)``) on the same stream. The graph's
calls rotate over copies of the K/V caches (one table) until each window's
K/V cycles >= 256 MiB, so a small window is not served from the 60 MiB L2.
Every output is checked once first (outputs start as NaN) against v2's:
max |a - b| / max |v2| <= 0.02.

Targets, per window: (a) v2 within 5 µs of plain x (W + page) / ctx (the
window's share of the full call); (b) v2 at least as fast as FlashInfer's
better variant with the same window.
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402
from spec_bench import (NOISY_PCT, TOL, WORKSPACE_BYTES, max_rel_err, on_cupy_stream,  # noqa: E402
                        spread_pct, time_calls)

HQ, HKV, D, P, ITEMSIZE = 32, 8, 128, 16, 2  # fp16
CELLS = ((1, 32768), (8, 32768), (32, 32768))
WINDOWS = (1024, 4096, 16384)
FI_VARIANTS = (("fi_cc", False), ("fi_tc", True))
MAX_COPIES = 16  # cache copies a cell rotates over (_common.cache_copies), at most
SLACK_US = 5.0  # target (a)
CSV_COLUMNS = ("batch", "ctx", "window", "copies", "plain_us", "v2_us", "v2_spread_pct", "expected_us",
               "v2_minus_expected_us", "fi_cc_us", "fi_tc_us", "fi_best_us", "fi_best_over_v2",
               "max_rel_err_vs_fi", "target_share", "target_fi", "note")


# ------------------------------------------------------- pure helpers (no GPU)
def window_kv_bytes(batch: int, ctx: int, window: int | None) -> int:
    """K and V bytes a call reads: each request's last W + 1 tokens (all
    ctx without a window), rounded out to whole pages at the window's start.

    >>> window_kv_bytes(1, 32768, None) == 32768 * 8 * 128 * 2 * 2
    True
    >>> window_kv_bytes(1, 32768, 1024) == 1040 * 8 * 128 * 2 * 2   # 1025 tokens from mid-page: 65 pages
    True
    """
    tokens = ctx if window is None or window + 1 >= ctx else min(ctx, -(-(window + 1) // P) * P)
    return batch * tokens * HKV * D * ITEMSIZE * 2


def copies_for(batch: int, ctx: int, windows, pool_bytes: int) -> int:
    """Cache copies a cell's graphs rotate over: enough that its smallest
    window cycles _common.ROTATE_BYTES, at most MAX_COPIES, and at most
    _common.MAX_COPY_BYTES of pools (``pool_bytes``: one copy's K and V pools).

    >>> copies_for(1, 32768, [1024, 4096], 2 * 268435456)   # a 4.3 MB window: the cap, 16 pools of 537 MB
    16
    >>> copies_for(8, 32768, [1024], 2 * 2147483648)         # 34 MB: 8 copies, but 24 GiB holds 6 pools
    6
    >>> copies_for(32, 32768, [4096], 2 * 8589934592)        # 537 MB per window: no rotation needed
    1
    """
    smallest = min(window_kv_bytes(batch, ctx, w) for w in windows) if windows else window_kv_bytes(batch, ctx, None)
    return _common.cache_copies(smallest, pool_bytes, MAX_COPIES)


def finish_row(row: dict) -> dict:
    """Adds the expected time, the FlashInfer ratio and both target marks."""
    plain, v2, w = row.get("plain_us"), row.get("v2_us"), row["window"]
    if plain is not None and v2 is not None:
        share = min(1.0, (w + P) / row["ctx"])
        row["expected_us"] = plain * share
        row["v2_minus_expected_us"] = v2 - row["expected_us"]
        row["target_share"] = "met" if abs(row["v2_minus_expected_us"]) <= SLACK_US else "missed"
    fi = [row[k] for k in ("fi_cc_us", "fi_tc_us") if row.get(k) is not None]
    if fi and v2:
        row["fi_best_us"] = min(fi)
        row["fi_best_over_v2"] = row["fi_best_us"] / v2
        row["target_fi"] = "met" if row["fi_best_over_v2"] >= 1.0 else "missed"
    return row


def markdown_report(rows, gpu: str, date: str, command: str, commit: str | None, peer: str) -> str:
    def f(x, digits=4):
        return "" if x is None else (f"{x:.{digits}g}" if isinstance(x, float) else str(x))

    share = [r.get("target_share") for r in rows if r.get("target_share")]
    fi = [r.get("target_fi") for r in rows if r.get("target_fi")]
    lines = [f"# Sliding windows against the full call and FlashInfer's window_left decode ({date[:10]})", "",
             f"- **Command**: `{command}`", f"- **GPU**: {gpu}; clocks as found",
             f"- **Date**: {date}; **commit**: `{commit or '?'}`; FlashInfer: {peer or 'not run'}",
             "- **Time**: GPU µs per call under CUDA-graph replay (cupaged.testing.GraphTimer), median of the "
             "interleaved rounds; the graph's calls rotate over `copies` copies of the K/V caches (cold L2). "
             "fp16, 32 q / 8 kv heads, head_dim 128, page 16, shuffled pages.", "",
             "| target | cells | met | missed |", "|---|---|---|---|",
             f"| (a) v2 within {SLACK_US:g} µs of plain × (W + page) / ctx | {len(share)} | {share.count('met')} | "
             f"{share.count('missed')} |",
             f"| (b) v2 ≥ FlashInfer-best with the same window | {len(fi)} | {fi.count('met')} | "
             f"{fi.count('missed')} |",
             "", "| batch | ctx | W | copies | plain µs | v2 µs | spread % | expected µs | v2 − expected | "
             "FI CC µs | FI TC µs | FI-best / v2 | max rel err | (a) | (b) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(f(r.get(c)) for c in (
            "batch", "ctx", "window", "copies", "plain_us", "v2_us", "v2_spread_pct", "expected_us",
            "v2_minus_expected_us", "fi_cc_us", "fi_tc_us", "fi_best_over_v2", "max_rel_err_vs_fi", "target_share",
            "target_fi", "note")) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------- GPU side
def measure(batch: int, ctx: int, windows, rounds: int, fi, seed: int):
    """Yield one finished row per window of one cell."""
    import cupy
    import numpy as np

    import cupaged
    from cupaged.testing import make_paged_batch

    b = make_paged_batch([ctx] * batch, HQ, HKV, D, "float16", page_size=P, seed=seed)
    table, q = b.table, b.q
    copies = copies_for(batch, ctx, windows, b.k_cache.nbytes + b.v_cache.nbytes)
    caches = [(b.k_cache, b.v_cache)] + [(b.k_cache.copy(), b.v_cache.copy()) for _ in range(copies - 1)]
    plain_plan = cupaged.plan_decode(table, HQ, HKV, D, np.float16)
    plain_out = _common.nan_like(q)
    plain = _common.rotating([lambda k=k, v=v: cupaged.decode(q, k, v, table, plain_plan, out=plain_out)
                              for k, v in caches])
    if fi is not None:
        flashinfer, torch, workspaces = fi
        dev = dict(dtype=torch.int32, device="cuda")
        table_t = [torch.tensor(np.asarray(a), **dev) for a in (table.indptr, table.indices, table.last_page_len)]
        kv_t = [(torch.from_dlpack(k), torch.from_dlpack(v)) for k, v in caches]
        q_t = torch.from_dlpack(q)
    for w in windows:
        notes, outs = [], {name: _common.nan_like(q) for name in ("v2", *dict(FI_VARIANTS))}
        plan = cupaged.plan_decode(table, HQ, HKV, D, np.float16, window_left=w)
        calls = {"plain": plain, "v2": _common.rotating([
            lambda k=k, v=v, o=outs["v2"]: cupaged.decode(q, k, v, table, plan, out=o, window_left=w)
            for k, v in caches])}
        if fi is not None:
            for name, tensor_cores in FI_VARIANTS:
                try:
                    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspaces[name], "NHD",
                                                                           use_tensor_cores=tensor_cores)
                    wrapper.plan(*table_t, HQ, HKV, D, P, window_left=w, q_data_type=torch.float16,
                                 kv_data_type=torch.float16)
                    torch.cuda.synchronize()
                    o_t = torch.from_dlpack(outs[name])
                    calls[name] = _common.rotating([on_cupy_stream(torch, lambda kv=kv, wr=wrapper, o_t=o_t: wr.run(
                        q_t, kv, out=o_t)) for kv in kv_t])
                except Exception as e:
                    notes.append(f"{name}: {type(e).__name__}: {e}"[:160])
        cupy.cuda.Device().synchronize()
        errs = {}
        for name in list(calls):  # one call each outside a graph; then every output against v2's
            try:
                calls[name]()
                cupy.cuda.Device().synchronize()
            except Exception as e:
                notes.append(f"{name} error: {type(e).__name__}: {e}"[:160])
                del calls[name]
        for name, _ in FI_VARIANTS:
            if name in calls:
                errs[name] = max_rel_err(outs[name], outs["v2"])
                if not errs[name] <= TOL:
                    notes.append(f"{name} differs from v2: max rel err {errs[name]:.3g} > {TOL}")
        times = time_calls(calls, rounds, notes)  # graph replay (CUDA events where capture fails)
        spreads = {name: spread_pct(t) for name, t in times.items()}
        notes += [f"{n} noisy: spread {s:.0f}%" for n, s in spreads.items() if s > NOISY_PCT]
        row = {"batch": batch, "ctx": ctx, "window": w, "copies": copies, "v2_spread_pct": spreads.get("v2"),
               "max_rel_err_vs_fi": max(errs.values(), default=None), "note": "; ".join(notes)}
        row.update({("plain_us" if n == "plain" else f"{n}_us"): statistics.median(t) for n, t in times.items()})
        yield finish_row(row)
    del caches, b
    _common.free_gpu_memory()  # (returns the pools, then waits out the driver's work on them)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG)
    p.add_argument("--batch", type=int, nargs="+", help="requests per cell (default 1 8 32; ctx 32768 each)")
    p.add_argument("--ctx", type=int, default=32768, help="tokens per request (default 32768)")
    p.add_argument("--window", type=int, nargs="+", default=list(WINDOWS),
                   help="window_left values (default 1024 4096 16384)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    p.add_argument("--no-flashinfer", action="store_true", help="time cupaged only")
    p.add_argument("--seed", type=int, default=0, help="seed of the pages, caches and queries (default 0)")
    p.add_argument("--commit", help="the commit to name in the report (default: git)")
    p.add_argument("--csv", help="write one row per (cell, window) to this CSV file")
    p.add_argument("--md", help="write a markdown report to this file")
    args = p.parse_args(argv)
    if any(w < 0 for w in args.window) or args.ctx < 1 or args.rounds < 1:
        p.error("--window must be >= 0, --ctx and --rounds >= 1")
    _common.require_gpu()
    fi, peer = None, ""
    if not args.no_flashinfer:
        try:
            import flashinfer
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            fi = (flashinfer, torch, {name: torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
                                      for name, _ in FI_VARIANTS})
            peer = f"FlashInfer {getattr(flashinfer, '__version__', '?')}"
        except Exception as e:
            print(f"FlashInfer not timed: {type(e).__name__}: {e}"[:200], file=sys.stderr)
    batches = args.batch or [b for b, _ in CELLS]
    rows = []
    print("batch   ctx      W copies  plain_us     v2_us  expected   v2-exp     fi_us  fi/v2  (a)     (b)")
    for batch in batches:
        for row in measure(batch, args.ctx, args.window, args.rounds, fi, args.seed + batch):
            rows.append(row)
            g = {k: (v if v is not None else math.nan) for k, v in row.items()}
            print(f"{batch:5d} {args.ctx:5d} {row['window']:6d} {row['copies']:6d} {g.get('plain_us', math.nan):9.2f} "
                  f"{g.get('v2_us', math.nan):9.2f} {g.get('expected_us', math.nan):9.2f} "
                  f"{g.get('v2_minus_expected_us', math.nan):8.2f} {g.get('fi_best_us', math.nan):9.2f} "
                  f"{g.get('fi_best_over_v2', math.nan):6.3f}  {row.get('target_share', '-'):7} "
                  f"{row.get('target_fi', '-')}  {row['note']}")
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as fcsv:
            wr = csv.DictWriter(fcsv, fieldnames=CSV_COLUMNS, extrasaction="ignore")
            wr.writeheader()
            wr.writerows(rows)
    if args.md:
        import bench_report

        import cupy

        gpu = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        Path(args.md).write_text(markdown_report(
            rows, gpu.decode() if isinstance(gpu, bytes) else gpu,
            datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python3 scripts/window_bench.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
            args.commit or bench_report.git_commit(), peer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
