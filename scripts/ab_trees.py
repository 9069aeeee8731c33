#!/usr/bin/env python3
"""Times the default plan of ``decode`` (method v2) on uniform cells, using
only the public API, so that the same script can time two versions of
cupaged side by side: run it once per tree with that tree first on
PYTHONPATH, alternating, and compare the CSVs.

    git archive c000a05 cupaged cuda_src scripts | tar -x -C .ab/old
    cp scripts/ab_trees.py .ab/old/scripts/   # the old tree's own scripts/_common.py
    for r in 1 2; do
      PYTHONPATH=.ab/old python3 .ab/old/scripts/ab_trees.py --label old --csv OUT/old$r.csv
      PYTHONPATH=$PWD    python3 scripts/ab_trees.py --label new --csv OUT/new$r.csv
    done
    python3 scripts/ab_trees.py --compare OUT/old1.csv OUT/old2.csv -- OUT/new1.csv OUT/new2.csv

A cell is ``BATCHxCTX[xPAGExHQxHKVxD[xDTYPE]]`` (default page 16, 32 q / 8 kv
heads, head_dim 128, float16); pages in random order; caches under 1 GB
rotate between two copies (cold L2). µs per call under CUDA-graph replay,
median of 5 replays of 20 calls.

Exit status: 0 ran, 2 bad arguments, 3 no CUDA GPU (message on stderr).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # after PYTHONPATH: the tree under test wins

import _common  # noqa: E402

#: Uniform cells of the earlier performance sweep: batch x ctx, MHA, a
#: 64-head group and head_dim 64.
CELLS = tuple(f"{b}x{c}" for b in (1, 4, 8, 32, 128) for c in (1024, 4096, 16384, 32768)) + (
    "1x131072", "4x131072", "4x4096x16x32x32x128", "8x8192x16x64x8x128", "8x8192x16x32x8x64",
    "8x4096x16x32x8x128xbfloat16", "32x16384x32x32x8x128xbfloat16")


def parse_cell(text: str) -> tuple:
    parts = text.lower().split("x")
    dtype = "float16"
    if parts and parts[-1] in ("float16", "bfloat16", "float32"):
        dtype = parts.pop()
    try:
        nums = [int(v) for v in parts]
    except ValueError:
        nums = []
    if len(nums) not in (2, 6) or min(nums) < 1:
        raise argparse.ArgumentTypeError(f"cell {text!r}: BATCHxCTX[xPAGExHQxHKVxD[xDTYPE]]")
    return tuple(nums + [16, 32, 8, 128][len(nums) - 2:]) + (dtype,)


def compare(paths_a: list[str], paths_b: list[str]) -> int:
    def load(paths):
        times: dict[str, list[float]] = {}
        for p in paths:
            for row in csv.DictReader(open(p)):
                times.setdefault(row["cell"], []).append(float(row["us"]))
        return {k: min(v) for k, v in times.items()}

    a, b = load(paths_a), load(paths_b)
    worst = 0.0
    print(f"{'cell':32s} {'A us':>9s} {'B us':>9s} {'B/A':>7s}")
    for cell in a:
        if cell in b:
            ratio = b[cell] / a[cell]
            worst = max(worst, ratio)
            print(f"{cell:32s} {a[cell]:9.2f} {b[cell]:9.2f} {ratio:7.3f}")
    print(f"SUMMARY worst B/A {worst:.3f} over {len(set(a) & set(b))} cells (best of each side's rounds)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", type=parse_cell, default=None,
                   help="cells BATCHxCTX[xPAGExHQxHKVxD[xDTYPE]] (default: 27 cells of the uniform sweep)")
    p.add_argument("--label", default="", help="a name for this tree, printed with each row")
    p.add_argument("--csv", default=None, help="write the rows to this CSV file")
    p.add_argument("--compare", nargs="+", metavar="CSV",
                   help="compare CSVs instead of timing: A files, then --, then B files")
    if argv is None:
        argv = sys.argv[1:]
    if "--compare" in argv:  # A files -- B files
        i = argv.index("--compare")
        rest = argv[i + 1:]
        if "--" not in rest:
            p.error("--compare needs A files, then --, then B files")
        j = rest.index("--")
        return compare(rest[:j], rest[j + 1:])
    args = p.parse_args(argv)
    _common.require_gpu()
    import cupy
    import numpy as np

    import cupaged
    from cupaged import autotune

    cells = args.cells or [parse_cell(c) for c in CELLS]
    print(f"{args.label}: cupaged from {Path(cupaged.__file__).parent}", flush=True)
    rows = []
    for batch, ctx, page, hq, hkv, d, dtype in cells:
        name = f"{batch}x{ctx}x{page}x{hq}x{hkv}x{d}x{dtype}"
        layout = _common.plan_layout(batch, ctx, page, seed=batch * 7 + ctx, mid_page=False, page_order="random")
        kv = _common.kv_bytes(layout, hkv, d, 2)
        dev = _common.make_device_batch(layout, hq, hkv, d, _common.resolve_dtype(dtype), seed=1,
                                        replicas=2 if kv < 2**30 else 1)
        plan = cupaged.plan_decode(dev.table, hq, hkv, d, dtype)
        out = cupy.empty_like(dev.q)
        turn = [0]

        def call():
            k, v = dev.caches[turn[0] % len(dev.caches)]
            turn[0] += 1
            cupaged.decode(dev.q, k, v, dev.table, plan, method="v2", out=out)

        us = autotune.graph_time_us(call, launches=20, reps=5)
        rows.append(dict(cell=name, label=args.label, us=round(us, 2), num_ctas=plan.num_ctas,
                         tbs=round(kv / us / 1e6, 3)))
        print(f"{args.label} {name} {us:.2f} us {plan.num_ctas} CTAs {kv / us / 1e6:.2f} TB/s", flush=True)
        del dev
        _common.free_gpu_memory()
    if args.csv:
        _common.write_csv(args.csv, ("cell", "label", "us", "num_ctas", "tbs"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
