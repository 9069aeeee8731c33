"""Launch state of the split-KV partial kernel, shared by :func:`cupaged.decode`
and :class:`cupaged.DecodeRunner`.

* :class:`PartialParams` mirrors the kernel's one ``__grid_constant__``
  parameter struct (cuda_src/paged_decode_partial.cu ``PartialParams``) field
  for field; tests/test_launch_params.py compares its offsets with NVRTC's.
* The **plan image** is one int32 array holding a plan's work units and a
  page table (layout in the kernel's header comment and :func:`write_image`).
  A new table or plan is one host-to-device copy from pinned memory into a
  buffer whose address never changes, so a CUDA graph captured once replays
  every later plan that fits the buffer.
* :class:`ExLauncher` launches with ``cuLaunchKernelEx`` and programmatic
  dependent launch (the tensor-core instances on sm_90+, unless env
  ``CUPAGED_PDL=0`` at import); :func:`residency_smem` keeps those launches
  to the CTAs per SM the plan counted.
* :class:`PartialLaunch` owns, for one device and one stream, the compiled
  function, the image buffer, the merge workspace and counters, and the
  packed parameters; a launch rewrites only the fields that changed.

No check happens here: callers validate their arguments first.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from . import _configs, _env, _loader

_P, _LL, _I, _F = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float
NULL_PTR = np.uint64(0)  # a null pointer argument of a RawKernel call (v1, merge)
THREADS = 128  # NUM_THREADS / MERGE_THREADS in cuda_src (v1, merge)


def elem_strides(a, axes: int | tuple[int, ...]) -> tuple:
    """Strides of ``a`` in elements, as int64 kernel arguments: of its first
    ``axes`` axes (an int), or of the axes listed (a tuple; append_kv's
    caches in either layout)."""
    isz = a.itemsize
    strides = a.strides[:axes] if isinstance(axes, int) else [a.strides[ax] for ax in axes]
    return tuple(np.int64(s // isz) for s in strides)


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h), the first argument of ``cuLaunchKernelEx``."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h, CUDA >= 11.8)
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class ExLauncher:
    """``cuLaunchKernelEx`` (the driver API through ctypes: CuPy wraps only
    ``cuLaunchKernel``), called like ``cupy_backends.cuda.api.driver.launchKernel``.
    With ``pdl`` the launch allows programmatic stream serialization: the
    kernel may start while the stream's previous kernel finishes; the partial
    kernel then waits in ``griddepcontrol.wait`` before it reads q, the caches
    or the workspace or writes anything (cuda_src/paged_decode_partial.cu).
    One per launch state: the config struct is reused under that state's lock."""

    def __init__(self, pdl: bool = True) -> None:
        lib = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
        # (item access: a function object of our own, without argtypes; every argument is
        # a ctypes object made once per launch shape, so a call converts nothing)
        self._fn = lib["cuLaunchKernelEx"]
        self._fn.restype = ctypes.c_int
        self._error_name = lib.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._attr = LaunchAttribute(id=ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value[0] = 1  # programmaticStreamSerializationAllowed (an int at the union's start)
        self._config = LaunchConfig(attrs=ctypes.pointer(self._attr), numAttrs=1 if pdl else 0)
        self._config_ref = ctypes.byref(self._config)
        self._key = None  # the arguments of the launch that _config and _args hold
        self._args = ()

    def __call__(self, function: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
                 stream: int, params: int, extra: int) -> None:
        self.launch_key((function, gx, gy, gz, bx, by, bz, smem, stream, params, extra))

    def launch_key(self, key: tuple) -> None:
        """Launches ``key``, :meth:`__call__`'s arguments as one tuple. A
        serving loop repeats one launch: the last key object again is one
        identity test (an equal one, one tuple comparison), not 8 ctypes writes."""
        if key is not self._key:
            if key != self._key:
                function, gx, gy, gz, bx, by, bz, smem, stream, params, extra = key
                c = self._config
                c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ = gx, gy, gz, bx, by, bz
                c.sharedMemBytes, c.hStream = smem, stream
                P = ctypes.c_void_p
                self._args = (self._config_ref, P(function), P(params), P(extra or None))
            self._key = key
        err = self._fn(*self._args)
        if err:
            name = ctypes.c_char_p()
            self._error_name(err, ctypes.byref(name))
            raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({err})")


class PartialParams(ctypes.Structure):
    """The partial kernel's parameters (``PartialParams`` in
    cuda_src/paged_decode_partial.cu), in the same order and C layout."""

    _fields_ = [
        ("q", _P), ("stride_q_batch", _LL), ("stride_q_head", _LL),
        ("k_cache", _P), ("stride_k_page", _LL), ("stride_k_token", _LL), ("stride_k_head", _LL),
        ("v_cache", _P), ("stride_v_page", _LL), ("stride_v_token", _LL), ("stride_v_head", _LL),
        ("plan", _P), ("k_head_scale", _P), ("v_head_scale", _P),
        ("partial_v", _P), ("partial_lse", _P), ("merge_counters", _P),
        ("final_out", _P), ("stride_o_batch", _LL), ("stride_o_head", _LL), ("final_lse", _P), ("sinks", _P),
        ("heads_groups", _I), ("page_size", _I), ("num_qo_heads", _I), ("group_size", _I), ("q_groups", _I),
        ("scale", _F), ("soft_cap", _F), ("v_scale", _F),
    ]


# word indices (8 bytes) of the pointer fields launch_pointers rewrites
_W_Q, _W_K, _W_V, _W_OUT, _W_LSE = (getattr(PartialParams, f).offset // 8
                                    for f in ("q", "k_cache", "v_cache", "final_out", "final_lse"))


# ------------------------------------------------------------------ the plan image
HEADER = 8  # int32: {num_units, o_indptr, indptr, last_page_len, first_page_offset, indices, batch, group_rows}
# the header's group_rows entry of a plan without row groups whose fused merge waits (PartialLaunch.waits)
HEADER_WAITS = -1
PARTIAL_EMPTY = 0xFFFFFFFF  # cuda_src/merge.cuh PARTIAL_EMPTY: a float of the waiting merge's workspace no CTA wrote
HEADER_BATCH = 6  # the header entry holding the batch size (append_kv's device_batch)


def image_capacity(max_batch: int, max_units: int, max_pages: int) -> int:
    """int32 elements of an image that holds any plan and table within these capacities."""
    return image_offsets(max_batch, max_units)[-1] + max_pages


def plan_units(plan) -> np.ndarray:
    """The plan's work units ``[plan.num_units, 4]`` int32 in launch order:
    ``(request, chunk, page_lo, page_hi)``; a request's last chunk ends at
    ``request_chunks * chunk_pages`` pages, past the request's pages while
    ``plan.matches`` holds (the kernel clips it), so the plan serves a grown
    table. With row groups only a group's first row has units (its CTAs
    serve the group's rows)."""
    order = plan.launch_order
    if plan.group_last is not None:
        from .plan import group_leaders

        order = order[group_leaders(plan.group_last)[plan.chunk_request[order]]]
    req = plan.chunk_request[order].astype(np.int64)
    pages = plan.request_chunk_pages[req].astype(np.int64)
    lo = plan.chunk_index[order] * pages
    return np.ascontiguousarray(np.stack([req, order, lo, lo + pages], axis=1).astype(np.int32))


def image_offsets(max_batch: int, max_units: int) -> tuple[int, int, int, int, int, int]:
    """Offsets (int32 elements) of ``o_indptr``, ``indptr``, ``last_page_len``,
    ``first_page_offset``, ``group_rows`` and ``indices`` in an image of these
    capacities: fixed, so kernels that take the table as plain pointers
    (append_kv) can be captured in a graph that outlives one table."""
    o = HEADER + 4 * max_units
    indptr = o + max_batch + 1
    last = indptr + max_batch + 1
    first = last + max_batch
    groups = first + max_batch
    return o, indptr, last, first, groups, groups + max_batch


def write_image(dst: np.ndarray, offsets: tuple, units: np.ndarray, plan, table, waits: bool = False) -> int:
    """Writes the image of (``units`` of ``plan``, ``table``) into the int32
    array ``dst`` at ``offsets`` (:func:`image_offsets`); returns the
    elements up to the end of the indices (the span to copy). The header
    holds ``num_units``, the offsets of o_indptr, the table and the indices,
    the batch size and the offset of ``group_rows`` (row ``r`` starts a group
    of ``group_last[r] - r + 1`` rows); when the plan has no row groups, that
    entry says which fused merge runs: 0 the ticket's, :data:`HEADER_WAITS`
    (``waits``) the waiting one (:meth:`PartialLaunch.waits`)."""
    n = units.shape[0]
    dst[HEADER:HEADER + 4 * n] = units.reshape(-1)
    o, indptr, last, first, groups, indices = offsets
    parts = (plan.o_indptr, table.indptr, table.last_page_len, table.first_page_offset, table.indices)
    for at, part in zip((o, indptr, last, first, indices), parts):
        dst[at:at + part.shape[0]] = part
    if plan.group_last is not None:
        b = plan.batch_size
        np.subtract(plan.group_last, np.arange(-1, b - 1, dtype=np.int32), out=dst[groups:groups + b])
    dst[:HEADER] = (n, o, indptr, last, first, indices, plan.batch_size,
                    (HEADER_WAITS if waits else 0) if plan.group_last is None else groups)
    return indices + table.indices.shape[0]


# ------------------------------------------------------------------ launch state


def residency_smem(function: int, threads: int, smem: int) -> tuple[int, ...]:
    """Dynamic shared memory (bytes) per CTA at which an SM holds at most k
    CTAs of ``function``, for k = 0 .. what ``smem`` lets fit (entries 0
    and 1 are the same; the last is ``smem`` itself). Raises the function's
    dynamic shared memory limit to the largest entry.

    Why: with programmatic dependent launch the next kernel's CTAs start in
    whatever slots this grid leaves free, so they end up unevenly spread
    over the SMs when the registers let more CTAs fit than the planner sized
    the grid for (H200, head_dim 64: up to 28 % slower); :meth:`PartialLaunch.launch`
    passes the entry for its grid."""
    import cupy
    from cupy_backends.cuda.api import driver

    def fits(nbytes: int) -> int:
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(function, threads, nbytes)

    most = fits(smem)
    rt, dev = cupy.cuda.runtime, cupy.cuda.runtime.getDevice()
    per_sm = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev)
    per_cta = rt.deviceGetAttribute(rt.cudaDevAttrReservedSharedMemoryPerBlock, dev)
    static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function)
    limit = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) - static
    # k + 1 CTAs no longer fit (rounded up to whole KB)
    padded = [max(smem, -(-(per_sm // (k + 1) - per_cta - static + 1) // 1024) * 1024) for k in range(1, most)]
    if not padded or padded[0] > limit:
        return (smem,) * (most + 1)
    if padded[0] > driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, function):
        driver.funcSetAttribute(function, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, padded[0])
    table = [b if fits(b) == k else smem for k, b in enumerate(padded, 1)] + [smem]
    return (table[0], *table)


def plan_waits(plan, units: int, heads_groups: int, sms: int) -> bool:
    """Whether ``plan`` (``units`` work units, ``heads_groups`` CTAs each)
    runs the waiting merge on a GPU of ``sms`` SMs (cuda_src/paged_decode_partial.cu
    ``merge_waiting``): it splits a request, has no row groups, its CTAs fit
    one wave at the plan's CTAs per SM, and its requests' first chunks (whose
    CTAs wait on the GPU for the others) are fewer CTAs than the GPU has SMs,
    so a slot is always left for a chunk they wait for, whatever else shares
    the GPU (one CTA per SM always fits). Otherwise the ticket's merge."""
    if plan.group_last is not None or not plan.needs_merge:
        return False
    firsts = int(np.count_nonzero(plan.request_chunks > 1)) * heads_groups
    return units * heads_groups <= sms * plan.ctas_per_sm and firsts < sms


class PartialLaunch:
    """One device's and one stream's launch state of the partial kernel for
    one shape (heads, head_dim, dtype pair, heads per CTA), sized for
    ``max_batch`` requests, ``max_units`` work units and ``max_pages`` page
    ids. The buffers are made once; :meth:`load` writes a plan and table into
    the image (one async copy from pinned memory on the current stream),
    :meth:`launch` launches ``units * heads_groups`` CTAs.

    Not for two streams at once (the image, workspace and counters are
    shared by its launches, in stream order); :attr:`lock` serializes
    threads."""

    _held = 1 << 30  # the loaded plan's CTAs per SM (DecodePlan.ctas_per_sm; none loaded: no hold of its own)

    def __init__(self, variant: str, num_qo_heads: int, num_kv_heads: int, head_dim: int, heads_per_cta: int,
                 page_size: int, max_batch: int, max_units: int, max_pages: int, family: str = "partial",
                 wait_plan=None):
        import cupy
        from cupy_backends.cuda.api import driver

        self.lock = threading.Lock()
        self.device = cupy.cuda.runtime.getDevice()
        self.variant, self.head_dim = variant, head_dim
        group = num_qo_heads // num_kv_heads
        q_groups = group // heads_per_cta
        self.heads_groups = num_kv_heads * q_groups
        self.max_batch, self.max_units, self.max_pages = max_batch, max_units, max_pages
        self.core = _configs.choose_core(variant, head_dim, _env.core())
        # family "rows" / "rows8" (plans with row groups: _configs.rows_family) or "partial" (the others)
        index, threads = _configs.partial_instance(variant, head_dim, heads_per_cta, self.core, family)
        self.family = family
        self.kernel = _loader.get_kernel(family, variant, head_dim, index)
        self.function = self.kernel.kernel.ptr  # CUfunction on this device (compiles on first use)
        self.smem = _configs.dynamic_smem(self.core, variant, head_dim, family)
        limit = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES  # opt-in: static + dynamic may exceed 48 KB
        if self.smem > driver.funcGetAttribute(limit, self.function):  # (never lowered: another state's may be higher)
            driver.funcSetAttribute(self.function, limit, self.smem)
        self.block = threads
        self.pdl = (_configs.module_pdl(family, variant, head_dim) and self.core == "mma"
                    and int(cupy.cuda.Device().compute_capability) >= 90)  # griddepcontrol: sm_90+
        # the grid's CTAs per SM: at most the planner's count, and no more than spreads the grid evenly
        self._sms = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, self.device)
        table = residency_smem(self.function, threads, self.smem) if self.pdl else (self.smem,)
        self._smem_at = table[:_configs.resident_ctas(variant, head_dim, heads_per_cta, self.core, family) + 1]
        p = self.params = PartialParams()
        # the waiting merge (opt-in, env CUPAGED_WAIT_MERGE=1), for the one plan a state is made for (decode's:
        # _plan_launch.PlanLaunch); a state whose plans change (DecodeRunner, its graph holding the workspace)
        # keeps the ticket's
        self.marked = (wait_plan is not None and _env.wait_merge()
                       and plan_waits(wait_plan, wait_plan.num_chunks, self.heads_groups, self._sms))
        self._alloc(max_batch, max_units, max_pages, num_qo_heads)
        p.heads_groups, p.page_size, p.num_qo_heads, p.group_size, p.q_groups = (
            self.heads_groups, page_size, num_qo_heads, group, q_groups)
        # the pointer fields as 8-byte words: a memoryview write costs a third of a ctypes field's
        self._words = memoryview(p).cast("B").cast("Q")
        self._arg = (ctypes.c_void_p * 1)(ctypes.addressof(p))
        self.params_ptr = ctypes.addressof(self._arg)
        self.scores = None  # the ScoreArgs whose values are in the parameters (keeps their arrays alive)
        self.table = None  # the table the image holds (kept alive while it does; never the plan: decode's
        # states are keyed by their plan and must not keep it alive)
        self.units = None  # the image's unit count
        self._units_smem = self.smem  # the shared memory of a grid of the image's units (set by load)
        self._current_stream = cupy.cuda.get_current_stream
        self._launch = ExLauncher() if self.pdl else driver.launchKernel
        self._launch_key = self._launch.launch_key if self.pdl else (lambda key: driver.launchKernel(*key))
        self._pointers_key = None  # launch_pointers' launch (the image's units on one stream), made once per load
        self._memcpy = cupy.cuda.runtime.memcpyAsync

    def _alloc(self, max_batch: int, max_units: int, max_pages: int, num_qo_heads: int) -> None:
        import cupy

        size = image_capacity(max_batch, max_units, max_pages)
        self.offsets = image_offsets(max_batch, max_units)
        self.image = cupy.zeros(size, dtype=cupy.int32)
        # two pinned staging images: one may still be in flight while the other is written
        self._staging = [np.frombuffer(cupy.cuda.alloc_pinned_memory(4 * size), np.int32, size) for _ in range(2)]
        self._events = [None, None]
        self._turn = 0
        rows = max(max_units, 1)
        if self.marked:  # (the waiting merge: every float PARTIAL_EMPTY between launches; the kernel puts it back)
            self.partial_v = cupy.full((rows, num_qo_heads, self.head_dim), PARTIAL_EMPTY,
                                       dtype=cupy.uint32).view(cupy.float32)
            self.partial_lse = cupy.full((rows, num_qo_heads), PARTIAL_EMPTY, dtype=cupy.uint32).view(cupy.float32)
        else:
            self.partial_v = cupy.empty((rows, num_qo_heads, self.head_dim), dtype=cupy.float32)
            self.partial_lse = cupy.empty((rows, num_qo_heads), dtype=cupy.float32)
        self.counters = cupy.zeros(max(max_batch, 1) * self.heads_groups, dtype=cupy.int32)
        p = self.params
        p.plan, p.partial_v, p.partial_lse, p.merge_counters = (
            self.image.data.ptr, self.partial_v.data.ptr, self.partial_lse.data.ptr, self.counters.data.ptr)

    def fits(self, batch: int, units: int, pages: int) -> bool:
        return batch <= self.max_batch and units <= self.max_units and pages <= self.max_pages

    def load(self, plan, units: np.ndarray, table) -> None:
        """Writes (plan, table) into the image: one host-to-device copy on the
        current stream, ordered before the next launch on it."""
        import cupy

        i = self._turn
        self._turn ^= 1
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the copy that last read this staging image is done (it nearly always is)
        staging = self._staging[i]
        n = write_image(staging, self.offsets, units, plan, table, self.waits(plan, units.shape[0]))
        stream = self._current_stream()
        self._memcpy(self.image.data.ptr, staging.ctypes.data, 4 * n, 1, stream.ptr)  # 1: host to device
        if event is None:
            event = self._events[i] = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        self.table, self.units = table, units.shape[0]
        self._held = plan.ctas_per_sm
        self._units_smem = self._smem_for(self.units * self.heads_groups)  # (once here, not per launch_pointers)
        self._pointers_key = None

    def waits(self, plan, units: int) -> bool:
        """Whether ``plan`` (``units`` work units) runs the waiting merge: a
        state made for it (``wait_plan``) and :func:`plan_waits` on this device."""
        return self.marked and plan_waits(plan, units, self.heads_groups, self._sms)

    def set_arrays(self, q, k, v, out, lse) -> None:
        """Pointers and element strides of q, the caches (NHD views), out and lse."""
        p = self.params
        isz, kvsz = q.itemsize, k.itemsize
        qs, ks, vs, os_ = q.strides, k.strides, v.strides, out.strides
        p.q, p.stride_q_batch, p.stride_q_head = q.data.ptr, qs[0] // isz, qs[1] // isz
        p.stride_k_page, p.stride_k_token, p.stride_k_head = ks[0] // kvsz, ks[1] // kvsz, ks[2] // kvsz
        p.stride_v_page, p.stride_v_token, p.stride_v_head = vs[0] // kvsz, vs[1] // kvsz, vs[2] // kvsz
        p.k_cache, p.v_cache = k.data.ptr, v.data.ptr
        p.final_out, p.stride_o_batch, p.stride_o_head = out.data.ptr, os_[0] // isz, os_[1] // isz
        p.final_lse = None if lse is None else lse.data.ptr

    def set_scores(self, scores) -> None:
        """The score fields of ``scores`` (a ScoreArgs); :attr:`scores` is
        ``scores`` afterwards (decode's hot path compares by identity)."""
        last = self.scores
        if (last is not None and last.scale == scores.scale and last.soft_cap == scores.soft_cap
                and last.v_scale == scores.v_scale and last.k_head_scale is scores.k_head_scale
                and last.v_head_scale is scores.v_head_scale and last.sinks is scores.sinks):
            self.scores = scores  # the same values
            return
        p = self.params
        p.scale, p.soft_cap, p.v_scale = scores.scale, scores.soft_cap, scores.v_scale
        ka, va, sinks = scores.k_head_scale, scores.v_head_scale, scores.sinks
        p.k_head_scale = None if ka is None else ka.data.ptr
        p.v_head_scale = None if va is None else va.data.ptr
        p.sinks = None if sinks is None else sinks.data.ptr
        self.scores = scores

    def launch(self, units: int) -> None:
        """Launches ``units * heads_groups`` CTAs on the current stream with
        the parameters as set."""
        ctas = units * self.heads_groups
        self._launch(self.function, ctas, 1, 1, self.block, 1, 1, self._smem_for(ctas),
                     self._current_stream().ptr, self.params_ptr, 0)

    def _smem_for(self, ctas: int) -> int:
        """The dynamic shared memory a grid of ``ctas`` CTAs launches with
        (see :func:`residency_smem`): at most the loaded plan's CTAs per SM,
        the instance's count, and what spreads the grid evenly."""
        at = self._smem_at
        return at[min(-(-ctas // self._sms), self._held, len(at) - 1)]

    def launch_pointers(self, q: int, k: int, v: int, out: int, lse: int | None, stream: int) -> None:
        """Launches the image's units on ``stream`` with new array pointers,
        everything else as last set."""
        w = self._words
        w[_W_Q], w[_W_K], w[_W_V], w[_W_OUT], w[_W_LSE] = q, k, v, out, lse or 0
        key = self._pointers_key
        if key is None or key[8] != stream:
            key = self._pointers_key = (self.function, self.units * self.heads_groups, 1, 1, self.block, 1, 1,
                                        self._units_smem, stream, self.params_ptr, 0)
        self._launch_key(key)
