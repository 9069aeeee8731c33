"""GPU tests of the serving runtime (issue 17): DecodeRunner over changing
batches, one CUDA graph captured once and replayed for later tables and batch
sizes (append_kv + decode), per-device and per-stream launch state of a held
plan, and decode's hot path on every argument kind. Every result is checked
against the float64 reference; outputs are poisoned with NaN first."""

import dataclasses

import numpy as np
import pytest

import cupaged
from cupaged import reference
from helpers import check_close, make_caches, make_fp8_caches, make_query, make_table

pytestmark = pytest.mark.gpu

F16 = np.dtype(np.float16)
HQ, HKV, D, P = 32, 8, 128, 16


def _cp():
    import cupy

    return cupy


def _random_table(rng, lens, num_pages):
    lens = np.asarray(lens, dtype=np.int64)
    pages = -(-lens // P)
    ids = rng.permutation(num_pages)[: int(pages.sum())].astype(np.int32)
    return cupaged.PageTable.from_seq_lens(lens.astype(np.int32), P, page_ids=ids)


def _pool(rng, num_pages):
    """Random K/V caches on the device and their host copies."""
    cp = _cp()
    shape = (num_pages, P, HKV, D)
    k = rng.standard_normal(shape, dtype=np.float32).astype(F16)
    v = rng.standard_normal(shape, dtype=np.float32).astype(F16)
    return cp.asarray(k), cp.asarray(v), k, v


def _check_rows(out, lse, q_h, k_h, v_h, table, **kw):
    b = table.batch_size
    ref = reference.decode(q_h[:b], k_h, v_h, table, **kw)
    check_close(out[:b].get().astype(np.float64), lse[:b].get().astype(np.float64), *ref, F16)


def _run_checked(runner, rng, rows, caches, table):
    """``runner.run`` of a fresh random q into NaN-poisoned ``rows``-row out
    and lse, checked against float64 for the table's rows; returns out."""
    cp = _cp()
    k, v, k_h, v_h = caches
    q_h = make_query(rng, rows, HQ, D, F16)
    out = cp.full((rows, HQ, D), np.nan, dtype=cp.float16)
    lse = cp.full((rows, HQ), np.nan, dtype=cp.float32)
    runner.run(cp.asarray(q_h), k, v, out=out, lse=lse)
    cp.cuda.runtime.deviceSynchronize()
    _check_rows(out, lse, q_h, k_h, v_h, table)
    return out


def test_runner_matches_reference_over_changing_batches():
    rng = np.random.default_rng(1)
    k, v, k_h, v_h = _pool(rng, 12000)
    runner = cupaged.DecodeRunner(HQ, HKV, D, F16, page_size=P, max_batch=64, max_pages=12000)
    for batch in (5, 17, 1, 64, 33):
        lens = rng.integers(1, 2000, batch)
        lens[0] = 20000  # one long request: split and merged
        table = _random_table(rng, lens, 12000)
        plan = runner.plan(table)
        assert plan.batch_size == batch and plan.num_chunks <= runner.max_units
        out = _run_checked(runner, rng, 64, (k, v, k_h, v_h), table)
        assert np.isnan(out[batch:].get()).all(), "rows past the batch were written"


def test_runner_holds_its_plan_while_requests_grow():
    """A steady batch whose unsplit requests grow by one token a step, across
    page boundaries, keeps the runner's own plan (plan.matches holds: an
    unsplit request's chunk is the plan's cap), and every step still matches
    float64: the kernel clips a chunk to its request. A join re-plans."""
    rng = np.random.default_rng(11)
    k, v, k_h, v_h = _pool(rng, 6000)
    lens = np.array([20000, 31, 300, 1000, 15, 1500])  # the first split (held fixed); the rest grow, unsplit
    need = -(-(lens + 8) // P)
    pool = rng.permutation(6000).astype(np.int32)
    own = np.split(pool[: int(need.sum())], np.cumsum(need)[:-1])

    def table_of(lens):
        ids = np.concatenate([o[: -(-n // P)] for o, n in zip(own, lens)])
        return cupaged.PageTable.from_seq_lens(lens.astype(np.int32), P, page_ids=ids)

    runner = cupaged.DecodeRunner(HQ, HKV, D, F16, page_size=P, max_batch=8, max_pages=6000)
    first = runner.plan(table_of(lens))
    assert first.request_chunks[0] > 1 and (first.request_chunks[1:] == 1).all()  # (the premise)
    for step in range(1, 9):
        table = table_of(lens + np.r_[0, [step] * 5])  # 31 -> 39, 15 -> 23, 300 -> 308, 1500 -> 1508: new pages
        assert runner.plan(table) is first, "requests that grew within their chunks re-planned"
        _run_checked(runner, rng, 8, (k, v, k_h, v_h), table)
    joined = cupaged.PageTable.from_seq_lens([*table.seq_lens.tolist(), 5], P,
                                             page_ids=np.concatenate([table.indices, pool[-1:]]))
    assert runner.plan(joined) is not first


def test_one_graph_serves_later_tables_and_batch_sizes():
    """append_kv + decode for 3 layers captured once at batch 3, replayed for
    batches of 1 to 48 requests over other pages."""
    cp = _cp()
    with cp.cuda.Stream(non_blocking=True):  # graphs are captured on a stream other than the default
        _graph_case(cp)


def _graph_case(cp):
    rng = np.random.default_rng(2)
    max_batch, num_pages, layers = 48, 12000, 3
    caches = [_pool(rng, num_pages) for _ in range(layers)]
    runner = cupaged.DecodeRunner(HQ, HKV, D, F16, page_size=P, max_batch=max_batch, max_pages=num_pages)
    q_buf = cp.zeros((max_batch, HQ, D), dtype=cp.float16)
    kv_new = [(cp.zeros((max_batch, HKV, D), dtype=cp.float16), cp.zeros((max_batch, HKV, D), dtype=cp.float16))
              for _ in range(layers)]
    outs = [cp.zeros((max_batch, HQ, D), dtype=cp.float16) for _ in range(layers)]
    lses = [cp.zeros((max_batch, HQ), dtype=cp.float32) for _ in range(layers)]

    def step():
        for (k, v, _, _), (k_new, v_new), out, lse in zip(caches, kv_new, outs, lses):
            runner.append_kv(k_new, v_new, k, v)
            runner.run(q_buf, k, v, out=out, lse=lse)

    runner.plan(_random_table(rng, [40, 700, 5000], num_pages))
    step()  # compiles outside the capture
    cp.cuda.get_current_stream().synchronize()
    capture = cp.cuda.get_current_stream()
    capture.begin_capture()
    try:
        step()
    finally:
        graph = capture.end_capture()
    for batch in (7, 1, 48, 20):
        lens = rng.integers(1, 3000, batch)
        lens[rng.integers(batch)] = 30000
        table = _random_table(rng, lens, num_pages)
        runner.plan(table)
        q_h = make_query(rng, max_batch, HQ, D, F16)
        q_buf[...] = cp.asarray(q_h)
        new = [(make_query(rng, max_batch, HKV, D, F16), make_query(rng, max_batch, HKV, D, F16))
               for _ in range(layers)]
        for (k_new, v_new), (kn, vn) in zip(kv_new, new):
            k_new[...], v_new[...] = cp.asarray(kn), cp.asarray(vn)
        before = [(k.get(), v.get()) for k, v, _, _ in caches]
        for out in outs:
            out.fill(np.nan)
        graph.launch()
        cp.cuda.runtime.deviceSynchronize()
        last = np.asarray(table.indptr[1:]) - 1  # each request's last page holds its new token
        slot = (np.asarray(table.last_page_len) - 1)
        pages = np.asarray(table.indices)[last]
        for (k, v, _, _), (kb, vb), (kn, vn), out, lse in zip(caches, before, new, outs, lses):
            kh, vh = k.get(), v.get()
            assert np.array_equal(kh[pages, slot], kn[:batch]) and np.array_equal(vh[pages, slot], vn[:batch])
            kb[pages, slot], vb[pages, slot] = kn[:batch], vn[:batch]
            assert np.array_equal(kh, kb) and np.array_equal(vh, vb), "append wrote outside the new slots"
            _check_rows(out, lse, q_h, kh, vh, table)
            assert np.isnan(out[batch:].get()).all()


def test_capture_needs_capacity_rows_and_plan_outside_capture():
    cp = _cp()
    rng = np.random.default_rng(3)
    k, v, _, _ = _pool(rng, 512)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        runner = cupaged.DecodeRunner(HQ, HKV, D, F16, page_size=P, max_batch=8, max_pages=512)
        table = _random_table(rng, [100, 200], 512)
        runner.plan(table)
        q = cp.zeros((2, HQ, D), dtype=cp.float16)
        runner.run(q, k, v)
        stream.begin_capture()
        try:
            with pytest.raises(cupaged.ShapeError, match="max_batch"):
                runner.run(q, k, v)
            with pytest.raises(cupaged.UnsupportedConfigError, match="capturing"):
                runner.plan(table)
        finally:
            stream.end_capture()
    with pytest.raises(cupaged.UnsupportedConfigError, match="stream"):
        runner.run(q, k, v)  # made on another stream


def test_capacities_are_enforced_and_units_replanned():
    cp = _cp()
    rng = np.random.default_rng(4)
    k, v, k_h, v_h = _pool(rng, 3000)
    runner = cupaged.DecodeRunner(HQ, HKV, D, F16, page_size=P, max_batch=4, max_pages=3000, max_units=6)
    with pytest.raises(cupaged.CapacityError):
        runner.plan(_random_table(rng, [10] * 5, 3000))
    with pytest.raises(cupaged.CapacityError):
        runner.plan(cupaged.PageTable.from_seq_lens([16 * 3001], P))
    table = _random_table(rng, [40000, 30, 5], 3000)  # the default plan splits it into more than 6 units
    assert cupaged.plan_decode(table, HQ, HKV, D, F16).num_chunks > 6
    plan = runner.plan(table)
    assert plan.num_chunks <= 6
    q_h = make_query(rng, 4, HQ, D, F16)
    out, lse = runner.run(cp.asarray(q_h), k, v, return_lse=True)
    cp.cuda.runtime.deviceSynchronize()
    _check_rows(out, lse, q_h, k_h, v_h, table)


@pytest.mark.parametrize("scale_mode", ["tensor", "head"])
def test_runner_fp8_with_scales_and_soft_cap(scale_mode):
    cp = _cp()
    rng = np.random.default_rng(5)
    table, num_pages = make_table(rng, [900, 5000, 33], P)
    k_h, v_h, ks, vs = make_fp8_caches(rng, table, num_pages, HKV, D, scale_mode)
    q_h = make_query(rng, 3, HQ, D, F16)
    runner = cupaged.DecodeRunner(HQ, HKV, D, F16, page_size=P, max_batch=3, max_pages=num_pages, kv_dtype="float8_e4m3fn")
    runner.plan(table)
    dev = lambda s: s if s is None or isinstance(s, float) else cp.asarray(s)  # noqa: E731
    out, lse = runner.run(cp.asarray(q_h), cp.asarray(k_h), cp.asarray(v_h), k_scale=dev(ks), v_scale=dev(vs),
                          logits_soft_cap=30.0, return_lse=True)
    cp.cuda.runtime.deviceSynchronize()
    ref = reference.decode(q_h, k_h, v_h, table, k_scale=ks, v_scale=vs, logits_soft_cap=30.0)
    check_close(out.get().astype(np.float64), lse.get().astype(np.float64), *ref, F16)


def test_one_plan_on_two_streams_at_once():
    """Issue 17 item 1 (one GPU): a held plan used on two streams without a
    sync between them; each stream has its own image and workspace."""
    cp = _cp()
    rng = np.random.default_rng(6)
    lens = [3000, 500, 12000, 64]
    table1, num_pages = make_table(rng, lens, P)
    table2 = cupaged.PageTable.from_seq_lens(table1.seq_lens, P, page_ids=np.asarray(table1.indices)[::-1].copy())
    plan = cupaged.plan_decode(table1, HQ, HKV, D, F16, target_ctas=10**5)  # split: both use the workspace
    assert plan.needs_merge and plan.matches(table2)
    k_h, v_h = make_caches(rng, table1, num_pages, HKV, D, F16)
    k2_h, v2_h = make_caches(rng, table2, num_pages, HKV, D, F16)
    q_h = make_query(rng, 4, HQ, D, F16)
    args = [(cp.asarray(q_h), cp.asarray(k_h), cp.asarray(v_h), table1),
            (cp.asarray(q_h), cp.asarray(k2_h), cp.asarray(v2_h), table2)]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = [[], []]
    for _ in range(4):
        for i, (s, (q, k, v, t)) in enumerate(zip(streams, args)):
            with s:
                outs[i].append(cupaged.decode(q, k, v, t, plan, return_lse=True))
    cp.cuda.runtime.deviceSynchronize()
    refs = [reference.decode(q_h, k_h, v_h, table1), reference.decode(q_h, k2_h, v2_h, table2)]
    for res, ref in zip(outs, refs):
        for out, lse in res:
            check_close(out.get().astype(np.float64), lse.get().astype(np.float64), *ref, F16)


def test_one_plan_and_table_on_two_devices_alternating():
    """Issue 17 item 1: one plan and one table used on GPU 0 and GPU 1 in turn."""
    cp = _cp()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    rng = np.random.default_rng(7)
    table, num_pages = make_table(rng, [4000, 300, 9000], P)
    plan = cupaged.plan_decode(table, HQ, HKV, D, F16, target_ctas=10**5)
    k_h, v_h = make_caches(rng, table, num_pages, HKV, D, F16)
    q_h = make_query(rng, 3, HQ, D, F16)
    ref = reference.decode(q_h, k_h, v_h, table)
    per_device = []
    for d in (0, 1):
        with cp.cuda.Device(d):
            per_device.append((cp.asarray(q_h), cp.asarray(k_h), cp.asarray(v_h)))
    for _ in range(3):
        for d in (0, 1):
            with cp.cuda.Device(d):
                out, lse = cupaged.decode(*per_device[d], table, plan, return_lse=True)
                dt = table.device()
                assert dt.indices.data.device_id == d
                new = cp.zeros((3, HKV, D), dtype=cp.float16)
                cupaged.append_kv(new, new, per_device[d][1].copy(), per_device[d][2].copy(), table)
                cp.cuda.runtime.deviceSynchronize()
                check_close(out.get().astype(np.float64), lse.get().astype(np.float64), *ref, F16)


@pytest.mark.parametrize("case", ["fp8_tensor", "fp8_head", "soft_cap", "hnd"])
def test_hot_path_on_every_argument_kind(case, monkeypatch):
    """Issue 17 item 8: a held plan's repeat call is hot on every path, and a
    changed argument value is checked again (never a stale scale)."""
    import importlib

    cp = _cp()
    mod = importlib.import_module("cupaged._plan_launch")
    rng = np.random.default_rng(8)
    table, num_pages = make_table(rng, [700, 33, 4000], P)
    q_h = make_query(rng, 3, HQ, D, F16)
    kw, ref_kw = {}, {}
    if case.startswith("fp8"):
        k_h, v_h, ks, vs = make_fp8_caches(rng, table, num_pages, HKV, D, case[4:])
        ref_kw = dict(k_scale=ks, v_scale=vs)
        kw = {n: s if isinstance(s, float) else cp.asarray(s) for n, s in ref_kw.items()}
        kv_dtype = "float8_e4m3fn"
    else:
        k_h, v_h = make_caches(rng, table, num_pages, HKV, D, F16)
        kv_dtype = None
        if case == "soft_cap":
            kw = ref_kw = dict(logits_soft_cap=7.5)
    k, v = cp.asarray(k_h), cp.asarray(v_h)
    if case == "hnd":
        kw = ref_kw = dict(kv_layout="HND")
        k_h, v_h = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k_h, v_h))
        k, v = cp.asarray(k_h), cp.asarray(v_h)
    plan = cupaged.plan_decode(table, HQ, HKV, D, F16, kv_dtype=kv_dtype)
    q = cp.asarray(q_h)
    ref = reference.decode(q_h, k_h, v_h, table, **ref_kw)
    hot = []
    real = mod.PlanLaunch.launch_pointers
    monkeypatch.setattr(mod.PlanLaunch, "launch_pointers", lambda self, *a: (hot.append(1), real(self, *a))[1])
    for _ in range(3):
        out, lse = cupaged.decode(q, k, v, table, plan, return_lse=True, **kw)
        cp.cuda.runtime.deviceSynchronize()
        check_close(out.get().astype(np.float64), lse.get().astype(np.float64), *ref, F16)
    assert len(hot) == 2
    if case == "fp8_tensor":  # a new per-tensor scale value: checked again, and used
        kw2 = dict(kw, k_scale=kw["k_scale"] * 2)
        ref2 = reference.decode(q_h, k_h, v_h, table, **dict(ref_kw, k_scale=ref_kw["k_scale"] * 2))
        out, lse = cupaged.decode(q, k, v, table, plan, return_lse=True, **kw2)
        cp.cuda.runtime.deviceSynchronize()
        check_close(out.get().astype(np.float64), lse.get().astype(np.float64), *ref2, F16)
        assert len(hot) == 2


def test_a_plan_edited_with_replace_is_refused():
    """Issue 17 item 2: decode checks a plan that plan_decode did not make."""
    cp = _cp()
    rng = np.random.default_rng(9)
    table, num_pages = make_table(rng, [3000, 100], P)
    k_h, v_h = make_caches(rng, table, num_pages, HKV, D, F16)
    q = cp.asarray(make_query(rng, 2, HQ, D, F16))
    plan = cupaged.plan_decode(table, HQ, HKV, D, F16, target_ctas=10**5)
    assert plan.needs_merge
    bad = dataclasses.replace(plan, needs_merge=False)
    with pytest.raises(cupaged.PlanMismatchError, match="needs_merge"):
        cupaged.decode(q, cp.asarray(k_h), cp.asarray(v_h), table, bad)


def test_threads_share_a_plan_each_on_its_own_stream():
    """Issue 17 item 3: four threads decode with one held plan at once, each
    on its own stream (and one runner per thread); every result checked."""
    import threading

    cp = _cp()
    rng = np.random.default_rng(10)
    table, num_pages = make_table(rng, [2500, 40, 7000, 300], P)
    plan = cupaged.plan_decode(table, HQ, HKV, D, F16, target_ctas=10**5)
    k_h, v_h = make_caches(rng, table, num_pages, HKV, D, F16)
    k, v = cp.asarray(k_h), cp.asarray(v_h)
    queries = [make_query(rng, 4, HQ, D, F16) for _ in range(4)]
    refs = [reference.decode(qh, k_h, v_h, table) for qh in queries]
    cupaged.decode(cp.asarray(queries[0]), k, v, table, plan)  # compiles once, before the threads
    cp.cuda.runtime.deviceSynchronize()
    errors, barrier = [], threading.Barrier(4)

    def worker(t):
        try:
            with cp.cuda.Stream(non_blocking=True) as stream:
                runner = cupaged.DecodeRunner(HQ, HKV, D, F16, page_size=P, max_batch=4, max_pages=num_pages)
                runner.plan(table)
                q = cp.asarray(queries[t])
                barrier.wait()
                for _ in range(10):
                    out, lse = cupaged.decode(q, k, v, table, plan, return_lse=True)
                    r_out, r_lse = runner.run(q, k, v, return_lse=True)
                stream.synchronize()
                for o, l in ((out, lse), (r_out, r_lse)):
                    check_close(o.get().astype(np.float64), l.get().astype(np.float64), *refs[t], F16)
        except Exception as e:  # reported by the main thread
            errors.append((t, e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
