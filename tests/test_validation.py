"""Bad input never corrupts (issue 7): one test per bad-input row of
docs/reliability.md, each asserting the specific exception class and a
fragment of its message.

Two halves:

- CPU tests (no marker). The O(1) host checks of ``decode``, ``select_method``
  and ``merge_states`` are plain functions of array attributes (shape, dtype,
  strides, ``data.ptr``, ``data.device_id``), so they run here on a small
  stand-in array (:class:`FakeArray`) on a machine without a GPU. The full
  device-table check (``decode(..., validate=True)``) runs against a
  NumPy-backed stand-in for CuPy. The pool and ``select_method`` with NumPy
  inputs need no stand-in.
- GPU tests (marker ``gpu``): the same rows through the public functions on
  real CuPy arrays, plus what only a device can show: ``validate=True``
  catching a device table corrupted after it was built, the cheap mode not
  synchronizing, and the gather fallback for strided or misaligned inputs
  giving the right answer.
"""

from __future__ import annotations

import re
import sys
import time
import types
from types import SimpleNamespace

import numpy as np
import pytest

import cupaged
from cupaged import _validate, reference
from cupaged._checks import check_core, check_inputs, check_out, check_plan, check_sm_scale
from cupaged.selection import default_method, select
from cupaged.errors import (ArgumentTypeError, CupagedError, DeviceMismatchError, DTypeError, InvalidArgumentError,
                            LayoutError, NoGPUError, OutOfPagesError, PageTableError, PlanMismatchError, ShapeError,
                            UnknownSequenceError, UnsupportedConfigError)
from cupaged.merge import _check_merge_inputs
from helpers import make_caches, make_query, make_table, rel_errors

F16 = np.dtype(np.float16)


def _escape(fragment: str) -> str:
    return re.escape(fragment)


# ------------------------------------------------------------------ the hierarchy
@pytest.mark.parametrize("cls, builtin", [
    (ArgumentTypeError, TypeError),
    (InvalidArgumentError, ValueError),
    (ShapeError, ValueError),
    (DTypeError, ValueError),
    (LayoutError, ValueError),
    (DeviceMismatchError, ValueError),
    (UnsupportedConfigError, ValueError),
    (PageTableError, ValueError),
    (PlanMismatchError, ValueError),
    (UnknownSequenceError, KeyError),
    (OutOfPagesError, MemoryError),
    (NoGPUError, RuntimeError),
], ids=lambda x: x.__name__)
def test_every_class_is_a_cupaged_error_and_its_builtin(cls, builtin):
    assert issubclass(cls, CupagedError) and issubclass(cls, builtin)
    assert getattr(cupaged, cls.__name__) is cls


def test_array_errors_share_invalid_argument_error():
    for cls in (ShapeError, DTypeError, LayoutError, DeviceMismatchError, UnsupportedConfigError):
        assert issubclass(cls, InvalidArgumentError)


def test_unknown_sequence_error_message_is_not_quoted():
    assert str(UnknownSequenceError("unknown sequence id 3")) == "unknown sequence id 3"


# ------------------------------------------------------------- CPU: stand-in arrays
class FakeArray:
    """What decode's and merge_states' O(1) checks read of a CuPy array."""

    def __init__(self, shape, dtype=F16, *, device=0, strides=None, ptr=0, values=None):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape))
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        c_strides = np.empty(self.shape or (1,), dtype=self.dtype).strides if self.shape else ()
        self.strides = tuple(strides) if strides is not None else c_strides
        self.flags = SimpleNamespace(c_contiguous=self.strides == c_strides)
        self.data = SimpleNamespace(ptr=ptr, device_id=device)
        self._values = values

    def get(self):
        return np.asarray(self._values, dtype=self.dtype)


# A batch: 3 requests (pages 3, 6, 2 at P = 16) in a cache of 16 pages, 8 query
# heads over 2 KV heads, head_dim 128.
TABLE = cupaged.PageTable.from_seq_lens([40, 90, 17], 16)
Q_SHAPE, CACHE_SHAPE = (3, 8, 128), (16, 16, 2, 128)


def fakes(q_shape=Q_SHAPE, k_shape=CACHE_SHAPE, v_shape=None, dtype=F16):
    return FakeArray(q_shape, dtype), FakeArray(k_shape, dtype), FakeArray(v_shape or k_shape, dtype)


# row -> (class, message fragment, (q, k, v, table))
INPUT_ROWS = {
    "table_not_a_page_table": (ArgumentTypeError, "table must be a cupaged.PageTable",
                               (*fakes(), TABLE.indptr)),
    "q_rank": (ShapeError, "q must be 3-D", (*fakes(q_shape=(3, 1024)), TABLE)),
    "cache_rank": (ShapeError, "must be 4-D [num_pages, page_size, num_kv_heads, head_dim]",
                   (*fakes(k_shape=(16, 16, 256), v_shape=(16, 16, 256)), TABLE)),
    "k_and_v_shapes_differ": (ShapeError, "k_cache and v_cache must have one shape",
                              (*fakes(v_shape=(15, 16, 2, 128)), TABLE)),
    "mixed_dtypes": (DTypeError, "must share one dtype",
                     (FakeArray(Q_SHAPE, np.float32), FakeArray(CACHE_SHAPE), FakeArray(CACHE_SHAPE), TABLE)),
    "unsupported_dtype": (DTypeError, "which no kernel serves; supported: float16 q with float16 KV",
                          (*fakes(dtype=np.float64), TABLE)),
    "head_dims_differ": (ShapeError, "q's head_dim (q.shape[2] = 64) must equal the caches' head_dim",
                         (*fakes(q_shape=(3, 8, 64)), TABLE)),
    "heads_not_divisible": (ShapeError, "num_qo_heads (7) must be a multiple of num_kv_heads (2)",
                            (*fakes(q_shape=(3, 7, 128)), TABLE)),
    "zero_kv_heads": (ShapeError, "must be >= 1", (*fakes(k_shape=(16, 16, 0, 128)), TABLE)),
    "zero_head_dim": (ShapeError, "head_dim (q.shape[2]) must be >= 1",
                      (*fakes(q_shape=(3, 8, 0), k_shape=(16, 16, 2, 0)), TABLE)),
    "page_size_differs": (ShapeError, "page_size (8: k_cache.shape[1] for NHD, shape[2] for HND) must equal table.page_size (16)",
                          (*fakes(k_shape=(16, 8, 2, 128)), TABLE)),
    "batch_differs": (ShapeError, "q's batch (q.shape[0] = 2) must equal table.batch_size (3 requests)",
                      (*fakes(q_shape=(2, 8, 128)), TABLE)),
    "page_id_out_of_range": (PageTableError, "page id 10 at indices[10] is out of range for a cache of num_pages=10",
                             (*fakes(k_shape=(10, 16, 2, 128)), TABLE)),
    "devices_differ": (DeviceMismatchError, "must be on one device, got devices 0, 1, 0",
                       (FakeArray(Q_SHAPE), FakeArray(CACHE_SHAPE, device=1), FakeArray(CACHE_SHAPE), TABLE)),
}


