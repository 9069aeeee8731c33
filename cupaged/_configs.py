"""The one table of supported kernel configurations.

It generates every ``name_expressions`` entry the loader compiles, drives the
dispatch checks (an unsupported combination raises ``ValueError`` listing what
is supported) and is what the CI compile check walks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import ml_dtypes

from . import _env


@dataclass(frozen=True)
class KVFormat:
    """One element format of a KV cache that the kernels read: the one table
    that the dtype names, the kernels' C++ types, the q/KV pairs and the
    cache arrays' storage dtypes below derive from, and that plan, decode,
    gather, append, reference and the error messages read."""

    name: str                  # the values' dtype name, as plans and messages spell it
    cpp: str                   # C++ storage type (cuda_src/common.cuh)
    storage: str               # dtype of a CuPy cache array holding it (CuPy has no float8: uint8 bits)
    scaled: bool               # dequantized by k_scale / v_scale; q and out stay 16-bit
    q_dtypes: tuple[str, ...]  # the q dtypes a kernel pairs it with


FP8 = "float8_e4m3fn"
KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("float16", "cupaged::f16", "float16", False, ("float16",)),
    KVFormat("bfloat16", "cupaged::bf16", "bfloat16", False, ("bfloat16",)),
    KVFormat("float32", "float", "float32", False, ("float32",)),
    KVFormat(FP8, "cupaged::e4m3", "uint8", True, ("float16", "bfloat16")),
)}
# q (and out, and an unscaled cache) dtype name -> C++ type
DTYPES: dict[str, str] = {f.name: f.cpp for f in KV_FORMATS.values() if not f.scaled}
HEAD_DIMS: tuple[int, ...] = (64, 80, 96, 128, 192, 256)
# scaled (fp8) KV format -> C++ type
KV_STORAGE: dict[str, str] = {f.name: f.cpp for f in KV_FORMATS.values() if f.scaled}
# q dtype -> KV formats a kernel pairs it with (the first is q's own).
KV_DTYPES: dict[str, tuple[str, ...]] = {
    q: (q, *(f.name for f in KV_FORMATS.values() if f.scaled and q in f.q_dtypes)) for q in DTYPES}
# storage dtype name of a scaled format's cache arrays -> that format (uint8 -> fp8)
_STORED: dict[str, KVFormat] = {f.storage: f for f in KV_FORMATS.values() if f.scaled}


def stored_format(cache_dtype) -> KVFormat | None:
    """The scaled KV format whose cache arrays have dtype ``cache_dtype``
    (uint8: fp8 e4m3 bits), or None (a cache of plain values)."""
    return _STORED.get(np.dtype(cache_dtype).name)


# Query heads one CTA of the partial kernel serves (plan.heads_per_cta picks
# the largest divisor of the GQA group size in this range).
HEADS_PER_CTA: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)

# Dynamic shared memory of an MMA-core CTA in KB (cuda_src/attend_mma.cuh
# CUPAGED_MMA_SMEM_KB; compiled in and passed at launch, so both agree). 72 KB
# holds a 2-stage ring of 4 warps at head_dim 128 (2 CTAs per SM, the
# register limit). Env CUPAGED_MMA_SMEM_KB overrides it (tuning experiments;
# read at import).
ENV_MMA_SMEM_KB = _env.MMA_SMEM_KB
MMA_SMEM_KB: int = _env.mma_smem_kb()
# Warps per MMA-core CTA and the CTAs per SM its register budget allows
# (CUPAGED_MMA_WARPS / CUPAGED_MMA_MIN_BLOCKS in attend_mma.cuh; env overrides
# for tuning experiments, read at import). Each warp runs its own serial
# chain (copy, QK^T, softmax, PV), so warps per SM, not ring depth, set the
# pace: on the H200 4 warps beat 2 by up to 1.5x at batch 1 and tie elsewhere
# (2 vs 4 stages made no difference; scripts/autotune.py, 2026-11-29).
MMA_WARPS: int = _env.mma_warps()  # 1..32; a bad value fails the import, naming the variable
MMA_MIN_BLOCKS: int = _env.mma_min_blocks()
# Whether the CTA shape is the default one, the shape every measured count below
# comes from (an env override is an experiment: one shape for every module).
DEFAULT_CTA_SHAPE: bool = (MMA_SMEM_KB, MMA_WARPS, MMA_MIN_BLOCKS) == (72, 4, 2)
# The fp8 tensor-core instances use 136-142 registers (16-bit: 174), so 3 CTAs
# fit per SM, which the planner must count (the driver's occupancy query on
# the H200, scripts/occupancy.py; docs/benchmarks/occupancy-h200-2026-12-01.csv).
# Measured for the default CTA shape only: any override keeps the bound.
# (The head_dim-64 16-bit and float32 CUDA-core instances fit more than their
# bound too; their plans were not re-measured, so they keep it.)
MMA_FP8_RESIDENT_CTAS: int = 3 if DEFAULT_CTA_SHAPE else MMA_MIN_BLOCKS
# (that count holds up to head_dim 128; at 192 the fp8 instances take ~200
# registers: mma_traits)

# Programmatic dependent launch of the partial kernel's tensor-core instances
# (on unless env CUPAGED_PDL=0, read at import: the kernel's griddepcontrol
# instructions are compiled in only then (module_pdl), and its launches on
# sm_90+ go through cuLaunchKernelEx with _launch.residency_smem). H200:
# small cells in a graph of layers 4-13 % faster; the CUDA-core instances
# lost with it (docs/benchmarks/h200-pdl-residency-2026-12-02.md).
PDL: bool = _env.pdl()

# Attention cores of the partial kernel (enum Core in paged_decode_partial.cu):
# name -> (C++ enumerator, threads per CTA, dtypes, head dims it serves).
# Tensor cores for 16-bit KV up to head_dim 192 (MMA_HEAD_DIMS; at 256 the
# accumulators no longer fit in registers); CUDA cores for everything, float32 included (tf32
# would break its 1e-5 tolerance). Dispatch prefers the first core listed in
# CORE_PREFERENCE that serves the call (env CUPAGED_CORE overrides).
# A core's dtypes are module variants (see variant()): "float16+float8_e4m3fn"
# is fp16 q over an fp8 cache, served by the tensor cores only (the CUDA-core
# mapping would need twice the registers per lane for 16 fp8 elements).
# The tensor cores' head dims per KV width ({fp8: dims}; core_head_dims). 16-bit
# rows (RowsTile) keep O as 16 rows x head_dim f32 accumulators, which at 192
# would be 96 registers a lane (255 registers and 300 bytes of spills, NVRTC
# sm_90); so 16-bit above 128, like fp8, runs the transposed tile (ColsTile:
# O^T, half of that; mma_cols). 256 runs on the CUDA cores; fp8 80 has no
# instance (ColsTile's fp8 blocks are 32 dims).
MMA_HEAD_DIMS: dict[bool, tuple[int, ...]] = {False: (64, 80, 96, 128, 192), True: (64, 96, 128, 192)}
CORES: dict[str, tuple[str, int, tuple[str, ...], tuple[int, ...]]] = {
    "simt": ("cupaged::Core::SIMT", 128, ("float16", "bfloat16", "float32"), HEAD_DIMS),
    "mma": ("cupaged::Core::MMA", 32 * MMA_WARPS,
             ("float16", "bfloat16", f"float16+{FP8}", f"bfloat16+{FP8}"),
             tuple(sorted({*MMA_HEAD_DIMS[False], *MMA_HEAD_DIMS[True]}))),
}
CORE_PREFERENCE: tuple[str, ...] = ("mma", "simt")


def pairs_text() -> str:
    """The supported q/KV dtype pairs, for error messages."""
    return ", ".join(f"{q} q with {kv} KV" for q, kvs in KV_DTYPES.items() for kv in kvs)


def variant(dtype: str, kv_dtype: str | None = None) -> str:
    """Module variant name of (q dtype, KV dtype): the q dtype when they agree,
    else ``"<q>+<kv>"``; ``ValueError`` listing the supported pairs."""
    if kv_dtype is None or kv_dtype == dtype:
        return dtype
    if kv_dtype not in KV_DTYPES.get(dtype, ()):
        raise ValueError(f"unsupported q/KV dtype pair {dtype}/{kv_dtype}; supported: {pairs_text()}")
    return f"{dtype}+{kv_dtype}"


def is_fp8(variant_name: str) -> bool:
    """Whether a module variant reads an fp8 (e4m3) cache: the one spelling
    of that test (a mixed variant is always q over fp8 KV).

    >>> is_fp8("float16+float8_e4m3fn"), is_fp8("bfloat16")
    (True, False)
    """
    return split_variant(variant_name)[1] == FP8


def split_variant(name: str) -> tuple[str, str]:
    """(q dtype, KV dtype) of a module variant name."""
    q, _, kv = name.partition("+")
    return q, kv or q


def _storage(variant_name: str) -> str:
    """C++ template arguments ``T, KV`` of a variant."""
    q, kv = split_variant(variant_name)
    return f"{DTYPES[q]}, {KV_STORAGE.get(kv, DTYPES.get(kv))}"


# kernel family -> source file in cuda_src/
SOURCES: dict[str, str] = {
    "partial": "paged_decode_partial.cu",
    # the partial kernel over row groups (several query tokens per request);
    # its own modules, so a plain decode never compiles them
    "rows": "paged_decode_partial.cu",
    # the same kernel on 8-warp CTAs, one per SM (wide_rows): row-group plans
    # held to one CTA per SM (small grids), 16-bit KV at head_dim 128
    "rows8": "paged_decode_partial.cu",
    "v1": "paged_decode_v1.cu",
    "merge": "merge_states.cu",
    "append": "append_kv.cu",
}

# append_kv (cuda_src/append_kv.cu) takes head_dim at run time: one module per
# new-token dtype, keyed head_dim APPEND_ANY_HEAD_DIM. Its instances write a
# cache of the same dtype or of float8 e4m3fn bits (KV_STORAGE[FP8]).
APPEND_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")
APPEND_ANY_HEAD_DIM = 0
APPEND_CACHE_TYPES: tuple[str, ...] = ("same", FP8)  # index = instance index
# the partial kernel's families -> its __global__ function
PARTIAL_FAMILIES: dict[str, str] = {"partial": "paged_decode_partial", "rows": "paged_decode_rows",
                                    "rows8": "paged_decode_rows"}
# Family rows8's CTA: (warps, CTAs per SM). A row-group plan held to one
# 4-warp CTA per SM (schedule.residency_choices: small grids, where fewer
# chunks mean a cheaper merge) leaves one warp per scheduler to wait on each
# MMA and shuffle; the same grid of 8-warp CTAs (the SM's 8 warps, as 2 CTAs
# of 4 give a large grid) ran batch-1 q_len 4-8 4-12 % faster (H200,
# docs/architecture.md "Eight warps for one-per-SM row groups").
WIDE_ROWS_SHAPE: tuple[int, int] = (8, 1)


_NAMES = {np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16",
          np.dtype(np.float32): "float32"}


def dtype_name(dtype) -> str:
    """Canonical name of a KV/query dtype; ``ValueError`` when unsupported."""
    name = _NAMES.get(dtype) if isinstance(dtype, np.dtype) else None  # the hot path: a dict hit
    if name is not None:
        return name
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None and dt == np.dtype(ml_dtypes.bfloat16):
        return "bfloat16"
    if dt is None or dt.name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return dt.name


def check_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"unsupported head_dim {head_dim}; the kernels support {', '.join(map(str, HEAD_DIMS))}"
        )


def name_expressions(family: str, dtype: str, head_dim: int) -> list[str]:
    """Template instances of one compiled module: (family, dtype, head_dim);
    ``dtype`` is a module variant (:func:`variant`) for the partial family
    (rows8: the tensor-core instances where :func:`wide_rows`, else none)."""
    if family in PARTIAL_FAMILIES:
        return [f"cupaged::{PARTIAL_FAMILIES[family]}<{_storage(dtype)}, {head_dim}, {h}, {core}>"
                for name, (core, _, _, _) in CORES.items() if serves(name, dtype, head_dim)
                and (family != "rows8" or (name == "mma" and wide_rows(dtype, head_dim)))
                for h in HEADS_PER_CTA]
    t = DTYPES[dtype]
    if family == "v1":
        return [f"cupaged::paged_decode_v1<{t}, {head_dim}>"]
    if family == "merge":  # dtype is the output dtype
        return [f"cupaged::merge_states<{t}, {head_dim}>"]
    if family == "append":  # dtype is k_new's; head_dim is a run-time argument
        return [f"cupaged::append_kv<{t}, {t if c == 'same' else KV_STORAGE[c]}>" for c in APPEND_CACHE_TYPES]
    raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(SOURCES)}")


def core_head_dims(core: str, dtype: str) -> tuple[int, ...]:
    """The head dims ``core`` serves for a module variant (none when it
    does not serve the dtype; the tensor cores' per KV width:
    ``MMA_HEAD_DIMS``)."""
    _, _, dtypes, dims = CORES[core]
    if dtype not in dtypes:
        return ()
    return MMA_HEAD_DIMS[is_fp8(dtype)] if core == "mma" else dims


def serves(core: str, dtype: str, head_dim: int) -> bool:
    return head_dim in core_head_dims(core, dtype)


def choose_core(dtype: str, head_dim: int, requested: str | None = None) -> str:
    """The partial kernel's core for (dtype, head_dim): ``requested`` when it
    serves them (else ValueError), otherwise the first of CORE_PREFERENCE."""
    if requested is not None:
        if requested not in CORES:
            raise ValueError(f"unknown core {requested!r}; known: {', '.join(CORES)}")
        if not serves(requested, dtype, head_dim):
            raise ValueError(f"core {requested!r} does not serve {dtype} with head_dim {head_dim}")
        return requested
    for c in CORE_PREFERENCE:
        if serves(c, dtype, head_dim):
            return c
    served = "; ".join(f"{c} core: head_dim {', '.join(map(str, core_head_dims(c, dtype)))}"
                       if core_head_dims(c, dtype) else f"{c} core: none" for c in CORE_PREFERENCE)
    raise ValueError(f"no kernel serves {dtype} with head_dim {head_dim} (for {dtype}: {served})")


class MmaTraits(NamedTuple):
    """What a tensor-core instance of one (KV format, head_dim) needs: the
    one place a new head dim's shared memory and occupancy are stated."""

    smem_kb: int        # dynamic shared memory per CTA (page-id window + a K/V ring of >= 2 stages)
    resident_ctas: int  # CTAs per SM its registers and shared memory allow (what the planner counts)


