"""Dispatch: one decode call -> checks, then the v2, v1 or gather path.

v2 is one launch of the split-KV partial kernel. A request with one chunk is
written straight into ``out``; a request with several chunks writes float32
partials that the last of its CTAs merges (an atomic ticket, merge fused into
the same launch). Whether any request splits is known on the host from the
plan (``plan.needs_merge``): only then are the workspace and ticket counters
allocated and passed. Every output element is written by exactly one CTA, so
``out`` never keeps uninitialised memory. The standalone merge kernel
(:func:`cupaged.merge_states`) is the reusable public half.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from dataclasses import dataclass

import numpy as np

from . import _configs, _loader
from ._device import require_gpu
from .errors import (ArgumentTypeError, DeviceMismatchError, DTypeError, InvalidArgumentError, LayoutError,
                     PlanMismatchError, ShapeError, UnsupportedConfigError)
from .page_table import PageTable
from .plan import DecodePlan, plan_decode

METHODS = ("auto", "v2", "v1", "gather")
ENV_METHOD = "CUPAGED_DECODE"
ENV_CORE = "CUPAGED_CORE"  # "mma" or "simt": pins the partial kernel's core (benchmarks)
LOG2E = 1.0 / math.log(2.0)
_NULL = np.uint64(0)  # a null pointer kernel argument
_THREADS = 128  # NUM_THREADS / MERGE_THREADS in cuda_src


@dataclass(frozen=True)
class Selection:
    """The path a decode call takes and why; :func:`select_method` returns it.

    A frozen dataclass (compares by value, hashable).

    Fields:
        method: ``"v2"``, ``"v1"`` or ``"gather"`` (``"auto"`` is resolved,
            never returned).
        reason: a human-readable string: ``"requested"`` (that method was
            asked for, by argument or env ``CUPAGED_DECODE``), ``"auto: ..."``
            (what ``method="auto"`` picked), or ``"fallback from <method>:
            <why>"`` when the kernels decline the tensors and the gather path
            runs instead.

    Example:

    >>> import cupaged
    >>> sel = cupaged.Selection("gather", "requested")
    >>> sel.method, sel.reason
    ('gather', 'requested')
    """

    method: str  # "v2", "v1" or "gather"
    reason: str


# --------------------------------------------------------------------------- checks
# Every check here is an O(1) comparison of attributes the caller's arrays
# already carry: no device sync, no allocation (the decode hot path, issue 5).
# The full checks that read device memory live in cupaged/_validate.py and run
# only with ``decode(..., validate=True)``.
_F32_MAX = float(np.finfo(np.float32).max)


def _as_cupy(x, name: str):
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    if hasattr(x, "__dlpack__") and _dlpack_on_gpu(x):
        return cupy.from_dlpack(x)
    hint = f"; copy it to the GPU first, e.g. cupy.asarray({name})" if isinstance(x, np.ndarray) else ""
    raise ArgumentTypeError(
        f"{name} must be a CuPy array (or a CUDA array via __cuda_array_interface__ / DLPack), "
        f"got {type(x).__module__}.{type(x).__name__}{hint}"
    )


def _dlpack_on_gpu(x) -> bool:
    """True when a DLPack producer says its data lives on a CUDA device."""
    try:
        device_type = int(x.__dlpack_device__()[0])
    except Exception:  # no or a broken __dlpack_device__: let CuPy decide
        return True
    return device_type in (2, 13)  # kDLCUDA, kDLCUDAManaged


def _check_inputs(q, k_cache, v_cache, table: PageTable) -> str:
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
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise DTypeError(
            f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    try:
        name = _configs.dtype_name(q.dtype)
    except ValueError:
        raise DTypeError(
            f"q, k_cache and v_cache have dtype {q.dtype}, which no kernel serves; "
            f"supported: {', '.join(_configs.DTYPES)}"
        ) from None
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_qo_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ShapeError(
            f"q's head_dim (q.shape[2] = {q_dim}) must equal the caches' head_dim (k_cache.shape[3] = {head_dim})"
        )
    if not (num_kv_heads and num_qo_heads and head_dim) or num_qo_heads % num_kv_heads:
        _raise_heads(num_qo_heads, num_kv_heads, head_dim)
    if page_size != table.page_size:
        raise ShapeError(
            f"the caches' page_size (k_cache.shape[1] = {page_size}) must equal table.page_size ({table.page_size})"
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


def _raise_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int):
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


def _raise_not_current(q):
    """The kernels launch on the current device: q (hence k, v, out) must be there."""
    import cupy

    raise DeviceMismatchError(
        f"q, k_cache and v_cache are on device {q.data.device_id} but the current device is "
        f"{cupy.cuda.runtime.getDevice()}; call decode inside `with cupy.cuda.Device({q.data.device_id}):`"
    )


def _check_sm_scale(sm_scale) -> float:
    """``sm_scale * log2(e)``, the kernels' float32 scale; it must be finite."""
    try:
        value = float(sm_scale)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"sm_scale must be a real number or None, got {sm_scale!r}") from None
    scale = value * LOG2E
    if not math.isfinite(scale) or abs(scale) > _F32_MAX:
        raise InvalidArgumentError(
            f"sm_scale must be finite, with |sm_scale * log2(e)| within float32 range, got {sm_scale!r}"
        )
    return scale


