#!/usr/bin/env python3
"""GPU cost of attention sinks, sliding windows and several query tokens per
request (issue 18's targets: sinks no slower than without, within 2 %; a
window W on a long request costs about (W + page) / ctx of the full call;
q_len 4 at most 1.15x the q_len 1 time on cells moving >= 256 MB).

Per cell (batch x ctx; 32 q / 8 kv heads, head_dim 128, page 16, fp16,
shuffled pages, cupaged.testing.make_paged_batch) it times cupaged.decode with
a held default plan under CUDA-graph replay (cupaged.testing.GraphTimer, 20
calls a graph) for: no feature, ``sinks=`` (float32 [32]), and
``window_left=W`` for W = ctx/8 and ctx/2 (each with its own
``plan_decode(window_left=W)`` plan) and ``qo_indptr`` with each ``--qlen``
tokens per request (a q of batch x q_len rows, its own plan), planned with
row groups ("q_len N": a request's tokens share each K/V read) and one row
per token ("q_len N rows", ``group_tokens=False``). The variants
take turns over
``--rounds`` rounds; the table gives each one's median µs, the spread of
its rounds ((max - min) / median), its ratio to the plain call and, for windows, the ratio (W + page) / ctx it should approach.
Exit status: 0 ran, 3 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402

CELLS = ((1, 32768), (8, 32768), (32, 16384), (128, 4096))
HQ, HKV, D, P = 32, 8, 128, 16


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    p.add_argument("--qlen", type=int, nargs="*", default=[2, 4, 8],
                   help="query tokens per request to time with qo_indptr (default 2 4 8; none: skip)")
    args = p.parse_args(argv)
    _common.require_gpu()
    import cupy
    import numpy as np

    import cupaged
    from cupaged.testing import GraphTimer, make_paged_batch

    rows = []
    print(f"{'cell':>10} {'variant':>16} {'us':>9} {'spread%':>8} {'/plain':>7} {'(W+P)/ctx':>9}")
    for batch, ctx in CELLS:
        b = make_paged_batch([ctx] * batch, HQ, HKV, D, "float16", page_size=P, seed=batch)
        out = cupy.empty_like(b.q)
        sinks = cupy.full(HQ, 3.0, dtype=cupy.float32)
        variants = {"plain": ({}, None), "sinks": ({"sinks": sinks}, None)}
        for w in (ctx // 8, ctx // 2):
            variants[f"window {w}"] = ({"window_left": w}, w)
        for q_len in args.qlen:
            ptr = np.arange(batch + 1, dtype=np.int32) * q_len
            variants[f"q_len {q_len}"] = ({"qo_indptr": ptr}, None)
            variants[f"q_len {q_len} rows"] = ({"qo_indptr": ptr}, None)  # group_tokens=False
        timers = {}
        for name, (kw, w) in variants.items():
            ptr = kw.get("qo_indptr")
            plan = cupaged.plan_decode(b.table, HQ, HKV, D, np.float16, window_left=w, qo_indptr=ptr,
                                       group_tokens=not name.endswith(" rows"))
            q = b.q if ptr is None else cupy.repeat(b.q, int(ptr[1]), axis=0)
            o = out if ptr is None else cupy.empty_like(q)
            timers[name] = GraphTimer(lambda plan=plan, kw=kw, b=b, q=q, o=o: cupaged.decode(
                q, b.k_cache, b.v_cache, b.table, plan, out=o, **kw))
        times = {name: [] for name in timers}
        for _ in range(args.rounds):
            for name, timer in timers.items():
                times[name].append(timer.time_us(3))
        plain = statistics.median(times["plain"])
        for name, (kw, w) in variants.items():
            us = statistics.median(times[name])
            spread = 100 * (max(times[name]) - min(times[name])) / us  # over the rounds
            expect = "" if w is None else f"{(w + P) / ctx:.3f}"
            print(f"{batch:>4}x{ctx:<5} {name:>16} {us:9.2f} {spread:8.2f} {us / plain:7.3f} {expect:>9}")
            rows.append((batch, ctx, name, round(us, 3), round(spread, 2), round(us / plain, 4), expect))
        del timers, b
        cupy.get_default_memory_pool().free_all_blocks()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("batch,ctx,variant,us,spread_pct,ratio_to_plain,window_fraction\n")
            f.writelines(",".join(map(str, r)) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
