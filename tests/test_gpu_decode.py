"""GPU tests of the decode paths against the NumPy float64 reference.

Every test runs on adversarial batches (tests/helpers.py): shuffled physical
pages from a pool with 2x slack, NaN in every slot no request can see, ragged
lengths, half the requests starting mid-page. Outputs are poisoned with NaN
before each launch, and the device is synchronized after it so an
asynchronous kernel fault fails the test that caused it.
"""

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference
from helpers import RAGGED_LENS, check_close, make_caches, make_query, make_table, rel_errors

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32)]


def _cp():
    import cupy

    return cupy


def run(method, q, k, v, table, plan=None, **kw):
    """decode with a NaN-poisoned out; returns host (out, lse)."""
    cp = _cp()
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupaged.decode(q, k, v, table, plan, method=method, out=out, return_lse=True, **kw)
    cp.cuda.runtime.deviceSynchronize()  # surfaces asynchronous kernel faults here
    assert res is out
    out_h = out.get().astype(np.float64)
    assert np.isfinite(out_h).all(), "output not fully written (NaN left from the poison)"
    return out_h, lse.get().astype(np.float64)


def batch(seed, seq_lens, page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=np.float16,
          mid_page=True):
    """(q, k, v) on the device, the table, and the host copies for the reference."""
    cp = _cp()
    rng = np.random.default_rng(seed)
    seq_lens = np.asarray(seq_lens)
    off = None
    if mid_page:  # half the requests start mid-page
        off = np.where(np.arange(len(seq_lens)) % 2 == 1, rng.integers(1, max(2, page_size), len(seq_lens)), 0)
        off = np.where(seq_lens > 0, off % page_size, 0)
    table, num_pages = make_table(rng, seq_lens, page_size, off)
    k, v = make_caches(rng, table, num_pages, num_kv_heads, head_dim, dtype)
    q = make_query(rng, len(seq_lens), num_qo_heads, head_dim, dtype)
    return (cp.asarray(q), cp.asarray(k), cp.asarray(v)), table, (q, k, v)


check = check_close


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("merged", [False, True], ids=["single_chunk", "merged"])
def test_v2_matches_reference(dtype, merged):
    dev, table, host = batch(1, RAGGED_LENS, dtype=dtype)
    # a huge target forces splitting; a tiny one keeps every request in one chunk
    plan = cupaged.plan_decode(table, 32, 8, 128, dtype, target_ctas=10**6 if merged else 1)
    assert plan.needs_merge == merged
    out, lse = run("v2", *dev, table, plan)
    ref_out, ref_lse = reference.decode(*host, table)
    check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("core", ["mma", "simt"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_both_cores_match_reference(core, dtype, head_dim, monkeypatch):
    monkeypatch.setenv("CUPAGED_CORE", core)
    dev, table, host = batch(30, [*RAGGED_LENS, 0, 4099], head_dim=head_dim, dtype=dtype)
    ref_out, ref_lse = reference.decode(*host, table)
    for c in (1, 5, None):
        plan = cupaged.plan_decode(table, 32, 8, head_dim, dtype, pages_per_chunk=c)
        out, lse = run("v2", *dev, table, plan)
        check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("seq_len", [16384, 12000])
def test_full_wave_plans_match_reference(seq_len, monkeypatch):
    # schedule.fill_waves's plans: one request on a device the plan thinks has 4 SMs (8 slots), whose one-wave
    # split of 4+ MB chunks goes to two waves (the second chunk shorter at 12000 tokens)
    dev, table, host = batch(40, [seq_len])
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=4)
    monkeypatch.setattr(cupaged.schedule, "fill_waves", lambda *a: None)
    one_wave = cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=4)
    assert one_wave.num_ctas == 8 and (plan.num_ctas, plan.needs_merge) == (16, True)
    out, lse = run("v2", *dev, table, plan)
    ref_out, ref_lse = reference.decode(*host, table)
    check(out, lse, ref_out, ref_lse, np.float16)


def test_single_chunk_and_merged_agree():
    dev, table, host = batch(2, RAGGED_LENS)
    a, _ = run("v2", *dev, table, cupaged.plan_decode(table, 32, 8, 128, np.float16, target_ctas=1))
    b, _ = run("v2", *dev, table, cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=1))
    assert rel_errors(a, b)[0] < 5e-3