@pytest.mark.parametrize("row", list(INPUT_ROWS))
def test_decode_input_checks_cpu(row):
    cls, fragment, args = INPUT_ROWS[row]
    with pytest.raises(cls, match=_escape(fragment)):
        check_inputs(*args)


def test_decode_input_checks_accept_a_valid_call_cpu():
    assert check_inputs(*fakes(), TABLE) == "float16"
    assert check_inputs(*fakes(dtype=np.float32), TABLE) == "float32"


OUT_ROWS = {
    "out_shape": (ShapeError, "out must have q's shape (3, 8, 128), got (3, 8, 64)", FakeArray((3, 8, 64))),
    "out_dtype": (DTypeError, "out must have q's dtype float16, got float32", FakeArray(Q_SHAPE, np.float32)),
    "out_head_dim_not_contiguous": (LayoutError, "out's head_dim must be contiguous",
                                    FakeArray(Q_SHAPE, strides=(8192, 512, 4))),
    "out_on_another_device": (DeviceMismatchError, "out must be on q's device 0, got device 1",
                              FakeArray(Q_SHAPE, device=1)),
    "out_numpy": (ArgumentTypeError, "out must be a CuPy array", np.zeros(Q_SHAPE, F16)),
}


@pytest.mark.parametrize("row", list(OUT_ROWS))
def test_decode_out_checks_cpu(row, monkeypatch):
    pytest.importorskip("cupy")  # _as_cupy imports it (no device needed)
    cls, fragment, out = OUT_ROWS[row]
    if isinstance(out, FakeArray):  # a stand-in is no CuPy array: let it past _as_cupy
        monkeypatch.setattr(sys.modules["cupaged._checks"], "as_cupy", lambda x, name: x)
    with pytest.raises(cls, match=_escape(fragment)):
        check_out(out, FakeArray(Q_SHAPE))


def test_select_method_rejects_numpy_inputs_cpu():
    """select_method needs no GPU: a NumPy q is refused before anything else."""
    pytest.importorskip("cupy")
    q = np.zeros(Q_SHAPE, F16)
    k = np.zeros(CACHE_SHAPE, F16)
    with pytest.raises(ArgumentTypeError, match=r"q must be a CuPy array .* copy it to the GPU first"):
        cupaged.select_method(q, k, k, TABLE)


def test_unknown_method_cpu():
    fragment = "method must be one of ('auto', 'v2', 'v1', 'gather'), got 'v3'"
    with pytest.raises(UnsupportedConfigError, match=_escape(fragment)):
        select(*fakes(), TABLE, "v3")


def test_env_method_cpu(monkeypatch):
    monkeypatch.setenv("CUPAGED_DECODE", "fast")
    with pytest.raises(UnsupportedConfigError, match="environment variable CUPAGED_DECODE='fast' must be one of"):
        default_method()
    with pytest.raises(UnsupportedConfigError, match="CUPAGED_DECODE"):
        select(*fakes(), TABLE, "auto")


@pytest.mark.parametrize("core, dtype, fragment", [
    ("tensor", "float16", "environment variable CUPAGED_CORE='tensor' must be one of ('mma', 'simt')"),
    ("mma", "float32", "CUPAGED_CORE='mma': core 'mma' does not serve float32"),
])
def test_env_core_cpu(monkeypatch, core, dtype, fragment):
    monkeypatch.setenv("CUPAGED_CORE", core)
    with pytest.raises(UnsupportedConfigError, match=_escape(fragment)):
        check_core(dtype, 128)
    monkeypatch.setenv("CUPAGED_CORE", "simt")
    check_core(dtype, 128)  # serves every dtype


@pytest.mark.parametrize("sm_scale, cls, fragment", [
    (float("nan"), InvalidArgumentError, "sm_scale must be finite"),
    (float("inf"), InvalidArgumentError, "sm_scale must be finite"),
    (1e39, InvalidArgumentError, "within float32 range"),
    (object(), ArgumentTypeError, "sm_scale must be a real number or None"),
])
def test_sm_scale_cpu(sm_scale, cls, fragment):
    with pytest.raises(cls, match=fragment):
        check_sm_scale(sm_scale)


def test_sm_scale_accepts_zero_and_negative_cpu():
    assert check_sm_scale(0) == 0.0 and check_sm_scale(-0.5) < 0


@pytest.mark.parametrize("ptr, strides, reason", [
    (0, None, None),
    (2, None, "k_cache is not 16-byte aligned (base pointer or strides)"),  # base pointer 2 bytes off
    (0, (8192, 520, 256, 2), "k_cache is not 16-byte aligned (base pointer or strides)"),  # token stride 520 B
    (0, (16384, 1024, 512, 4), "k_cache's head_dim is not contiguous"),
], ids=["aligned", "base_pointer", "token_stride", "strided_head_dim"])
def test_kernels_decline_strided_or_misaligned_cpu(ptr, strides, reason):
    """Not an error: the gather path runs, and select_method says why."""
    q, _, v = fakes()
    k = FakeArray(CACHE_SHAPE, ptr=ptr, strides=strides)
    sel = select(q, k, v, TABLE, "v2")
    if reason is None:
        assert sel == cupaged.Selection("v2", "requested")
    else:
        assert sel.method == "gather" and sel.reason == f"fallback from v2: {reason}"


