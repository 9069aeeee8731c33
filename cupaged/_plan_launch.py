"""decode()'s launch states, one per plan, device and stream
(:class:`PlanLaunch`, a :class:`~cupaged._launch.PartialLaunch` sized for the
plan), and the hot path's records (:class:`HotCall`): what a fully checked
call looked like, so that the next call of the same kind skips the checks."""

from __future__ import annotations

import operator
import threading
import weakref

import numpy as np

from . import _configs, _env, _launch
from .page_table import PageTable
from .plan import DecodePlan

MAX_HOT_RECORDS = 256  # hot-path records per launch state: a model's layers of distinct scale arrays


class PlanLaunch(_launch.PartialLaunch):
    """decode()'s launch state of one plan on one device and stream: a
    :class:`~cupaged._launch.PartialLaunch` sized for the plan (its page
    capacity grows with the table), plus what the hot path needs: the last
    table the plan was checked against (tables are immutable), the shapes it
    was checked for and the record of the last call (:class:`HotCall`)."""

    def __init__(self, plan: DecodePlan, dtype: str, table: PageTable, stream_ptr: int):
        pages = max(int(table.indptr[-1]), 1)
        family = "partial" if plan.group_last is None else _configs.rows_family(
            dtype, plan.head_dim, _configs.choose_core(dtype, plan.head_dim, _env.core()), plan.ctas_per_sm)
        super().__init__(dtype, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.heads_per_cta,
                         plan.page_size, plan.batch_size, plan.num_chunks, pages + pages // 4, family, wait_plan=plan)
        self.plan_units = _launch.plan_units(plan)
        self.stream_ptr = stream_ptr
        self.checked_table = None  # weakref to the last table that matched
        self.hot = None  # HotCall of the last v2 launch, when it may be repeated unchecked
        # records by the identities of their k_scale, v_scale and sinks (one per layer of a
        # model with per-layer scale or sink arrays); all of one geometry, the parameters' strides
        self.hots: dict[tuple, HotCall] = {}
        self.signature = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, dtype)

    def record(self, hot: "HotCall | None") -> None:
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
            self._alloc(self.max_batch, self.max_units, self.max_pages, plan.num_qo_heads)  # (and the pointers)
        self.load(plan, self.plan_units, table)


class PlanStates(dict):
    """A plan's launch states, ``{(device id, stream pointer): PlanLaunch}``;
    ``last`` is the one used last (the hot path's guess); ``ref`` is a weak
    reference to the plan whose callback drops the entry."""

    last: "PlanLaunch | None" = None
    ref: "weakref.ref | None" = None


# Keyed by id(plan), not by a WeakKeyDictionary: its get() makes a weak
# reference per call (~0.4 us of the hot path). An entry lives exactly as long
# as its plan: the weak reference's callback runs while the plan is freed,
# before its id can be reused, so a key found here is a live DecodePlan. The
# states must never hold the plan itself (that would keep it alive forever).
PLAN_STATES: "dict[int, PlanStates]" = {}
_STATES_LOCK = threading.Lock()


def plan_states(plan) -> "PlanStates | None":
    """The launch states of ``plan`` made so far, or None."""
    return PLAN_STATES.get(id(plan)) if type(plan) is DecodePlan else None


def plan_state(plan: DecodePlan, dtype: str, table: PageTable) -> PlanLaunch:
    """The plan's launch state on the current device and stream, made on
    first use. Each (device, stream) gets its own workspace and image, so
    one plan may run on several GPUs, or on several streams at once."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)
    states = PLAN_STATES.get(id(plan))
    if states is None:
        with _STATES_LOCK:
            states = PLAN_STATES.get(id(plan))
            if states is None:
                states = PlanStates()
                pid = id(plan)
                states.ref = weakref.ref(plan, lambda _, pid=pid: PLAN_STATES.pop(pid, None))
                PLAN_STATES[pid] = states
    state = states.get(key)
    if state is None:
        with _STATES_LOCK:
            state = states.get(key) or states.setdefault(key, PlanLaunch(plan, dtype, table, key[1]))
    states.last = state
    return state


_env_method_raw = _env.decode_method_raw  # one dict lookup (os.environ.get costs ~0.7 us unset)
_NO_ENV = object()  # the record of a call whose method was not "auto"


def same_arg(a, b) -> bool:
    """The hot path's test that an argument is the recorded one: the same
    object, or an equal plain float, int or str (an array must be the same
    object)."""
    return a is b or (type(a) in (float, int, str) and type(a) is type(b) and a == b)


def _c_contiguous(a) -> bool:
    """CuPy's C-contiguity flag (a field read; ``flags`` makes an object);
    False where the attribute is missing (the record then compares strides)."""
    return getattr(a, "_c_contiguous", False) is True


def host_snapshot(a):
    """``(dtype, shape, bytes)`` of a NumPy array (what a later call's array
    must equal to be the recorded one), None for anything else."""
    return (a.dtype, a.shape, a.tobytes()) if type(a) is np.ndarray else None


def same_host(a, snap) -> bool:
    """Whether ``a`` is None where the record had none, or a NumPy array of
    the snapshot's dtype, shape and bytes (content, not identity: a host
    array may have been changed in place since)."""
    if snap is None:
        return a is None
    return type(a) is np.ndarray and a.dtype == snap[0] and a.shape == snap[1] and a.tobytes() == snap[2]


def args_match(args: tuple, rec: tuple) -> bool:
    """Whether every argument is the recorded one (:func:`same_arg`). Never
    ``==`` on the tuples: an array's ``==`` is elementwise (a GPU kernel for
    CuPy) and its truth value raises, or, for one element, would let a new
    array of equal values through while the launch still reads the recorded
    one's pointer."""
    return not any(map(operator.is_not, args, rec)) or all(map(same_arg, args, rec))


