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

import math
import os
import weakref
from dataclasses import dataclass

import numpy as np

from . import _configs, _loader
from ._device import require_gpu
from .errors import PlanMismatchError
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
def _as_cupy(x, name: str):
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"):
        return cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x)
    raise TypeError(f"{name} must be a CuPy array (or a CUDA array via DLPack), got {type(x).__name__}")


def _check_inputs(q, k_cache, v_cache, table: PageTable) -> str:
    """Shape/dtype/device checks that cost no device sync; returns the dtype name."""
    if not isinstance(table, PageTable):
        raise TypeError(f"table must be a cupaged.PageTable, got {type(table).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, num_qo_heads, head_dim], got shape {q.shape}")
    if k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(
            "k_cache and v_cache must be [num_pages, page_size, num_kv_heads, head_dim] (NHD), "
            f"got shapes {k_cache.shape} and {v_cache.shape}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {k_cache.shape} != v_cache shape {v_cache.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    name = _configs.dtype_name(q.dtype)
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_qo_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ValueError(f"q head_dim {q_dim} != cache head_dim {head_dim}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if page_size != table.page_size:
        raise ValueError(f"cache page_size {page_size} != table.page_size {table.page_size}")
    if batch != table.batch_size:
        raise ValueError(f"q has batch {batch} but the table has {table.batch_size} requests")
    table.check_page_ids(num_pages)
    if not (q.device.id == k_cache.device.id == v_cache.device.id):
        raise ValueError(
            f"q, k_cache and v_cache must be on one device, got {q.device.id}, {k_cache.device.id}, {v_cache.device.id}"
        )
    return name


def _kernel_decline_reason(q, k_cache, v_cache) -> str | None:
    """Why the CUDA kernels cannot serve these tensors (None when they can)."""
    head_dim = q.shape[-1]
    if head_dim not in _configs.HEAD_DIMS:
        return f"head_dim {head_dim} has no kernel instance (supported: {_configs.HEAD_DIMS})"
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if a.strides[-1] != a.itemsize:
            return f"{name}'s head_dim is not contiguous"
        if a.data.ptr % 16 or any(s % 16 for s in a.strides[:-1]):
            return f"{name} is not 16-byte aligned (base pointer or strides)"
    return None


def _check_out(out, q):
    out = _as_cupy(out, "out")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must have q's shape {q.shape} and dtype {q.dtype}, got {out.shape} {out.dtype}")
    if out.strides[-1] != out.itemsize:
        raise ValueError("out's head_dim must be contiguous")
    if out.device.id != q.device.id:
        raise ValueError(f"out is on device {out.device.id}, q on {q.device.id}")
    return out


def _check_plan(plan: DecodePlan, table: PageTable, q, k_cache, dtype_name: str) -> None:
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


# ------------------------------------------------------------------------- selection
def default_method() -> str:
    method = os.environ.get(ENV_METHOD, "auto")
    if method not in METHODS:
        raise ValueError(f"{ENV_METHOD}={method!r}; expected one of {METHODS}")
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
        TypeError (an input that is not a CuPy/CUDA array, NumPy arrays
        included; ``table`` not a PageTable), ValueError (shapes, heads not
        divisible, mixed or unsupported dtypes, devices, an unknown ``method``
        or ``CUPAGED_DECODE``), PageTableError (a page id ``>= num_pages``).
        It raises no NoGPUError of its own, but CuPy arrays need a GPU.

    Example (needs a GPU)::

        table = cupaged.PageTable.from_seq_lens([100], page_size=16)
        k = cupy.zeros((7, 16, 2, 96), dtype=cupy.float16)  # head_dim 96: no kernel
        q = cupy.zeros((1, 8, 96), dtype=cupy.float16)
        sel = cupaged.select_method(q, k, k, table, method="v2")
        sel.method   # "gather"
        sel.reason   # "fallback from v2: head_dim 96 has no kernel instance (supported: (64, 128, 256))"
    """
    q, k_cache, v_cache = (_as_cupy(x, n) for x, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
    _check_inputs(q, k_cache, v_cache, table)
    return _select(q, k_cache, v_cache, table, method)


def _select(q, k_cache, v_cache, table: PageTable, method: str) -> Selection:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
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
           sm_scale: float | None = None, out=None, return_lse: bool = False):
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

    Returns:
        ``out`` (``[batch, num_qo_heads, head_dim]``, q's dtype), or
        ``(out, lse)`` with ``return_lse``. An empty request's output is zeros.
        ``batch == 0`` launches nothing (pass no plan: :func:`plan_decode`
        refuses an empty batch).

    Raises:
        TypeError (an input not a CuPy/CUDA array, ``table`` not a
        PageTable), ValueError (shapes, heads not divisible, mixed or
        unsupported dtypes, devices, a bad ``out``, an unknown ``method`` or
        ``CUPAGED_DECODE``; an unknown ``CUPAGED_CORE``, or one that does
        not serve the dtype and head_dim, read when a plan is first launched
        on the v2 path), PageTableError (a page id ``>= num_pages``),
        PlanMismatchError (a plan built for other heads, head_dim or dtype,
        or a stale one: ``plan.matches(table)`` is false), NoGPUError (no
        CUDA device; checked before anything else).

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

    q, k_cache, v_cache = (_as_cupy(x, n) for x, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
    dtype = _check_inputs(q, k_cache, v_cache, table)
    if out is None:
        out = cupy.empty(q.shape, dtype=q.dtype)
    else:
        out = _check_out(out, q)
    lse = cupy.empty(q.shape[:2], dtype=cupy.float32) if return_lse else None
    head_dim = q.shape[-1]
    scale = (1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)) * LOG2E

    selection = _select(q, k_cache, v_cache, table, method)
    if selection.method == "gather":
        from .gather import gather_decode

        gather_decode(q, k_cache, v_cache, table, scale, out, lse)
    elif q.shape[0] == 0:
        pass  # an empty batch has nothing to launch
    elif selection.method == "v1":
        _launch_v1(q, k_cache, v_cache, table, dtype, scale, out, lse)
    else:
        if plan is None:
            plan = plan_decode(table, q.shape[1], k_cache.shape[2], head_dim, q.dtype)
        else:
            buf = _plan_buffers.get(plan)
            if buf is None or buf.checked_table is None or buf.checked_table() is not table:
                _check_plan(plan, table, q, k_cache, dtype)
                plan_buffers(plan, dtype).checked_table = weakref.ref(table)
            elif (q.shape[1], k_cache.shape[2], head_dim, dtype) != buf.signature:
                _check_plan(plan, table, q, k_cache, dtype)  # raises: same table, other shapes
        _launch_v2(q, k_cache, v_cache, table, plan, dtype, scale, out, lse)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------- launches
def _elem_strides(a, ndim: int):
    isz = a.itemsize
    return tuple(np.int64(s // isz) for s in a.strides[:ndim])


_FLOAT_BITS: dict[float, int] = {}


def _f32_bits(x: float) -> int:
    """A float32 kernel argument as the integer its 4 bytes spell (cached)."""
    bits = _FLOAT_BITS.get(x)
    if bits is None:
        if len(_FLOAT_BITS) > 64:
            _FLOAT_BITS.clear()
        bits = _FLOAT_BITS[x] = int(np.float32(x).view(np.uint32))
    return bits


# Argument slots of paged_decode_partial (cuda_src/paged_decode_partial.cu),
# in order. Each argument gets one 8-byte slot; 4-byte ones use its low half.
_V2_ARGS = ("q", "sq_b", "sq_h", "k", "sk_p", "sk_t", "sk_h", "v", "sv_p", "sv_t", "sv_h",
            "indices", "indptr", "last_page_len", "first_page_offset",
            "chunk_request", "o_indptr", "pages_per_chunk", "page_size", "num_qo_heads", "group_size", "q_groups",
            "scale", "partial_v", "partial_lse", "counters", "out", "so_b", "so_h", "lse")
_SLOT = {name: i for i, name in enumerate(_V2_ARGS)}


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
        if self.smem > 48 * 1024:  # opt-in above the default 48 KB
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
        s[0:11] = (q.data.ptr, qs[0] // isz, qs[1] // isz,
                   k_cache.data.ptr, ks[0] // isz, ks[1] // isz, ks[2] // isz,
                   v_cache.data.ptr, vs[0] // isz, vs[1] // isz, vs[2] // isz)
        if table is not self.table:
            s[11:15] = tuple(a.data.ptr for a in table.device())
            self.table = table
        s[22] = _f32_bits(scale)
        s[26:30] = (out.data.ptr, os_[0] // isz, os_[1] // isz, 0 if lse is None else lse.data.ptr)
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
