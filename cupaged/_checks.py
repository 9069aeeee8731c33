"""Argument checks of the decode entry points (:func:`cupaged.decode`,
:class:`cupaged.DecodeRunner`, :func:`cupaged.cascade_decode`): shapes,
dtypes, layouts, devices, plans and score arguments, each an O(1)
comparison of attributes the caller's arrays already carry (no device
sync, no allocation: decode's checked path runs them every call). The full
checks that read device memory are in cupaged/_validate.py and run only
with ``decode(..., validate=True)``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

from . import _configs, _env
from ._arrays import as_cupy, check_float32
from ._validate import check_plan_structure, plan_mismatch_reason
from .errors import (ArgumentTypeError, DeviceMismatchError, DTypeError, InvalidArgumentError, LayoutError,
                     PlanMismatchError, ShapeError, UnsupportedConfigError)
from .page_table import PageTable
from .plan import DecodePlan

LOG2E = 1.0 / math.log(2.0)

# Every check here is an O(1) comparison of attributes the caller's arrays
# already carry: no device sync, no allocation (the decode hot path, issue 5).
# The full checks that read device memory live in cupaged/_validate.py and run
# only with ``decode(..., validate=True)``.
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


def check_inputs(q, k_cache, v_cache, table: PageTable) -> str:
    """Shape/dtype/device checks that cost no device sync; returns the dtype name."""
    if not isinstance(table, PageTable):
        raise ArgumentTypeError(f"table must be a cupaged.PageTable, got {type(table).__name__}")
    if q.ndim != 3:
        raise ShapeError(f"q must be 3-D [batch, num_qo_heads, head_dim], got shape {q.shape}")
    if k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ShapeError(
            "k_cache and v_cache must be 4-D [num_pages, page_size, num_kv_heads, head_dim] (NHD), "
            f"got shapes {k_cache.shape} and {v_cache.shape}"
        )
    if k_cache.shape != v_cache.shape:
        raise ShapeError(f"k_cache and v_cache must have one shape, got {k_cache.shape} and {v_cache.shape}")
    name = dtype_variant(q.dtype, k_cache.dtype, v_cache.dtype)
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_qo_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ShapeError(
            f"q's head_dim (q.shape[2] = {q_dim}) must equal the caches' head_dim (k_cache.shape[3] = {head_dim})"
        )
    if not (num_kv_heads and num_qo_heads and head_dim) or num_qo_heads % num_kv_heads:
        raise_heads(num_qo_heads, num_kv_heads, head_dim)
    if page_size != table.page_size:
        raise ShapeError(
            f"the caches' page_size ({page_size}: k_cache.shape[1] for NHD, shape[2] for HND) must equal "
            f"table.page_size ({table.page_size})"
        )
    if batch != table.batch_size:
        raise ShapeError(f"q's batch (q.shape[0] = {batch}) must equal table.batch_size ({table.batch_size} requests)")
    table.check_page_ids(num_pages)
    if not (q.data.device_id == k_cache.data.device_id == v_cache.data.device_id):
        raise DeviceMismatchError(
            "q, k_cache and v_cache must be on one device, got devices "
            f"{q.data.device_id}, {k_cache.data.device_id}, {v_cache.data.device_id}"
        )
    return name


def dtype_variant(q_dtype, k_dtype, v_dtype) -> str:
    """Module variant of (q, caches): the shared dtype's name, or
    ``"<q>+float8_e4m3fn"`` for uint8 (e4m3 bits) caches under a 16-bit q
    (``_configs.stored_format``)."""
    fmt = _configs.stored_format(k_dtype)
    if k_dtype != v_dtype or not (fmt is not None or q_dtype == k_dtype):
        raise DTypeError(
            f"q, k_cache and v_cache must share one dtype, or the caches hold fp8 (uint8 e4m3 bits) under a "
            f"float16/bfloat16 q; got {q_dtype}, {k_dtype}, {v_dtype}"
        )
    try:
        name = _configs.dtype_name(q_dtype)
        return name if fmt is None else _configs.variant(name, fmt.name)
    except ValueError:
        raise DTypeError(
            f"q has dtype {q_dtype} and the caches {k_dtype}, which no kernel serves; supported: "
            f"{_configs.pairs_text()} "
            "(an fp8 cache is a uint8 array of float8_e4m3fn bits)"
        ) from None


def raise_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int):
    if not head_dim:
        raise ShapeError("head_dim (q.shape[2]) must be >= 1, got 0")
    if not num_kv_heads or not num_qo_heads:
        raise ShapeError(
            f"num_qo_heads (q.shape[1] = {num_qo_heads}) and num_kv_heads (k_cache.shape[2] = {num_kv_heads}) "
            "must be >= 1"
        )
    raise ShapeError(
        f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads}): "
        "each KV head serves a group of query heads"
    )


def raise_not_current(q):
    """The kernels launch on the current device: q (hence k, v, out) must be there."""
    import cupy

    raise DeviceMismatchError(
        f"q, k_cache and v_cache are on device {q.data.device_id} but the current device is "
        f"{cupy.cuda.runtime.getDevice()}; call decode inside `with cupy.cuda.Device({q.data.device_id}):`"
    )


def check_sm_scale(sm_scale) -> float:
    """``sm_scale * log2(e)``, the kernels' float32 scale; it must be finite."""
    try:
        value = float(sm_scale)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"sm_scale must be a real number or None, got {sm_scale!r}") from None
    scale = value * LOG2E
    if not math.isfinite(scale) or abs(scale) > F32_MAX:
        raise InvalidArgumentError(
            f"sm_scale must be finite, with |sm_scale * log2(e)| within float32 range, got {sm_scale!r}"
        )
    return scale


