#!/usr/bin/env python3
"""Hash every field of plan_decode's plans over a fixed set of random tables, to show that a change to the planner leaves its plans unchanged.

Plans (host NumPy, no GPU needed) of seeded random tables: uniform, lognormal
and one-long-among-short lengths, page sizes 1, 16 and 32, five q/KV dtype
pairs (fp8 spelled as its dtype and as uint8) and four head shapes, every
fifth table with an explicit pages_per_chunk; 132 SMs. Prints the plan count
and one SHA-256 over every field of every plan. Two trees that print the same
hash plan identically, so a planner refactor that keeps it moves no GPU timing.
With --against, runs the same in another checkout and compares.

    python3 scripts/plan_hash.py                        # "6000 plans <hash>"
    python3 scripts/plan_hash.py --against /tmp/old     # exit 1 if the plans differ
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PAIRS = (("float16", None), ("bfloat16", None), ("float32", None), ("float16", "float8_e4m3fn"),
         ("bfloat16", "uint8"))
SHAPES = ((32, 8, 128), (8, 8, 64), (64, 8, 96), (28, 4, 128))  # (num_qo_heads, num_kv_heads, head_dim)


def plans_hash(tables: int = 300, seed: int = 123) -> tuple[int, str]:
    """``(plan count, sha256 prefix)`` of this process's cupaged."""
    import numpy as np

    import cupaged

    h = hashlib.sha256()
    count = 0
    rng = np.random.default_rng(seed)
    for t in range(tables):
        batch, page_size = int(rng.integers(1, 300)), int(rng.choice([1, 16, 32]))
        if t % 3 == 0:
            lens = rng.integers(0, 40000, batch)
        elif t % 3 == 1:
            lens = np.minimum(rng.lognormal(7, 1.2, batch).astype(int), 200000)
        else:
            lens = np.concatenate([[int(rng.integers(50000, 140000))], rng.integers(1, 600, batch - 1)])[:batch]
        table = cupaged.PageTable.from_seq_lens(lens.tolist(), page_size)
        for dtype, kv in PAIRS:
            for hq, hkv, d in SHAPES:
                kw = {} if kv is None else {"kv_dtype": kv}
                if t % 5 == 0:
                    kw["pages_per_chunk"] = int(rng.integers(1, 64))
                plan = cupaged.plan_decode(table, hq, hkv, d, dtype, num_sms=132, **kw)
                for key, value in sorted(plan.__dict__.items()):
                    h.update(key.encode())
                    h.update(repr(value.tolist() if hasattr(value, "tolist") else value).encode())
                count += 1
    return count, h.hexdigest()[:16]


def _hash_in(tree: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import cupaged, plan_hash; "
            "assert cupaged.__file__.startswith(sys.argv[2]), cupaged.__file__; print(*plan_hash.plans_hash())")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts"), str(tree)],
                         cwd=tree, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"planning in {tree} failed:\n{res.stderr[-2000:]}")
    return res.stdout.strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="exit status: 0 printed (or the same plans), 1 the plans differ, "
                                       "2 bad arguments")
    p.add_argument("--against", type=Path, help="another checkout (its cupaged/) to compare with")
    args = p.parse_args(argv)
    if args.against is not None and not (args.against / "cupaged").is_dir():
        p.error(f"{args.against} has no cupaged/ package")
    mine = _hash_in(ROOT)
    if args.against is None:
        print(f"{mine.split()[0]} plans {mine.split()[1]}")
        return 0
    theirs = _hash_in(args.against.resolve())
    print(f"this tree: {mine}\n{args.against}: {theirs}")
    print("plans identical" if mine == theirs else "plans DIFFER")
    return 0 if mine == theirs else 1


if __name__ == "__main__":
    sys.exit(main())
