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

import operator
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from . import _configs, _env, _launch, _loader
from ._arrays import as_cupy as _as_cupy
from ._checks import (ScoreArgs, call_scores, check_core, check_inputs, check_lse, check_out, check_plan,
                      kernel_decline_reason, nhd_views, raise_not_current)
from ._device import require_gpu
from ._log import log_fallback
from .errors import UnsupportedConfigError
from .page_table import PageTable, kernel_table
from .plan import DecodePlan, plan_decode

METHODS = ("auto", "v2", "v1", "gather")
ENV_METHOD = "CUPAGED_DECODE"
ENV_CORE = "CUPAGED_CORE"  # "mma" or "simt": pins the partial kernel's core (benchmarks)


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


# ------------------------------------------------------------------------- selection
def default_method() -> str:
    return _env.decode_method()  # CUPAGED_DECODE, validated


def auto_method(table: PageTable) -> Selection:
    """What ``method="auto"`` picks for a batch the kernels can serve.

    v2 everywhere: the H200 microbenchmark (docs/benchmarks/) shows no cell
    where v1 or gather is faster.
    """
    return Selection("v2", "auto: split-KV v2 (fastest in every measured cell)")


def select_method(q, k_cache, v_cache, table: PageTable, plan: DecodePlan | None = None, method: str = "auto", *,
                  kv_layout: str = "NHD", per_head_scales: bool = False, sinks: bool = False, window_left=None,
                  qo_indptr=None) -> Selection:
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
        kv_layout: ``"NHD"`` or ``"HND"``, as for ``decode``.
        per_head_scales: True when the call passes per-head (array)
            ``k_scale``/``v_scale`` (v1 takes per-tensor scales only).
        sinks: True when the call passes ``sinks`` (v1 takes none).
        window_left, qo_indptr: as for ``decode`` (the checks then see its
            table: ``q`` has a row per query token).

    Returns:
        A :class:`Selection`. The kernels decline a head_dim other than 64,
        96, 128 or 256, a non-contiguous head_dim, and a base pointer or
        stride that is not a multiple of 16 bytes; fp8 KV runs on v2 at
        head_dim 64, 96 and 128 only; v1 takes no fp8, no per-head
        scales and no sinks. For those the result is ``"gather"`` with the reason, e.g.
        ``"fallback from v2: head_dim 80 has no kernel instance (supported:
        (64, 96, 128, 256))"``.

    Raises:
        ArgumentTypeError [TypeError] (an input that is not a CuPy/CUDA
        array, NumPy arrays included; ``table`` not a PageTable), ShapeError,
        DTypeError, DeviceMismatchError, UnsupportedConfigError (an unknown
        ``method`` or ``CUPAGED_DECODE``), all ValueErrors, as for
        :func:`decode`; PageTableError (a page id ``>= num_pages``). It
        raises no NoGPUError of its own, but CuPy arrays need a GPU.

    Example (needs a GPU)::

        table = cupaged.PageTable.from_seq_lens([100], page_size=16)
        k = cupy.zeros((7, 16, 2, 80), dtype=cupy.float16)  # head_dim 80: no kernel
        q = cupy.zeros((1, 8, 80), dtype=cupy.float16)
        sel = cupaged.select_method(q, k, k, table, method="v2")
        sel.method   # "gather"
        sel.reason   # "fallback from v2: head_dim 80 has no kernel instance (supported: (64, 96, 128, 256))"
    """
    q, k_cache, v_cache = _as_cupy(q, "q"), _as_cupy(k_cache, "k_cache"), _as_cupy(v_cache, "v_cache")
    k_cache, v_cache = nhd_views(k_cache, v_cache, kv_layout)
    table = kernel_table(table, qo_indptr, window_left)
    variant = check_inputs(q, k_cache, v_cache, table)
    return _select(q, k_cache, v_cache, table, method, variant, per_head_scales, sinks)


def _select_method_name(method: str) -> str:
    """``method`` checked, with ``"auto"`` replaced by env CUPAGED_DECODE's value."""
    if method not in METHODS:
        raise UnsupportedConfigError(f"method must be one of {METHODS}, got {method!r}")
    return default_method() if method == "auto" else method