def kernel_decline_reason(q, k_cache, v_cache, method: str = "v2", variant: str = "") -> str | None:
    """Why the CUDA kernels of ``method`` cannot serve these tensors (None
    when they can).

    On the hot path: plain attribute reads and one OR per array (no
    generators); the alignment test ORs the pointer and the strides, so one
    ``& 15`` covers them all (negative strides included)."""
    head_dim = q.shape[-1]
    if head_dim not in _configs.HEAD_DIMS:
        return f"head_dim {head_dim} has no kernel instance (supported: {_configs.HEAD_DIMS})"
    if _configs.is_fp8(variant):  # fp8 KV: tensor cores only
        if method == "v1" or not _configs.serves("mma", variant, head_dim):
            dims = ", ".join(map(str, _configs.core_head_dims("mma", variant)))
            return (f"v1 has no fp8 KV instance (v2 serves fp8 at head_dim {dims})" if method == "v1"
                    else f"no kernel serves fp8 KV at head_dim {head_dim} (v2 serves it at {dims})")
        cc = compute_capability(q.data.device_id)
        if cc < 89:
            return f"fp8 KV needs compute capability 8.9+ (cvt from e4m3), this GPU has {cc // 10}.{cc % 10}"
    qs, ks, vs = q.strides, k_cache.strides, v_cache.strides
    if qs[2] != q.itemsize or ks[3] != k_cache.itemsize or vs[3] != v_cache.itemsize:
        name = "q" if qs[2] != q.itemsize else "k_cache" if ks[3] != k_cache.itemsize else "v_cache"
        return f"{name}'s head_dim is not contiguous"
    if ((q.data.ptr | qs[0] | qs[1]) & 15 or (k_cache.data.ptr | ks[0] | ks[1] | ks[2]) & 15
            or (v_cache.data.ptr | vs[0] | vs[1] | vs[2]) & 15):
        name = ("q" if (q.data.ptr | qs[0] | qs[1]) & 15 else
                "k_cache" if (k_cache.data.ptr | ks[0] | ks[1] | ks[2]) & 15 else "v_cache")
        return f"{name} is not 16-byte aligned (base pointer or strides)"
    return None


@functools.lru_cache(maxsize=16)
def compute_capability(device_id: int) -> int:
    """Compute capability of a device as major * 10 + minor (cached)."""
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def check_out(out, q):
    out = as_cupy(out, "out")
    if out.shape != q.shape:
        raise ShapeError(f"out must have q's shape {q.shape}, got {out.shape}")
    if out.dtype != q.dtype:
        raise DTypeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
    if out.size and out.strides[-1] != out.itemsize:  # (CuPy gives an empty array all-zero strides)
        raise LayoutError(
            f"out's head_dim must be contiguous (last stride {out.itemsize} bytes), got strides {out.strides}"
        )
    if out.data.device_id != q.data.device_id:
        raise DeviceMismatchError(f"out must be on q's device {q.data.device_id}, got device {out.data.device_id}")
    return out


