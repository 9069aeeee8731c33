#!/usr/bin/env python3
"""Tunes ``pages_per_chunk`` over a sweep of cells and reports, per cell, the
winner, the heuristic's choice and the time each candidate took (CUDA-graph
replay), so the default heuristic can be calibrated from measurements.

Exit status: 0 ran, 3 no CUDA GPU (message on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402

COLUMNS = ("batch", "ctx", "page_size", "num_qo_heads", "num_kv_heads", "head_dim", "dtype",
           "heuristic", "heuristic_us", "best", "best_us", "gain", "timings")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="autotune.py",
        description="Time every candidate chunk size (pages_per_chunk) of cupaged's split-KV decode on a "
        "sweep of cells under CUDA-graph replay, and print per cell the winner, the default heuristic's "
        "choice and each candidate's time. Winners go to cupaged's autotune cache unless --no-store. "
        "Lists accept spaces or commas.",
        epilog=_common.EXIT_CODES_EPILOG,
    )
    p.add_argument("--batch", nargs="+", default=["1", "4", "8", "32", "128"],
                   help="batch sizes (default 1 4 8 32 128; a cell of more than 4M tokens in all is skipped)")
    p.add_argument("--ctx", nargs="+", default=["1024", "4096", "16384", "32768"],
                   help="context lengths in tokens (default 1024 4096 16384 32768)")
    p.add_argument("--page-size", nargs="+", default=["16"], help="page sizes in tokens (default 16)")
    p.add_argument("--num-qo-heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--dtype", default="float16", choices=_common.DTYPE_NAMES,
                   help="q and KV dtype (default float16)")
    p.add_argument("--csv", default=None, help="also write one row per cell to this CSV file")
    p.add_argument("--no-store", action="store_true", help="do not write the on-disk cache")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    _common.require_gpu()
    from cupaged import autotune

    dtype = _common.resolve_dtype(args.dtype)
    rows = []
    for batch in _common.parse_list(args.batch, int):
        for ctx in _common.parse_list(args.ctx, int):
            for page_size in _common.parse_list(args.page_size, int):
                if batch * ctx > 4 * 2**20:  # keep the pool within a few GiB
                    continue
                layout = _common.plan_layout(batch, ctx, page_size, seed=batch * 7 + ctx, mid_page=False,
                                             page_order="random")
                dev = _common.make_device_batch(layout, args.num_qo_heads, args.num_kv_heads, args.head_dim,
                                                dtype, seed=1)
                res = autotune.tune(dev.q, dev.k_cache, dev.v_cache, dev.table, store=not args.no_store)
                row = dict(batch=batch, ctx=ctx, page_size=page_size, num_qo_heads=args.num_qo_heads,
                           num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                           heuristic=res.heuristic, heuristic_us=round(res.timings_us[res.heuristic], 2),
                           best=res.best, best_us=round(res.timings_us[res.best], 2),
                           gain=round(res.timings_us[res.heuristic] / res.timings_us[res.best], 3),
                           timings=" ".join(f"{c}:{t:.1f}" for c, t in sorted(res.timings_us.items())))
                rows.append(row)
                print(" ".join(f"{k}={row[k]}" for k in COLUMNS), flush=True)
                del dev
                _common.free_gpu_memory()
    if args.csv:
        _common.write_csv(args.csv, COLUMNS, rows)
    print(_common.text_table(COLUMNS[:-1], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