def _select(q, k_cache, v_cache, table: PageTable, method: str, variant: str = "",
            per_head_scales: bool = False, sinks: bool = False) -> Selection:
    method = _select_method_name(method)
    if method == "gather":
        return Selection("gather", "requested")
    decline = kernel_decline_reason(q, k_cache, v_cache, method, variant)
    if decline is None and method == "v1" and per_head_scales:
        decline = "v1 takes per-tensor k_scale/v_scale only"
    if decline is None and method == "v1" and sinks:
        decline = "v1 takes no sinks"
    if decline is not None:
        log_fallback(method, decline)  # a WARNING, once per (method, reason)
        return Selection("gather", f"fallback from {method}: {decline}")
    if method == "auto":
        return auto_method(table)
    return Selection(method, "requested")


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
            With a held plan, a v2 call like the previous one (same table
            object, shapes, strides, dtypes, device, stream, method, sm_scale,
            soft cap, k/v scales and layout) skips the input checks and only
            swaps pointers; so does one like an earlier call with other
            ``k_scale``/``v_scale``/``sinks`` objects (a model's per-layer
            scale or sink arrays: the plan keeps a record per such triple).
        method: ``"auto"`` (env ``CUPAGED_DECODE`` overrides; else v2),
            ``"v2"`` (split-KV, merge fused), ``"v1"`` (one CTA per request
            and query head) or ``"gather"`` (CuPy + cuBLAS). The kernels
            decline a head_dim other than 64/96/128/256, a non-contiguous
            head_dim, or a pointer or stride not a multiple of 16 bytes; fp8
            runs on v2 at head_dim 64/96/128; v1 takes neither fp8 nor
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
        states = _plan_states.get(id(plan))  # only live DecodePlans are keys (see plan_states)
        if states is not None:
            state = states.last
            hot = state.hot
            if hot is not None and (k_scale is not hot.k_scale or v_scale is not hot.v_scale
                                    or sinks is not hot.sinks):  # another layer's scales or sinks
                hot = state.hots.get((id(k_scale), id(v_scale), id(sinks)))
            if hot is not None:
                res = hot.launch(state, q, k_cache, v_cache, table, method,
                                 (sm_scale, logits_soft_cap, k_scale, v_scale, kv_layout, sinks, window_left, qo_indptr),
                                 out, return_lse, lse)
                if res is not None:
                    return res
    if method not in METHODS or method == "auto":  # argument errors before the GPU check
        _select_method_name(method)
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

    selection = _select(q, k_cache, v_cache, table, method, dtype, scores.k_head_scale is not None
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


def _decode_v2(q, k_cache, v_cache, table, plan, dtype: str, scores, out, lse, call: tuple) -> None:
    """decode's v2 launch, its inputs checked: plans the call when ``plan``
    is None, else checks the plan against the table once per table, loads
    the table into the plan's launch state and launches; with a held plan
    the call is recorded for the hot path. ``call``: (k and v as passed,
    the table as passed, the method, decode's keyword arguments)."""
    import cupy

    raw_k, raw_v, raw_table, method, args = call
    head_dim = q.shape[-1]
    held = plan is not None  # only a caller's plan is worth a _HotCall record
    if plan is None:
        check_core(dtype, head_dim)
        plan = plan_decode(table, q.shape[1], k_cache.shape[2], head_dim, q.dtype,
                           kv_dtype=None if k_cache.dtype == q.dtype else _configs.FP8)
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
        # arguments may skip decode's checks (_HotCall); any other v2 call with
        # this plan rewrites the fields, so it drops or replaces the record.
        # (host arrays that shape the table, a window per request or a
        # qo_indptr, could change in place under the same object: not recorded)
        sm_scale, window_left, qo_indptr = args[0], args[6], args[7]
        eligible = (held and (sm_scale is None or type(sm_scale) in (float, int)) and type(q) is cupy.ndarray
                    and type(raw_k) is cupy.ndarray and type(raw_v) is cupy.ndarray and qo_indptr is None
                    and (window_left is None or type(window_left) is int))
        state.record(_HotCall(q, raw_k, raw_v, raw_table, method, args, out, scores) if eligible else None)


# ---------------------------------------------------------------------- launches
MAX_HOT_RECORDS = 256  # hot-path records per launch state: a model's layers of distinct scale arrays


class _PlanLaunch(_launch.PartialLaunch):
    """decode()'s launch state of one plan on one device and stream: a
    :class:`~cupaged._launch.PartialLaunch` sized for the plan (its page
    capacity grows with the table), plus what the hot path needs: the last
    table the plan was checked against (tables are immutable), the shapes it
    was checked for and the record of the last call (:class:`_HotCall`)."""

    def __init__(self, plan: DecodePlan, dtype: str, table: PageTable, stream_ptr: int):
        pages = max(int(table.indptr[-1]), 1)
        super().__init__(dtype, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.heads_per_cta,
                         plan.page_size, plan.batch_size, plan.num_chunks, pages + pages // 4,
                         "partial" if plan.group_last is None else "rows")
        self.plan_units = _launch.plan_units(plan)
        self.stream_ptr = stream_ptr
        self.checked_table = None  # weakref to the last table that matched
        self.hot = None  # _HotCall of the last v2 launch, when it may be repeated unchecked
        # records by the identities of their k_scale, v_scale and sinks (one per layer of a
        # model with per-layer scale or sink arrays); all of one geometry, the parameters' strides
        self.hots: dict[tuple, _HotCall] = {}
        self.signature = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, dtype)

    def record(self, hot: "_HotCall | None") -> None:
        """Makes ``hot`` (None: no record) the record of the last call; the
        records of other scales stay while they share its geometry (the
        strides the parameters now hold), at most MAX_HOT_RECORDS of them."""
        last = self.hot
        self.hot = hot
        if hot is None or last is None or hot.geometry != last.geometry:
            self.hots.clear()
        if hot is not None:
            hots = self.hots
            hots[(id(hot.k_scale), id(hot.v_scale), id(hot.sinks))] = hot
            if len(hots) > MAX_HOT_RECORDS:
                del hots[next(iter(hots))]  # the oldest

    def load_table(self, plan: DecodePlan, table: PageTable) -> None:
        pages = int(table.indptr[-1])
        if pages > self.max_pages:  # the requests grew past the image: a larger one (not while captured)
            self.max_pages = pages + pages // 4
            self._alloc(self.max_batch, self.max_units, self.max_pages, plan.num_qo_heads)
            p = self.params
            p.plan, p.partial_v, p.partial_lse, p.merge_counters = (
                self.image.data.ptr, self.partial_v.data.ptr, self.partial_lse.data.ptr, self.counters.data.ptr)
        self.load(plan, self.plan_units, table)