def test_chunk_size_invariance():
    dev, table, host = batch(3, [3000, 1021, 17, 2048], dtype=np.float32)
    ref_out, ref_lse = reference.decode(*host, table)
    outs = []
    for c in (1, 2, 3, 4, 7, 16, 33, 1000):  # 8 chunk sizes, ragged and non-powers of two
        plan = cupaged.plan_decode(table, 32, 8, 128, np.float32, pages_per_chunk=c)
        out, lse = run("v2", *dev, table, plan)
        check(out, lse, ref_out, ref_lse, np.float32)
        outs.append(out)
    for o in outs[1:]:
        assert rel_errors(o, outs[0])[0] < 1e-5


@pytest.mark.parametrize("num_qo_heads,num_kv_heads", [(8, 8), (16, 8), (32, 8), (64, 8), (128, 8), (20, 4), (12, 2)])
def test_gqa_head_group_mapping(num_qo_heads, num_kv_heads):
    # group sizes 1, 2, 4, 8, 16 (two q groups per kv head), 5 and 6
    dev, table, host = batch(4, [100, 37, 513], num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads)
    plan = cupaged.plan_decode(table, num_qo_heads, num_kv_heads, 128, np.float16)
    out, lse = run("v2", *dev, table, plan)
    check(out, lse, *reference.decode(*host, table), np.float16)


def test_front_trimmed_windows_every_request_mid_page():
    cp = _cp()
    rng = np.random.default_rng(5)
    lens = np.array([1, 2, 15, 16, 17, 100, 999])
    off = rng.integers(1, 16, len(lens))  # every request starts mid-page; one-page ones too
    table, num_pages = make_table(rng, lens, 16, off)
    assert (table.first_page_offset > 0).all()
    k, v = make_caches(rng, table, num_pages, 8, 128, np.float16)
    q = make_query(rng, len(lens), 32, 128, np.float16)
    for c in (1, 4, None):
        plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=c)
        out, lse = run("v2", cp.asarray(q), cp.asarray(k), cp.asarray(v), table, plan)
        check(out, lse, *reference.decode(q, k, v, table), np.float16)


@pytest.mark.parametrize("pages_per_chunk", [1, None], ids=["merged", "auto"])
def test_empty_requests_do_not_poison_neighbours(pages_per_chunk):
    lens = [0, 300, 0, 17, 0]
    dev, table, host = batch(6, lens, mid_page=False)
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=pages_per_chunk)
    out, lse = run("v2", *dev, table, plan)
    ref_out, ref_lse = reference.decode(*host, table)
    check(out, lse, ref_out, ref_lse, np.float16)
    for i in (0, 2, 4):
        assert (out[i] == 0).all() and np.isneginf(lse[i]).all()


@pytest.mark.parametrize("method", ["v1", "gather"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_baselines_match_reference(method, dtype):
    dev, table, host = batch(7, [*RAGGED_LENS, 0], dtype=dtype)
    out, lse = run(method, *dev, table)
    check(out, lse, *reference.decode(*host, table), dtype)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=str)
def test_head_dims(head_dim, dtype):
    dev, table, host = batch(8, [50, 700, 33], head_dim=head_dim, dtype=dtype)
    for c in (1, None):
        plan = cupaged.plan_decode(table, 32, 8, head_dim, dtype, pages_per_chunk=c)
        out, lse = run("v2", *dev, table, plan)
        check(out, lse, *reference.decode(*host, table), dtype)


@pytest.mark.parametrize("head_dim", [80, 192])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dims_80_and_192_on_every_core(head_dim, dtype, monkeypatch):
    """Issue 19's added head dims (Phi-2's 80, MLA-style 192) on each core that
    serves them (tensor cores: 16-bit, at 192 with the transposed tile;
    CUDA cores: every dtype), split and unsplit, mid-page starts, an empty
    and a long request, against float64; dispatch picks the tensor cores
    where they serve."""
    from cupaged import _configs

    variant = _configs.dtype_name(dtype)
    want_core = "simt" if dtype == np.float32 else "mma"
    assert _configs.choose_core(variant, head_dim) == want_core
    dev, table, host = batch(32, [*RAGGED_LENS, 0, 4099], head_dim=head_dim, dtype=dtype)
    ref_out, ref_lse = reference.decode(*host, table)
    assert cupaged.select_method(*dev, table).method == "v2"
    for core in [c for c in _configs.CORES if _configs.serves(c, variant, head_dim)]:
        monkeypatch.setenv("CUPAGED_CORE", core)
        for c in (1, 5, None):
            plan = cupaged.plan_decode(table, 32, 8, head_dim, dtype, pages_per_chunk=c)
            out, lse = run("v2", *dev, table, plan)
            check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("page_size", [1, 7, 64, 256])
def test_page_sizes(page_size):
    dev, table, host = batch(9, [1, page_size + 1, 3 * page_size - 1, 1000], page_size=page_size)
    for c in (1, None):
        plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=c)
        out, lse = run("v2", *dev, table, plan)
        check(out, lse, *reference.decode(*host, table), np.float16)