def _kernel_decline_reason(q, k_cache, v_cache) -> str | None:
    """Why the CUDA kernels cannot serve these tensors (None when they can).

    On the hot path: plain attribute reads and one OR per array (no
    generators); the alignment test ORs the pointer and the strides, so one
    ``& 15`` covers them all (negative strides included)."""
    head_dim = q.shape[-1]
    if head_dim not in _configs.HEAD_DIMS:
        return f"head_dim {head_dim} has no kernel instance (supported: {_configs.HEAD_DIMS})"
    qs, ks, vs = q.strides, k_cache.strides, v_cache.strides
    isz = q.itemsize
    if qs[2] != isz or ks[3] != isz or vs[3] != isz:
        name = "q" if qs[2] != isz else "k_cache" if ks[3] != isz else "v_cache"
        return f"{name}'s head_dim is not contiguous"
    if ((q.data.ptr | qs[0] | qs[1]) & 15 or (k_cache.data.ptr | ks[0] | ks[1] | ks[2]) & 15
            or (v_cache.data.ptr | vs[0] | vs[1] | vs[2]) & 15):
        name = ("q" if (q.data.ptr | qs[0] | qs[1]) & 15 else
                "k_cache" if (k_cache.data.ptr | ks[0] | ks[1] | ks[2]) & 15 else "v_cache")
        return f"{name} is not 16-byte aligned (base pointer or strides)"
    return None


def _check_out(out, q):
    out = _as_cupy(out, "out")
    if out.shape != q.shape:
        raise ShapeError(f"out must have q's shape {q.shape}, got {out.shape}")
    if out.dtype != q.dtype:
        raise DTypeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
    if out.strides[-1] != out.itemsize:
        raise LayoutError(
            f"out's head_dim must be contiguous (last stride {out.itemsize} bytes), got strides {out.strides}"
        )
    if out.data.device_id != q.data.device_id:
        raise DeviceMismatchError(f"out must be on q's device {q.data.device_id}, got device {out.data.device_id}")
    return out