def test_head_dim_without_kernel_falls_back_cpu():
    sel = select(*fakes(q_shape=(3, 8, 40), k_shape=(16, 16, 2, 40)), TABLE, "auto")
    assert sel.method == "gather" and "head_dim 40 has no kernel instance" in sel.reason


def test_plan_checks_cpu():
    q, k, _ = fakes()
    plan = cupaged.plan_decode(TABLE, 8, 2, 128, np.float16)
    check_plan(plan, TABLE, q, k, "float16")
    with pytest.raises(ArgumentTypeError, match="plan must be a cupaged.DecodePlan"):
        check_plan(object(), TABLE, q, k, "float16")
    fragment = "plan was built for (num_qo_heads, num_kv_heads, head_dim, dtype[+kv_dtype]) = (16, 2, 128, 'float16')"
    with pytest.raises(PlanMismatchError, match=_escape(fragment)):
        check_plan(cupaged.plan_decode(TABLE, 16, 2, 128, np.float16), TABLE, q, k, "float16")
    with pytest.raises(PlanMismatchError, match="plan was built for"):
        check_plan(cupaged.plan_decode(TABLE, 8, 2, 128, np.float32), TABLE, q, k, "float16")
    grown = cupaged.PageTable.from_seq_lens([40, 90, 40], 16)  # request 2: 2 -> 3 pages
    stale = cupaged.plan_decode(grown, 8, 2, 128, np.float16, pages_per_chunk=1)
    with pytest.raises(PlanMismatchError, match="stale plan"):
        check_plan(stale, TABLE, q, k, "float16")


def test_stale_plan_says_what_changed_cpu():
    """Issue 16: a stale plan's PlanMismatchError names the property that
    changed (batch size, page size, or which request's chunk count), from
    decode's plan check and from the plan's own range methods."""
    q, k, _ = fakes()
    grown = cupaged.PageTable.from_seq_lens([40, 90, 40], 16)  # request 2: 2 -> 3 pages
    stale = cupaged.plan_decode(grown, 8, 2, 128, np.float16, pages_per_chunk=1)
    with pytest.raises(PlanMismatchError, match=_escape("request 2: chunk count 3 -> 2 (2 pages at pages_per_chunk=1)")):
        check_plan(stale, TABLE, q, k, "float16")
    with pytest.raises(PlanMismatchError, match=_escape("request 2: chunk count 3 -> 2")):
        stale.chunk_token_ranges(TABLE)
    with pytest.raises(PlanMismatchError, match=_escape("request 2: chunk count 3 -> 2")):
        stale.chunk_page_ranges(TABLE)
    two = cupaged.plan_decode(cupaged.PageTable.from_seq_lens([40, 90], 16), 8, 2, 128, np.float16)
    with pytest.raises(PlanMismatchError, match=_escape("batch size 2 -> 3")):
        check_plan(two, TABLE, q, k, "float16")
    p32 = cupaged.plan_decode(cupaged.PageTable.from_seq_lens([40, 90, 17], 32), 8, 2, 128, np.float16)
    with pytest.raises(PlanMismatchError, match=_escape("page size 32 -> 16")):
        p32.chunk_page_ranges(TABLE)
    many = cupaged.PageTable.from_seq_lens([1] * 6, 16)
    plan6 = cupaged.plan_decode(cupaged.PageTable.from_seq_lens([40] * 6, 16), 8, 2, 128, np.float16,
                                pages_per_chunk=1)
    assert _validate.plan_mismatch_reason(plan6, many).endswith("; and 3 more request(s)")


def test_bad_method_is_reported_before_the_gpu_check(monkeypatch):
    """Issue 16: decode(method="v3") and CUPAGED_DECODE=bogus name the bad
    value on any machine; on a CPU they used to be reported as NoGPUError."""
    monkeypatch.delenv("CUPAGED_DECODE", raising=False)
    q, k, v = fakes()
    with pytest.raises(UnsupportedConfigError, match=_escape("method must be one of ('auto', 'v2', 'v1', 'gather'), got 'v3'")):
        cupaged.decode(q, k, v, TABLE, method="v3")
    monkeypatch.setenv("CUPAGED_DECODE", "bogus")
    with pytest.raises(UnsupportedConfigError, match=_escape("environment variable CUPAGED_DECODE='bogus' must be one of")):
        cupaged.decode(q, k, v, TABLE)
    with pytest.raises(UnsupportedConfigError, match="CUPAGED_DECODE"):
        cupaged.decode(q, k, v, TABLE, method="auto")
    monkeypatch.setenv("CUPAGED_DECODE", "gather")
    if not cupaged.has_gpu():  # a valid method: the GPU check comes next
        with pytest.raises(NoGPUError):
            cupaged.decode(q, k, v, TABLE, method="v2")


def test_fallback_is_logged_once_per_configuration_cpu(caplog, monkeypatch):
    """Issue 16: a call the kernels decline (head_dim 40, a misaligned
    pointer, v1 with per-head scales) logs a WARNING on the "cupaged" logger,
    once per (method, reason); a requested gather path logs nothing."""
    import logging

    from cupaged import _log

    pytest.importorskip("cupy")  # select_method's as_cupy imports it (no device needed)
    monkeypatch.setattr(sys.modules["cupaged.selection"], "as_cupy", lambda x, name: x)
    monkeypatch.delenv("CUPAGED_DECODE", raising=False)
    _log.reset()
    d80 = fakes(q_shape=(3, 8, 40), k_shape=(16, 16, 2, 40))
    with caplog.at_level(logging.INFO, logger="cupaged"):
        for _ in range(3):
            assert cupaged.select_method(*d80, TABLE, method="v2").method == "gather"
        cupaged.select_method(*d80, TABLE)  # "auto": another configuration
        misaligned = (FakeArray(Q_SHAPE, ptr=8), *fakes()[1:])
        cupaged.select_method(*misaligned, TABLE, method="v2")
        assert cupaged.select_method(*fakes(), TABLE, method="v1", per_head_scales=True).method == "gather"
        assert cupaged.select_method(*fakes(), TABLE, method="v1", sinks=True).method == "gather"
        assert cupaged.select_method(*fakes(), TABLE, method="v2", sinks=True).method == "v2"
        assert cupaged.select_method(*d80, TABLE, method="gather").reason == "requested"
        assert cupaged.select_method(*fakes(), TABLE, method="v2").method == "v2"
    records = [r for r in caplog.records if r.name == "cupaged"]
    assert [r.levelno for r in records] == [logging.WARNING] * 5, [r.getMessage() for r in records]
    text = [r.getMessage() for r in records]
    assert "method='v2'" in text[0] and "head_dim 40 has no kernel instance" in text[0] and "gather" in text[0]
    assert "method='auto'" in text[1]
    assert "q is not 16-byte aligned" in text[2]
    assert "v1 takes per-tensor k_scale/v_scale only" in text[3]
    assert "v1 takes no sinks" in text[4]
    _log.reset()