def test_long_request_spans_many_page_windows():
    # 8192 pages in one chunk: the kernel stages page ids 256 at a time
    dev, table, host = batch(10, [8192 * 4 - 3], page_size=4, num_qo_heads=8, num_kv_heads=8)
    plan = cupaged.plan_decode(table, 8, 8, 128, np.float16, target_ctas=1)
    assert plan.pages_per_chunk >= 8192
    out, lse = run("v2", *dev, table, plan)
    check(out, lse, *reference.decode(*host, table), np.float16)


def test_strided_cache_slice_of_larger_buffer():
    cp = _cp()
    dev, table, host = batch(11, [100, 257, 31])
    q, k, v = dev
    # caches that are every other page of a buffer twice as large, and q a head slice
    big_k = cp.full((k.shape[0] * 2, *k.shape[1:]), np.nan, dtype=k.dtype)
    big_v = cp.full_like(big_k, np.nan)
    big_k[::2], big_v[::2] = k, v
    big_q = cp.zeros((q.shape[0], q.shape[1] * 2, q.shape[2]), dtype=q.dtype)
    big_q[:, ::2] = q
    ks, vs, qs = big_k[::2], big_v[::2], big_q[:, ::2]
    assert not ks.flags.c_contiguous and not qs.flags.c_contiguous
    assert cupaged.select_method(qs, ks, vs, table).method == "v2"
    out, lse = run("v2", qs, ks, vs, table)
    check(out, lse, *reference.decode(*host, table), np.float16)


def test_declined_shape_falls_back_with_reason():
    dev, table, host = batch(12, [40, 90], head_dim=40)
    sel = cupaged.select_method(*dev, table, method="v2")
    assert sel.method == "gather" and "head_dim 40" in sel.reason
    out, lse = run("v2", *dev, table)
    check(out, lse, *reference.decode(*host, table), np.float16)


def test_sm_scale_and_determinism():
    dev, table, host = batch(13, [500, 77])
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=2)
    a, _ = run("v2", *dev, table, plan, sm_scale=0.3)
    b, _ = run("v2", *dev, table, plan, sm_scale=0.3)
    assert np.array_equal(a, b)  # bitwise repeatable
    check(a, _, *reference.decode(*host, table, sm_scale=0.3), np.float16)


def test_plan_reused_across_decode_steps_and_stale_plan_rejected():
    cp = _cp()
    rng = np.random.default_rng(14)
    table, num_pages = make_table(rng, [160, 40], 16)
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=4)
    k, v = make_caches(rng, table, num_pages + 64, 8, 128, np.float16)
    k = np.nan_to_num(k, nan=0.5).astype(np.float16)
    v = np.nan_to_num(v, nan=-0.5).astype(np.float16)
    q = make_query(rng, 2, 32, 128, np.float16)
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    # next step: request 1 gains a token inside its last page; same chunk counts
    step = cupaged.PageTable(table.indices, table.indptr, table.last_page_len + np.array([0, 1], np.int32),
                             page_size=16)
    assert plan.matches(step)
    out, lse = run("v2", dq, dk, dv, step, plan)
    check(out, lse, *reference.decode(q, k, v, step), np.float16)
    # request 0 grows from 10 to 13 pages, past a 4-page chunk boundary: the plan is stale
    grown = cupaged.PageTable.from_seq_lens([193, 40], 16, page_ids=np.arange(num_pages + 64, dtype=np.int32))
    assert not plan.matches(grown)
    with pytest.raises(cupaged.PlanMismatchError):
        cupaged.decode(dq, dk, dv, grown, plan)


