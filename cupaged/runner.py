"""DecodeRunner: the serving runtime's launch object, one per device and stream.

A server calls decode once per layer per step, requests join and leave every
step, and the whole step is best captured once as a CUDA graph and replayed.
A :class:`DecodeRunner` owns fixed-capacity device buffers (the plan image:
work units and page table; the merge workspace; the ticket counters), the
compiled kernel and its packed parameters:

* :meth:`DecodeRunner.plan` plans a table (or takes a plan) and writes it
  into the image with one async copy from pinned memory: no allocation, and
  the image's address never changes;
* :meth:`DecodeRunner.run` launches. Outside a graph capture it launches the
  CTAs of the current plan; while its stream is capturing it launches the
  capacity grid, whose CTAs past the current plan exit at once (about 0.6 ns
  of GPU time each on the H200, docs/benchmarks/empty-grid-h200-2026-12-01.log),
  so the captured graph serves every later plan within the capacities,
  a changed batch size included.

Thread safety: a runner serializes its own methods with a lock, but its
buffers belong to one stream: call :meth:`plan` and :meth:`run` on the stream
the runner was made for (the current stream at construction) or make one
runner per stream. Plans and tables are frozen values that any thread may
share.
"""

from __future__ import annotations

import threading

import numpy as np

from . import _configs, _launch
from ._device import require_gpu
from ._checks import (call_scores, check_inputs, check_lse, check_out, check_plan_for, kernel_decline_reason,
                      nhd_views)
from ._arrays import as_cupy
from .errors import (ArgumentTypeError, CapacityError, DeviceMismatchError, InvalidArgumentError, ShapeError,
                     UnsupportedConfigError)
from .page_table import PageTable, kernel_table
from .plan import DecodePlan, _plan_decode, heads_per_cta, plan_decode

__all__ = ["DecodeRunner"]