def _check_plan(plan: DecodePlan, table: PageTable, q, k_cache, dtype_name: str) -> None:
    if not isinstance(plan, DecodePlan):
        raise ArgumentTypeError(
            f"plan must be a cupaged.DecodePlan from plan_decode or None, got {type(plan).__name__}"
        )
    _, num_qo_heads, head_dim = q.shape
    expected = (num_qo_heads, k_cache.shape[2], head_dim, dtype_name)
    got = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, _configs.dtype_name(plan.dtype))
    if got != expected:
        raise PlanMismatchError(
            f"plan was built for (num_qo_heads, num_kv_heads, head_dim, dtype) = {got}, "
            f"the call has {expected}"
        )
    if not plan.matches(table):
        raise PlanMismatchError(
            "stale plan: the table's batch, page size or some request's chunk count changed; "
            "build a new one with plan_decode(table, ...)"
        )


def _check_core(dtype_name: str, head_dim: int) -> None:
    """Env CUPAGED_CORE, read where a plan's launch state is first built."""
    requested = os.environ.get(ENV_CORE) or None
    if requested is None:
        return
    try:
        _configs.choose_core(dtype_name, head_dim, requested)
    except ValueError as e:
        raise UnsupportedConfigError(f"{ENV_CORE}={requested!r}: {e}") from None


# ------------------------------------------------------------------------- selection
def default_method() -> str:
    method = os.environ.get(ENV_METHOD, "auto")
    if method not in METHODS:
        raise UnsupportedConfigError(f"environment variable {ENV_METHOD}={method!r} must be one of {METHODS}")
    return method


def auto_method(table: PageTable) -> Selection:
    """What ``method="auto"`` picks for a batch the kernels can serve.

    v2 everywhere: the H200 microbenchmark (docs/benchmarks/) shows no cell
    where v1 or gather is faster.
    """
    return Selection("v2", "auto: split-KV v2 (fastest in every measured cell)")


def select_method(q, k_cache, v_cache, table: PageTable, plan: DecodePlan | None = None, method: str = "auto") -> Selection:
    """The path :func:`decode` takes for these arguments, and why.

    Launches nothing. Runs ``decode``'s input checks, but not its GPU check,
    its ``out`` check or its plan checks.

    Args:
        q, k_cache, v_cache, table: as for :func:`decode`: ``q [B, Hq, D]``,
            caches ``[num_pages, page_size, Hkv, D]`` (NHD) CuPy (or CUDA)
            arrays of one dtype, and the batch's :class:`PageTable`.
        plan: accepted so a ``decode`` call can be mirrored verbatim; unused
            and unchecked (the choice does not depend on it).
        method: ``"auto"`` (default; env ``CUPAGED_DECODE`` overrides it),
            ``"v2"``, ``"v1"`` or ``"gather"``, as for ``decode``.

    Returns:
        A :class:`Selection`. The kernels decline a head_dim other than 64,
        128 or 256, a non-contiguous head_dim, and a base pointer or stride
        that is not a multiple of 16 bytes; for those the result is
        ``"gather"`` with the reason, e.g. ``"fallback from v2: head_dim 96
        has no kernel instance (supported: (64, 128, 256))"``.

    Raises:
        ArgumentTypeError [TypeError] (an input that is not a CuPy/CUDA
        array, NumPy arrays included; ``table`` not a PageTable), ShapeError,
        DTypeError, DeviceMismatchError, UnsupportedConfigError (an unknown
        ``method`` or ``CUPAGED_DECODE``), all ValueErrors, as for
        :func:`decode`; PageTableError (a page id ``>= num_pages``). It
        raises no NoGPUError of its own, but CuPy arrays need a GPU.

    Example (needs a GPU)::

        table = cupaged.PageTable.from_seq_lens([100], page_size=16)
        k = cupy.zeros((7, 16, 2, 96), dtype=cupy.float16)  # head_dim 96: no kernel
        q = cupy.zeros((1, 8, 96), dtype=cupy.float16)
        sel = cupaged.select_method(q, k, k, table, method="v2")
        sel.method   # "gather"
        sel.reason   # "fallback from v2: head_dim 96 has no kernel instance (supported: (64, 128, 256))"
    """
    q, k_cache, v_cache = _as_cupy(q, "q"), _as_cupy(k_cache, "k_cache"), _as_cupy(v_cache, "v_cache")
    _check_inputs(q, k_cache, v_cache, table)
    return _select(q, k_cache, v_cache, table, method)