def test_bad_inputs_raise_clearly():
    cp = _cp()
    dev, table, host = batch(15, [40, 90])
    q, k, v = dev
    with pytest.raises(cupaged.PageTableError, match="out of range"):
        cupaged.decode(q, k[:2], v[:2], table)
    with pytest.raises(ValueError, match="dtype"):
        cupaged.decode(q.astype(cp.float32), k, v, table)
    with pytest.raises(ValueError, match="multiple"):
        cupaged.decode(q[:, :30], k[:, :, :7], v[:, :, :7], table)
    with pytest.raises(ValueError, match="out"):
        cupaged.decode(q, k, v, table, out=cp.empty((2, 32, 64), dtype=q.dtype))
    with pytest.raises(cupaged.PlanMismatchError):
        cupaged.decode(q, k, v, table, cupaged.plan_decode(table, 16, 8, 128, np.float16))
    with pytest.raises(TypeError):
        cupaged.decode(host[0], k, v, table)


def test_pool_built_batch_with_forks_and_windows():
    cp = _cp()
    rng = np.random.default_rng(16)
    pool = cupaged.BlockPool(num_pages=512, page_size=16)
    a = pool.add_sequence()
    pool.append(a, 300)
    b, copies = pool.fork(a)  # shares a's pages; partial last page copied
    pool.append(b, 50)
    c = pool.add_sequence()
    pool.append(c, 1000)
    pool.apply_window(c, 333)  # drops retired pages, starts mid-page
    table, rope = pool.page_table([a, b, c])
    assert rope.tolist() == [300, 350, 1000] and table.seq_lens.tolist() == [300, 350, 333]
    k = rng.standard_normal((512, 16, 8, 128), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((512, 16, 8, 128), dtype=np.float32).astype(np.float16)
    cupaged.apply_page_copies([k, v], copies)
    q = make_query(rng, 3, 32, 128, np.float16)
    out, lse = run("v2", cp.asarray(q), cp.asarray(k), cp.asarray(v), table)
    check(out, lse, *reference.decode(q, k, v, table), np.float16)


# ------------------------------------------------------------------ merge kernel
def _partials(rng, n, heads=8, head_dim=128, empty=()):
    v = rng.standard_normal((n, heads, head_dim)).astype(np.float32)
    lse = (rng.standard_normal((n, heads)) * 4).astype(np.float32)
    for i in empty:
        lse[i] = -np.inf
        v[i] = np.nan  # an empty partial's values must not be read
    return v, lse


def test_merge_closed_form_and_empty_rows():
    cp = _cp()
    rng = np.random.default_rng(20)
    v, lse = _partials(rng, 9, empty=(2, 6, 7))
    o_indptr = np.array([0, 3, 3, 6, 8, 9], np.int32)  # row 1 has no partial; row 3 only empty ones
    v_out, lse_out = cupaged.merge_states(cp.asarray(v), cp.asarray(lse), o_indptr)
    ref_v, ref_lse = reference.merge_states(np.nan_to_num(v), lse, o_indptr)
    v_out, lse_out = v_out.get(), lse_out.get()
    assert np.isfinite(v_out).all()
    assert (v_out[1] == 0).all() and np.isneginf(lse_out[1]).all()
    assert (v_out[3] == 0).all() and np.isneginf(lse_out[3]).all()
    np.testing.assert_allclose(v_out, ref_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse_out, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_dtype", [np.float16, BF16], ids=str)
def test_merge_output_dtypes(out_dtype):
    cp = _cp()
    rng = np.random.default_rng(21)
    v, lse = _partials(rng, 6, head_dim=64)
    o_indptr = np.array([0, 2, 6], np.int32)
    v_out, _ = cupaged.merge_states(cp.asarray(v), cp.asarray(lse), o_indptr, out_dtype=out_dtype)
    assert v_out.dtype == np.dtype(out_dtype)
    ref_v, _ = reference.merge_states(v, lse, o_indptr)
    assert rel_errors(v_out.get(), ref_v)[0] < 1e-2


def test_merge_is_associative_under_regrouping():
    cp = _cp()
    rng = np.random.default_rng(22)
    v, lse = _partials(rng, 10, empty=(4,))
    once_v, once_lse = cupaged.merge_states(cp.asarray(v), cp.asarray(lse), np.array([0, 10], np.int32))
    # merge in groups [0,3) [3,7) [7,10), then merge the three results
    mid_v, mid_lse = cupaged.merge_states(cp.asarray(v), cp.asarray(lse), np.array([0, 3, 7, 10], np.int32))
    two_v, two_lse = cupaged.merge_states(mid_v, mid_lse, np.array([0, 3], np.int32))
    np.testing.assert_allclose(two_v.get(), once_v.get(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two_lse.get(), once_lse.get(), rtol=1e-6, atol=1e-5)


def test_merge_rejects_bad_indptr():
    cp = _cp()
    v, lse = _partials(np.random.default_rng(23), 4)
    with pytest.raises(ValueError, match="o_indptr"):
        cupaged.merge_states(cp.asarray(v), cp.asarray(lse), np.array([0, 3, 2], np.int32))
    with pytest.raises(ValueError, match="o_indptr"):
        cupaged.merge_states(cp.asarray(v), cp.asarray(lse), np.array([0, 5], np.int32))


def test_cuda_graph_capture_and_replay():
    cp = _cp()
    dev, table, host = batch(17, [3000, 17, 0, 500], dtype=np.float16)
    q, k, v = dev
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=8)
    assert plan.needs_merge  # the fused merge's ticket counters must reset between replays
    out = cp.empty_like(q)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cupaged.decode(q, k, v, table, plan, out=out)  # warm-up: compile, upload table and plan buffers
        stream.synchronize()
        stream.begin_capture()
        cupaged.decode(q, k, v, table, plan, out=out)
        graph = stream.end_capture()
        rng = np.random.default_rng(18)
        for step in range(3):  # each replay reads the current contents of q
            q_host = make_query(rng, 4, 32, 128, np.float16)
            q.set(q_host, stream=stream)
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            got = out.get().astype(np.float64)
            assert np.isfinite(got).all()
            ref_out, _ = reference.decode(q_host, host[1], host[2], table)
            assert rel_errors(got, ref_out)[0] < 2e-2, step


def waiting_states(plan):
    """The plan's launch states, each with whether it ran the waiting merge."""
    from cupaged._plan_launch import plan_states

    return [(s, s.waits(plan, s.plan_units.shape[0])) for s in plan_states(plan).values()]


@pytest.mark.parametrize("pages_per_chunk", [2, 64])
def test_fused_merge_carries_a_chunks_nan(pages_per_chunk, monkeypatch):
    # a NaN in a visible V row makes one chunk's partials NaN for its kv head: the fused merge carries the
    # NaN to that head group's output, as the reference does, and the other requests and heads are exact
    # (2 pages a chunk: 888 CTAs, the ticket's merge; 64: 40 CTAs, the waiting merge, the NaN in the merging chunk)
    monkeypatch.setenv("CUPAGED_WAIT_MERGE", "1")  # (opt-in: cupaged/_env.py wait_merge)
    cp = _cp()
    (q, k, v), table, host = batch(44, [3000, 500, 17], dtype=np.float16)
    v_host = host[2].copy()
    page = int(table.indices[table.indptr[0] + 5])  # request 0's sixth page (its chunk 2 at 2 pages a chunk)
    v_host[page, 3, 1] = np.nan  # kv head 1 (query heads 4..7)
    v.set(v_host)
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=pages_per_chunk)
    assert plan.request_chunks[0] > 1
    out = cp.full(q.shape, 0.5, dtype=q.dtype)
    cupaged.decode(q, k, v, table, plan, out=out)
    cp.cuda.runtime.deviceSynchronize()
    assert [w for _, w in waiting_states(plan)] == [pages_per_chunk == 64]
    got = out.get().astype(np.float64)
    ref_out, _ = reference.decode(host[0], host[1], v_host, table)
    assert np.isnan(ref_out[0, 4:8]).all() and np.isnan(got[0, 4:8]).all()
    keep = np.ones(got.shape[:2], bool)
    keep[0, 4:8] = False
    assert rel_errors(got[keep], ref_out[keep])[0] < 2e-2


@pytest.mark.parametrize("core", ["mma", "simt"])
def test_waiting_merge_matches_reference_and_leaves_its_workspace_empty(core, monkeypatch):
    # a split plan whose CTAs fit one wave runs the waiting merge: each request's first chunk merges the
    # partials as their values leave PARTIAL_EMPTY (no ticket) and puts PARTIAL_EMPTY back, so every launch
    # after the first waits on its own values; a plan of two waves keeps the ticket's merge
    cp = _cp()
    from cupaged._launch import PARTIAL_EMPTY

    monkeypatch.setenv("CUPAGED_CORE", core)
    dev, table, host = batch(43, [3000, 17, 0, 500, 1, 4099], dtype=np.float16)
    ref_out, ref_lse = reference.decode(*host, table)
    for c, waits, env in ((64, True, "1"), (8, False, "1"), (64, False, "0"), (64, False, None)):  # 12 units of 8 CTAs; 64
        if env is None:  # (unset, the default: the ticket; the env is read at a plan's first launch)
            monkeypatch.delenv("CUPAGED_WAIT_MERGE", raising=False)
        else:
            monkeypatch.setenv("CUPAGED_WAIT_MERGE", env)
        plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=c)
        assert plan.needs_merge
        for _ in range(3):
            out, lse = run("v2", *dev, table, plan)
            check(out, lse, ref_out, ref_lse, np.float16)
        ((state, took),) = waiting_states(plan)
        assert took == waits, (c, env, core)
        if waits:
            for a in (state.partial_v, state.partial_lse):
                assert int((a.view(cp.uint32) != PARTIAL_EMPTY).sum()) == 0, (c, core)
        else:
            assert int(cp.count_nonzero(state.counters)) == 0


