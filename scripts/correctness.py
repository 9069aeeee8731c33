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
{512,4096,16384,32768}, batch {1,4,8}) plus the serving-feature list below;
the axis flags override one axis each.

**Serving features** (issue 6): ``FEATURE_CONFIGS`` is a curated list of about
140 extra configurations, not a product: fp8 KV caches (uint8 e4m3 bits; q
float16 or bfloat16; no scale, a per-tensor or a per-head scale; head_dim 64,
96, 128, 256), head_dim 96 in every dtype, GQA groups 3, 5, 6, 7 and 16, page
sizes 1 and 256, ``logits_soft_cap`` 30 and 50 (with an ``sm_scale`` of
``8 / sqrt(head_dim)`` so that the cap changes the result), the HND layout, a
custom ``sm_scale`` and k/v scales on 16/32-bit caches; each value several
times, at ctx <= 512 and at ctx 4096. Then issue 18's decode features: 2, 4,
8 and 16 query tokens per request (``qo_indptr``), attention sinks and
sliding windows (0, 7, 15, 100 and 300 slots), with the other features
rotating through. ``--full`` runs them after the 216;
``--features`` runs only them. On that list the axis flags (``--head-dim`` ...
``--dtype``) and the feature flags (``--kv-dtype``, ``--kv-layout``,
``--soft-cap``, ``--scale-mode``) *filter*; on the product sweep the feature
flags are extra axes (e.g. ``--kv-layout HND`` runs the default 24 in HND;
``--kv-dtype float8_e4m3fn`` with fp8 caches, float32 q skipped). An fp8
configuration is compared with the reference on the very bits stored on the
GPU, dequantized exactly and scaled (float64), with the tolerance of its q
dtype (the kernels compute in float32 from the exact dequantized values).

Exit status: 0 all passed, 1 a configuration failed, 2 bad arguments, 3 no
CUDA GPU on this machine (message on stderr).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from dataclasses import asdict, dataclass, replace

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
#: The fp8 KV dtype name (an fp8 cache on the GPU is uint8 e4m3 bit patterns).
FP8 = "float8_e4m3fn"
KV_DTYPE_NAMES = (*_common.DTYPE_NAMES, FP8)
KV_LAYOUTS = ("NHD", "HND")
#: k/v scale modes: none (1.0), one float per tensor, a float32 array [num_kv_heads].
SCALE_MODES = ("none", "tensor", "head")
#: The feature axes: flags of the same name filter FEATURE_CONFIGS and are
#: extra axes of the product sweep.
FEATURE_AXES = ("kv_dtype", "kv_layout", "soft_cap", "scale_mode")
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
    "kv_dtype",
    "kv_layout",
    "soft_cap",
    "scale_mode",
    "sm_scale",
    "group",
    "lengths",
    "q_len",
    "sinks",
    "window",
)