def _select(q, k_cache, v_cache, table: PageTable, method: str) -> Selection:
    if method not in METHODS:
        raise UnsupportedConfigError(f"method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        method = default_method()
    if method == "gather":
        return Selection("gather", "requested")
    decline = _kernel_decline_reason(q, k_cache, v_cache)
    if decline is not None:
        return Selection("gather", f"fallback from {method}: {decline}")
    if method == "auto":
        return auto_method(table)
    return Selection(method, "requested")


# ---------------------------------------------------------------------- the entry
def decode(q, k_cache, v_cache, table: PageTable, plan: DecodePlan | None = None, *, method: str = "auto",
           sm_scale: float | None = None, out=None, return_lse: bool = False, validate: bool = False):
    """Paged-attention decode: one query token per request against its paged KV.

    Args:
        q: ``[batch, num_qo_heads, head_dim]`` CuPy array (or a CUDA array
            via ``__cuda_array_interface__`` / DLPack), float16, bfloat16
            (``ml_dtypes.bfloat16``) or float32. The kernels need head_dim
            contiguous and 16-byte aligned rows; otherwise the gather path runs.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``
            (NHD) CuPy arrays of q's dtype. The page stride may exceed the
            page's size (a slice of a larger cache).
        table: the :class:`PageTable` (CSR view) of the batch; its page ids
            must be ``< num_pages``.
        plan: a :class:`DecodePlan` from :func:`plan_decode` for this table
            and shapes, held across decode steps while ``plan.matches(table)``.
            Built here when None (host cost every call). A plan owns its merge
            workspace: order the calls that share a plan on one stream.
        method: ``"auto"`` (env ``CUPAGED_DECODE`` overrides; else v2),
            ``"v2"`` (split-KV, merge fused), ``"v1"`` (one CTA per request
            and query head) or ``"gather"`` (CuPy + cuBLAS). The kernels
            decline a head_dim other than 64/128/256, a non-contiguous
            head_dim, or a pointer or stride not a multiple of 16 bytes; such
            calls run the gather path, silently (:func:`select_method` says
            which path and why). Env ``CUPAGED_CORE=mma|simt`` pins v2's core.
        sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
        out: optional output array (q's shape and dtype, head_dim contiguous).
        return_lse: also return the LSE, ``[batch, num_qo_heads]`` float32 in
            **log2 units** (natural log = lse * ln 2); -inf for an empty request.
        validate: a debugging aid, off by default. The default checks are
            O(1) host comparisons (no device sync); they trust the device
            copy of the table (``table.device()``). ``validate=True`` also
            reads that copy back with CuPy reductions (one sync) and checks
            every CSR rule on it (indptr from 0 and non-decreasing, page ids
            in ``[0, num_pages)``, ``last_page_len`` in ``[1, page_size]``,
            ``first_page_offset`` valid, sizes, and equality with the host
            table), and that ``out``'s elements do not overlap.

    Returns:
        ``out`` (``[batch, num_qo_heads, head_dim]``, q's dtype), or
        ``(out, lse)`` with ``return_lse``. An empty request's output is zeros.
        ``batch == 0`` launches nothing (pass no plan: :func:`plan_decode`
        refuses an empty batch).

    Raises:
        Every class below is a :class:`~cupaged.errors.CupagedError` and
        also the builtin in brackets. ArgumentTypeError [TypeError] (an
        input not a CuPy/CUDA array, NumPy included; ``table`` not a
        PageTable; ``plan`` not a DecodePlan; ``sm_scale`` not a number),
        ShapeError [ValueError] (a rank, head_dim, page size or batch that
        differs; zero heads; heads not divisible; ``out`` of another shape),
        DTypeError [ValueError] (mixed or unsupported dtypes; ``out`` of
        another dtype), LayoutError [ValueError] (``out``'s head_dim not
        contiguous; with ``validate``, overlapping ``out`` elements),
        DeviceMismatchError [ValueError] (arrays on different devices, or
        not on the current one), UnsupportedConfigError [ValueError] (an
        unknown ``method`` or ``CUPAGED_DECODE``; an unknown
        ``CUPAGED_CORE``, or one that does not serve the dtype and head_dim,
        read when a plan's launch state is first built on the v2 path),
        InvalidArgumentError [ValueError] (a non-finite ``sm_scale``),
        PageTableError [ValueError] (a page id ``>= num_pages``; with
        ``validate``, a device table that breaks a rule), PlanMismatchError
        [ValueError] (a plan built for other heads, head_dim or dtype, or a
        stale one: ``plan.matches(table)`` is false), NoGPUError
        [RuntimeError] (no CUDA device; checked before anything else).

    Example (needs a GPU)::

        import cupy, numpy, cupaged

        table = cupaged.PageTable.from_seq_lens([700, 33], page_size=16)  # 47 pages
        k_cache = cupy.random.standard_normal((64, 16, 8, 128), dtype=cupy.float32).astype(cupy.float16)
        v_cache = cupy.random.standard_normal((64, 16, 8, 128), dtype=cupy.float32).astype(cupy.float16)
        q = cupy.random.standard_normal((2, 32, 128), dtype=cupy.float32).astype(cupy.float16)
        plan = cupaged.plan_decode(table, 32, 8, 128, numpy.float16)
        out, lse = cupaged.decode(q, k_cache, v_cache, table, plan, return_lse=True)
        # out: [2, 32, 128] float16; lse: [2, 32] float32, log2 units
        ref, ref_lse = cupaged.reference.decode(q, k_cache, v_cache, table)  # float64 check
    """
    require_gpu("cupaged.decode")
    import cupy

    q, k_cache, v_cache = _as_cupy(q, "q"), _as_cupy(k_cache, "k_cache"), _as_cupy(v_cache, "v_cache")
    dtype = _check_inputs(q, k_cache, v_cache, table)
    if q.data.device_id != cupy.cuda.runtime.getDevice():
        _raise_not_current(q)
    head_dim = q.shape[-1]
    scale = (1.0 / math.sqrt(head_dim)) * LOG2E if sm_scale is None else _check_sm_scale(sm_scale)
    if out is None:
        out = cupy.empty(q.shape, dtype=q.dtype)
    else:
        out = _check_out(out, q)
        if validate:
            from ._validate import check_out_overlap

            check_out_overlap(out)
    lse = cupy.empty(q.shape[:2], dtype=cupy.float32) if return_lse else None

    selection = _select(q, k_cache, v_cache, table, method)
    if validate:
        from ._validate import check_device_table

        check_device_table(table, k_cache.shape[0])
    if selection.method == "gather":
        from .gather import gather_decode

        gather_decode(q, k_cache, v_cache, table, scale, out, lse)
    elif q.shape[0] == 0:
        pass  # an empty batch has nothing to launch
    elif selection.method == "v1":
        _launch_v1(q, k_cache, v_cache, table, dtype, scale, out, lse)
    else:
        if plan is None:
            _check_core(dtype, head_dim)
            plan = plan_decode(table, q.shape[1], k_cache.shape[2], head_dim, q.dtype)
        else:
            try:
                buf = _plan_buffers.get(plan)
            except TypeError:  # not weak-referenceable, so not a DecodePlan: _check_plan says so
                buf = None
            if buf is None or buf.checked_table is None or buf.checked_table() is not table:
                _check_plan(plan, table, q, k_cache, dtype)
                if buf is None:
                    _check_core(dtype, head_dim)
                plan_buffers(plan, dtype).checked_table = weakref.ref(table)
            elif (q.shape[1], k_cache.shape[2], head_dim, dtype) != buf.signature:
                _check_plan(plan, table, q, k_cache, dtype)  # raises: same table, other shapes
        _launch_v2(q, k_cache, v_cache, table, plan, dtype, scale, out, lse)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------- launches
def _elem_strides(a, ndim: int):
    isz = a.itemsize
    return tuple(np.int64(s // isz) for s in a.strides[:ndim])


@functools.lru_cache(maxsize=64)
def _f32_bits(x: float) -> int:
    """A float32 kernel argument as the integer its 4 bytes spell (cached)."""
    return int(np.float32(x).view(np.uint32))


# Argument slots of paged_decode_partial (cuda_src/paged_decode_partial.cu),
# in order. Each argument gets one 8-byte slot; 4-byte ones use its low half.
_V2_ARGS = ("q", "sq_b", "sq_h", "k", "sk_p", "sk_t", "sk_h", "v", "sv_p", "sv_t", "sv_h",
            "indices", "indptr", "last_page_len", "first_page_offset",
            "chunk_request", "o_indptr", "pages_per_chunk", "page_size", "num_qo_heads", "group_size", "q_groups",
            "scale", "partial_v", "partial_lse", "counters", "out", "so_b", "so_h", "lse")
_SLOT = {name: i for i, name in enumerate(_V2_ARGS)}
# The slot runs a call rewrites: q, k, v with their strides; the table; the
# scale; out, its strides and lse.
_ARRAYS = slice(_SLOT["q"], _SLOT["sv_h"] + 1)
_TABLE = slice(_SLOT["indices"], _SLOT["first_page_offset"] + 1)
_SCALE = _SLOT["scale"]
_OUT = slice(_SLOT["out"], _SLOT["lse"] + 1)


class _PlanBuffers:
    """Per-plan launch state, made on the plan's first launch: device copies of
    its metadata, the merge workspace and ticket counters (they reset
    themselves in-kernel), the kernel and its arguments packed once, and the
    last table the plan was checked against (tables are immutable).

    The launch goes straight to cuLaunchKernel with the packed argument
    slots: CuPy's RawKernel call re-packs all 30 arguments on every call,
    which alone costs ~14 us of host time. A call rewrites only the slots of
    the arrays it was given and the table's pointers."""

    def __init__(self, plan: DecodePlan, dtype: str):
        import ctypes

        import cupy
        from cupy_backends.cuda.api import driver

        self.chunk_request = cupy.asarray(plan.chunk_request, dtype=cupy.int32)
        self.o_indptr = cupy.asarray(plan.o_indptr, dtype=cupy.int32)
        self.partial_v = self.partial_lse = self.counters = None
        if plan.needs_merge:
            self.partial_v = cupy.empty((plan.num_chunks, plan.num_qo_heads, plan.head_dim), dtype=cupy.float32)
            self.partial_lse = cupy.empty((plan.num_chunks, plan.num_qo_heads), dtype=cupy.float32)
            self.counters = cupy.zeros(plan.batch_size * plan.grid[1], dtype=cupy.int32)
        self.core = _configs.choose_core(dtype, plan.head_dim, os.environ.get(ENV_CORE) or None)
        index, threads = _configs.partial_instance(dtype, plan.head_dim, plan.heads_per_cta, self.core)
        self.kernel = _loader.get_kernel("partial", dtype, plan.head_dim, index)
        self.function = self.kernel.kernel.ptr  # CUfunction on the current device (compiles on first use)
        self.smem = _configs.dynamic_smem(self.core)
        if self.smem:  # opt-in: static + dynamic may exceed the default 48 KB
            driver.funcSetAttribute(self.function, _MAX_DYNAMIC_SMEM_ATTR, self.smem)
        self.grid = tuple(plan.grid) + (1,) * (3 - len(plan.grid))
        self.block = (threads, 1, 1)

        self.slots = (ctypes.c_uint64 * len(_V2_ARGS))()
        base = ctypes.addressof(self.slots)
        self.params = (ctypes.c_void_p * len(_V2_ARGS))(*(base + 8 * i for i in range(len(_V2_ARGS))))
        self.params_ptr = ctypes.addressof(self.params)
        s = self.slots
        for name, value in (("chunk_request", self.chunk_request.data.ptr), ("o_indptr", self.o_indptr.data.ptr),
                            ("pages_per_chunk", plan.pages_per_chunk), ("page_size", plan.page_size),
                            ("num_qo_heads", plan.num_qo_heads), ("group_size", plan.group_size),
                            ("q_groups", plan.q_groups)):
            s[_SLOT[name]] = int(value)
        if plan.needs_merge:
            s[_SLOT["partial_v"]] = self.partial_v.data.ptr
            s[_SLOT["partial_lse"]] = self.partial_lse.data.ptr
            s[_SLOT["counters"]] = self.counters.data.ptr
        self.table = None  # the table whose pointers are in the slots (kept alive while they are)
        self.checked_table = None  # weakref to the last table that matched
        self.signature = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, dtype)
        self._current_stream = cupy.cuda.get_current_stream
        self._launch = driver.launchKernel

    def launch(self, q, k_cache, v_cache, table, scale: float, out, lse) -> None:
        s = self.slots
        isz = q.itemsize
        qs, ks, vs, os_ = q.strides, k_cache.strides, v_cache.strides, out.strides
        s[_ARRAYS] = (q.data.ptr, qs[0] // isz, qs[1] // isz,
                   k_cache.data.ptr, ks[0] // isz, ks[1] // isz, ks[2] // isz,
                   v_cache.data.ptr, vs[0] // isz, vs[1] // isz, vs[2] // isz)
        if table is not self.table:
            s[_TABLE] = tuple(a.data.ptr for a in table.device())
            self.table = table
        s[_SCALE] = _f32_bits(scale)
        s[_OUT] = (out.data.ptr, os_[0] // isz, os_[1] // isz, 0 if lse is None else lse.data.ptr)
        g, b = self.grid, self.block
        self._launch(self.function, g[0], g[1], g[2], b[0], b[1], b[2], self.smem,
                     self._current_stream().ptr, self.params_ptr, 0)


_MAX_DYNAMIC_SMEM_ATTR = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

_plan_buffers: "weakref.WeakKeyDictionary[DecodePlan, _PlanBuffers]" = weakref.WeakKeyDictionary()


def plan_buffers(plan: DecodePlan, dtype: str | None = None) -> _PlanBuffers:
    """The plan's launch state. The workspace and counters are reused by every
    call with this plan: do not run one plan on two streams at once."""
    buf = _plan_buffers.get(plan)
    if buf is None:
        buf = _plan_buffers[plan] = _PlanBuffers(plan, dtype or _configs.dtype_name(plan.dtype))
    return buf


def _launch_v2(q, k_cache, v_cache, table, plan: DecodePlan, dtype, scale, out, lse):
    plan_buffers(plan, dtype).launch(q, k_cache, v_cache, table, scale, out, lse)


def _launch_v1(q, k_cache, v_cache, table, dtype, scale, out, lse):
    batch, num_qo_heads, head_dim = q.shape
    if batch == 0:
        return
    kernel = _loader.get_kernel("v1", dtype, head_dim)
    kernel(
        (batch, num_qo_heads, 1), (_THREADS,),
        (q, *_elem_strides(q, 2), k_cache, *_elem_strides(k_cache, 3), v_cache, *_elem_strides(v_cache, 3),
         *table.device(), np.int32(table.page_size), np.int32(num_qo_heads),
         np.int32(num_qo_heads // k_cache.shape[2]), np.float32(scale), out, *_elem_strides(out, 2),
         _NULL if lse is None else lse),
    )