class HotCall:
    """What one fully checked v2 call looked like, so that the next call of the
    same kind (a serving loop: per layer a new q, out and layer cache of the
    same shapes) skips decode's checks: it compares the arrays' types,
    shapes, strides (or C-contiguity, when the record's arrays were), dtypes
    and devices, the table's identity, the method (and CUPAGED_DECODE),
    sm_scale, the soft cap, the layout and the window with the record (decode
    picks the record by its k/v scales and sinks), the content of host arrays
    that shape the kernel's table (a NumPy ``qo_indptr`` or per-request
    ``window_left``: ~0.3 us for a batch of 64), tests the new pointers'
    16-byte alignment, and launches with only the pointer fields rewritten.
    Any difference returns None and the full path runs (and records again).
    Host cost measured by scripts/host_profile.py: every Python operation
    here costs ~20-80 ns of the ~8 us budget, so the common case is a chain
    of identity tests and one tuple comparison."""

    __slots__ = ("table", "method", "args", "scores", "k_scale", "v_scale", "sinks", "sm_scale", "soft_cap",
                 "kv_layout", "window_left", "env", "ndarray", "empty", "float32", "get_device", "get_stream",
                 "device", "meta", "shapes", "contiguous", "devices", "geometry", "lse_meta", "host")

    def __init__(self, q, k, v, table, method: str, args: tuple, out, scores):
        import cupy

        self.table, self.method, self.args, self.scores = table, method, args, scores
        # (sm_scale, logits_soft_cap, k_scale, v_scale, kv_layout, sinks, window_left, qo_indptr)
        self.sm_scale, self.soft_cap, self.k_scale, self.v_scale, self.kv_layout, self.sinks, self.window_left = args[:7]
        # (window_left, qo_indptr) as NumPy arrays: their content when recorded; None when neither is one
        host = (host_snapshot(args[6]), host_snapshot(args[7]))
        self.host = None if host == (None, None) else host
        self.env = _env_method_raw() if method == "auto" else _NO_ENV
        self.ndarray, self.empty, self.float32 = cupy.ndarray, cupy.empty, cupy.float32
        self.get_device, self.get_stream = cupy.cuda.runtime.getDevice, cupy.cuda.get_current_stream
        device = self.device = q.data.device_id
        # k and v as passed (HND: before the NHD view); out as given (or as allocated)
        self.meta = (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
                     q.shape, out.strides, q.dtype)
        self.shapes = (q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, q.shape, q.dtype)
        # C-contiguous arrays of the record's shapes and dtypes have its strides (but on dimensions
        # of size 1, whose stride no element's address uses): one flag read instead of a strides tuple
        self.contiguous = all(_c_contiguous(a) for a in (q, k, v, out))
        self.devices = (device, device, device, device, device)
        self.geometry = (self.meta, args[4])  # shapes, strides and layout: the parameters' strides
        rows = q.shape[:2]
        self.lse_meta = (rows, np.dtype(np.float32), True, device)  # C-contiguous, the full path's rule (check_lse)

    def launch(self, state: PlanLaunch, q, k, v, table, method, sm_scale, soft_cap, kv_layout, window_left,
               qo_indptr, out, return_lse, lse):
        """Launches with ``state`` (whose record this is) and returns decode's
        result, or None (the full path runs). The caller has matched k_scale,
        v_scale and sinks (the record's key)."""
        nd = self.ndarray
        if (table is not self.table or method != self.method or type(q) is not nd or type(k) is not nd
                or type(v) is not nd):
            return None
        host = self.host
        if host is None:
            if qo_indptr is not None:
                return None
        else:
            if not same_host(qo_indptr, host[1]):
                return None
            if host[0] is not None:
                if not same_host(window_left, host[0]):
                    return None
                window_left = self.window_left  # (its content matched)
        if not (sm_scale is self.sm_scale and soft_cap is self.soft_cap and kv_layout is self.kv_layout
                and window_left is self.window_left) and not args_match(
                    (sm_scale, soft_cap, kv_layout, window_left),
                    (self.sm_scale, self.soft_cap, self.kv_layout, self.window_left)):
            return None
        if self.env is not _NO_ENV and _env_method_raw() != self.env:
            return None
        if out is None:
            out = self.empty(self.meta[0], dtype=self.meta[2])
        elif type(out) is not nd:
            return None
        if self.contiguous:
            if ((q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, out.shape, out.dtype) != self.shapes
                    or not (q._c_contiguous and k._c_contiguous and v._c_contiguous and out._c_contiguous)):
                return None
        elif (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
                out.shape, out.strides, out.dtype) != self.meta:
            return None
        qp, kp, vp, op = q.data, k.data, v.data, out.data
        qa, ka, va = qp.ptr, kp.ptr, vp.ptr
        device = self.get_device()
        if ((qa | ka | va) & 15 or (qp.device_id, kp.device_id, vp.device_id, op.device_id, device) != self.devices
                or self.get_stream(device).ptr != state.stream_ptr):
            return None
        if lse is not None:
            if type(lse) is not nd or (lse.shape, lse.dtype, _c_contiguous(lse), lse.data.device_id) != self.lse_meta:
                return None
        elif return_lse:
            lse = self.empty(self.lse_meta[0], dtype=self.float32)
        lock = state.lock
        lock.acquire()
        try:
            if state.scores is not self.scores:  # another layer's record: its scales and sinks
                state.set_scores(self.scores)
            state.launch_pointers(qa, ka, va, op.ptr, None if lse is None else lse.data.ptr, state.stream_ptr)
        finally:
            lock.release()
        return (out, lse) if return_lse else out