def check_lse(lse, q):
    """``lse`` as a CuPy array if it can receive q's LSE: C-contiguous
    float32 ``[batch, num_qo_heads]`` on q's device (decode's and
    DecodeRunner.run's check; the runner passes q's rows it serves)."""
    return check_float32(as_cupy(lse, "lse"), "lse", q.shape[:2], q.data.device_id, "q", " (q's first two)")


def check_plan(plan: DecodePlan, table: PageTable, q, k_cache, dtype_name: str) -> None:
    check_plan_for(plan, table, q.shape[1], k_cache.shape[2], q.shape[2], dtype_name)


def check_plan_for(plan: DecodePlan, table: PageTable, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   dtype_name: str) -> None:
    """Raises unless ``plan`` is a consistent DecodePlan for these shapes, this
    module variant and ``table`` (decode's and DecodeRunner.plan's check)."""
    if not isinstance(plan, DecodePlan):
        raise ArgumentTypeError(
            f"plan must be a cupaged.DecodePlan from plan_decode or None, got {type(plan).__name__}"
        )
    expected = (num_qo_heads, num_kv_heads, head_dim, dtype_name)
    got = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan_variant(plan))
    if got != expected:
        raise PlanMismatchError(
            f"plan was built for (num_qo_heads, num_kv_heads, head_dim, dtype[+kv_dtype]) = {got}, "
            f"the call has {expected}"
        )
    check_plan_structure(plan)  # once per plan object; plan_decode's own plans pass at once
    if not plan.matches(table):
        raise PlanMismatchError(
            f"stale plan: {plan_mismatch_reason(plan, table)}; build a new one with plan_decode(table, ...)"
        )


def plan_variant(plan: DecodePlan) -> str:
    """Module variant of a plan's (dtype, kv_dtype)."""
    kv = getattr(plan, "kv_dtype", None)
    q = _configs.dtype_name(plan.dtype)
    return q if kv is None or kv == plan.dtype else _configs.variant(q, np.dtype(kv).name)


def check_core(dtype_name: str, head_dim: int) -> None:
    """Env CUPAGED_CORE, read where a plan's launch state is first built."""
    requested = _env.core()
    if requested is None:
        return
    try:
        _configs.choose_core(dtype_name, head_dim, requested)
    except ValueError as e:
        raise UnsupportedConfigError(f"{_env.CORE}={requested!r}: {e}") from None


class ScoreArgs(NamedTuple):
    """The kernels' score arguments (cuda_src/paged_decode_partial.cu):
    base-2 logits ``s = (q.k) * scale * k_head_scale[h]``, then with a soft
    cap ``s = soft_cap * tanh(s)``; the output times ``v_scale *
    v_head_scale[h]``. The per-head arrays are float32 CuPy ``[Hkv]`` or None;
    ``sinks`` float32 CuPy ``[Hq]`` (natural-log sink logits) or None."""

    scale: float
    soft_cap: float = 0.0
    v_scale: float = 1.0
    k_head_scale: Any = None
    v_head_scale: Any = None
    sinks: Any = None


def check_sinks(sinks, q):
    """``sinks`` as a CuPy array the kernels can read: C-contiguous float32
    ``[num_qo_heads]`` on q's device (values not checked, as the scales')."""
    return check_float32(as_cupy(sinks, "sinks"), "sinks", (q.shape[1],), q.data.device_id, "q",
                         " (num_qo_heads)")


def scale_value(x, name: str) -> float:
    """A per-tensor k/v scale (decode's and append_kv's rule): a positive
    normal float32, as the kernels take it (1e39 would be inf, 1e-50 zero)
    and so that its reciprocal (append_kv's quantization) is finite."""
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"{name} must be a real number, got {x!r}") from None
    if not (math.isfinite(value) and F32_TINY <= value <= F32_MAX):
        raise InvalidArgumentError(
            f"{name} must be positive, finite and a normal float32 ({F32_TINY:.3g} to {F32_MAX:.3g}, so its "
            f"reciprocal is finite), got {x!r}")
    return value