@dataclass(frozen=True)
class Config:
    """One configuration. ``dtype`` is q's (and out's); ``kv_dtype`` None means
    the caches share it, ``"float8_e4m3fn"`` an fp8 cache. ``soft_cap`` 0 is
    off; ``sm_scale`` None is ``1/sqrt(head_dim)``; ``group`` names the list
    the configuration comes from ("base" = the product sweep)."""

    head_dim: int
    gqa: int
    page_size: int
    ctx: int
    batch: int
    dtype: str
    num_kv_heads: int
    kv_dtype: str | None = None
    kv_layout: str = "NHD"
    soft_cap: float = 0.0
    scale_mode: str = "none"
    sm_scale: float | None = None
    group: str = "base"
    lengths: str = ""  # a ragged batch: "DISTRIBUTION:SEED" (scripts/_common.py); then ctx is unused
    q_len: int = 1  # query tokens per request (qo_indptr), at most each request's length
    sinks: bool = False  # attention sinks, one random logit per query head
    window: int = -1  # window_left (-1: none)

    @property
    def num_qo_heads(self) -> int:
        return self.gqa * self.num_kv_heads

    @property
    def kv_dtype_name(self) -> str:
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype_name == FP8

    @property
    def has_features(self) -> bool:
        """Any serving feature (cache dtype, layout, cap, scales, sm_scale) not
        at its default; without one the batch is built exactly as before."""
        return (self.kv_dtype_name != self.dtype or self.kv_layout != "NHD" or bool(self.soft_cap)
                or self.scale_mode != "none" or self.sm_scale is not None or self.q_len != 1 or self.sinks
                or self.window >= 0)

    def label(self) -> str:
        ctx = f"lengths={self.lengths}" if self.lengths else f"ctx{self.ctx}"
        text = f"{self.dtype} D{self.head_dim} g{self.gqa} P{self.page_size} {ctx} B{self.batch}"
        extra = []
        if self.kv_dtype_name != self.dtype:
            extra.append("kv=fp8" if self.is_fp8 else f"kv={self.kv_dtype_name}")
        if self.scale_mode != "none":
            extra.append(f"scale={self.scale_mode}")
        if self.kv_layout != "NHD":
            extra.append(self.kv_layout)
        if self.soft_cap:
            extra.append(f"cap{self.soft_cap:g}")
        if self.sm_scale is not None:
            extra.append(f"sm{self.sm_scale:.4g}")
        if self.q_len != 1:
            extra.append(f"q_len{self.q_len}")
        if self.sinks:
            extra.append("sinks")
        if self.window >= 0:
            extra.append(f"win{self.window}")
        return " ".join([text, *extra])

    def fields(self) -> dict:
        """The row fields of this configuration (kv_dtype spelled out)."""
        return {**asdict(self), "kv_dtype": self.kv_dtype_name, "num_qo_heads": self.num_qo_heads}


