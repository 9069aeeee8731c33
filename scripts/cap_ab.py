#!/usr/bin/env python3
"""Times given chunk caps (``plan_decode(max_pages_per_chunk=...)``) per
ragged cell, interleaved, to A/B two planner settings on the same pools.

    python3 scripts/cap_ab.py --kv-dtype fp8 --cell 64:onelong:131072:512:0=328,316,256 ...

Each ``--cell`` is ``BATCH:DISTRIBUTION:SEED=CAP[,CAP...]`` (the ragged
syntax of chunk_sweep.py, then the caps). 32 q / 8 kv heads, head_dim 128,
page 16, float16 q; µs per call under CUDA-graph replay (median of 5 replays
of 20 calls), two interleaved rounds; caches under 1 GB rotate between two
copies. Exit status: 0 ran, 2 bad arguments, 3 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402
import chunk_sweep  # noqa: E402


def parse_cell(text: str):
    cell, _, caps = text.rpartition("=")
    try:
        values = [int(c) for c in caps.split(",")]
    except ValueError:
        values = []
    if not cell or not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--cell {text!r}: BATCH:DISTRIBUTION:SEED=CAP[,CAP...]")
    return chunk_sweep.parse_ragged(cell), values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell", action="append", type=parse_cell, required=True,
                   help="a ragged cell and the caps to time: BATCH:DISTRIBUTION:SEED=CAP[,CAP...]")
    p.add_argument("--kv-dtype", choices=("fp16", "fp8"), default="fp16", help="KV cache dtype")
    args = p.parse_args(argv)
    _common.require_gpu()
    import cupy
    import numpy as np

    import cupaged
    from cupaged import autotune

    fp8 = args.kv_dtype == "fp8"
    for (batch, spec, seed), caps in args.cell:
        layout = _common.lengths_layout(_common.ragged_lengths(spec, batch, seed), 16, seed=seed)
        kv = _common.kv_bytes(layout, 8, 128, 1 if fp8 else 2)
        dev = _common.make_device_batch(layout, 32, 8, 128, np.float16, seed=1, replicas=2 if kv < 2**30 else 1)
        caches = [tuple(cupaged.fp8.to_e4m3(x) for x in pair) for pair in dev.caches] if fp8 else dev.caches
        out = cupy.empty_like(dev.q)
        plans = {c: cupaged.plan_decode(dev.table, 32, 8, 128, "float16", kv_dtype=np.uint8 if fp8 else None,
                                        max_pages_per_chunk=c) for c in caps}
        times = {c: [] for c in caps}
        for _ in range(2):
            for c, plan in plans.items():
                turn = [0]

                def call(plan=plan, turn=turn):
                    k, v = caches[turn[0] % len(caches)]
                    turn[0] += 1
                    cupaged.decode(dev.q, k, v, dev.table, plan, method="v2", out=out)

                times[c].append(autotune.graph_time_us(call, launches=20, reps=5))
        line = "  ".join(f"cap {c}: {min(t):.2f} us ({plans[c].num_ctas} CTAs)" for c, t in times.items())
        print(f"AB {args.kv_dtype} {batch}:{spec}:{seed}  {line}", flush=True)
        del dev, caches, plans
        _common.free_gpu_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