def check_scale_array(arr, name: str, num_kv_heads: int) -> None:
    """A per-head k/v scale's metadata (decode's and append_kv's rule):
    float32 ``[num_kv_heads]``, or ``[1]`` for every head; never cast."""
    if tuple(arr.shape) not in ((num_kv_heads,), (1,)):
        raise ShapeError(f"{name} must have shape ({num_kv_heads},) (one per kv head) or (1,), got {tuple(arr.shape)}")
    if arr.dtype != np.float32:
        raise DTypeError(f"{name} must be float32, got {arr.dtype}; it is never cast")


def scale_arg(x, name: str, num_kv_heads: int, q):
    """(per-tensor float, per-head float32 CuPy array or None) of a k/v scale."""
    if x is None:
        return 1.0, None
    if isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return scale_value(x, name), None
    arr = as_cupy(x, name)
    check_scale_array(arr, name, num_kv_heads)
    if arr.data.device_id != q.data.device_id:
        raise DeviceMismatchError(f"{name} must be on q's device {q.data.device_id}, got device {arr.data.device_id}")
    if arr.shape != (num_kv_heads,):  # (1,): one scale for every head
        arr = arr.repeat(num_kv_heads)
    return 1.0, arr if arr.flags.c_contiguous else arr.copy()


def score_args(sm_scale, head_dim: int, logits_soft_cap, k_scale, v_scale, num_kv_heads: int, q) -> ScoreArgs:
    """The kernels' score arguments of one call (see ScoreArgs)."""
    sm = 1.0 / math.sqrt(head_dim) if sm_scale is None else check_sm_scale(sm_scale) / LOG2E
    k_mult, k_arr = scale_arg(k_scale, "k_scale", num_kv_heads, q)
    v_mult, v_arr = scale_arg(v_scale, "v_scale", num_kv_heads, q)
    cap = 0.0
    if logits_soft_cap is not None:
        try:
            cap = float(logits_soft_cap)
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"logits_soft_cap must be a number or None, got {logits_soft_cap!r}") from None
        if not math.isfinite(cap) or cap < 0:
            raise InvalidArgumentError(f"logits_soft_cap must be finite and >= 0 (0 or None: off), got {logits_soft_cap!r}")
    if cap > 0:
        scale, soft_cap = sm * k_mult / cap, cap * LOG2E
    else:
        scale, soft_cap = sm * k_mult * LOG2E, 0.0
    if not (math.isfinite(scale) and (scale == 0 or F32_TINY <= abs(scale) <= F32_MAX)
            and abs(soft_cap) <= F32_MAX):
        raise InvalidArgumentError(
            "sm_scale * k_scale (/ logits_soft_cap) * log2(e) must be a normal float32 (or 0), "
            f"got {scale!r}")
    return ScoreArgs(scale, soft_cap, v_mult, k_arr, v_arr)


def call_scores(sm_scale, head_dim: int, logits_soft_cap, k_scale, v_scale, sinks, num_kv_heads: int,
                q) -> ScoreArgs:
    """A call's :class:`ScoreArgs` (decode's and DecodeRunner.run's); the
    common call (at most ``sm_scale``) skips :func:`score_args`' checks."""
    if logits_soft_cap is None and k_scale is None and v_scale is None:
        scores = ScoreArgs((1.0 / math.sqrt(head_dim)) * LOG2E if sm_scale is None else check_sm_scale(sm_scale))
    else:
        scores = score_args(sm_scale, head_dim, logits_soft_cap, k_scale, v_scale, num_kv_heads, q)
    return scores if sinks is None else scores._replace(sinks=check_sinks(sinks, q))


KV_LAYOUTS = ("NHD", "HND")


def nhd_views(k_cache, v_cache, kv_layout: str):
    """NHD views of the caches: HND ``[pages, Hkv, page_size, D]`` is the
    same memory with the token and head strides swapped (no copy)."""
    if kv_layout == "NHD":
        return k_cache, v_cache
    if kv_layout != "HND":
        raise LayoutError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ShapeError(
            "with kv_layout='HND', k_cache and v_cache must be 4-D [num_pages, num_kv_heads, page_size, head_dim], "
            f"got shapes {k_cache.shape} and {v_cache.shape}"
        )
    return k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)