# ---------------------------------------------------------------- CPU: merge_states
V_SHAPE = (4, 8, 128)
IND = np.array([0, 1, 4], np.int32)


def merge_args(v=None, lse=None, o_indptr=None, out_dtype=np.float32, validate=True):
    return (FakeArray(V_SHAPE, np.float32) if v is None else v,
            FakeArray(V_SHAPE[:2], np.float32) if lse is None else lse,
            IND if o_indptr is None else o_indptr, out_dtype, validate)


MERGE_ROWS = {
    "v_rank": (ShapeError, "v must be 3-D", merge_args(v=FakeArray((4, 1024), np.float32))),
    "v_dtype": (DTypeError, "v must be float32", merge_args(v=FakeArray(V_SHAPE, np.float16))),
    "v_not_contiguous": (LayoutError, "v must be C-contiguous",
                         merge_args(v=FakeArray(V_SHAPE, np.float32, strides=(8192, 1024, 8)))),
    "lse_shape": (ShapeError, "lse must have shape (4, 8)", merge_args(lse=FakeArray((4, 4), np.float32))),
    "lse_dtype": (DTypeError, "lse must be float32", merge_args(lse=FakeArray((4, 8), np.float64))),
    "lse_not_contiguous": (LayoutError, "lse must be C-contiguous",
                           merge_args(lse=FakeArray((4, 8), np.float32, strides=(64, 8)))),
    "lse_on_another_device": (DeviceMismatchError, "lse must be on v's device 0, got device 1",
                              merge_args(lse=FakeArray((4, 8), np.float32, device=1))),
    "head_dim_without_kernel": (UnsupportedConfigError, "v's head_dim: unsupported head_dim 40",
                                merge_args(v=FakeArray((4, 8, 40), np.float32))),
    "out_dtype": (DTypeError, "out_dtype must be one of float16, bfloat16, float32", merge_args(out_dtype=np.float64)),
    "o_indptr_list": (DTypeError, "o_indptr must be a 1-D int32 NumPy or CuPy array, got list",
                      merge_args(o_indptr=[0, 4])),
    "o_indptr_int64": (DTypeError, "o_indptr must be int32 (the kernel reads int32), got int64",
                       merge_args(o_indptr=np.array([0, 4], np.int64))),
    "o_indptr_int64_device": (DTypeError, "o_indptr must be int32",
                              merge_args(o_indptr=FakeArray((2,), np.int64, values=[0, 4]))),
    "o_indptr_2d": (ShapeError, "o_indptr must be 1-D", merge_args(o_indptr=np.zeros((1, 2), np.int32))),
    "o_indptr_empty": (ShapeError, "M+1 >= 1 entries", merge_args(o_indptr=np.zeros(0, np.int32))),
    "o_indptr_strided_device": (LayoutError, "a CuPy o_indptr must be contiguous",
                                merge_args(o_indptr=FakeArray((3,), np.int32, strides=(8,), values=[0, 2, 4]))),
    "o_indptr_on_another_device": (DeviceMismatchError, "o_indptr must be on v's device 0, got device 1",
                                   merge_args(o_indptr=FakeArray((3,), np.int32, device=1, values=[0, 2, 4]))),
    "o_indptr_first": (InvalidArgumentError, "o_indptr must start at 0, got o_indptr[0]=1",
                       merge_args(o_indptr=np.array([1, 4], np.int32))),
    "o_indptr_first_device": (InvalidArgumentError, "o_indptr must start at 0",
                              merge_args(o_indptr=FakeArray((2,), np.int32, values=[1, 4]))),
    "o_indptr_decreasing": (InvalidArgumentError, "o_indptr must never decrease, but o_indptr[1]=3 > o_indptr[2]=2",
                            merge_args(o_indptr=np.array([0, 3, 2], np.int32))),
    "o_indptr_beyond_n": (InvalidArgumentError, "o_indptr must end at most at N=4 (rows of v), got o_indptr[-1]=5",
                          merge_args(o_indptr=np.array([0, 5], np.int32))),
}


@pytest.mark.parametrize("row", list(MERGE_ROWS))
def test_merge_checks_cpu(row):
    cls, fragment, args = MERGE_ROWS[row]
    with pytest.raises(cls, match=_escape(fragment)):
        _check_merge_inputs(*args)


def test_merge_checks_accept_valid_and_trust_without_validate_cpu():
    assert _check_merge_inputs(*merge_args()) == "float32"
    assert _check_merge_inputs(*merge_args(o_indptr=FakeArray((3,), np.int32, values=[0, 1, 4]))) == "float32"
    # validate=False checks dtype/rank/length/layout/device only: the values are trusted
    assert _check_merge_inputs(*merge_args(o_indptr=np.array([0, 3, 2], np.int32), validate=False)) == "float32"
    with pytest.raises(DTypeError):  # but the dtype never is
        _check_merge_inputs(*merge_args(o_indptr=np.array([0, 4], np.int64), validate=False))


# ------------------------------------------------------- CPU: the full (validate) mode
class _HostCupy(np.ndarray):
    """A NumPy array that answers .get() like a CuPy one."""

    def get(self):
        return np.asarray(self).copy()