# one long request among short ones, and a lognormal mix: the default plan
# splits each request into equal chunks under a cap and runs them longest
# first (work units in launch order); pages shuffled, half the requests
# starting mid-page, NaN in every invisible slot
RAGGED_BATCHES = {
    "one_long": [8191] + [97, 1, 16, 17, 255] * 12,
    "lognormal": np.maximum(1, np.round(300 * np.exp(np.random.default_rng(7).standard_normal(96)))).astype(int),
    "two_long": [4099, 0, 3000, 33] + [64] * 40,
}


@pytest.mark.parametrize("name", list(RAGGED_BATCHES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_ragged_default_plans_match_reference(name, dtype):
    dev, table, host = batch(40, RAGGED_BATCHES[name], dtype=dtype)
    ref_out, ref_lse = reference.decode(*host, table)
    default = cupaged.plan_decode(table, 32, 8, 128, dtype)
    if name == "one_long":  # the long request is split, the short ones are not
        assert default.request_chunks[0] > 1 and (default.request_chunks[1:] == 1).all()
    for plan in (default, cupaged.plan_decode(table, 32, 8, 128, dtype, max_pages_per_chunk=3),
                 cupaged.plan_decode(table, 32, 8, 128, dtype, pages_per_chunk=1)):
        out, lse = run("v2", *dev, table, plan)
        check(out, lse, ref_out, ref_lse, dtype)


def test_ragged_plan_reused_while_requests_grow():
    # a held plan serves the next steps while no request needs another chunk:
    # the last chunk of each request ends past its pages (the kernel clips it)
    lens = [2000, 5, 650, 33]
    dev, table, host = batch(41, lens, mid_page=False)
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, max_pages_per_chunk=40)
    grown_dev, grown, grown_host = batch(41, [n + 9 for n in lens], mid_page=False)
    assert plan.matches(grown)
    out, lse = run("v2", *grown_dev, grown, plan)
    ref_out, ref_lse = reference.decode(*grown_host, grown)
    check(out, lse, ref_out, ref_lse, np.float16)
