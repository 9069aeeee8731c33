#!/usr/bin/env python3
"""Where the host time of one ``cupaged.decode`` call goes (held plan, ``out``
given, no graph): the median of N calls with the same arrays, of N calls
rotating through several layers' caches with a new q and out each (a serving
step), and of the bare driver launch; then a cProfile of the first kind of
call sorted by own time. First, without a GPU too, the host cost of
``plan_decode`` on ragged batches of 128 and 256 requests (``--plan-only``
stops there). Exit status: 0 ran, 3 no CUDA GPU (after the plan timings).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402


#: Ragged batches whose plan_decode host cost is timed (batch, lengths, seed).
PLAN_BATCHES = ((128, "lognormal:1024:1.2", 1), (256, "lognormal:512:1.0", 3), (256, "zipf:1.5:256:32768", 8),
                (256, "uniform:1:32768", 4))


def plan_costs(calls: int = 300) -> None:
    """Median host µs of ``plan_decode`` (the default plan: the step model
    picks the split) on ragged batches, fp16, 32 q / 8 kv heads, D 128,
    page 16, 132 SMs, and of the step model alone
    (``schedule.choose_max_pages_per_chunk`` with the plan's arguments)."""
    import numpy as np

    import cupaged
    from cupaged import plan as plan_mod
    from cupaged import schedule

    def median_us(fn):
        for _ in range(20):
            fn()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times), np.percentile(times, 10), np.percentile(times, 90)

    for batch, spec, seed in PLAN_BATCHES:
        layout = _common.lengths_layout(_common.ragged_lengths(spec, batch, seed), 16, seed=seed)
        table = _common.layout_table(layout)
        med, p10, p90 = median_us(lambda: cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=132))
        plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=132)
        slots = plan_mod.ctas_per_sm(plan.dtype, plan.kv_dtype, 128, plan.heads_per_cta) * 132
        model = (table.request_pages, plan.heads_groups, slots, 16 * 2 * 128 * 2, -(-plan_mod.MIN_CHUNK_TOKENS // 16))
        model_us = median_us(lambda: schedule.choose_max_pages_per_chunk(*model))[0]
        print(f"host us per plan_decode, batch {batch} {spec}: median {med:.1f}, "
              f"p10 {p10:.1f}, p90 {p90:.1f} ({calls} calls); the step model alone {model_us:.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG)
    p.add_argument("--batch", type=int, default=8, help="requests in the batch (default 8)")
    p.add_argument("--ctx", type=int, default=4096, help="tokens per request (default 4096)")
    p.add_argument("--calls", type=int, default=2000, help="calls per timing and in the profile (default 2000)")
    p.add_argument("--layers", type=int, default=4, help="caches rotated through in the serving-step timing")
    p.add_argument("--plan-only", action="store_true", help="time plan_decode on ragged batches only (no GPU)")
    args = p.parse_args(argv)
    plan_costs()
    if args.plan_only:
        return 0
    _common.require_gpu()
    import cupy
    import numpy as np

    import cupaged

    layout = _common.plan_layout(args.batch, args.ctx, 16, seed=1, mid_page=False, page_order="random")
    dev = _common.make_device_batch(layout, 32, 8, 128, np.float16, seed=1)
    plan = cupaged.plan_decode(dev.table, 32, 8, 128, np.float16)
    out = cupy.empty_like(dev.q)

    def call():
        cupaged.decode(dev.q, dev.k_cache, dev.v_cache, dev.table, plan, out=out)

    def timed(fn, label):
        for _ in range(50):
            fn()
        cupy.cuda.Device().synchronize()
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            if len(times) % 100 == 0:  # keep the launch queue short
                cupy.cuda.Device().synchronize()
        cupy.cuda.Device().synchronize()
        print(f"host us per {label}: median {statistics.median(times):.2f}, "
              f"p10 {np.percentile(times, 10):.2f}, p90 {np.percentile(times, 90):.2f} ({args.calls} calls)")

    timed(call, "decode call")
    # A serving step: per layer its own caches and a new q and out (same shapes).
    layers = [(cupy.empty_like(dev.q), cupy.empty_like(dev.k_cache), cupy.empty_like(dev.v_cache),
               cupy.empty_like(dev.q)) for _ in range(args.layers)]
    turn = iter(range(1 << 62))

    def layer_call():
        q, k, v, o = layers[next(turn) % args.layers]
        cupaged.decode(q, k, v, dev.table, plan, out=o)

    timed(layer_call, f"decode call rotating {args.layers} layers")
    # The floor: the driver launch alone (cuLaunchKernel with packed arguments).
    from cupaged.decode import plan_buffers

    buf = plan_buffers(plan)
    ptrs = (dev.q.data.ptr, dev.k_cache.data.ptr, dev.v_cache.data.ptr, out.data.ptr, 0)
    timed(lambda: buf.launch_pointers(*ptrs), "bare launch (launch_pointers)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
