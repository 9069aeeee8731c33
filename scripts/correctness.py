#!/usr/bin/env python3
"""Elementwise correctness sweep of cupaged.decode against the float64
NumPy reference (cupaged.reference.decode).

For every configuration (head_dim x gqa x page_size x ctx x batch x dtype) an
adversarial batch is built directly (not through the pool; see
scripts/_common.py): ragged lengths just below ``ctx``, half the requests
starting mid-page, physical pages handed out in reverse order from a pool with
2x slack. The reference is computed once per configuration on the host from
the very values stored on the GPU (``.get()``), then each method (v2, v1,
gather by default) runs with ``out`` poisoned with NaN and ``return_lse=True``:

* every output element must be finite (the NaN poison fully overwritten) and
  the result must be written into ``out``;
* ``max_rel = max|o - r| / max|r|`` and ``rel_rms = ||o - r||_2 / ||r||_2``;
  the configuration passes when ``max_rel <= tol``;
* the LSE (log2 units) must match the reference where it is finite:
  ``|lse - lse_ref| <= tol * max(1, |lse_ref|)``.

Each row shows the v2 plan (pages_per_chunk, num_chunks, num_ctas,
needs_merge) next to max_rel and rel_rms. ``--force-merge`` plans with
``pages_per_chunk=1`` so every request of more than one page goes through the
merge kernel; ``--single-chunk`` plans one chunk per request, so no merge runs
and the partial kernel writes ``out`` directly (the default plan splits every
configuration of the default sweep).

Default: 24 configurations (head_dim {64,128} x gqa {1,4,8} x page {32} x ctx
{512,4096} x batch {1,4}); ``--full``: 216 (page {16,32,64}, ctx
{512,4096,16384,32768}, batch {1,4,8}); the axis flags override one axis each.

Exit status: 0 all passed, 1 a configuration failed, 2 bad arguments, 3 no
CUDA GPU on this machine (message on stderr).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

try:  # run as a script (scripts/ is sys.path[0]) or imported with scripts/ on the path
    import _common
except ImportError:  # imported as scripts.correctness
    from scripts import _common

#: The sweeps, declared as data. dtype and num_kv_heads come from flags.
DEFAULT_SWEEP = {
    "head_dim": (64, 128),
    "gqa": (1, 4, 8),
    "page_size": (32,),
    "ctx": (512, 4096),
    "batch": (1, 4),
}
FULL_SWEEP = {
    "head_dim": (64, 128),
    "gqa": (1, 4, 8),
    "page_size": (16, 32, 64),
    "ctx": (512, 4096, 16384, 32768),
    "batch": (1, 4, 8),
}
AXES = ("head_dim", "gqa", "page_size", "ctx", "batch")
METHODS = ("v2", "v1", "gather")
#: Default tolerance on max_rel (and on the relative LSE error) per dtype:
#: 2e-2 for 16-bit storage, 1e-5 for float32 (SPEC.md).
DEFAULT_TOL = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 1e-5}

#: CSV schema: columns are appended, never reordered.
CSV_COLUMNS = (
    "config",
    "dtype",
    "head_dim",
    "gqa",
    "num_qo_heads",
    "num_kv_heads",
    "page_size",
    "ctx",
    "batch",
    "seed",
    "force_merge",
    "method",
    "pages_per_chunk",
    "num_chunks",
    "num_ctas",
    "needs_merge",
    "max_rel",
    "rel_rms",
    "lse_err",
    "finite",
    "tol",
    "passed",
    "error",
    "ref_s",
    "run_s",
    "single_chunk",
)


@dataclass(frozen=True)
class Config:
    head_dim: int
    gqa: int
    page_size: int
    ctx: int
    batch: int
    dtype: str
    num_kv_heads: int

    @property
    def num_qo_heads(self) -> int:
        return self.gqa * self.num_kv_heads

    def label(self) -> str:
        return f"{self.dtype} D{self.head_dim} g{self.gqa} P{self.page_size} ctx{self.ctx} B{self.batch}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="correctness.py",
        description="Compare cupaged.decode (v2, v1, gather) elementwise with the float64 NumPy reference "
        "over head_dim x gqa x page_size x ctx x batch. Lists accept spaces or commas.",
        epilog=_common.EXIT_CODES_EPILOG,
    )
    p.add_argument("--full", action="store_true", help="the 216-configuration sweep (default: 24)")
    p.add_argument("--head-dim", nargs="+", help="override the head_dim axis")
    p.add_argument("--gqa", nargs="+", help="override the GQA group-size axis (num_qo_heads = gqa * num_kv_heads)")
    p.add_argument("--page-size", nargs="+", help="override the page-size axis")
    p.add_argument("--ctx", nargs="+", help="override the context-length axis")
    p.add_argument("--batch", nargs="+", help="override the batch axis")
    p.add_argument(
        "--dtype", nargs="+", default=["float16"], help="KV/query dtypes: float16 bfloat16 float32 (default float16)"
    )
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--methods", nargs="+", default=[",".join(METHODS)], help="methods to check (default v2,v1,gather)")
    chunking = p.add_mutually_exclusive_group()
    chunking.add_argument(
        "--force-merge",
        action="store_true",
        help="plan with pages_per_chunk=1 (merge kernel on every multi-page request)",
    )
    chunking.add_argument(
        "--single-chunk",
        action="store_true",
        help="plan with pages_per_chunk = the longest request's page count: one chunk per request, no merge "
        "(the partial kernel writes out directly)",
    )
    p.add_argument("--csv", help="write one row per (configuration, method) to this CSV")
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="max_rel tolerance (default 2e-2 for float16/bfloat16, 1e-5 for float32)",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed; configuration i uses seed + i")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for axis in AXES:
            setattr(args, axis, _common.parse_list(getattr(args, axis), int))
        args.dtype = _common.parse_list(args.dtype, str)
        args.methods = _common.parse_list(args.methods, str)
    except ValueError as e:
        parser.error(str(e))
    for name in args.dtype:
        if name not in _common.DTYPE_NAMES:
            parser.error(f"--dtype {name}: choose from {', '.join(_common.DTYPE_NAMES)}")
    for m in args.methods:
        if m not in METHODS + ("auto",):
            parser.error(f"--methods {m}: choose from {', '.join(METHODS + ('auto',))}")
    for axis in AXES:
        values = getattr(args, axis)
        if values is not None and min(values) < 1:
            parser.error(f"--{axis.replace('_', '-')} values must be >= 1")
    if args.num_kv_heads < 1:
        parser.error("--num-kv-heads must be >= 1")
    return args


def sweep_axes(args: argparse.Namespace) -> dict:
    """The axes of the sweep: the default or --full table, axis flags win."""
    return _common.sweep_axes(FULL_SWEEP if args.full else DEFAULT_SWEEP, args, AXES)


def configs(args: argparse.Namespace) -> list[Config]:
    axes = sweep_axes(args)
    return [
        Config(head_dim=d, gqa=g, page_size=p, ctx=c, batch=b, dtype=dt, num_kv_heads=args.num_kv_heads)
        for dt in args.dtype
        for d, g, p, c, b in itertools.product(*(axes[a] for a in AXES))
    ]


def pages_per_chunk(args: argparse.Namespace, layout: _common.BatchLayout) -> int | None:
    """The plan's chunk size: 1 (--force-merge), the longest request
    (--single-chunk) or None (the planner's choice)."""
    if args.force_merge:
        return 1
    if args.single_chunk:
        return max(1, int(layout.request_pages.max()))
    return None


def tolerance(args: argparse.Namespace, dtype: str) -> float:
    return args.tol if args.tol is not None else DEFAULT_TOL[dtype]


def compare(out: np.ndarray, ref: np.ndarray, lse: np.ndarray, lse_ref: np.ndarray) -> dict:
    """Deviation metrics of a kernel result against the float64 reference."""
    o = out.astype(np.float64)
    finite = bool(np.isfinite(o).all())
    diff = o - ref
    ref_max = float(np.abs(ref).max())
    ref_norm = float(np.linalg.norm(ref))
    max_rel = float(np.abs(diff).max()) / max(ref_max, 1e-300) if finite else math.inf
    rel_rms = float(np.linalg.norm(diff)) / max(ref_norm, 1e-300) if finite else math.inf
    lse = lse.astype(np.float64)
    ref_finite = np.isfinite(lse_ref)
    lse_ok_inf = bool(np.all(np.isneginf(lse[~ref_finite])))
    if ref_finite.any():
        rel = np.abs(lse[ref_finite] - lse_ref[ref_finite]) / np.maximum(1.0, np.abs(lse_ref[ref_finite]))
        lse_err = float(rel.max()) if np.isfinite(rel).all() else math.inf
    else:
        lse_err = 0.0
    if not lse_ok_inf:
        lse_err = math.inf
    return {"finite": finite, "max_rel": max_rel, "rel_rms": rel_rms, "lse_err": lse_err}


def run_config(index: int, cfg: Config, args: argparse.Namespace) -> list[dict]:
    """Check every method on one configuration; one row per method."""
    import cupy

    import cupaged

    seed = args.seed + index
    tol = tolerance(args, cfg.dtype)
    dtype = _common.resolve_dtype(cfg.dtype)
    base = {
        **asdict(cfg),
        "config": index,
        "num_qo_heads": cfg.num_qo_heads,
        "seed": seed,
        "force_merge": args.force_merge,
        "single_chunk": args.single_chunk,
        "tol": tol,
    }
    layout = _common.plan_layout(cfg.batch, cfg.ctx, cfg.page_size, seed=seed, mid_page=True, page_order="reverse")
    batch = _common.make_device_batch(layout, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, dtype, seed=seed)
    plan = cupaged.plan_decode(
        batch.table,
        cfg.num_qo_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype,
        pages_per_chunk=pages_per_chunk(args, layout),
    )
    base.update(
        pages_per_chunk=int(plan.pages_per_chunk),
        num_chunks=int(plan.num_chunks),
        num_ctas=int(plan.num_ctas),
        needs_merge=bool(plan.needs_merge),
    )
    t0 = time.perf_counter()
    q_h, k_h, v_h = batch.q.get(), batch.k_cache.get(), batch.v_cache.get()
    ref, lse_ref = cupaged.reference.decode(q_h, k_h, v_h, batch.table)
    base["ref_s"] = time.perf_counter() - t0
    del k_h, v_h

    rows = []
    for method in args.methods:
        row = dict(base, method=method, passed=False, error="")
        t0 = time.perf_counter()
        try:
            out = _common.nan_like(batch.q)
            result, lse = cupaged.decode(
                batch.q, batch.k_cache, batch.v_cache, batch.table, plan, method=method, out=out, return_lse=True
            )
            cupy.cuda.get_current_stream().synchronize()
            row["run_s"] = time.perf_counter() - t0
            row.update(compare(out.get(), ref, lse.get(), lse_ref))
            problems = []
            if result.data.ptr != out.data.ptr or result.shape != out.shape:
                problems.append("result is not the out= array")
            if not row["finite"]:
                problems.append("non-finite output (NaN poison not overwritten?)")
            if not row["max_rel"] <= tol:
                problems.append(f"max_rel {row['max_rel']:.3e} > tol {tol:g}")
            if not row["lse_err"] <= tol:
                problems.append(f"lse_err {row['lse_err']:.3e} > tol {tol:g}")
            row["error"] = "; ".join(problems)
            row["passed"] = not problems
            del out, result, lse
        except Exception as e:  # a failing method is a result, not a crash
            row["run_s"] = time.perf_counter() - t0
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        rows.append(row)
    del batch, q_h
    _common.free_gpu_memory()
    return rows


def format_row(cfg: Config, row: dict) -> str:
    status = "PASS" if row["passed"] else "FAIL"
    merge = {True: "yes", False: "no"}.get(row.get("needs_merge"), "?")
    plan = f"c={row.get('pages_per_chunk')} chunks={row.get('num_chunks')} ctas={row.get('num_ctas')} merge={merge}"
    dev = " ".join(f"{k}={_common.format_value(row.get(k))}" for k in ("max_rel", "rel_rms", "lse_err"))
    tail = f"  [{row['error']}]" if row["error"] else ""
    return f"{status} {cfg.label():<40} {row['method']:<6} {plan:<44} {dev}{tail}"


def summarize(rows: list[dict]) -> tuple[str, bool]:
    passed = sum(1 for r in rows if r["passed"])
    ok = passed == len(rows) and len(rows) > 0
    lines = [f"SUMMARY: {passed}/{len(rows)} (config, method) checks passed"]
    by_method = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    for method, rs in by_method.items():
        measured = [r for r in rs if r.get("max_rel") is not None]
        if measured:
            worst = max(measured, key=lambda r: r["max_rel"])
            worst_rms = max(r["rel_rms"] for r in measured)
            worst_lse = max(r["lse_err"] for r in measured)
            lines.append(
                f"  {method:<6} {sum(r['passed'] for r in rs)}/{len(rs)} passed; worst max_rel "
                f"{_common.format_value(worst['max_rel'])} (config {worst['config']}), worst rel_rms "
                f"{_common.format_value(worst_rms)}, worst lse_err {_common.format_value(worst_lse)}"
            )
        else:
            lines.append(f"  {method:<6} {sum(r['passed'] for r in rs)}/{len(rs)} passed; no measurement")
    ref_s = {r["config"]: r["ref_s"] for r in rows if r.get("ref_s") is not None}
    if ref_s:
        lines.append(
            f"  reference: {sum(ref_s.values()):.1f} s total, slowest configuration {max(ref_s.values()):.1f} s"
        )
    return "\n".join(lines), ok


def main(argv=None) -> int:
    args = parse_args(argv)
    _common.require_gpu()
    from tqdm import tqdm

    cfgs = configs(args)
    mode = " force-merge" if args.force_merge else " single-chunk" if args.single_chunk else ""
    print(
        f"correctness: {len(cfgs)} configurations x {len(args.methods)} methods ({', '.join(args.methods)}){mode}",
        flush=True,
    )
    rows = []
    try:
        # the bar only shows on a terminal (disable=None), not in tee'd logs
        with tqdm(total=len(cfgs), unit="cfg", file=sys.stderr, dynamic_ncols=True, disable=None) as bar:
            for i, cfg in enumerate(cfgs):
                bar.set_postfix_str(cfg.label())
                try:
                    cfg_rows = run_config(i, cfg, args)
                except Exception as e:  # e.g. out of memory building the batch: record, keep going
                    error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    cfg_rows = [
                        {
                            **asdict(cfg),
                            "config": i,
                            "num_qo_heads": cfg.num_qo_heads,
                            "method": m,
                            "passed": False,
                            "error": f"configuration failed: {error}",
                        }
                        for m in args.methods
                    ]
                    _common.free_gpu_memory()
                for row in cfg_rows:
                    rows.append(row)
                    tqdm.write(format_row(cfg, row), file=sys.stdout)
                bar.update(1)
    finally:
        if args.csv and rows:
            _common.write_csv(args.csv, CSV_COLUMNS, rows)
    text, ok = summarize(rows)
    print(text, flush=True)
    if args.csv:
        print(f"csv: {args.csv}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