PAGE_WINDOW_BYTES = 256 * 4  # cuda_src/attend.cuh PAGE_WINDOW page ids
SM_SMEM_KB = 228  # shared memory per SM (sm_90), 1 KB of it reserved per CTA


def mma_traits(variant_name: str, head_dim: int, family: str = "partial") -> MmaTraits:
    """The :class:`MmaTraits` of a tensor-core instance. Shared memory:
    ``MMA_SMEM_KB`` (72: 2-3 ring stages up to head_dim 128), or what two
    stages of the row layout take when that is more (16-bit head_dim 192:
    97 KB; rows as MmaLayout in attend_mma.cuh: whole 128-byte lines, else
    padded by 16 bytes). Resident CTAs: ``MMA_MIN_BLOCKS`` (the
    ``__launch_bounds__`` minimum), 3 for fp8 up to head_dim 128
    (``MMA_FP8_RESIDENT_CTAS``), then what the shared memory allows.

    >>> mma_traits("float16", 128), mma_traits("float16", 192), mma_traits("float16+float8_e4m3fn", 128)
    (MmaTraits(smem_kb=72, resident_ctas=2), MmaTraits(smem_kb=97, resident_ctas=2), MmaTraits(smem_kb=72, resident_ctas=3))
    """
    fp8 = is_fp8(variant_name)
    data = head_dim * (1 if fp8 else 2)
    row = data if data % 128 == 0 else data + 16
    warps, min_blocks = cta_shape(family)
    ring = 2 * warps * 2 * 16 * row  # 2 stages x warps x (K, V) x 16 tokens
    smem_kb = max(MMA_SMEM_KB, -(-(ring + PAGE_WINDOW_BYTES) // 1024))
    ctas = MMA_FP8_RESIDENT_CTAS if fp8 and head_dim <= 128 else min_blocks
    return MmaTraits(smem_kb, min(ctas, SM_SMEM_KB // (smem_kb + 1)))


def cta_shape(family: str) -> tuple[int, int]:
    """(warps per tensor-core CTA, its ``__launch_bounds__`` CTAs per SM) of a
    partial-kernel family: :data:`WIDE_ROWS_SHAPE` for rows8, else
    ``MMA_WARPS`` and ``MMA_MIN_BLOCKS``."""
    return WIDE_ROWS_SHAPE if family == "rows8" else (MMA_WARPS, MMA_MIN_BLOCKS)


def wide_rows(dtype: str, head_dim: int) -> bool:
    """Whether family rows8 has instances for a module variant: 16-bit KV at
    head_dim 128 (where plans weigh one CTA per SM and it was measured), at
    the default CTA shape (:data:`DEFAULT_CTA_SHAPE`)."""
    return DEFAULT_CTA_SHAPE and dtype in ("float16", "bfloat16") and head_dim == 128


def rows_family(dtype: str, head_dim: int, core: str, ctas_per_sm: int) -> str:
    """The family that launches a row-group plan: rows8 when the plan holds
    one CTA per SM and rows8 serves it on ``core``, else rows.

    >>> rows_family("float16", 128, "mma", 1), rows_family("float16", 128, "mma", 2)
    ('rows8', 'rows')
    >>> rows_family("float16", 64, "mma", 1), rows_family("float16", 128, "simt", 1)
    ('rows', 'rows')
    """
    return "rows8" if ctas_per_sm == 1 and core == "mma" and wide_rows(dtype, head_dim) else "rows"


def resident_ctas(variant_name: str, head_dim: int, heads: int, core: str, family: str = "partial") -> int:
    """CTAs per SM the planner counts for a partial-kernel instance (its
    ``__launch_bounds__`` minimum): :func:`mma_traits` for the tensor cores,
    3 (``heads`` <= 4) or 1 (``MinBlocks`` in attend.cuh) for the CUDA cores."""
    if core == "mma":
        return mma_traits(variant_name, head_dim, family).resident_ctas
    return 3 if heads <= 4 else 1


def dynamic_smem(core: str, variant_name: str, head_dim: int, family: str = "partial") -> int:
    """Bytes of dynamic shared memory a partial-kernel CTA of ``core`` takes."""
    return mma_traits(variant_name, head_dim, family).smem_kb * 1024 if core == "mma" else 0


def nvrtc_defines(smem_kb: int | None = None, pdl: bool = PDL, shape: tuple[int, int] | None = None) -> tuple[str, ...]:
    """Preprocessor options that must match the launch parameters above
    (``smem_kb``: a module's MMA shared memory, default ``MMA_SMEM_KB``;
    ``pdl``: its launches may use programmatic dependent launch; ``shape``:
    its :func:`cta_shape`, default ``MMA_WARPS``, ``MMA_MIN_BLOCKS``)."""
    warps, min_blocks = shape or (MMA_WARPS, MMA_MIN_BLOCKS)
    return (f"-DCUPAGED_MMA_SMEM_KB={MMA_SMEM_KB if smem_kb is None else smem_kb}", f"-DCUPAGED_MMA_WARPS={warps}",
            f"-DCUPAGED_MMA_MIN_BLOCKS={min_blocks}", *(("-DCUPAGED_PDL=1",) if pdl else ()))


def module_pdl(family: str, dtype: str, head_dim: int) -> bool:
    """Whether a module is compiled for programmatic dependent launch: only
    partial-kernel modules with tensor-core instances (whose tensor-core
    launches use it). H200, PDL on vs off: the tensor-core instances at
    0.870-1.004x the time on the cells measured (with
    :func:`cupaged._launch.residency_smem`); the CUDA-core ones up to 1.26x
    (head_dim 256), and 1.68x with the cap (group 8, 1 planned CTA per SM),
    so they keep the ordinary launch."""
    return PDL and family in PARTIAL_FAMILIES and serves("mma", dtype, head_dim)


def module_smem_kb(family: str, dtype: str, head_dim: int) -> int:
    """The MMA shared memory a module is compiled for: its tensor-core
    instances' :func:`mma_traits` (``MMA_SMEM_KB`` for a module without)."""
    if family in PARTIAL_FAMILIES and serves("mma", dtype, head_dim):
        return mma_traits(dtype, head_dim, family).smem_kb
    return MMA_SMEM_KB


def partial_instance(dtype: str, head_dim: int, heads_per_cta: int, core: str,
                     family: str = "partial") -> tuple[int, int]:
    """(index into name_expressions(family, dtype, ...), threads per CTA) of
    one instance of the partial kernel (``family`` "partial", or "rows" /
    "rows8" for plans with row groups: :func:`rows_family`); ``dtype`` is a
    module variant."""
    if not serves(core, dtype, head_dim):
        raise ValueError(f"core {core!r} does not serve {dtype} with head_dim {head_dim}")
    name = f"cupaged::{PARTIAL_FAMILIES[family]}<{_storage(dtype)}, {head_dim}, {heads_per_cta}, {CORES[core][0]}>"
    threads = 32 * cta_shape(family)[0] if core == "mma" else CORES[core][1]
    return name_expressions(family, dtype, head_dim).index(name), threads


def mma_cols(dtype: str, head_dim: int) -> bool:
    """Whether a tensor-core instance runs the transposed tile (cuda_src
    MmaCols: fp8 KV, or 16-bit KV above head_dim 128) rather than the rows
    tile."""
    return is_fp8(dtype) or head_dim > 128


def tokens_per_cta(dtype: str, head_dim: int, heads_per_cta: int, core: str) -> int:
    """Query tokens of one request a "rows" CTA serves per read of its K/V
    (cuda_src AttendCore::PAIR_TOKENS), the most a plan's row group holds:
    a warp's tensor-core tile holds 16 M rows (RowsTile) or 8 N columns
    (ColsTile: :func:`mma_cols`) over the CTA's heads; RowsTile at a
    power-of-two ``heads_per_cta`` runs a group of more tokens than that on
    warp pairs sharing each K/V tile, twice the tokens (AttendCore::PAIRS);
    the CUDA-core core serves one token at a time.

    >>> tokens_per_cta("float16", 128, 4, "mma"), tokens_per_cta("float16+float8_e4m3fn", 128, 4, "mma")
    (8, 2)
    >>> tokens_per_cta("float16", 128, 3, "mma"), tokens_per_cta("float16", 128, 3, "simt")
    (5, 1)
    """
    pairs = core == "mma" and not mma_cols(dtype, head_dim) and heads_per_cta & (heads_per_cta - 1) == 0
    return (2 if pairs else 1) * tokens_per_warp(dtype, head_dim, heads_per_cta, core)


def tokens_per_warp(dtype: str, head_dim: int, heads_per_cta: int, core: str) -> int:
    """Query tokens one warp's tensor-core tile holds (cuda_src
    AttendCore::TOKENS): 16 M rows (RowsTile) or 8 N columns (ColsTile) over
    the CTA's heads; 1 on the CUDA-core core.

    >>> tokens_per_warp("float16", 128, 4, "mma"), tokens_per_warp("float16+float8_e4m3fn", 128, 4, "mma")
    (4, 2)
    """
    if core != "mma":
        return 1
    return (8 if mma_cols(dtype, head_dim) else 16) // heads_per_cta


def all_modules() -> list[tuple[str, str, int]]:
    """Every (family, dtype, head_dim) module the library can compile (the
    partial family also over its mixed q/KV variants)."""
    mods = ([(f, d, h) for f in SOURCES if f != "append" for d in DTYPES for h in HEAD_DIMS]
            + [("append", d, APPEND_ANY_HEAD_DIM) for d in APPEND_DTYPES])
    mixed = sorted({d for _, _, dtypes, _ in CORES.values() for d in dtypes if is_fp8(d)})
    mods += [(f, d, h) for f in PARTIAL_FAMILIES for d in mixed for h in HEAD_DIMS
             if any(serves(c, d, h) for c in CORES)]
    return [m for m in mods if m[0] != "rows8" or wide_rows(m[1], m[2])]  # (rows8: wide_rows only)