def _capacity(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= int(value) <= 2**31 - 1:
        raise InvalidArgumentError(f"{name} must be an int in [1, 2**31 - 1], got {value!r}")
    return int(value)


def cap_for_units(pages: np.ndarray, max_units: int) -> int:
    """The smallest chunk cap ``L`` (pages) at which splitting every request
    into ``max(1, ceil(pages / L))`` chunks makes at most ``max_units``
    chunks (``max_units >= len(pages)``).

    >>> cap_for_units(np.array([100, 10, 0]), 5)
    34
    """
    pages = np.asarray(pages, dtype=np.int64)
    lo, hi = 1, max(int(pages.max(initial=1)), 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(np.maximum(1, -(-pages // mid)).sum()) <= max_units:
            hi = mid
        else:
            lo = mid + 1
    return lo


class DecodeRunner:
    """Launch object of the split-KV decode for one shape, device and stream,
    with fixed capacities (see the module docstring).

    Args:
        num_qo_heads, num_kv_heads, head_dim: the model's attention shape.
        dtype: q's and out's dtype (float16, bfloat16 or float32).
        page_size: tokens per page of the caches and tables.
        max_batch: the most requests a plan may have.
        max_pages: the most page ids a table may hold (``table.indptr[-1]``).
        kv_dtype: the caches' dtype: None (q's) or fp8 (``"float8_e4m3fn"``,
            ``np.uint8`` or ``ml_dtypes.float8_e4m3fn``; uint8 caches), as
            for :func:`cupaged.plan_decode`.
        max_units: the most chunks a plan may have (default ``max_batch +
            128``). A plan with more is re-planned with the smallest larger
            chunk cap that fits. A graph captured by :meth:`run` launches
            ``max_units * heads_groups`` CTAs.
        group_tokens: False (default) or True: the runner launches the
            kernel of row groups, so that a step of several query tokens per
            request (``plan(table, qo_indptr=...)``, no window) reads each
            chunk's K/V once for a request's tokens, as ``decode`` does. The
            kernel is part of a captured graph, so it is chosen here; steps
            of one token each then run its 16-row tile too.

    Example (needs a GPU)::

        runner = cupaged.DecodeRunner(32, 8, 128, cupy.float16, page_size=16, max_batch=64, max_pages=65536)
        runner.plan(table)                      # step 1
        graph = capture(lambda: runner.run(q_buf, k, v, out=out_buf))  # q_buf/out_buf: [max_batch, 32, 128]
        runner.plan(next_table)                 # step 2: other requests, other batch size
        graph.launch()                          # decodes next_table's batch into out_buf[:batch]

    Raises (constructor): InvalidArgumentError (a capacity that is not a
    positive int32), ShapeError/DTypeError/UnsupportedConfigError (shapes
    and dtypes no kernel serves), NoGPUError.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype, *, page_size: int,
                 max_batch: int, max_pages: int, kv_dtype=None, max_units: int | None = None,
                 group_tokens: bool = False):
        require_gpu("cupaged.DecodeRunner")
        import cupy

        self.max_batch = _capacity(max_batch, "max_batch")
        self.max_pages = _capacity(max_pages, "max_pages")
        self.max_units = _capacity(self.max_batch + 128 if max_units is None else max_units, "max_units")
        if self.max_units < self.max_batch:
            raise InvalidArgumentError(f"max_units ({self.max_units}) must be >= max_batch ({self.max_batch}): "
                                       "every request is at least one unit")
        # plan_decode checks the shapes and dtypes and names what is unsupported
        probe = plan_decode(PageTable.from_seq_lens([page_size], page_size), num_qo_heads, num_kv_heads, head_dim,
                            dtype, kv_dtype=kv_dtype)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.dtype, self.kv_dtype = probe.page_size, probe.dtype, probe.kv_dtype
        q_name = _configs.dtype_name(probe.dtype)
        self.variant = _configs.variant(q_name, probe.kv_dtype.name)
        try:
            _configs.choose_core(self.variant, head_dim)
        except ValueError as e:
            raise UnsupportedConfigError(f"DecodeRunner: {e}") from None
        self.device = cupy.cuda.runtime.getDevice()
        self.stream = cupy.cuda.get_current_stream()
        if not isinstance(group_tokens, (bool, np.bool_)):
            raise InvalidArgumentError(f"group_tokens must be True or False, got {group_tokens!r}")
        self.group_tokens = bool(group_tokens)
        self._launch = _launch.PartialLaunch(self.variant, num_qo_heads, num_kv_heads, head_dim,
                                             heads_per_cta(num_qo_heads // num_kv_heads), probe.page_size,
                                             self.max_batch, self.max_units, self.max_pages,
                                             "rows" if self.group_tokens else "partial")
        self._lock = threading.RLock()
        self._is_capturing = cupy.cuda.runtime.streamIsCapturing
        self._num_pages = None  # the caches' page count seen by run(): later tables are checked against it
        self.current_plan: DecodePlan | None = None
        self.current_table: PageTable | None = None
        self._own = None  # (plan, window_left) of the runner's last own plan without knobs or qo_indptr

    # ------------------------------------------------------------------ plan
    def plan(self, table: PageTable, plan: DecodePlan | None = None, *, window_left=None, qo_indptr=None,
             **knobs) -> DecodePlan:
        """Makes ``table`` (and its plan) the runner's current step: plans it
        with :func:`plan_decode` (``knobs`` are its keyword arguments) unless
        ``plan`` is given, and writes it into the image with one copy on the
        current stream, ordered before the next :meth:`run`. Returns the plan.
        Not while the stream is capturing (the copy reads pinned host memory
        that the next plan rewrites). Without ``plan`` or knobs, the runner
        keeps its last own plan while that still serves the table
        (``plan.matches``: requests grew within their chunks; an unsplit
        request's chunk is the plan's cap), so a steady batch re-plans only
        when a request joins, leaves or outgrows its chunks. With ``window_left`` (as for
        :func:`cupaged.decode`) the runner's step is ``table.windowed(window_left)``
        (a given ``plan`` must be made for that window); ``append_kv`` still
        writes each request's last slot, which the window keeps. A model that
        mixes windowed and full layers holds one runner per window. With
        ``qo_indptr`` (several query tokens per request, as for
        :func:`cupaged.decode`) the step is ``table.query_rows(qo_indptr)``:
        one row per query token, counted against ``max_batch``. ``run`` then
        takes ``q`` of ``qo_indptr[-1]`` rows, and :meth:`append_kv` writes
        row ``r`` of ``k_new``/``v_new`` into query token ``r``'s slot (a row's
        last visible slot is its token's): a step's new tokens in
        ``qo_indptr`` order.

        Raises CapacityError (the table exceeds max_batch or max_pages),
        PlanMismatchError (a plan for other shapes, or stale),
        PageTableError (a page id past the caches run() has seen), and
        plan_decode's errors."""
        if not isinstance(table, PageTable):
            raise ArgumentTypeError(f"table must be a cupaged.PageTable, got {type(table).__name__}")
        step = (table, window_left, qo_indptr)  # what plan_decode plans (row groups need qo_indptr)
        table = kernel_table(table, qo_indptr, window_left)
        with self._lock:
            self._check_device("plan")
            if self._is_capturing(self.stream.ptr):
                raise UnsupportedConfigError("DecodeRunner.plan cannot run while its stream is capturing a graph: "
                                             "plan before the capture (or between replays)")
            pages = int(table.indptr[-1])
            if table.batch_size > self.max_batch or pages > self.max_pages or table.batch_size == 0:
                raise CapacityError(
                    f"table of {table.batch_size} requests and {pages} pages does not fit the runner "
                    f"(1..{self.max_batch} requests, {self.max_pages} pages)")
            if table.page_size != self.page_size:
                raise ShapeError(f"table.page_size ({table.page_size}) must equal the runner's ({self.page_size})")
            if self._num_pages is not None:
                table.check_page_ids(self._num_pages)
            if plan is None:
                plan = self._held(table, step, knobs) or self._plan(step, knobs)
                simple = not knobs and qo_indptr is None and (window_left is None or type(window_left) is int)
                self._own = (plan, window_left) if simple else None
            else:
                check_plan_for(plan, table, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.variant)
                if plan.group_last is not None and not self.group_tokens:
                    raise UnsupportedConfigError(
                        "a plan with row groups needs DecodeRunner(..., group_tokens=True); or plan with "
                        "plan_decode(..., qo_indptr=..., group_tokens=False), or let the runner plan")
                if plan.num_chunks > self.max_units:
                    raise CapacityError(f"plan has {plan.num_chunks} chunks, the runner holds {self.max_units}")
            self._launch.load(plan, _launch.plan_units(plan), table)
            self.current_plan, self.current_table = plan, table
            return plan

    def _held(self, table: PageTable, step: tuple, knobs: dict) -> DecodePlan | None:
        """The runner's last own plan when it still serves this step's
        (kernel) ``table``: requests that grew within their chunks (an
        unsplit request's chunk is the plan's cap) need no new plan, so a
        steady batch skips plan_decode on most steps. Only for a plain step
        (no knobs, no qo_indptr, the same window)."""
        if self._own is None or knobs or step[2] is not None:
            return None
        plan, window_left = self._own
        if step[1] is not window_left and not (type(step[1]) is int and step[1] == window_left):
            return None
        return plan if plan.matches(table) else None

    def _plan(self, step: tuple, knobs: dict) -> DecodePlan:
        """plan_decode of the step ``(table, window_left, qo_indptr)`` (row
        groups with ``group_tokens``) within ``max_units`` chunks, for the
        runner's 4-warp rows kernel (no 8-warp plans: its kernel is captured)."""
        table, window_left, qo_indptr = step
        args = (table, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.dtype)
        kw = dict(kv_dtype=self.kv_dtype, window_left=window_left, qo_indptr=qo_indptr,
                  group_tokens=self.group_tokens, eight_warps=False, **knobs)
        plan = _plan_decode(*args, **kw)
        if plan.num_chunks > self.max_units:  # fewer, longer chunks: the smallest cap that fits
            kw = {k: v for k, v in kw.items() if k not in ("pages_per_chunk", "max_pages_per_chunk")}
            pages = kernel_table(table, qo_indptr, window_left).request_pages
            cap = cap_for_units(pages if plan.group_last is None else pages[plan.group_last], self.max_units)
            plan = _plan_decode(*args, max_pages_per_chunk=cap, **kw)
        return plan

    # ------------------------------------------------------------------- run
    def run(self, q, k_cache, v_cache, out=None, *, sm_scale: float | None = None,
            logits_soft_cap: float | None = None, k_scale=None, v_scale=None, kv_layout: str = "NHD",
            return_lse: bool = False, lse=None, sinks=None):
        """Decodes the current plan's batch: request ``i`` reads ``q[i]`` and
        writes ``out[i]`` for ``i < batch`` (rows past it are neither read
        nor written). Arguments as for :func:`cupaged.decode`; ``lse``
        (float32 ``[rows, num_qo_heads]``, contiguous) receives the LSE when
        given (a graph needs a fixed buffer), else ``return_lse`` allocates it.

        While the stream is capturing, ``q``, ``out`` (and ``lse``) must hold
        ``max_batch`` rows, so that replays for any later batch stay inside
        them; the capture launches the capacity grid.

        Returns ``out``, or ``(out, lse)`` with ``return_lse``.

        Raises as :func:`cupaged.decode` does, plus UnsupportedConfigError
        when no kernel serves the tensors (the runner has no gather path)
        and when no plan was made yet, and ShapeError when q or out has fewer
        rows than the batch (or than max_batch while capturing)."""
        import cupy

        with self._lock:
            plan = self.current_plan
            if plan is None:
                raise UnsupportedConfigError("DecodeRunner.run before DecodeRunner.plan: plan a table first")
            self._check_device("run")
            q, k_cache, v_cache = as_cupy(q, "q"), as_cupy(k_cache, "k_cache"), as_cupy(v_cache, "v_cache")
            if kv_layout != "NHD":
                k_cache, v_cache = nhd_views(k_cache, v_cache, kv_layout)
            capturing = self._is_capturing(self.stream.ptr) != 0
            rows = self.max_batch if capturing else plan.batch_size
            if q.ndim != 3 or q.shape[0] < rows:
                raise ShapeError(f"q must be [rows, {self.num_qo_heads}, {self.head_dim}] with rows >= {rows} "
                                 f"({'max_batch, while capturing' if capturing else 'the batch'}), got {q.shape}")
            table = self.current_table
            variant = check_inputs(q[:plan.batch_size], k_cache, v_cache, table)
            if (q.shape[1], k_cache.shape[2], variant) != (self.num_qo_heads, self.num_kv_heads, self.variant):
                raise ShapeError(f"the runner serves {self.num_qo_heads} q / {self.num_kv_heads} kv heads of "
                                 f"{self.variant}, the call has {q.shape[1]} / {k_cache.shape[2]} of {variant}")
            decline = kernel_decline_reason(q, k_cache, v_cache, "v2", variant)
            if decline is not None:
                raise UnsupportedConfigError(f"DecodeRunner: {decline}")
            out = cupy.empty(q.shape, dtype=q.dtype) if out is None else check_out(out, q)
            if lse is None and return_lse:
                lse = cupy.empty(q.shape[:2], dtype=cupy.float32)
            elif lse is not None:
                lse = check_lse(lse, q)
            self._num_pages = k_cache.shape[0]
            launch = self._launch
            launch.set_arrays(q, k_cache, v_cache, out, lse)
            launch.set_scores(call_scores(sm_scale, self.head_dim, logits_soft_cap, k_scale, v_scale, sinks,
                                          self.num_kv_heads, q))
            launch.launch(self.max_units if capturing else launch.units)
            return (out, lse) if return_lse else out

    # ---------------------------------------------------------------- append
    def append_kv(self, k_new, v_new, k_cache, v_cache, *, kv_layout: str = "NHD", k_scale=None,
                  v_scale=None) -> None:
        """Writes one new token per request of the current plan's table (its
        last visible slot) into the caches, like :func:`cupaged.append_kv`,
        but through the runner's plan image, so that a captured graph serves
        every later table. ``k_new``/``v_new``: ``[rows, num_kv_heads,
        head_dim]`` with rows >= the batch (``max_batch`` while capturing);
        row ``i`` is request ``i``'s token, rows past the batch are not read.
        Raises as :func:`cupaged.append_kv` does."""
        from .append import check_append, launch_append, scale_as_cupy

        with self._lock:
            table = self.current_table
            if table is None:
                raise UnsupportedConfigError("DecodeRunner.append_kv before DecodeRunner.plan: plan a table first")
            self._check_device("append_kv")
            k_new, v_new = as_cupy(k_new, "k_new"), as_cupy(v_new, "v_new")
            k_cache, v_cache = as_cupy(k_cache, "k_cache"), as_cupy(v_cache, "v_cache")
            k_scale, v_scale = scale_as_cupy(k_scale, "k_scale"), scale_as_cupy(v_scale, "v_scale")
            if any(a.data.device_id != self.device for a in (k_new, v_new, k_cache, v_cache)):
                raise DeviceMismatchError(f"k_new, v_new and the caches must be on the runner's device {self.device}")
            capturing = self._is_capturing(self.stream.ptr) != 0
            rows = self.max_batch if capturing else table.batch_size
            if k_new.ndim != 3 or k_new.shape[0] < rows or v_new.shape != k_new.shape:
                raise ShapeError(f"k_new and v_new must be [rows, num_kv_heads, head_dim] with rows >= {rows}, "
                                 f"got {k_new.shape} and {v_new.shape}")
            batch = table.batch_size
            launch = check_append(k_new[:batch], v_new[:batch], k_cache, v_cache, table, None, kv_layout,
                                   k_scale, v_scale)
            base, (_, indptr, last, first, _, indices) = self._launch.image.data.ptr, self._launch.offsets
            pointers = tuple(np.uint64(base + 4 * off) for off in (indices, indptr, last, first))
            launch_append(k_new, v_new, k_cache, v_cache, table, kv_layout, launch,
                           (pointers, base + 4 * _launch.HEADER_BATCH, rows))

    def _check_device(self, what: str) -> None:
        """The runner's device and stream must be current (its buffers are theirs)."""
        import cupy

        if cupy.cuda.runtime.getDevice() != self.device:
            raise DeviceMismatchError(f"DecodeRunner.{what}: the runner was made on device {self.device}, the "
                                      f"current device is {cupy.cuda.runtime.getDevice()}; make one runner per device")
        if cupy.cuda.get_current_stream().ptr != self.stream.ptr:
            raise UnsupportedConfigError(f"DecodeRunner.{what}: the runner was made on another stream; its image and "
                                         "workspace are ordered on that one (make one runner per stream)")

