#!/usr/bin/env python3
"""Times v2 at the chunk sizes that give a ladder of CTA counts (64 to 792 on
132 SMs), per cell, to calibrate ``plan.default_pages_per_chunk``.

    python3 scripts/chunk_sweep.py --csv OUT/chunks.csv
    python3 scripts/chunk_sweep.py --cells 1x131072 4x32768x16x32x8x128

A cell is ``BATCHxCTX[xPAGExHQxHKVxD]`` (default page 16, 32 q / 8 kv heads,
head_dim 128); float16, pages in random order, two cache copies used in turn
(so cells of a few MB do not run from L2). Each chunk size is timed in two
interleaved rounds (µs per call under CUDA-graph replay, median of 5 replays of
20 calls); ``default`` marks the plan's own choice.

Exit status: 0 ran, 2 bad arguments, 3 no CUDA GPU (message on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402

CELLS = ("1x4096", "1x16384", "1x32768", "1x131072", "4x16384", "4x32768", "4x131072", "1x32768x32",
         "1x4096x16x64x8x128", "1x16384x16x64x8x128", "1x4096x16x32x8x64", "1x16384x16x32x32x128")
#: CTA counts to aim at: under, at and over one and two CTAs per SM on 132 SMs.
TARGETS = (64, 100, 128, 132, 160, 200, 232, 256, 264, 330, 396, 528, 792)
COLUMNS = ("batch", "ctx", "page_size", "num_qo_heads", "num_kv_heads", "head_dim", "pages_per_chunk",
           "num_ctas", "us_round1", "us_round2", "default")
DEFAULT_SHAPE = (16, 32, 8, 128)  # page, hq, hkv, d


def parse_cell(text: str) -> tuple[int, ...]:
    """``"4x32768"`` -> (4, 32768, 16, 32, 8, 128); all six may be given."""
    parts = [int(v) for v in text.lower().split("x")]
    if len(parts) < 2 or len(parts) > 6 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"cell {text!r}: BATCHxCTX[xPAGExHQxHKVxD], positive integers")
    return tuple(parts + list(DEFAULT_SHAPE[len(parts) - 2:]))


def candidates(longest_pages: int, batch: int, ctas_per_chunk: int, default: int) -> list[int]:
    """Chunk sizes (pages) reaching each of TARGETS CTAs for ``batch`` equal
    requests of ``longest_pages`` pages, plus the default.

    >>> candidates(256, 1, 8, 16)[:4]
    [3, 4, 6, 7]
    """
    cs = {default}
    for target in TARGETS:
        chunks = max(1, -(-target // (ctas_per_chunk * batch)))
        cs.add(max(1, -(-longest_pages // chunks)))
    return sorted(cs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG)
    p.add_argument("--cells", nargs="+", type=parse_cell, default=[parse_cell(c) for c in CELLS],
                   help="cells as BATCHxCTX[xPAGExHQxHKVxD] (default page 16, 32 q / 8 kv heads, head_dim 128); "
                   "default: a dozen cells from 1x4096 to 4x131072")
    p.add_argument("--csv", default=None, help="also write one row per (cell, chunk size) to this CSV file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    _common.require_gpu()
    import cupy
    import numpy as np

    import cupaged
    from cupaged import autotune
    from cupaged.plan import plan_decode

    rows = []
    print(",".join(COLUMNS), flush=True)
    for batch, ctx, page, hq, hkv, d in args.cells:
        layout = _common.plan_layout(batch, ctx, page, seed=batch * 7 + ctx, mid_page=False, page_order="random")
        dev = _common.make_device_batch(layout, hq, hkv, d, np.float16, seed=1, replicas=2)
        table = dev.table
        default = plan_decode(table, hq, hkv, d, "float16")
        plans = {c: plan_decode(table, hq, hkv, d, "float16", pages_per_chunk=c)
                 for c in candidates(int(layout.request_pages.max()), batch, default.grid[1],
                                     default.pages_per_chunk)}
        out = cupy.empty_like(dev.q)
        times: dict[int, list[float]] = {c: [] for c in plans}
        for _ in range(2):
            for c, plan in plans.items():
                turn = [0]

                def call(plan=plan, turn=turn):
                    k, v = dev.caches[turn[0] % 2]
                    turn[0] += 1
                    cupaged.decode(dev.q, k, v, table, plan, method="v2", out=out)

                times[c].append(autotune.graph_time_us(call, launches=20, reps=5))
        for c, plan in plans.items():
            row = dict(batch=batch, ctx=ctx, page_size=page, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                       pages_per_chunk=c, num_ctas=plan.num_ctas, us_round1=round(times[c][0], 2),
                       us_round2=round(times[c][1], 2), default=int(c == default.pages_per_chunk))
            rows.append(row)
            print(",".join(str(row[k]) for k in COLUMNS), flush=True)
        del dev
        _common.free_gpu_memory()
    if args.csv:
        _common.write_csv(args.csv, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