def _feature_configs() -> tuple[Config, ...]:
    """The serving-feature configurations, as data (num_kv_heads 8; ``configs``
    substitutes ``--num-kv-heads``). Each group crosses its own axes; the other
    axes rotate through short cycles so every value of every new axis comes up
    several times, at ctx 512 and at ctx 4096 (test_scripts.py checks this)."""

    def cyc(values, i):
        return values[i % len(values)]

    def capped(d, cap):  # an sm_scale large enough that the cap changes the result
        return round(8 / math.sqrt(d), 6) if cap else None

    out = []

    def add(group, d, g, p, ctx, b, dt, **kw):
        cap = kw.pop("soft_cap", 0.0)
        sm = kw.pop("sm_scale", capped(d, cap))
        out.append(Config(d, g, p, ctx, b, dt, 8, soft_cap=float(cap), sm_scale=sm, group=group, **kw))

    # fp8 KV: q dtype x scale mode x head_dim at ctx 512, and every head_dim at 4096
    for i, (dt, mode, d) in enumerate(
        itertools.product(("float16", "bfloat16"), SCALE_MODES, (64, 96, 128, 256))
    ):
        add("fp8", d, cyc((4, 3, 8, 5, 1, 6, 7, 16), i), cyc((16, 256, 1), i), 512, cyc((4, 1, 3), i // 2), dt,
            kv_dtype=FP8, scale_mode=mode, kv_layout=cyc(KV_LAYOUTS, i // 4), soft_cap=cyc((0, 0, 30, 0, 50), i))
    for i, (dt, d) in enumerate(itertools.product(("float16", "bfloat16"), (64, 96, 128, 256))):
        add("fp8", d, cyc((4, 8, 5, 16), i), cyc((16, 256), i // 2), 4096, 2, dt, kv_dtype=FP8,
            scale_mode=cyc(("head", "tensor", "head", "none"), i), kv_layout=cyc(KV_LAYOUTS, i),
            soft_cap=cyc((0, 0, 0, 50, 0, 30, 0, 0), i))
    # head_dim 96 in every dtype
    for i, (dt, g) in enumerate(itertools.product(_common.DTYPE_NAMES, (1, 3, 8, 16))):
        add("head_dim96", 96, g, cyc((16, 1, 256, 32), i), 512, cyc((4, 1, 8), i), dt,
            kv_layout=cyc(KV_LAYOUTS, i // 2), soft_cap=cyc((0, 30, 0, 0, 50), i))
    for i, (dt, g) in enumerate(itertools.product(_common.DTYPE_NAMES, (4, 7))):
        add("head_dim96", 96, g, cyc((16, 256, 1), i), 4096, 3, dt, kv_layout=cyc(KV_LAYOUTS, i))
    # GQA groups that are not powers of two, and 16 (two q-head groups of 8)
    for i, (g, dt) in enumerate(itertools.product((3, 5, 6, 7, 16), ("float16", "bfloat16"))):
        add("gqa", cyc((128, 64, 256), i), g, cyc((16, 1, 256, 32), i), cyc((512, 97), i // 2), cyc((4, 8, 1), i),
            dt, kv_layout=cyc(KV_LAYOUTS, i // 3))
    for i, g in enumerate((3, 5, 6, 7, 16)):
        add("gqa", cyc((128, 64), i), g, 16, 4096, 2, cyc(_common.DTYPE_NAMES, i), sm_scale=cyc((None, 0.3), i))
    # page sizes 1 (vector-sparse) and 256
    for i, (p, dt, ctx) in enumerate(itertools.product((1, 256), _common.DTYPE_NAMES, (512, 4096))):
        add("page", cyc((128, 64, 96), i), cyc((4, 8, 1, 5), i), p, ctx, 4 if ctx == 512 else 2, dt,
            kv_layout=cyc(KV_LAYOUTS, i // 2))
    # logits soft cap (every method must honour it)
    for i, (cap, dt, ctx) in enumerate(itertools.product((30, 50), _common.DTYPE_NAMES, (512, 4096))):
        add("soft_cap", cyc((128, 64), i), cyc((4, 1, 8), i), cyc((16, 32), i // 2), ctx, 4 if ctx == 512 else 2,
            dt, soft_cap=cap)
    # the HND layout
    for i, (dt, d, ctx) in enumerate(itertools.product(_common.DTYPE_NAMES, (64, 128), (512, 4096))):
        add("hnd", d, cyc((4, 1, 8), i), cyc((16, 32, 64), i), ctx, 4 if ctx == 512 else 2, dt, kv_layout="HND")
    # a custom sm_scale
    for i, (sm, dt, ctx) in enumerate(itertools.product((0.05, 0.3), _common.DTYPE_NAMES, (512, 4096))):
        add("sm_scale", cyc((128, 64), i), cyc((4, 8, 1), i), 16, ctx, 4 if ctx == 512 else 2, dt, sm_scale=sm)
    # k/v scales on 16/32-bit caches
    for i, (mode, dt) in enumerate(itertools.product(("tensor", "head"), _common.DTYPE_NAMES)):
        add("scales", cyc((128, 64), i), cyc((4, 1), i), 16, 512, 4, dt, scale_mode=mode,
            kv_layout=cyc(KV_LAYOUTS, i // 3))
    for i, mode in enumerate(("tensor", "head")):
        add("scales", 128, 4, 32, 4096, 2, cyc(("float16", "bfloat16"), i), scale_mode=mode)
    # several query tokens per request, sinks and sliding windows (issue 18), with
    # the other features rotating through
    for i, (ql, dt) in enumerate(itertools.product((2, 4, 8, 16), ("float16", "bfloat16"))):
        add("decode18", cyc((128, 64, 96), i), cyc((4, 8, 1), i), cyc((16, 1, 32), i), cyc((512, 4096), i // 2),
            cyc((4, 2), i), dt, q_len=ql, sinks=i % 3 == 0, window=cyc((-1, -1, 7, 100), i),
            kv_layout=cyc(KV_LAYOUTS, i // 2), kv_dtype=FP8 if i % 4 == 3 else None,
            scale_mode="head" if i % 4 == 3 else "none")
    for i, (w, dt) in enumerate(itertools.product((0, 15, 300), ("float16", "bfloat16", "float32"))):
        add("decode18", 128 if dt != "float32" else 256, cyc((4, 8), i), cyc((16, 32, 1), i), cyc((4096, 512), i),
            2, dt, window=w, sinks=i % 2 == 1, soft_cap=cyc((0, 30), i // 3))
    return tuple(out)


#: The serving-feature list (see the module docstring): run by --full after the
#: 216, alone by --features.
FEATURE_CONFIGS = _feature_configs()


def _ragged_configs() -> tuple[Config, ...]:
    """The ragged family of the benchmarks (scripts/_common.py RAGGED_FAMILY)
    with every length divided by 8 (the float64 reference stays quick), in
    float16, bfloat16 and fp8 KV: the default plan's balanced, longest-first
    chunks (and --force-merge's one-page chunks) on ragged tables."""
    out = []
    for i, (batch, spec, seed) in enumerate(_common.RAGGED_FAMILY):
        name, args = _common.parse_lengths(spec)
        scaled = ":".join([name] + [f"{max(1.0, a / 8):g}" if (name, k) not in (("zipf", 0), ("lognormal", 1)) else f"{a:g}"
                                    for k, a in enumerate(args)])
        dt, kv = (("float16", None), ("bfloat16", None), ("float16", FP8))[i % 3]
        out.append(Config(head_dim=128, gqa=4, page_size=16, ctx=0, batch=batch, dtype=dt, num_kv_heads=8,
                          kv_dtype=kv, group="ragged", lengths=f"{scaled}:{seed}"))
    return tuple(out)


RAGGED_CONFIGS = _ragged_configs()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="correctness.py",
        description="Compare cupaged.decode (v2, v1, gather) elementwise with the float64 NumPy reference "
        "over head_dim x gqa x page_size x ctx x batch. Lists accept spaces or commas.",
        epilog=_common.EXIT_CODES_EPILOG,
    )
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument(
        "--full",
        action="store_true",
        help=f"the 216-configuration sweep plus the {len(FEATURE_CONFIGS)} serving-feature configurations (default: 24)",
    )
    sweep.add_argument(
        "--features",
        action="store_true",
        help=f"only the {len(FEATURE_CONFIGS)} serving-feature configurations (fp8 KV, head_dim 96/256, GQA 3/5/6/7/16, "
        "page 1/256, soft cap, HND, sm_scale, k/v scales, several query tokens, sinks, windows); the axis and "
        "feature flags filter them",
    )
    sweep.add_argument(
        "--ragged",
        action="store_true",
        help=f"only the {len(RAGGED_CONFIGS)} ragged batches (the benchmark family at 1/8 of its lengths: one "
        "long request among short ones, lognormal, uniform, bimodal and Zipf lengths; float16, bfloat16, fp8 KV)",
    )
    p.add_argument("--head-dim", nargs="+", help="override the head_dim axis (filter the feature list)")
    p.add_argument("--gqa", nargs="+", help="override the GQA group-size axis (num_qo_heads = gqa * num_kv_heads; filter the feature list)")
    p.add_argument("--page-size", nargs="+", help="override the page-size axis (filter the feature list)")
    p.add_argument("--ctx", nargs="+", help="override the context-length axis (filter the feature list)")
    p.add_argument("--batch", nargs="+", help="override the batch axis (filter the feature list)")
    p.add_argument(
        "--dtype",
        nargs="+",
        default=None,
        help="query (and, without --kv-dtype, KV) dtypes: float16 bfloat16 float32 (default float16; the feature "
        "list: all)",
    )
    p.add_argument("--kv-dtype", nargs="+", help=f"KV dtypes: {' '.join(KV_DTYPE_NAMES)} (fp8 only with 16-bit q)")
    p.add_argument("--kv-layout", nargs="+", help="KV layouts: NHD HND")
    p.add_argument("--soft-cap", nargs="+", help="logits_soft_cap values (0 = off)")
    p.add_argument("--scale-mode", nargs="+", help="k/v scale modes: none tensor head")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (default 8; the feature list too)")
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
        args.kv_dtype = _common.parse_list(args.kv_dtype, str)
        args.kv_layout = _common.parse_list(args.kv_layout, str)
        args.soft_cap = _common.parse_list(args.soft_cap, float)
        args.scale_mode = _common.parse_list(args.scale_mode, str)
    except ValueError as e:
        parser.error(str(e))
    for name in args.dtype or ():
        if name not in _common.DTYPE_NAMES:
            parser.error(f"--dtype {name}: choose from {', '.join(_common.DTYPE_NAMES)}")
    for flag, values, choices in (
        ("--kv-dtype", args.kv_dtype, KV_DTYPE_NAMES),
        ("--kv-layout", args.kv_layout, KV_LAYOUTS),
        ("--scale-mode", args.scale_mode, SCALE_MODES),
    ):
        for value in values or ():
            if value not in choices:
                parser.error(f"{flag} {value}: choose from {', '.join(choices)}")
    for cap in args.soft_cap or ():
        if not (math.isfinite(cap) and cap >= 0):
            parser.error(f"--soft-cap {cap}: must be a finite number >= 0 (0 = off)")
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


def _kv_dtype_fits(dtype: str, kv_dtype: str) -> bool:
    """fp8 caches go with 16-bit q; otherwise the caches share q's dtype."""
    return dtype in ("float16", "bfloat16") if kv_dtype == FP8 else kv_dtype == dtype


def product_configs(args: argparse.Namespace) -> list[Config]:
    """The product sweep (default 24, --full 216); the feature flags, when
    given, are extra axes (combinations of an fp8 cache with float32 q, or of a
    16/32-bit cache with another q dtype, are left out)."""
    axes = sweep_axes(args)
    out = []
    for dt in args.dtype or ("float16",):
        for kv in args.kv_dtype or (None,):
            if kv is not None and not _kv_dtype_fits(dt, kv):
                continue
            for layout, cap, mode in itertools.product(
                args.kv_layout or ("NHD",), args.soft_cap or (0.0,), args.scale_mode or ("none",)
            ):
                for d, g, p, c, b in itertools.product(*(axes[a] for a in AXES)):
                    out.append(
                        Config(
                            head_dim=d,
                            gqa=g,
                            page_size=p,
                            ctx=c,
                            batch=b,
                            dtype=dt,
                            num_kv_heads=args.num_kv_heads,
                            kv_dtype=None if kv in (None, dt) else kv,
                            kv_layout=layout,
                            soft_cap=float(cap),
                            scale_mode=mode,
                        )
                    )
    return out


def feature_configs(args: argparse.Namespace) -> list[Config]:
    """FEATURE_CONFIGS with ``--num-kv-heads`` substituted, filtered by every
    axis and feature flag given."""
    keep = []
    for cfg in FEATURE_CONFIGS:
        cfg = replace(cfg, num_kv_heads=args.num_kv_heads)
        values = {axis: getattr(cfg, axis) for axis in (*AXES, "dtype", *FEATURE_AXES)}
        values["kv_dtype"] = cfg.kv_dtype_name
        if all(getattr(args, flag) is None or value in getattr(args, flag) for flag, value in values.items()):
            keep.append(cfg)
    return keep


def configs(args: argparse.Namespace) -> list[Config]:
    """The configurations to run, in order: the product sweep (not with
    --features), then the feature list (with --full or --features)."""
    if args.ragged:
        return list(RAGGED_CONFIGS)
    out = [] if args.features else product_configs(args)
    if args.full or args.features:
        out += feature_configs(args)
    return out


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


@dataclass
class FeatureInputs:
    """Keyword arguments of one configuration's features: those of
    ``cupaged.decode`` (device scales) and of ``cupaged.reference.decode``
    (host scales); only the non-default ones are passed. ``scales`` is the
    host (k_scale, v_scale) or None."""

    decode_kwargs: dict
    reference_kwargs: dict
    scales: tuple | None


#: Per-head magnitudes of the real K/V values with per-head scales (cycled
#: over the heads), so that a kernel using one head's scale for another fails.
HEAD_MAGNITUDES = (0.5, 1.0, 2.0, 4.0)
#: The per-tensor scales of 16/32-bit caches (real K = 0.37 * stored K).
TENSOR_SCALES = (0.37, 1.9)


def feature_scales(cfg: Config, k_real, v_real, head_axis: int):
    """(k_scale, v_scale) for ``cfg.scale_mode``: None; floats; float32
    ``[num_kv_heads]`` arrays (NumPy). fp8: the scale that maps each tensor's
    (or head's) max |value| to 448; 16/32-bit: fixed values (TENSOR_SCALES,
    HEAD_MAGNITUDES)."""
    import cupy

    from cupaged import fp8

    if cfg.scale_mode == "none":
        return None
    if cfg.scale_mode == "tensor":
        if not cfg.is_fp8:
            return TENSOR_SCALES
        return tuple(float(cupy.abs(x).max()) / fp8.E4M3_MAX for x in (k_real, v_real))
    if not cfg.is_fp8:
        mags = np.resize(np.array(HEAD_MAGNITUDES, np.float32), cfg.num_kv_heads)
        return mags, mags[::-1].copy()
    axes = tuple(a for a in range(4) if a != head_axis)
    return tuple((cupy.abs(x).max(axis=axes) / fp8.E4M3_MAX).astype(cupy.float32).get() for x in (k_real, v_real))


def make_feature_batch(layout: _common.BatchLayout, cfg: Config, dtype: np.dtype, *, seed: int):
    """The device batch of a feature configuration and its FeatureInputs.

    Caches are ``[num_pages, P, Hkv, D]`` (NHD) or ``[num_pages, Hkv, P, D]``
    (HND) of random normal values in ``dtype``, or for fp8 the e4m3 bits
    (uint8) of real values ``x / scale`` (``cupaged.fp8.to_e4m3``; with
    per-head scales the real values of head ``h`` are scaled by
    ``HEAD_MAGNITUDES[h % 4]`` first, per-tensor by 3).
    """
    import cupy

    from cupaged import fp8

    table = _common.layout_table(layout)
    rs = cupy.random.RandomState(seed)
    head_axis = 2 if cfg.kv_layout == "NHD" else 1
    if cfg.kv_layout == "NHD":
        shape = (layout.num_pages, layout.page_size, cfg.num_kv_heads, cfg.head_dim)
    else:
        shape = (layout.num_pages, cfg.num_kv_heads, layout.page_size, cfg.head_dim)
    if cfg.is_fp8:
        real = [_common.fill_random(shape, np.float32, rs) for _ in range(2)]
        if cfg.scale_mode == "head":
            view = [1, 1, 1, 1]
            view[head_axis] = cfg.num_kv_heads
            mags = cupy.asarray(np.resize(np.array(HEAD_MAGNITUDES, np.float32), cfg.num_kv_heads)).reshape(view)
            real = [x * mags for x in real]
        elif cfg.scale_mode == "tensor":
            real = [x * 3 for x in real]
        scales = feature_scales(cfg, *real, head_axis)
        if scales is None:
            caches = [fp8.to_e4m3(x) for x in real]
        else:
            caches = [fp8.to_e4m3(x, s, head_axis=head_axis) for x, s in zip(real, scales)]
        del real
    else:
        caches = [_common.fill_random(shape, dtype, rs) for _ in range(2)]
        scales = feature_scales(cfg, *caches, head_axis)
    common, qo_indptr = decode18_kwargs(cfg, table, seed)
    rows = layout.batch_size if qo_indptr is None else int(qo_indptr[-1])
    q = _common.fill_random((rows, cfg.num_qo_heads, cfg.head_dim), dtype, rs)
    cupy.cuda.Device().synchronize()
    batch = _common.DeviceBatch(
        layout, table, q, [tuple(caches)], cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, np.dtype(dtype)
    )
    if cfg.sm_scale is not None:
        common["sm_scale"] = cfg.sm_scale
    if cfg.soft_cap:
        common["logits_soft_cap"] = cfg.soft_cap
    if cfg.kv_layout != "NHD":
        common["kv_layout"] = cfg.kv_layout
    dec, ref = dict(common), dict(common)
    if "sinks" in common:  # decode takes them on the device
        dec["sinks"] = cupy.asarray(common["sinks"])
    if scales is not None:
        ref.update(k_scale=scales[0], v_scale=scales[1])
        dev = [s if isinstance(s, float) else cupy.asarray(s, dtype=cupy.float32) for s in scales]
        dec.update(k_scale=dev[0], v_scale=dev[1])
    return batch, FeatureInputs(dec, ref, scales)


def decode18_kwargs(cfg: Config, table, seed: int) -> tuple[dict, np.ndarray | None]:
    """The issue-18 keyword arguments of a configuration (host arrays:
    ``qo_indptr`` of ``cfg.q_len`` tokens per request, at most its length;
    sinks of random logits in the range of the LSEs; ``window_left``) and
    the ``qo_indptr`` (None for one token each)."""
    kw: dict = {}
    qo_indptr = None
    if cfg.q_len != 1:
        q_len = np.minimum(cfg.q_len, np.maximum(table.seq_lens, 1))
        qo_indptr = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
        kw["qo_indptr"] = qo_indptr
    if cfg.sinks:
        kw["sinks"] = np.random.default_rng(seed).uniform(2.0, 8.0, cfg.num_qo_heads).astype(np.float32)
    if cfg.window >= 0:
        kw["window_left"] = cfg.window
    return kw, qo_indptr


def run_config(index: int, cfg: Config, args: argparse.Namespace) -> list[dict]:
    """Check every method on one configuration; one row per method."""
    import cupy

    import cupaged

    seed = args.seed + index
    tol = tolerance(args, cfg.dtype)
    dtype = _common.resolve_dtype(cfg.dtype)
    base = {
        **cfg.fields(),
        "config": index,
        "seed": seed,
        "force_merge": args.force_merge,
        "single_chunk": args.single_chunk,
        "tol": tol,
    }
    if cfg.lengths:
        spec, _, lseed = cfg.lengths.rpartition(":")
        lens = _common.ragged_lengths(spec, cfg.batch, int(lseed))
        layout = _common.lengths_layout(lens, cfg.page_size, seed=seed)
    else:  # page size 1 has no mid-page start
        layout = _common.plan_layout(
            cfg.batch, cfg.ctx, cfg.page_size, seed=seed, mid_page=cfg.page_size > 1, page_order="reverse"
        )
    if not cfg.has_features:
        batch = _common.make_device_batch(layout, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, dtype, seed=seed)
        features = FeatureInputs({}, {}, None)
    else:
        batch, features = make_feature_batch(layout, cfg, dtype, seed=seed)
    plan_kw = {"kv_dtype": FP8} if cfg.is_fp8 else {}
    plan_kw.update({k: features.reference_kwargs[k] for k in ("qo_indptr", "window_left")
                    if k in features.reference_kwargs})
    plan = cupaged.plan_decode(
        batch.table,
        cfg.num_qo_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype,
        pages_per_chunk=pages_per_chunk(args, layout),
        **plan_kw,
    )
    base.update(
        pages_per_chunk=int(plan.pages_per_chunk),
        num_chunks=int(plan.num_chunks),
        num_ctas=int(plan.num_ctas),
        needs_merge=bool(plan.needs_merge),
    )
    t0 = time.perf_counter()
    q_h, k_h, v_h = batch.q.get(), batch.k_cache.get(), batch.v_cache.get()
    # the reference sees the very values on the GPU (fp8: the stored bits, dequantized exactly)
    ref, lse_ref = cupaged.reference.decode(q_h, k_h, v_h, batch.table, **features.reference_kwargs)
    base["ref_s"] = time.perf_counter() - t0
    del k_h, v_h

    rows = []
    for method in args.methods:
        row = dict(base, method=method, passed=False, error="")
        t0 = time.perf_counter()
        try:
            out = _common.nan_like(batch.q)
            result, lse = cupaged.decode(
                batch.q,
                batch.k_cache,
                batch.v_cache,
                batch.table,
                plan,
                method=method,
                out=out,
                return_lse=True,
                **features.decode_kwargs,
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
    if not cfgs:
        print("correctness: no configuration matches the flags", file=sys.stderr)
        return 2
    mode = " force-merge" if args.force_merge else " single-chunk" if args.single_chunk else ""
    n_feat = sum(c.group != "base" for c in cfgs)
    parts = f" ({len(cfgs) - n_feat} product + {n_feat} serving-feature)" if n_feat else ""
    print(
        f"correctness: {len(cfgs)} configurations{parts} x {len(args.methods)} methods ({', '.join(args.methods)}){mode}",
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
                            **cfg.fields(),
                            "config": i,
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
