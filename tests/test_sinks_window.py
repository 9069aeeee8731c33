"""Attention sinks and sliding windows (issue 18) against the float64
reference (``cupaged.reference.decode(..., sinks=, window_left=)``).

GPU tests use test_features_gpu's adversarial batches (shuffled pages, half
the requests starting mid-page, NaN in every slot no request can see, NaN
poison in ``out``). A windowed call also gets caches whose slots before the
window are NaN, so reading one of them fails the check: pages before the
window must never be read. The table tests at the top run on the CPU and
compare ``PageTable.windowed`` with the reference's own window.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import RAGGED_LENS, make_caches, make_query, make_table, rel_errors, visible_mask

import cupaged
from cupaged import reference
from test_features_gpu import BF16, F16, F32, FP8, _cp, check, differs, make_batch, run, tolerance

gpu = pytest.mark.gpu

WINDOWS = (0, 1, 5, 15, 16, 17, 40, 300, 10**6)


# ------------------------------------------------------------- tables (CPU)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_table_is_the_reference_window(page_size, window):
    """Decoding the windowed table without a window is the reference's
    windowed decode, and the windowed table keeps exactly the window."""
    rng = np.random.default_rng(page_size * 1000 + window % 997)
    lens = np.array([*RAGGED_LENS, 0, 2])
    off = np.where((np.arange(len(lens)) % 2 == 1) & (lens > 0), rng.integers(0, page_size, len(lens)), 0)
    table, num_pages = make_table(rng, lens, page_size, off)
    k, v = make_caches(rng, table, num_pages, 2, 64, np.float32)
    q = make_query(rng, len(lens), 4, 64, np.float32)
    w = table.windowed(window)
    np.testing.assert_array_equal(w.seq_lens, np.minimum(table.seq_lens, window + 1))
    np.testing.assert_array_equal(w.last_page_len, table.last_page_len)
    for i in range(table.batch_size):  # the kept pages are the original's last ones
        kept = w.indices[w.indptr[i]:w.indptr[i + 1]]
        np.testing.assert_array_equal(kept, table.indices[table.indptr[i + 1] - len(kept):table.indptr[i + 1]])
        if len(kept):
            assert w.first_page_offset[i] < page_size and (w.request_pages[i] - 1) * page_size < \
                w.seq_lens[i] + w.first_page_offset[i]  # no page wholly before the window
    got = reference.decode(q, k, v, w)
    want = reference.decode(q, k, v, table, window_left=window)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    if window >= int(table.seq_lens.max()):
        assert w is table


def test_windowed_per_request_and_errors():
    rng = np.random.default_rng(3)
    table, num_pages = make_table(rng, [100, 40, 7, 0], 16, [3, 0, 5, 0])
    win = np.array([10, -1, 0, 4])
    w = table.windowed(win)
    assert w.seq_lens.tolist() == [11, 40, 1, 0]
    assert table.windowed(win) is w and table.windowed(-1) is table and table.windowed(None) is table
    k, v = make_caches(rng, table, num_pages, 1, 64, np.float32)
    q = make_query(rng, 4, 2, 64, np.float32)
    for a, b in zip(reference.decode(q, k, v, w), reference.decode(q, k, v, table, window_left=win)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    plan = cupaged.plan_decode(table, 2, 1, 64, np.float32, window_left=win, pages_per_chunk=1)
    assert plan.matches(w) and plan.request_chunks.tolist() == np.maximum(w.request_pages, 1).tolist()
    for bad, err in ((-2, cupaged.InvalidArgumentError), (np.array([1, 2]), cupaged.ShapeError),
                     (1.5, cupaged.ShapeError), ([[1]], cupaged.ShapeError)):
        with pytest.raises(err):
            table.windowed(bad)


def test_windowed_tables_are_plain_tables():
    """A windowed table pickles, copies and validates like any other (its
    window cache is not carried), and plan_decode(window_left=) needs a
    PageTable."""
    import copy
    import pickle
    import types

    table = cupaged.PageTable.from_seq_lens([100, 3, 50], page_size=8, first_page_offset=[5, 0, 7])
    w = table.windowed(np.array([20, -1, 9]))
    for c in (pickle.loads(pickle.dumps(w)), copy.deepcopy(w)):
        for name in ("indices", "indptr", "last_page_len", "first_page_offset"):
            np.testing.assert_array_equal(getattr(c, name), getattr(w, name))
        assert c.windowed(4).seq_lens.tolist() == [5, 3, 5]
    w.validate()
    duck = types.SimpleNamespace(batch_size=1, page_size=8, request_pages=np.array([2], np.int32))
    with pytest.raises(cupaged.ArgumentTypeError, match="window_left"):
        cupaged.plan_decode(duck, 4, 1, 64, np.float16, window_left=3)
    assert cupaged.plan_decode(duck, 4, 1, 64, np.float16).batch_size == 1  # no window: duck tables plan


# --------------------------------------------------------------- GPU: sinks


def _sinks(rng, num_qo_heads, lo=2.0, hi=8.0):
    """Sink logits in the range of the batches' natural-log LSEs, so they matter."""
    return rng.uniform(lo, hi, num_qo_heads).astype(np.float32)