class _PlanStates(dict):
    """A plan's launch states, ``{(device id, stream pointer): _PlanLaunch}``;
    ``last`` is the one used last (the hot path's guess); ``ref`` is a weak
    reference to the plan whose callback drops the entry."""

    last: "_PlanLaunch | None" = None
    ref: "weakref.ref | None" = None


# Keyed by id(plan), not by a WeakKeyDictionary: its get() makes a weak
# reference per call (~0.4 us of the hot path). An entry lives exactly as long
# as its plan: the weak reference's callback runs while the plan is freed,
# before its id can be reused, so a key found here is a live DecodePlan. The
# states must never hold the plan itself (that would keep it alive forever).
_plan_states: "dict[int, _PlanStates]" = {}
_states_lock = threading.Lock()


def plan_states(plan) -> "_PlanStates | None":
    """The launch states of ``plan`` made so far, or None."""
    return _plan_states.get(id(plan)) if type(plan) is DecodePlan else None


def plan_state(plan: DecodePlan, dtype: str, table: PageTable) -> _PlanLaunch:
    """The plan's launch state on the current device and stream, made on
    first use. Each (device, stream) gets its own workspace and image, so
    one plan may run on several GPUs, or on several streams at once."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)
    states = _plan_states.get(id(plan))
    if states is None:
        with _states_lock:
            states = _plan_states.get(id(plan))
            if states is None:
                states = _PlanStates()
                pid = id(plan)
                states.ref = weakref.ref(plan, lambda _, pid=pid: _plan_states.pop(pid, None))
                _plan_states[pid] = states
    state = states.get(key)
    if state is None:
        with _states_lock:
            state = states.get(key) or states.setdefault(key, _PlanLaunch(plan, dtype, table, key[1]))
    states.last = state
    return state


_env_method_raw = _env.decode_method_raw  # one dict lookup (os.environ.get costs ~0.7 us unset)
_NO_ENV = object()  # the record of a call whose method was not "auto"


def _same_arg(a, b) -> bool:
    """The hot path's test that an argument is the recorded one: the same
    object, or an equal plain float or int (an array must be the same object)."""
    return a is b or (type(a) in (float, int) and type(a) is type(b) and a == b)


def args_match(args: tuple, rec: tuple) -> bool:
    """Whether every argument is the recorded one (:func:`_same_arg`). Never
    ``==`` on the tuples: an array's ``==`` is elementwise (a GPU kernel for
    CuPy) and its truth value raises, or, for one element, would let a new
    array of equal values through while the launch still reads the recorded
    one's pointer."""
    return not any(map(operator.is_not, args, rec)) or all(map(_same_arg, args, rec))