@pytest.fixture
def host_cupy(monkeypatch):
    """A NumPy-backed stand-in for the part of CuPy the full check uses."""
    view = lambda a: np.asarray(a).view(_HostCupy)  # noqa: E731
    fake = types.SimpleNamespace(
        ndarray=_HostCupy,
        int64=np.int64,
        asarray=view,
        where=lambda c, a, b: view(np.where(c, a, b)),
        stack=lambda xs: view(np.stack(xs)),
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0, CUDARuntimeError=RuntimeError)),
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake


def _table():
    # pages 3, 1, 0, 2 (a one-page request and a zero-page one)
    return cupaged.PageTable.from_seq_lens([40, 5, 0, 20], 16, [0, 3, 0, 0], page_ids=[7, 2, 9, 0, 4, 5])


# kind -> (field, index, value, message fragment)
CORRUPTIONS = {
    "page_id_out_of_range": ("indices", 3, 12, "request 1: page id 12 at indices[3] is out of range [0, num_pages=10)"),
    "page_id_negative": ("indices", 0, -1, "request 0: page id -1 at indices[0] is out of range"),
    "indptr_first": ("indptr", 0, 1, "indptr[0] must be 0, got 1"),
    "indptr_decreasing": ("indptr", 1, 5, "request 1: indptr must be non-decreasing, but indptr[1]=5 > indptr[2]=4"),
    "indptr_last": ("indptr", 4, 5, "indptr[-1] must equal len(indices): indptr[-1]=5, len(indices)=6"),
    "last_page_len_zero": ("last_page_len", 0, 0, "request 0: last_page_len must be in [1, page_size=16]"),
    "last_page_len_over": ("last_page_len", 3, 17, "request 3: last_page_len must be in [1, page_size=16]"),
    "first_page_offset_over": ("first_page_offset", 0, 16, "request 0: first_page_offset must be in [0, page_size=16)"),
    "one_page_offset_ge_last": ("first_page_offset", 1, 9, "request 1: a one-page request needs first_page_offset < last_page_len"),
    "zero_page_offset": ("first_page_offset", 2, 1, "request 2: a zero-page request needs first_page_offset == 0"),
    "zero_page_last": ("last_page_len", 2, 17, "request 2: a zero-page request needs last_page_len in [0, page_size=16]"),
    "page_id_rewritten_in_range": ("indices", 4, 8, "request 3: indices[4] = 8 differs from the host table's 4"),
    "last_page_len_rewritten_in_range": ("last_page_len", 3, 5, "request 3: last_page_len[3] = 5 differs from the host table's 4"),
}


def test_full_check_passes_a_clean_table_cpu(host_cupy):
    _validate.check_device_table(_table(), 10)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_full_check_catches_a_corrupted_device_table_cpu(host_cupy, kind):
    field, index, value, fragment = CORRUPTIONS[kind]
    table = _table()
    getattr(table.device(), field)[index] = value  # a write the host checks never see
    with pytest.raises(PageTableError, match=_escape(f"table.device(): {fragment}")):
        _validate.check_device_table(table, 10)


def test_full_check_runs_the_host_checks_too_cpu(host_cupy):
    with pytest.raises(PageTableError, match="out of range for a cache of num_pages=8"):
        _validate.check_device_table(_table(), 8)


@pytest.mark.parametrize("shape, strides, ok", [
    ((3, 8, 128), (2048, 256, 2), True),            # C-contiguous
    ((3, 8, 128), (256, 768, 2), True),             # heads outermost: disjoint
    ((1, 8, 128), (0, 256, 2), True),               # stride 0 on a size-1 dim
    ((3, 8, 128), (0, 256, 2), False),              # broadcast over the batch
    ((3, 8, 128), (2048, 128, 2), False),           # heads half a row apart
])
def test_out_overlap_check_cpu(shape, strides, ok):
    out = FakeArray(shape, strides=strides)
    if ok:
        _validate.check_out_overlap(out)
    else:
        with pytest.raises(LayoutError, match="out's elements overlap"):
            _validate.check_out_overlap(out)


# --------------------------------------------------------------------- CPU: the pool
def _pool():
    pool = cupaged.BlockPool(4, 4)
    s = pool.add_sequence()
    pool.append(s, 5)
    return pool, s


@pytest.mark.parametrize("op, cls, fragment", [
    (lambda p, s: p.append(99, 1), UnknownSequenceError, "unknown sequence id 99"),
    (lambda p, s: (p.free(s), p.free(s)), UnknownSequenceError, "unknown sequence id 0"),
    (lambda p, s: p.append(s, -1), InvalidArgumentError, "n_tokens must be >= 0, got -1"),
    (lambda p, s: p.append(s, 1.5), InvalidArgumentError, "n_tokens must be an int, got float"),
    (lambda p, s: p.trim_front(s, 6), InvalidArgumentError, "cannot trim 6 tokens from sequence 0: only 5 visible"),
    (lambda p, s: p.apply_window(s, -1), InvalidArgumentError, "window must be >= 0"),
    (lambda p, s: p.add_sequence(s), InvalidArgumentError, "sequence id 0 already exists"),
    (lambda p, s: p.refcount(4), InvalidArgumentError, "page id 4 out of range [0, 4)"),
    (lambda p, s: p.append(s, 100), OutOfPagesError, "need 25, 2 of 4 free"),
    (lambda p, s: cupaged.apply_page_copies(np.zeros((4, 2)), [(0, 4)]), InvalidArgumentError,
     "page id 4 out of range for a cache of shape (4, 2)"),
    (lambda p, s: cupaged.BlockPool(4, 0), InvalidArgumentError, "page_size must be in [1, 65536], got 0"),
], ids=["unknown_id", "double_free", "negative_count", "float_count", "over_trim", "negative_window",
        "duplicate_id", "refcount_out_of_range", "exhausted", "copy_out_of_range", "page_size_zero"])
def test_pool_rejections_cpu(op, cls, fragment):
    pool, s = _pool()
    with pytest.raises(cls, match=_escape(fragment)):
        op(pool, s)


# =============================================================== GPU: public entries
def _cp():
    import cupy

    return cupy


