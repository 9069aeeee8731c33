#!/usr/bin/env python3
"""Times cupaged v2 on a few cells under CUDA-graph replay, for A/B runs of
two kernel source trees: run it once as is and once with env
CUPAGED_CUDA_SRC=<another cuda_src/> (same Python side), interleaved.

    python3 scripts/ab_sources.py fp16                        # this tree
    CUPAGED_CUDA_SRC=/tmp/base/cuda_src python3 scripts/ab_sources.py fp16
    AB_CELLS="128x32768 8x32768" python3 scripts/ab_sources.py fp8
    AB_CELLS="8x32768x8 64x8192x4" python3 scripts/ab_sources.py fp16   # q_len 8 and 4

Prints, per cell (batch x ctx, or batch x ctx x q_len query tokens per request
planned with qo_indptr, causal; 32 q / 8 kv heads, head_dim 128, page 16,
shuffled pages, fp16 q; KV fp16 or fp8 e4m3), the median µs per call of 15
replays of a 20-call graph, TB/s of KV bytes, the max-min spread and the plan's
pages_per_chunk. Exit status 3 without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cupaged  # noqa: E402

CELLS = ((1, 1024), (1, 16384), (1, 131072), (4, 4096), (8, 4096), (8, 32768), (32, 4096), (32, 16384),
         (128, 1024), (128, 4096), (128, 32768))
HQ, HKV, D, P = 32, 8, 128, 16


def cells() -> list[tuple[int, int, int]]:
    """``(batch, ctx, q_len)`` of env AB_CELLS (``BATCHxCTX[xQLEN]``), else CELLS at q_len 1."""
    env = os.environ.get("AB_CELLS")
    if not env:
        return [(b, c, 1) for b, c in CELLS]
    out = []
    for cell in env.split():
        parts = tuple(map(int, cell.split("x")))
        out.append(parts if len(parts) == 3 else (*parts, 1))
    return out


def time_cell(batch: int, ctx: int, kv: str, rng, q_len: int = 1) -> tuple[float, float, int]:
    """(median µs, spread, pages_per_chunk) of one cell (``q_len`` tokens per request)."""
    import cupy as cp

    pages = -(-ctx // P)
    npg = batch * pages
    table = cupaged.PageTable.from_seq_lens(np.full(batch, ctx, np.int32), P,
                                            page_ids=rng.permutation(npg).astype(np.int32))
    if kv == "fp8":  # random finite e4m3 bit patterns
        k = cp.random.randint(0, 0x70, (npg, P, HKV, D), dtype=cp.uint8)
        v = cp.random.randint(0, 0x70, (npg, P, HKV, D), dtype=cp.uint8)
    else:
        k = cp.random.standard_normal((npg, P, HKV, D), dtype=cp.float32).astype(cp.float16)
        v = cp.random.standard_normal((npg, P, HKV, D), dtype=cp.float32).astype(cp.float16)
    kw = {"qo_indptr": np.arange(batch + 1, dtype=np.int32) * q_len} if q_len > 1 else {}
    # (q_len > 1: always row groups, the rows kernel, whatever the default would pick for the cell)
    plan = cupaged.plan_decode(table, HQ, HKV, D, np.float16, kv_dtype=np.uint8 if kv == "fp8" else None, **kw,
                               **({"group_tokens": True} if kw else {}))
    q = cp.random.standard_normal((batch * q_len, HQ, D), dtype=cp.float32).astype(cp.float16)
    out = cp.empty_like(q)
    stream = cp.cuda.Stream(non_blocking=True)
    calls = 20
    with stream:
        for _ in range(3):
            cupaged.decode(q, k, v, table, plan, out=out, **kw)
        stream.synchronize()
        stream.begin_capture()
        for _ in range(calls):
            cupaged.decode(q, k, v, table, plan, out=out, **kw)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(15):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1000 / calls)
    med = float(np.median(times))
    return med, (max(times) - min(times)) / med, plan.pages_per_chunk


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ab_sources.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Time cupaged's v2 decode on a few cells under CUDA-graph replay, for A/B runs
of two kernel source trees: run it once as is and once with
env CUPAGED_CUDA_SRC=<another cuda_src/ folder>, interleaved. Prints per cell
(32 q / 8 kv heads, head_dim 128, page 16, shuffled pages, fp16 q) the median
microseconds per call, TB/s of KV bytes, the spread and the chunk size.""",
        epilog="""\
examples:
  python3 scripts/ab_sources.py fp16
  CUPAGED_CUDA_SRC=/tmp/base/cuda_src python3 scripts/ab_sources.py fp16
  AB_CELLS="128x32768 8x32768" python3 scripts/ab_sources.py fp8   # cells BATCHxCTX
  AB_CELLS="8x32768x8" python3 scripts/ab_sources.py fp16   # BATCHxCTXxQLEN: q_len query tokens per request

exit status: 0 ran, 2 bad arguments, 3 no CUDA GPU on this machine""",
    )
    p.add_argument("kv", nargs="?", default="fp16", choices=("fp16", "fp8"),
                   help="KV cache dtype: fp16, or fp8 (e4m3) under an fp16 q (default fp16)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    kv = parse_args(argv).kv
    if not cupaged.has_gpu():
        print("no CUDA GPU available: this script needs an NVIDIA GPU; exiting with status 3", file=sys.stderr)
        return 3
    import cupy as cp

    rng = np.random.default_rng(0)
    for batch, ctx, q_len in cells():
        med, spread, ppc = time_cell(batch, ctx, kv, rng, q_len)
        kv_bytes = 2 * batch * ctx * HKV * D * (1 if kv == "fp8" else 2)
        q = f" q{q_len}" if q_len > 1 else ""
        print(f"{kv} b{batch:<4} ctx{ctx:<7}{q} {med:9.2f} us  {kv_bytes / med / 1e6:5.2f} TB/s  "
              f"spread {spread * 100:.1f}%  ppc {ppc}", flush=True)
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
