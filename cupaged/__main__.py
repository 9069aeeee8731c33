"""``python -m cupaged demo``: one checked decode of a small random paged batch.

With a GPU it runs ``cupaged.decode`` (every method) and compares each against
the float64 reference; without one it says so and runs the reference and its
split-then-merge emulation instead. Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from . import reference
from ._device import has_gpu
from .plan import plan_decode
from .pool import BlockPool


def _random_batch(rng, batch: int, page_size: int, num_pages: int):
    """A pool-built batch: ragged lengths, one forked prefix, one sliding window."""
    pool = BlockPool(num_pages, page_size)
    seqs = []
    for _ in range(batch):
        s = pool.add_sequence()
        pool.append(s, int(rng.integers(1, 40 * page_size)))
        seqs.append(s)
    child, _copies = pool.fork(seqs[0])  # shares seqs[0]'s full pages
    pool.append(child, 3)
    pool.apply_window(seqs[-1], max(1, pool.sequence(seqs[-1]).length // 2))
    table, rope_offsets = pool.page_table([*seqs, child])
    return pool, table, rope_offsets


def demo(args) -> int:
    rng = np.random.default_rng(args.seed)
    num_qo_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16
    pool, table, rope_offsets = _random_batch(rng, args.batch, page_size, num_pages=4096)
    # Shared pages hold copied data in a real cache; here fork's partial-page
    # copy is irrelevant because the caches are random anyway.
    print(f"batch of {table.batch_size} requests, seq_lens {table.seq_lens.tolist()}")
    print(f"rope offsets (written lengths) {rope_offsets.tolist()}")
    plan = plan_decode(table, num_qo_heads, num_kv_heads, head_dim, np.float16, num_sms=None)
    print(f"plan: pages_per_chunk={plan.pages_per_chunk} chunks={plan.num_chunks} "
          f"ctas={plan.num_ctas} merge={plan.needs_merge}")
    shape = (pool.num_pages, page_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    v = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    q = rng.standard_normal((table.batch_size, num_qo_heads, head_dim), dtype=np.float32).astype(np.float16)
    ref_out, ref_lse = reference.decode(q, k, v, table)

    if not has_gpu():
        print("no CUDA GPU found: running the NumPy float64 reference only")
        out, lse = reference.decode_split(q, k, v, table, plan)[:2]
        err = np.abs(out - ref_out).max() / np.abs(ref_out).max()
        print(f"reference split/merge vs unsplit: max_rel={err:.2e}")
        return 0 if err < 1e-10 else 1

    import cupy

    from .decode import decode

    dq, dk, dv = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)
    ok = True
    for method in ("v2", "v1", "gather"):
        out = decode(dq, dk, dv, table, plan if method == "v2" else None, method=method).get().astype(np.float64)
        err = np.abs(out - ref_out).max() / np.abs(ref_out).max()
        good = bool(np.isfinite(out).all()) and err < 2e-2
        ok &= good
        print(f"{method:>6}: max_rel={err:.2e} {'ok' if good else 'FAILED'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupaged", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="decode a small random paged batch and check it")
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