@gpu
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
def test_sinks_match_reference(dtype):
    cp = _cp()
    b = make_batch(180, [*RAGGED_LENS, 0], dtype=dtype, head_dim=256 if dtype == F32 else 128)
    sinks = _sinks(np.random.default_rng(181), b.num_qo_heads)
    want = b.reference(sinks=sinks)
    assert differs(want[0], b.reference()[0], tolerance(dtype))  # the sinks matter
    assert np.allclose(want[1][-1], sinks / math.log(2))  # the empty request: LSE = the sink
    s = cp.asarray(sinks)
    for plan in (b.plan(pages_per_chunk=1), b.plan(pages_per_chunk=10**6), None):
        check(run("v2", b, plan, sinks=s), want, dtype)
    for method in ("gather", "v1"):  # v1 falls back to gather
        check(run(method, b, sinks=s), want, dtype)
    sel = cupaged.select_method(b.q, b.k, b.v, b.table, method="v1", sinks=True)
    assert sel.method == "gather" and "sinks" in sel.reason


@gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_sinks_with_fp8_scales_soft_cap_and_hnd(dtype):
    cp = _cp()
    b = make_batch(182, [5, 1000, 16, 257, 0], num_qo_heads=48, num_kv_heads=8, head_dim=96, dtype=dtype,
                   kv_dtype=FP8, scale_mode="head", kv_layout="HND", page_size=32)
    sinks = _sinks(np.random.default_rng(183), 48)
    kw = {"logits_soft_cap": 20.0, "sm_scale": 6 / math.sqrt(96)}
    want = b.reference(sinks=sinks, **kw)
    for c in (1, None):
        check(run("v2", b, b.plan(pages_per_chunk=c), sinks=cp.asarray(sinks), **kw), want, dtype)


@gpu
def test_bad_sinks_are_refused():
    cp = _cp()
    b = make_batch(184, [30, 7])
    for bad, err in ((cp.zeros(31, cp.float32), cupaged.ShapeError), (cp.zeros(32, cp.float16), cupaged.DTypeError),
                     (cp.zeros(64, cp.float32)[::2], cupaged.LayoutError),
                     (np.zeros(32, np.float32), cupaged.ArgumentTypeError)):
        with pytest.raises(err):
            cupaged.decode(b.q, b.k, b.v, b.table, sinks=bad)


# -------------------------------------------------------------- GPU: window


def _outside_window_nan(b, window):
    """The batch's device caches with every slot the window leaves out set to
    NaN (fp8: the e4m3 NaN bits), so a kernel that reads one fails."""
    cp = _cp()
    keep = visible_mask(b.table.windowed(window), b.host[1].shape[0])[:, :, None, None]
    caches = []
    for x in b.host[1:]:  # NHD host copies (HND batches: transposed back and forth)
        hnd = b.dev_kw.get("kv_layout") == "HND"
        nhd = x.transpose(0, 2, 1, 3) if hnd else x
        fill = np.uint8(0x7F) if x.dtype == np.uint8 else np.array(np.nan, dtype=x.dtype)
        y = np.where(keep, nhd, fill).astype(x.dtype)
        caches.append(cp.asarray(np.ascontiguousarray(y.transpose(0, 2, 1, 3) if hnd else y)))
    return tuple(caches)