def gpu_batch(seed=0, lens=(40, 90, 17), page_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=128, dtype=F16):
    """Device q, k, v (NaN in every slot no request sees), the table and host copies."""
    cp = _cp()
    rng = np.random.default_rng(seed)
    table, num_pages = make_table(rng, list(lens), page_size)
    k, v = make_caches(rng, table, num_pages, num_kv_heads, head_dim, dtype)
    q = make_query(rng, len(lens), num_qo_heads, head_dim, dtype)
    return SimpleNamespace(q=cp.asarray(q), k=cp.asarray(k), v=cp.asarray(v), table=table,
                           num_pages=num_pages, host=(q, k, v))


def _decode(b, **kw):
    return lambda: cupaged.decode(b.q, b.k, b.v, b.table, **kw)


# row -> (class, message fragment, builder(b, cp) -> the failing call)
DECODE_ROWS = {
    "numpy_q": (ArgumentTypeError, "q must be a CuPy array",
                lambda b, cp: lambda: cupaged.decode(b.host[0], b.k, b.v, b.table)),
    "numpy_caches": (ArgumentTypeError, "k_cache must be a CuPy array",
                     lambda b, cp: lambda: cupaged.decode(b.q, b.host[1], b.v, b.table)),
    "table_not_a_page_table": (ArgumentTypeError, "table must be a cupaged.PageTable",
                               lambda b, cp: lambda: cupaged.decode(b.q, b.k, b.v, b.table.device())),
    "q_rank": (ShapeError, "q must be 3-D", lambda b, cp: lambda: cupaged.decode(b.q[0], b.k, b.v, b.table)),
    "cache_rank": (ShapeError, "must be 4-D", lambda b, cp: lambda: cupaged.decode(b.q, b.k[0], b.v[0], b.table)),
    "k_and_v_shapes_differ": (ShapeError, "k_cache and v_cache must have one shape",
                              lambda b, cp: lambda: cupaged.decode(b.q, b.k, b.v[:-1], b.table)),
    "mixed_dtypes": (DTypeError, "must share one dtype",
                     lambda b, cp: lambda: cupaged.decode(b.q.astype(cp.float32), b.k, b.v, b.table)),
    "unsupported_dtype": (DTypeError, "no kernel serves",
                          lambda b, cp: lambda: cupaged.decode(b.q.astype(cp.float64), b.k.astype(cp.float64),
                                                               b.v.astype(cp.float64), b.table)),
    "head_dims_differ": (ShapeError, "q's head_dim (q.shape[2] = 64)",
                         lambda b, cp: lambda: cupaged.decode(b.q[:, :, :64], b.k, b.v, b.table)),
    "heads_not_divisible": (ShapeError, "num_qo_heads (7) must be a multiple of num_kv_heads (2)",
                            lambda b, cp: lambda: cupaged.decode(b.q[:, :7], b.k, b.v, b.table)),
    "zero_kv_heads": (ShapeError, "must be >= 1",
                      lambda b, cp: lambda: cupaged.decode(b.q, b.k[:, :, :0], b.v[:, :, :0], b.table)),
    "page_size_differs": (ShapeError, "must equal table.page_size (16)",
                          lambda b, cp: lambda: cupaged.decode(b.q, b.k[:, :8], b.v[:, :8], b.table)),
    "batch_differs": (ShapeError, "q's batch (q.shape[0] = 2) must equal table.batch_size (3 requests)",
                      lambda b, cp: lambda: cupaged.decode(b.q[:2], b.k, b.v, b.table)),
    "page_id_out_of_range": (PageTableError, "out of range for a cache of num_pages=2",
                             lambda b, cp: lambda: cupaged.decode(b.q, b.k[:2], b.v[:2], b.table)),
    "out_shape": (ShapeError, "out must have q's shape",
                  lambda b, cp: _decode(b, out=cp.empty((3, 8, 64), dtype=b.q.dtype))),
    "out_dtype": (DTypeError, "out must have q's dtype",
                  lambda b, cp: _decode(b, out=cp.empty(b.q.shape, dtype=cp.float32))),
    "out_head_dim_not_contiguous": (LayoutError, "out's head_dim must be contiguous",
                                    lambda b, cp: _decode(b, out=cp.empty((3, 8, 256), dtype=b.q.dtype)[:, :, ::2])),
    "out_numpy": (ArgumentTypeError, "out must be a CuPy array",
                  lambda b, cp: _decode(b, out=np.empty(b.q.shape, dtype=b.q.dtype))),
    "out_overlapping_validate": (LayoutError, "out's elements overlap",
                                 lambda b, cp: _decode(b, validate=True,
                                                       out=cp.broadcast_to(cp.empty((1, 1, 128), b.q.dtype), b.q.shape))),
    "method_unknown": (UnsupportedConfigError, "method must be one of", lambda b, cp: _decode(b, method="v3")),
    "sm_scale_nan": (InvalidArgumentError, "sm_scale must be finite", lambda b, cp: _decode(b, sm_scale=float("nan"))),
    "sm_scale_overflow": (InvalidArgumentError, "within float32 range", lambda b, cp: _decode(b, sm_scale=1e39)),
    "sm_scale_not_a_number": (ArgumentTypeError, "sm_scale must be a real number",
                              lambda b, cp: _decode(b, sm_scale=object())),
    "plan_not_a_plan": (ArgumentTypeError, "plan must be a cupaged.DecodePlan",
                        lambda b, cp: _decode(b, plan=5, method="v2")),
    "plan_for_other_heads": (PlanMismatchError, "plan was built for",
                             lambda b, cp: _decode(b, method="v2",
                                                   plan=cupaged.plan_decode(b.table, 16, 2, 128, np.float16))),
    "plan_for_other_dtype": (PlanMismatchError, "plan was built for",
                             lambda b, cp: _decode(b, method="v2",
                                                   plan=cupaged.plan_decode(b.table, 8, 2, 128, np.float32))),
    "stale_plan": (PlanMismatchError, "stale plan",
                   lambda b, cp: _decode(b, method="v2", plan=cupaged.plan_decode(
                       cupaged.PageTable.from_seq_lens([40, 90, 40], 16), 8, 2, 128, np.float16, pages_per_chunk=1))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("row", list(DECODE_ROWS))
def test_decode_rejects(row):
    cp = _cp()
    cls, fragment, build = DECODE_ROWS[row]
    call = build(gpu_batch(), cp)
    with pytest.raises(cls, match=_escape(fragment)):
        call()
    cp.cuda.runtime.deviceSynchronize()  # nothing was launched that could fault


@pytest.mark.gpu
@pytest.mark.parametrize("env, value, method, fragment", [
    ("CUPAGED_DECODE", "fast", "auto", "CUPAGED_DECODE='fast' must be one of"),
    ("CUPAGED_CORE", "tensor", "v2", "CUPAGED_CORE='tensor' must be one of ('mma', 'simt')"),
])
def test_decode_rejects_bad_env(monkeypatch, env, value, method, fragment):
    b = gpu_batch()
    monkeypatch.setenv(env, value)
    with pytest.raises(UnsupportedConfigError, match=_escape(fragment)):
        cupaged.decode(b.q, b.k, b.v, b.table, method=method)


@pytest.mark.gpu
@pytest.mark.parametrize("with_plan", [False, True], ids=["plan_none", "fresh_plan"])
def test_decode_rejects_core_that_does_not_serve_the_dtype(monkeypatch, with_plan):
    b = gpu_batch(dtype=np.float32)
    plan = cupaged.plan_decode(b.table, 8, 2, 128, np.float32) if with_plan else None
    monkeypatch.setenv("CUPAGED_CORE", "mma")  # tensor cores serve 16-bit KV only
    with pytest.raises(UnsupportedConfigError, match=_escape("core 'mma' does not serve float32")):
        cupaged.decode(b.q, b.k, b.v, b.table, plan, method="v2")


@pytest.mark.gpu
def test_arrays_on_two_devices_rejected():
    cp = _cp()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    b = gpu_batch()
    with cp.cuda.Device(1):
        k1, v1 = cp.asarray(b.host[1]), cp.asarray(b.host[2])
        out1 = cp.empty(b.q.shape, dtype=b.q.dtype)
    with pytest.raises(DeviceMismatchError, match="must be on one device, got devices 0, 1, 1"):
        cupaged.decode(b.q, k1, v1, b.table)
    with pytest.raises(DeviceMismatchError, match="out must be on q's device 0, got device 1"):
        cupaged.decode(b.q, b.k, b.v, b.table, out=out1)
    with cp.cuda.Device(1):
        with pytest.raises(DeviceMismatchError, match="the current device is 1"):
            cupaged.decode(b.q, b.k, b.v, b.table)


# ---------------------------------------------------------- GPU: the gather fallback
@pytest.mark.gpu
def test_strided_head_dim_falls_back_to_gather_and_is_correct():
    cp = _cp()
    b = gpu_batch(1)
    wide = cp.zeros((3, 8, 256), dtype=b.q.dtype)
    wide[:, :, ::2] = b.q
    q = wide[:, :, ::2]  # head_dim stride 2 elements
    sel = cupaged.select_method(q, b.k, b.v, b.table, method="v2")
    assert sel == cupaged.Selection("gather", "fallback from v2: q's head_dim is not contiguous")
    out, lse = cupaged.decode(q, b.k, b.v, b.table, method="v2", return_lse=True)
    ref, ref_lse = reference.decode(*b.host, b.table)
    assert np.isfinite(out.get()).all()
    assert rel_errors(out.get(), ref)[0] < 2e-2
    np.testing.assert_allclose(lse.get(), ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_misaligned_cache_falls_back_to_gather_and_is_correct():
    cp = _cp()
    b = gpu_batch(2)
    n, P, H, D = b.k.shape
    padded = cp.full((n, P, H, D + 8), np.nan, dtype=b.k.dtype)  # rows of 272 bytes: aligned strides
    padded[..., 1 : D + 1] = b.k
    k = padded[..., 1 : D + 1]  # base pointer 2 bytes past a 16-byte boundary
    sel = cupaged.select_method(b.q, k, b.v, b.table, method="v2")
    reason = "fallback from v2: k_cache is not 16-byte aligned (base pointer or strides)"
    assert sel == cupaged.Selection("gather", reason)
    out = cupaged.decode(b.q, k, b.v, b.table, method="v2")
    ref, _ = reference.decode(*b.host, b.table)
    assert np.isfinite(out.get()).all() and rel_errors(out.get(), ref)[0] < 2e-2


# --------------------------------------------------- GPU: the full (validate) mode
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["v2", "v1"])
def test_validate_passes_a_clean_table_and_changes_nothing(method):
    cp = _cp()
    b = gpu_batch(3)
    plan = cupaged.plan_decode(b.table, 8, 2, 128, np.float16, pages_per_chunk=2) if method == "v2" else None
    a, lse_a = cupaged.decode(b.q, b.k, b.v, b.table, plan, method=method, return_lse=True)
    c, lse_c = cupaged.decode(b.q, b.k, b.v, b.table, plan, method=method, return_lse=True, validate=True)
    cp.cuda.runtime.deviceSynchronize()
    assert cp.array_equal(a, c) and cp.array_equal(lse_a, lse_c)


# kind -> (field, index of the entry, new value as a function of the old and num_pages, fragment)
DEVICE_CORRUPTIONS = {
    "page_id_beyond_cache": ("indices", 3, lambda old, n: n + 5, "is out of range [0, num_pages="),
    "page_id_negative": ("indices", 0, lambda old, n: -1, "page id -1 at indices[0] is out of range"),
    "indptr_first": ("indptr", 0, lambda old, n: 1, "indptr[0] must be 0, got 1"),
    "indptr_decreasing": ("indptr", 1, lambda old, n: 10, "request 1: indptr must be non-decreasing"),
    "last_page_len_zero": ("last_page_len", 0, lambda old, n: 0, "request 0: last_page_len must be in [1, page_size=16]"),
    "last_page_len_over": ("last_page_len", 1, lambda old, n: 17, "request 1: last_page_len must be in [1, page_size=16]"),
    "first_page_offset_over": ("first_page_offset", 2, lambda old, n: 16,
                               "request 2: first_page_offset must be in [0, page_size=16)"),
    "page_id_rewritten_in_range": ("indices", 4, lambda old, n: (old + 1) % n, "differs from the host table's"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(DEVICE_CORRUPTIONS))
def test_validate_catches_device_table_corrupted_after_build(kind):
    cp = _cp()
    b = gpu_batch(4)  # pages 3, 6, 2: indptr [0, 3, 9, 11]
    field, index, new, fragment = DEVICE_CORRUPTIONS[kind]
    arr = getattr(b.table.device(), field)
    old = int(arr[index : index + 1].get()[0])
    arr[index] = new(old, b.num_pages)  # on the GPU, behind every host check
    cp.cuda.runtime.deviceSynchronize()
    for method in ("v2", "v1"):
        with pytest.raises(PageTableError, match=_escape("table.device()")) as e:
            cupaged.decode(b.q, b.k, b.v, b.table, method=method, validate=True)
        assert fragment in str(e.value)
    # (never decoded without validate: the kernels would read the corrupted ids)


_SPIN = r'''
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}
'''


@pytest.mark.gpu
def test_cheap_mode_never_syncs_and_validate_does(monkeypatch):
    """With a 0.3 s kernel queued ahead on the stream, a cheap decode returns
    while the stream is still busy (no sync, and the full check never runs);
    validate=True waits for it (its one sync)."""
    cp = _cp()
    b = gpu_batch(5)
    plan = cupaged.plan_decode(b.table, 8, 2, 128, np.float16, pages_per_chunk=2)
    out = cp.empty_like(b.q)
    spin = cp.RawKernel(_SPIN, "spin")
    ns = np.uint64(300_000_000)  # 0.3 s on the device's nanosecond timer
    called = []
    real = _validate.check_device_table
    monkeypatch.setattr(_validate, "check_device_table", lambda *a: (called.append(1), real(*a)))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cupaged.decode(b.q, b.k, b.v, b.table, plan, out=out)  # warm: compile, upload table and plan state
        stream.synchronize()
        spin((1,), (1,), (ns,))
        cupaged.decode(b.q, b.k, b.v, b.table, plan, out=out)
        busy = not stream.done
        stream.synchronize()
        assert busy, "a cheap decode waited for the stream"
        assert not called, "the cheap mode ran the full check"
        spin((1,), (1,), (ns,))
        t0 = time.perf_counter()
        cupaged.decode(b.q, b.k, b.v, b.table, plan, out=out, validate=True)
        waited = time.perf_counter() - t0
        stream.synchronize()
    assert called == [1]
    assert waited > 0.1, f"validate=True returned after {waited:.3f} s: it did not sync"


# ---------------------------------------------------------------- GPU: merge_states
def _merge_inputs(cp, n=4, heads=8, head_dim=128):
    rng = np.random.default_rng(6)
    v = cp.asarray(rng.standard_normal((n, heads, head_dim)).astype(np.float32))
    lse = cp.asarray(rng.standard_normal((n, heads)).astype(np.float32))
    return v, lse


MERGE_GPU_ROWS = {
    "v_numpy": (ArgumentTypeError, "v must be a CuPy array", lambda cp, v, lse: (v.get(), lse, IND)),
    "v_rank": (ShapeError, "v must be 3-D", lambda cp, v, lse: (v[0], lse, IND)),
    "v_dtype": (DTypeError, "v must be float32", lambda cp, v, lse: (v.astype(cp.float16), lse, IND)),
    "v_not_contiguous": (LayoutError, "v must be C-contiguous",
                         lambda cp, v, lse: (cp.repeat(v, 2, axis=2)[:, :, ::2], lse, IND)),
    "lse_shape": (ShapeError, "lse must have shape (4, 8)", lambda cp, v, lse: (v, lse[:, :4], IND)),
    "lse_dtype": (DTypeError, "lse must be float32", lambda cp, v, lse: (v, lse.astype(cp.float64), IND)),
    "lse_not_contiguous": (LayoutError, "lse must be C-contiguous",
                           lambda cp, v, lse: (v, cp.repeat(lse, 2, axis=1)[:, ::2], IND)),
    "head_dim_without_kernel": (UnsupportedConfigError, "unsupported head_dim 40",
                                lambda cp, v, lse: (cp.ascontiguousarray(v[:, :, :40]), lse, IND)),
    "o_indptr_int64": (DTypeError, "o_indptr must be int32", lambda cp, v, lse: (v, lse, IND.astype(np.int64))),
    "o_indptr_int64_device": (DTypeError, "o_indptr must be int32",
                              lambda cp, v, lse: (v, lse, cp.asarray(IND, dtype=cp.int64))),
    "o_indptr_empty": (ShapeError, "M+1 >= 1 entries", lambda cp, v, lse: (v, lse, np.zeros(0, np.int32))),
    "o_indptr_strided_device": (LayoutError, "a CuPy o_indptr must be contiguous",
                                lambda cp, v, lse: (v, lse, cp.asarray([0, 9, 1, 9, 4, 9], dtype=cp.int32)[::2])),
    "o_indptr_first": (InvalidArgumentError, "o_indptr must start at 0",
                       lambda cp, v, lse: (v, lse, np.array([1, 4], np.int32))),
    "o_indptr_first_device": (InvalidArgumentError, "o_indptr must start at 0",
                              lambda cp, v, lse: (v, lse, cp.asarray([1, 4], dtype=cp.int32))),
    "o_indptr_decreasing": (InvalidArgumentError, "never decrease",
                            lambda cp, v, lse: (v, lse, np.array([0, 3, 2], np.int32))),
    "o_indptr_beyond_n": (InvalidArgumentError, "end at most at N=4",
                          lambda cp, v, lse: (v, lse, np.array([0, 5], np.int32))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("row", list(MERGE_GPU_ROWS))
def test_merge_states_rejects(row):
    cp = _cp()
    cls, fragment, build = MERGE_GPU_ROWS[row]
    args = build(cp, *_merge_inputs(cp))
    with pytest.raises(cls, match=_escape(fragment)):
        cupaged.merge_states(*args)


@pytest.mark.gpu
def test_merge_states_rejects_unsupported_out_dtype():
    cp = _cp()
    v, lse = _merge_inputs(cp)
    with pytest.raises(DTypeError, match="out_dtype must be one of"):
        cupaged.merge_states(v, lse, IND, out_dtype=np.float64)