class _HotCall:
    """What one fully checked v2 call looked like, so that the next call of the
    same kind (a serving loop: per layer a new q, out and layer cache of the
    same shapes) skips decode's checks: it compares the arrays' types,
    shapes, strides, dtypes and devices, the table's identity, the method
    (and CUPAGED_DECODE), sm_scale, the soft cap, the k/v scales and the
    layout with the record, tests the new pointers' 16-byte alignment, and
    launches with only the pointer fields rewritten. Any difference returns
    None and the full path runs (and records again). Host cost measured by
    scripts/host_profile.py; each comparison is one tuple comparison, as
    every Python operation here costs ~50 ns of the ~8 us budget."""

    def __init__(self, q, k, v, table, method: str, args: tuple, out, scores):
        import cupy

        self.table, self.method, self.args, self.scores = table, method, args, scores
        self.k_scale, self.v_scale, self.sinks = args[2], args[3], args[5]  # (keys of _PlanLaunch.hots)
        self.env = _env_method_raw() if method == "auto" else _NO_ENV
        self.ndarray, self.empty, self.float32 = cupy.ndarray, cupy.empty, cupy.float32
        self.get_device, self.get_stream = cupy.cuda.runtime.getDevice, cupy.cuda.get_current_stream
        device = self.device = q.data.device_id
        # k and v as passed (HND: before the NHD view); out as given (or as allocated)
        self.meta = (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
                     q.shape, out.strides, q.dtype)
        self.devices = (device, device, device, device, device)
        self.geometry = (self.meta, args[4])  # shapes, strides and layout: the parameters' strides
        rows = q.shape[:2]
        self.lse_meta = (rows, np.dtype(np.float32), (4 * rows[1], 4), device)

    def launch(self, state: _PlanLaunch, q, k, v, table, method, args: tuple, out, return_lse, lse):
        """Launches with ``state`` (whose record this is) and returns decode's
        result, or None (the full path runs)."""
        nd = self.ndarray
        if table is not self.table or method != self.method or type(q) is not nd or type(k) is not nd \
                or type(v) is not nd:
            return None
        rec = self.args  # (sm_scale, logits_soft_cap, k_scale, v_scale, kv_layout, sinks, window_left, qo_indptr)
        if not args_match(args, rec):
            return None
        if self.env is not _NO_ENV and _env_method_raw() != self.env:
            return None
        if out is None:
            out = self.empty(self.meta[0], dtype=self.meta[2])
        elif type(out) is not nd:
            return None
        if (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
                out.shape, out.strides, out.dtype) != self.meta:
            return None
        qp, kp, vp, op = q.data, k.data, v.data, out.data
        qa, ka, va = qp.ptr, kp.ptr, vp.ptr
        stream = state.stream_ptr
        if ((qa | ka | va) & 15 or self.get_stream().ptr != stream
                or (qp.device_id, kp.device_id, vp.device_id, op.device_id, self.get_device()) != self.devices):
            return None
        if lse is not None:
            if type(lse) is not nd or (lse.shape, lse.dtype, lse.strides, lse.data.device_id) != self.lse_meta:
                return None
        elif return_lse:
            lse = self.empty(self.lse_meta[0], dtype=self.float32)
        with state.lock:
            if state.scores is not self.scores:  # another layer's record: its scales and sinks
                state.set_scores(self.scores)
            state.launch_pointers(qa, ka, va, op.ptr, None if lse is None else lse.data.ptr, stream)
        return (out, lse) if return_lse else out


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
