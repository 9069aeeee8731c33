#!/usr/bin/env python3
"""Where one decode call's time goes, CTA by CTA (issue 20).

Needs the kernels of a ``cta_stamps`` tree, which record per-CTA
``%globaltimer`` stamps and SM ids in a ``__device__`` array::

    python3 scripts/make_variant.py cta_stamps .variants/cta_stamps
    CUPAGED_CUDA_SRC=$PWD/.variants/cta_stamps python3 scripts/cta_timeline.py 1x1024 8x32768

For each cell ``BATCHxCTX`` (fp16, 32 q / 8 kv heads, head_dim 128, page 16,
the default plan) a CUDA graph of ``--layers`` calls over cache copies that
share one table (enough copies that no call reads from the L2, as
``microbench.py`` rotates them) is timed, replayed once more, and the stamps
of its last call are read back. Times are µs from the moment
``griddepcontrol.wait`` first returned in that call, i.e. when the call
before it had finished:

* ``attention``: when CTAs finished their chunk (p10 / median / p90 / last);
* ``exit``: when the last CTA left (a split request's last CTA merges first:
  ``merge`` = exit - last attention);
* ``gap``: µs per call minus (exit - release), the time between calls;
* ``release spread``: when the last CTA passed the wait (a grid of more than
  one wave: when its last wave started);
* for grids with SMs holding fewer CTAs than others, the median attention
  end of CTAs alone on their SM and of those sharing one.

The stamps cost a few registers and stores; the timing is the probe tree's.
Exit status: 0 ran, 1 the kernels are not a cta_stamps tree, 2 bad
arguments, 3 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402

ROWS, MAX_CTAS = 5, 16384  # make_variant.py cta_stamps: cupaged_probe[5][16384]
ENTRY, ATTENDED, EXIT, SM, RELEASED = range(ROWS)


def parse_cell(text: str) -> tuple[int, int]:
    """``"8x32768"`` -> ``(8, 32768)``; ValueError when malformed.

    >>> parse_cell("8x32768")
    (8, 32768)
    """
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a cell is BATCHxCTX with positive integers, got {text!r}")
    return int(parts[0]), int(parts[1])


def summarize(stamps, num_ctas: int, us_per_call: float) -> dict[str, float]:
    """The timeline of one call from its stamps (``[ROWS, >= num_ctas]``
    int64 ns), as the module docstring describes.

    >>> import numpy as np
    >>> s = np.zeros((ROWS, 4), dtype=np.int64)
    >>> s[RELEASED] = [1000, 1000, 1100, 1100]; s[ATTENDED] = [3000, 3500, 4000, 5000]
    >>> s[EXIT] = [3000, 3500, 4000, 6000]; s[SM] = [0, 0, 1, 2]
    >>> r = summarize(s, 4, 6.0)
    >>> r["attention_last"], r["merge"], r["gap"], r["lone_median"], r["shared_median"]
    (4.0, 1.0, 1.0, 3.5, 2.25)
    """
    import numpy as np

    a = np.asarray(stamps)[:, :num_ctas].astype(np.int64)
    t0 = a[RELEASED].min()
    att, ext = (a[ATTENDED] - t0) / 1e3, (a[EXIT] - t0) / 1e3
    p10, p50, p90 = np.percentile(att, [10, 50, 90])
    out = {"release_spread": float((a[RELEASED].max() - t0) / 1e3), "attention_p10": float(p10),
           "attention_median": float(p50), "attention_p90": float(p90), "attention_last": float(att.max()),
           "exit": float(ext.max()), "merge": float(ext.max() - att.max()), "gap": us_per_call - float(ext.max()),
           "lone_median": float("nan"), "shared_median": float("nan")}
    per_sm = np.bincount(a[SM], minlength=int(a[SM].max()) + 1)[a[SM]]
    lone = per_sm < per_sm.max()
    if lone.any():
        out["lone_median"], out["shared_median"] = float(np.median(att[lone])), float(np.median(att[~lone]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG)
    p.add_argument("cells", nargs="+", help="BATCHxCTX cells (fp16, 32 q / 8 kv heads, head_dim 128, page 16)")
    p.add_argument("--layers", type=int, default=32, help="calls per graph (default 32)")
    p.add_argument("--max-copies", type=int, default=16, help="cache copies the calls rotate over, at most (default 16)")
    args = p.parse_args(argv)
    try:
        cells = [parse_cell(c) for c in args.cells]
    except ValueError as exc:
        p.error(str(exc))
    if args.layers < 1 or args.max_copies < 1:
        p.error("--layers and --max-copies must be >= 1")
    _common.require_gpu()
    import cupy
    import numpy as np

    import cupaged
    from cupaged import _loader
    from cupaged.testing import GraphTimer, make_paged_batch

    for batch, ctx in cells:
        b = make_paged_batch([ctx] * batch, 32, 8, 128, "float16", page_size=16, seed=1)
        copies = _common.cache_copies(b.kv_bytes, 2 * b.k_cache.nbytes, args.max_copies)
        caches = [(b.k_cache, b.v_cache)] + [(b.k_cache.copy(), b.v_cache.copy()) for _ in range(copies - 1)]
        outs = [cupy.empty_like(b.q) for _ in caches]
        plan = cupaged.plan_decode(b.table, 32, 8, 128, np.float16)
        if plan.num_ctas > MAX_CTAS:
            print(f"{batch}x{ctx}: {plan.num_ctas} CTAs, past the {MAX_CTAS} the stamps hold", file=sys.stderr)
            return 2
        calls = [lambda k=k, v=v, o=o: cupaged.decode(b.q, k, v, b.table, plan, out=o)
                 for (k, v), o in zip(caches, outs)]
        timer = GraphTimer(_common.rotating(calls), launches=args.layers)
        us = timer.time_us(7)
        try:
            ptr = _loader._module("partial", "float16", 128).get_global("cupaged_probe")
        except Exception:  # CuPy raises its driver error for a missing symbol
            print("the kernels have no cupaged_probe array: set CUPAGED_CUDA_SRC to a tree of "
                  "'scripts/make_variant.py cta_stamps DIR'", file=sys.stderr)
            return 1
        stamps = cupy.ndarray((ROWS, MAX_CTAS), cupy.uint64, ptr)
        stamps[:] = 0
        timer.replay()
        r = summarize(cupy.asnumpy(stamps), plan.num_ctas, us)
        lone = (f"; attention median alone on an SM {r['lone_median']:.2f}, sharing {r['shared_median']:.2f}"
                if r["lone_median"] == r["lone_median"] else "")
        print(f"{batch}x{ctx}: {plan.num_ctas} CTAs, {copies} copies, {us:.2f} us per call | from the release "
              f"(spread {r['release_spread']:.2f}): attention p10/50/90/last {r['attention_p10']:.2f}/"
              f"{r['attention_median']:.2f}/{r['attention_p90']:.2f}/{r['attention_last']:.2f}, exit "
              f"{r['exit']:.2f} (merge {r['merge']:.2f}), gap {r['gap']:.2f}{lone}", flush=True)
        del b, caches, outs, timer, calls
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
