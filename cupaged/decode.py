"""Dispatch: one decode call -> checks, then the v2, v1 or gather path.

v2 is one launch of the split-KV partial kernel (its launch state is
cupaged/_launch.py's, per plan, device and stream). A request with one chunk is
written straight into ``out``; a request with several chunks writes float32
partials that the last of its CTAs merges (an atomic ticket, merge fused into
the same launch). Every output element is written by exactly one CTA, so
``out`` never keeps uninitialised memory. The standalone merge kernel
(:func:`cupaged.merge_states`) is the reusable public half.
"""

from __future__ import annotations

import weakref

import numpy as np

from . import _configs, _launch, _loader
from ._arrays import as_cupy as _as_cupy
from ._checks import (ScoreArgs, call_scores, check_core, check_inputs, check_lse, check_out, check_plan,
                      nhd_views, raise_not_current)
from ._device import require_gpu
from ._plan_launch import PLAN_STATES, HotCall, plan_state, plan_states
from .page_table import PageTable, kernel_table
from .plan import DecodePlan, plan_decode
from .selection import METHODS, check_method, select


# ---------------------------------------------------------------------- the entry
def decode(q, k_cache, v_cache, table: PageTable, plan: DecodePlan | None = None, *, method: str = "auto",
           sm_scale: float | None = None, logits_soft_cap: float | None = None, k_scale=None, v_scale=None,
           kv_layout: str = "NHD", out=None, return_lse: bool = False, lse=None, sinks=None, window_left=None,
           qo_indptr=None, validate: bool = False):
    """Paged-attention decode: one query token per request (or several, with
    ``qo_indptr``) against its paged KV.

    Args:
        q: ``[batch, num_qo_heads, head_dim]`` CuPy array (or a CUDA array
            via ``__cuda_array_interface__`` / DLPack), float16, bfloat16
            (``ml_dtypes.bfloat16``) or float32. The kernels need head_dim
            contiguous and 16-byte aligned rows; otherwise the gather path runs.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``
            (NHD; ``[num_pages, num_kv_heads, page_size, head_dim]`` with
            ``kv_layout="HND"``) CuPy arrays of q's dtype, or **fp8**: uint8
            arrays of float8_e4m3fn bit patterns (CuPy has no float8 dtype;
            :func:`cupaged.fp8.to_e4m3` makes them) under a float16/bfloat16
            q. The page stride may exceed the page's size (a slice of a
            larger cache).
        table: the :class:`PageTable` (CSR view) of the batch; its page ids
            must be ``< num_pages``.
        plan: a :class:`DecodePlan` from :func:`plan_decode` for this table
            and shapes, held across decode steps while ``plan.matches(table)``.
            Built here when None (host cost every call). A plan gets its own
            launch state (workspace, and a device copy of the plan and the
            table) per device and stream, so it may serve several GPUs and
            streams. A CUDA graph that captured a v2 call reads that state: it
            decodes the table of the plan's latest call on that stream (for
            one graph over changing tables, use :class:`cupaged.DecodeRunner`).
            The state lives as long as the plan: keep the plan (and q, the
            caches and out) alive while such a graph may replay.
            With a held plan, a v2 call like the previous one (same table
            object, shapes, strides, dtypes, device, stream, method, sm_scale,
            soft cap, k/v scales and layout) skips the input checks and only
            swaps pointers; so does one like an earlier call with other
            ``k_scale``/``v_scale``/``sinks`` objects (a model's per-layer
            scale or sink arrays: the plan keeps a record per such triple).
        method: ``"auto"`` (env ``CUPAGED_DECODE`` overrides; else v2),
            ``"v2"`` (split-KV, merge fused), ``"v1"`` (one CTA per request
            and query head) or ``"gather"`` (CuPy + cuBLAS). The kernels
            decline a head_dim other than 64/80/96/128/192/256, a non-contiguous
            head_dim, or a pointer or stride not a multiple of 16 bytes; fp8
            runs on v2 at head_dim 64/96/128/192; v1 takes neither fp8 nor
            per-head scales. Such calls run the gather path and log a
            WARNING on ``logging.getLogger("cupaged")`` once per method and
            reason (:func:`select_method` says which path and why). Env
            ``CUPAGED_CORE=mma|simt`` pins v2's core.
        sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
        logits_soft_cap: None or 0 (off), or ``cap > 0``: logits become
            ``cap * tanh(sm_scale * q.k / cap)`` (Gemma-2) before the softmax.
        k_scale, v_scale: dequantization scales, None (1), a positive float
            (per tensor; a normal float32) or a float32 ``[num_kv_heads]``
            array on q's device (per kv head; its values are not checked):
            the attention reads ``K = k_cache * k_scale`` and ``V = v_cache *
            v_scale``. Any KV dtype; meant for fp8 (which v2 serves on GPUs of
            compute capability 8.9+; older ones run the gather path).
        kv_layout: ``"NHD"`` (default) or ``"HND"``, the layout of both caches.
        out: optional output array (q's shape and dtype, head_dim contiguous).
        return_lse: also return the LSE, ``[batch, num_qo_heads]`` float32 in
            **log2 units** (natural log = lse * ln 2) of the (capped) logits;
            -inf for an empty request.
        lse: optional LSE output, a C-contiguous float32 ``[batch,
            num_qo_heads]`` array on q's device: the LSE is written there
            (returned with ``return_lse``) instead of a new array; saves an
            allocation (~2-3 us of host time) per call.
        sinks: optional attention sinks (gpt-oss): a C-contiguous float32
            ``[num_qo_heads]`` array on q's device of natural-log logits in
            the units of ``q.k * sm_scale`` (not soft-capped). Head ``h``'s
            softmax denominator gains ``exp(sinks[h])`` (nothing in the
            numerator); the LSE includes it (an empty request: zeros, LSE
            ``sinks[h] * log2(e)``). v2 and gather (v1 falls back to gather).
        window_left: sliding window (Mistral, Gemma 2/3, gpt-oss): None or
            -1 (none), an int ``W >= 0``, or an int ``[batch]`` array (-1:
            none for that request). Each request's query, at its last
            visible slot ``p``, sees slots ``p - W .. p`` only; pages before
            the window are never read. Runs on ``table.windowed(W)`` (cached
            on the table), so a held ``plan`` must be made for the same
            window (``plan_decode(..., window_left=W)``).
        qo_indptr: several query tokens per request (speculative decoding,
            draft verification): None (one each), or an int ``[batch + 1]``
            NumPy or CuPy array or sequence from 0 with ``q_len_i =
            qo_indptr[i+1] - qo_indptr[i]`` in ``[1, 16]``. ``q``, ``out``
            and ``lse`` then have ``qo_indptr[-1]`` rows; request ``i``'s new
            tokens are its last ``q_len_i`` visible slots (already appended),
            and its token ``j`` sees visible slots ``0 .. seq_len_i - q_len_i
            + j``. Runs on ``table.query_rows(qo_indptr)`` (cached on the
            table; with ``window_left`` each token has its own window), so a
            held ``plan`` must be made with the same ``qo_indptr``. Each query
            row reads its KV on its own for now (the tokens of one request
            share it through L2).
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
        ``(out, lse)`` with ``return_lse`` (``lse`` is the given array when
        one is passed). An empty request's output is zeros.
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
        contiguous; ``lse`` not C-contiguous; with ``validate``,
        overlapping ``out`` elements),
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
        [RuntimeError] (no CUDA device; checked right after ``method`` and env
        ``CUPAGED_DECODE``, before the arrays).

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
    if plan is not None and not validate:  # a held plan: the hot path when the call repeats the last one
        states = PLAN_STATES.get(id(plan))  # only live DecodePlans are keys (see plan_states)
        if states is not None:
            state = states.last
            hot = state.hot
            if hot is not None and (k_scale is not hot.k_scale or v_scale is not hot.v_scale
                                    or sinks is not hot.sinks):  # another layer's scales or sinks
                hot = state.hots.get((id(k_scale), id(v_scale), id(sinks)))
            if hot is not None:
                res = hot.launch(state, q, k_cache, v_cache, table, method, sm_scale, logits_soft_cap, kv_layout,
                                 window_left, qo_indptr, out, return_lse, lse)
                if res is not None:
                    return res
    if method not in METHODS or method == "auto":  # argument errors before the GPU check
        check_method(method)
    require_gpu("cupaged.decode")
    import cupy

    q, k_cache, v_cache = _as_cupy(q, "q"), _as_cupy(k_cache, "k_cache"), _as_cupy(v_cache, "v_cache")
    raw_k, raw_v, raw_table = k_cache, v_cache, table  # as passed: what the hot path's record compares
    if window_left is not None or qo_indptr is not None:
        table = kernel_table(table, qo_indptr, window_left)
    if kv_layout != "NHD":
        k_cache, v_cache = nhd_views(k_cache, v_cache, kv_layout)
    dtype = check_inputs(q, k_cache, v_cache, table)
    if q.data.device_id != cupy.cuda.runtime.getDevice():
        raise_not_current(q)
    head_dim = q.shape[-1]
    scores = call_scores(sm_scale, head_dim, logits_soft_cap, k_scale, v_scale, sinks, k_cache.shape[2], q)
    out, lse = _outputs(q, out, lse, return_lse, validate)
    selection = select(q, k_cache, v_cache, table, method, dtype, scores.k_head_scale is not None
                        or scores.v_head_scale is not None, scores.sinks is not None)
    if validate:
        from ._validate import check_device_table

        check_device_table(table, k_cache.shape[0])
    if selection.method == "gather":
        from .gather import gather_decode

        gather_decode(q, k_cache, v_cache, table, scores.scale, out, lse, soft_cap=scores.soft_cap,
                      v_scale=scores.v_scale, k_head_scale=scores.k_head_scale, v_head_scale=scores.v_head_scale,
                      sinks=scores.sinks)
    elif q.shape[0] == 0:
        pass  # an empty batch has nothing to launch
    elif selection.method == "v1":
        _launch_v1(q, k_cache, v_cache, table, dtype, scores, out, lse)
    else:
        _decode_v2(q, k_cache, v_cache, table, plan, dtype, scores, out, lse, (raw_k, raw_v, raw_table, method, (
            sm_scale, logits_soft_cap, k_scale, v_scale, kv_layout, sinks, window_left, qo_indptr)))
    return (out, lse) if return_lse else out


def _outputs(q, out, lse, return_lse: bool, validate: bool):
    """decode's ``(out, lse)``: the given arrays checked, or new ones (no
    LSE array unless one is given or ``return_lse``)."""
    import cupy

    if out is None:
        out = cupy.empty(q.shape, dtype=q.dtype)
    else:
        out = check_out(out, q)
        if validate:
            from ._validate import check_out_overlap

            check_out_overlap(out)
    if lse is not None:
        lse = check_lse(lse, q)
    elif return_lse:
        lse = cupy.empty(q.shape[:2], dtype=cupy.float32)
    return out, lse


def _decode_v2(q, k_cache, v_cache, table, plan, dtype: str, scores, out, lse, call: tuple) -> None:
    """decode's v2 launch, its inputs checked: plans the call when ``plan``
    is None, else checks the plan against the table once per table, loads
    the table into the plan's launch state and launches; with a held plan
    the call is recorded for the hot path. ``call``: (k and v as passed,
    the table as passed, the method, decode's keyword arguments)."""
    import cupy

    raw_k, raw_v, raw_table, method, args = call
    head_dim = q.shape[-1]
    held = plan is not None  # only a caller's plan is worth a HotCall record
    if plan is None:
        check_core(dtype, head_dim)
        plan = plan_decode(table, q.shape[1], k_cache.shape[2], head_dim, q.dtype,
                           kv_dtype=_configs.split_variant(dtype)[1])
        state = plan_state(plan, dtype, table)
    else:
        states = plan_states(plan)
        state = None if states is None else states.last
        if state is None or state.checked_table is None or state.checked_table() is not table:
            check_plan(plan, table, q, k_cache, dtype)
            if state is None:
                check_core(dtype, head_dim)
        elif (q.shape[1], k_cache.shape[2], head_dim, dtype) != state.signature:
            check_plan(plan, table, q, k_cache, dtype)  # raises: same table, other shapes
        state = plan_state(plan, dtype, table)
    with state.lock:
        if table is not state.table:
            state.load_table(plan, table)
        state.checked_table = weakref.ref(table)
        state.set_arrays(q, k_cache, v_cache, out, lse)
        state.set_scores(scores)
        state.launch(state.units)
        # The next call with these shapes, strides, dtypes, device, stream and
        # arguments may skip decode's checks (HotCall); any other v2 call with
        # this plan rewrites the fields, so it drops or replaces the record.
        # (host arrays that shape the table, a window per request or a
        # qo_indptr, may change in place under the same object: the record
        # keeps their content; a CuPy qo_indptr would need a device read: not recorded)
        sm_scale, window_left, qo_indptr = args[0], args[6], args[7]
        eligible = (held and (sm_scale is None or type(sm_scale) in (float, int)) and type(q) is cupy.ndarray
                    and type(raw_k) is cupy.ndarray and type(raw_v) is cupy.ndarray
                    and (qo_indptr is None or type(qo_indptr) is np.ndarray)
                    and (window_left is None or type(window_left) in (int, np.ndarray)))
        state.record(HotCall(q, raw_k, raw_v, raw_table, method, args, out, scores) if eligible else None)


def _launch_v1(q, k_cache, v_cache, table, dtype, scores: ScoreArgs, out, lse):
    batch, num_qo_heads, head_dim = q.shape
    if batch == 0:
        return
    kernel = _loader.get_kernel("v1", dtype, head_dim)
    strides = _launch.elem_strides
    kernel(
        (batch, num_qo_heads, 1), (_launch.THREADS,),
        (q, *strides(q, 2), k_cache, *strides(k_cache, 3), v_cache, *strides(v_cache, 3),
         *table.device(), np.int32(table.page_size), np.int32(num_qo_heads),
         np.int32(num_qo_heads // k_cache.shape[2]), np.float32(scores.scale), np.float32(scores.soft_cap),
         np.float32(scores.v_scale), out, *strides(out, 2),
         _launch.NULL_PTR if lse is None else lse),
    )