@gpu
@pytest.mark.parametrize("window", [0, 5, 16, 40, 10**6])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_window_matches_reference_and_skips_pages(dtype, window):
    b = make_batch(185, [*RAGGED_LENS, 0, 3000], dtype=dtype)
    want = b.reference(window_left=window)
    if window < 100:
        assert differs(want[0], b.reference()[0], tolerance(dtype))
    b.k, b.v = _outside_window_nan(b, window)
    for plan in (b.plan(pages_per_chunk=1, window_left=window), b.plan(window_left=window), None):
        check(run("v2", b, plan, window_left=window), want, dtype)
    for method in ("v1", "gather"):
        check(run(method, b, window_left=window), want, dtype)


@gpu
def test_window_per_request_with_sinks_fp8_and_lse_buffer():
    cp = _cp()
    b = make_batch(186, [700, 33, 1, 0, 5000, 17], dtype=BF16, kv_dtype=FP8, scale_mode="tensor")
    window = np.array([100, -1, 0, 3, 4095, 16])
    sinks = _sinks(np.random.default_rng(187), b.num_qo_heads)
    want = b.reference(window_left=window, sinks=sinks)
    b.k, b.v = _outside_window_nan(b, window)
    s = cp.asarray(sinks)
    plan = b.plan(window_left=window, pages_per_chunk=2)
    for _ in range(3):  # (a per-request window array is not recorded for the hot path: it could change in place)
        check(run("v2", b, plan, window_left=window, sinks=s), want, BF16)
    lse = cp.empty((6, 32), cp.float32)
    out = cupaged.decode(b.q, b.k, b.v, b.table, plan, window_left=window, sinks=s, lse=lse, **b.dev_kw)
    cp.cuda.runtime.deviceSynchronize()
    check((out.get().astype(np.float64), lse.get().astype(np.float64)), want, BF16)
    with pytest.raises(cupaged.PlanMismatchError):  # a plan for the whole table, a windowed call
        cupaged.decode(b.q, b.k, b.v, b.table, b.plan(pages_per_chunk=1), window_left=window, **b.dev_kw)


@gpu
def test_runner_with_window_and_sinks_replays_in_a_graph():
    """One runner per window: plan(table, window_left=) each step; a graph
    captured at step 1 serves the later (windowed) tables."""
    cp = _cp()
    rng = np.random.default_rng(188)
    window = 50
    sinks = cp.asarray(_sinks(rng, 32))
    table0, num_pages = make_table(rng, [300, 20, 900], 16, [0, 3, 0], slack=1.5)
    k, v = make_caches(rng, table0, num_pages, 8, 128, np.float16)
    k_d, v_d = cp.asarray(np.nan_to_num(k)), cp.asarray(np.nan_to_num(v))
    q = cp.zeros((4, 32, 128), cp.float16)
    out = cp.zeros_like(q)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        runner = cupaged.DecodeRunner(32, 8, 128, np.float16, page_size=16, max_batch=4, max_pages=400)
        runner.plan(table0, window_left=window)
        stream.begin_capture()
        runner.run(q, k_d, v_d, out, sinks=sinks)
        graph = stream.end_capture()
        for lens in ([300, 20, 900], [301, 21], [5, 64, 1000, 2]):
            table, _ = make_table(rng, lens, 16, slack=1.0)
            table = cupaged.PageTable(table.indices % num_pages, table.indptr, table.last_page_len, page_size=16)
            qh = make_query(rng, len(lens), 32, 128, np.float16)
            q[:len(lens)] = cp.asarray(qh)
            runner.plan(table, window_left=window)
            graph.launch(stream)
            stream.synchronize()
            want = reference.decode(qh, np.nan_to_num(k), np.nan_to_num(v), table, window_left=window,
                                    sinks=sinks.get())
            got = out[:len(lens)].get().astype(np.float64)
            assert np.isfinite(got).all()
            assert rel_errors(got, want[0])[0] <= tolerance(F16)
