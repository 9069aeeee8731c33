"""GPU tests of decode's hot path: a call like the last fully checked v2 call
with the same plan (same table, shapes, strides, dtypes, device, stream,
method, sm_scale, soft cap, k/v scales and layout) skips the checks and
rewrites only the array pointers. Each test
changes one thing between calls and checks the result against the float64
reference, so a stale slot (pointer, stride, scale, table) fails here.
"""

import numpy as np
import pytest

import cupaged
from cupaged import reference
from helpers import check_close, make_caches, make_query

from test_gpu_decode import batch

pytestmark = pytest.mark.gpu

F16 = np.dtype(np.float16)


def _cp():
    import cupy

    return cupy


def _buffers(plan):
    import importlib

    return importlib.import_module("cupaged._plan_launch").plan_states(plan).last


def _decode(q, k, v, table, plan, **kw):
    cp = _cp()
    res = cupaged.decode(q, k, v, table, plan, return_lse=True, **kw)
    cp.cuda.runtime.deviceSynchronize()
    return res[0].get().astype(np.float64), res[1].get().astype(np.float64)


def _count_launches(monkeypatch):
    """Counts the checked launches and the hot ones."""
    import importlib

    cls = importlib.import_module("cupaged._plan_launch").PlanLaunch
    counts = {"checked": 0, "hot": 0}
    for name, key in (("launch", "checked"), ("launch_pointers", "hot")):
        real = getattr(cls, name)

        def wrapper(self, *a, _real=real, _key=key):
            counts[_key] += 1
            return _real(self, *a)

        monkeypatch.setattr(cls, name, wrapper)
    return counts


@pytest.mark.parametrize("merged", [False, True], ids=["single_chunk", "merged"])
def test_layers_of_a_step(merged, monkeypatch):
    """A serving step: one plan, per layer a new q and that layer's caches;
    only the first call is checked."""
    cp = _cp()
    counts = _count_launches(monkeypatch)
    dev, table, host = batch(71, [300, 41, 1700, 16], mid_page=True)
    plan = cupaged.plan_decode(table, 32, 8, 128, F16, target_ctas=10**6 if merged else 1)
    rng = np.random.default_rng(72)
    layers = [host[1:]] + [make_caches(rng, table, host[1].shape[0], 8, 128, F16) for _ in range(2)]
    for step in range(2):
        for k_h, v_h in layers:
            q_h = make_query(rng, 4, 32, 128, F16)
            out, lse = _decode(cp.asarray(q_h), cp.asarray(k_h), cp.asarray(v_h), table, plan)
            check_close(out, lse, *reference.decode(q_h, k_h, v_h, table), F16)
            assert _buffers(plan).hot is not None
    assert counts == {"checked": 1, "hot": 5}


def test_each_difference_takes_the_checked_path(monkeypatch):
    cp = _cp()
    dev, table, host = batch(73, [200, 90, 513], mid_page=False)
    q, k, v = dev
    plan = cupaged.plan_decode(table, 32, 8, 128, F16)
    ref = reference.decode(*host, table)
    check_close(*_decode(q, k, v, table, plan), *ref, F16)
    assert _buffers(plan).hot is not None
    counts = _count_launches(monkeypatch)
    check_close(*_decode(q, k, v, table, plan), *ref, F16)
    assert counts == {"checked": 0, "hot": 1}

    # another sm_scale, then a soft cap (recorded too: its repeat is hot), then plain again
    check_close(*_decode(q, k, v, table, plan, sm_scale=0.05), *reference.decode(*host, table, sm_scale=0.05), F16)
    assert _buffers(plan).hot.args[0] == 0.05
    capped = reference.decode(*host, table, logits_soft_cap=5.0)
    counts.update(checked=0, hot=0)
    for _ in range(2):
        check_close(*_decode(q, k, v, table, plan, logits_soft_cap=5.0), *capped, F16)
    assert _buffers(plan).hot.args[1] == 5.0 and counts == {"checked": 1, "hot": 1}
    check_close(*_decode(q, k, v, table, plan, logits_soft_cap=2.0),
                *reference.decode(*host, table, logits_soft_cap=2.0), F16)  # a new value: checked again
    check_close(*_decode(q, k, v, table, plan), *ref, F16)

    # out with other strides (a slice of a wider buffer)
    wide = cp.full((3, 40, 128), np.nan, dtype=cp.float16)
    res, lse = cupaged.decode(q, k, v, table, plan, out=wide[:, 4:36], return_lse=True)
    cp.cuda.runtime.deviceSynchronize()
    assert res.data.ptr == wide[:, 4:36].data.ptr
    check_close(res.get().astype(np.float64), lse.get().astype(np.float64), *ref, F16)
    assert np.isnan(wide[:, :4].get()).all() and np.isnan(wide[:, 36:].get()).all()

    # a q that is not 16-byte aligned: the kernels decline it (gather path)
    buf = cp.empty(3 * 32 * 128 + 1, dtype=cp.float16)
    q_odd = buf[1:].reshape(3, 32, 128)
    q_odd[...] = q
    assert cupaged.select_method(q_odd, k, v, table).method == "gather"
    check_close(*_decode(q_odd, k, v, table, plan), *ref, F16)

    # CUPAGED_DECODE set between calls: method="auto" must follow it
    check_close(*_decode(q, k, v, table, plan), *ref, F16)
    calls = []
    import cupaged.gather as gather_module

    real = gather_module.gather_decode
    monkeypatch.setattr(gather_module, "gather_decode", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    monkeypatch.setenv("CUPAGED_DECODE", "gather")
    check_close(*_decode(q, k, v, table, plan), *ref, F16)
    assert calls == [1]
    monkeypatch.delenv("CUPAGED_DECODE")

    # a new table with the same lengths (so the plan matches) over other
    # pages: the new table's pointers must be used (caches NaN where t2 cannot see)
    t2 = cupaged.PageTable.from_seq_lens(table.seq_lens, 16, page_ids=np.asarray(table.indices)[::-1].copy())
    assert plan.matches(t2) and t2 is not table
    k2, v2 = make_caches(np.random.default_rng(75), t2, host[1].shape[0], 8, 128, F16)
    check_close(*_decode(q, cp.asarray(k2), cp.asarray(v2), t2, plan), *reference.decode(host[0], k2, v2, t2), F16)

    # a cache of another shape (fewer pages) is checked again: page ids out of range
    with pytest.raises(cupaged.PageTableError):
        cupaged.decode(q, k[:2], v[:2], table, plan)


def test_arrays_on_another_device_are_checked():
    cp = _cp()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    dev, table, host = batch(74, [100, 30, 70], mid_page=False)
    q, k, v = dev
    plan = cupaged.plan_decode(table, 32, 8, 128, F16)
    _decode(q, k, v, table, plan)
    with cp.cuda.Device(1):
        q1 = cp.asarray(host[0])
    with pytest.raises(cupaged.DeviceMismatchError):
        cupaged.decode(q1, k, v, table, plan)


def test_plans_and_their_launch_state_are_freed():
    """decode() without a plan makes one per call, with its workspace and
    image: neither may outlive the call (the launch state must not keep its
    own plan alive). A held plan's state goes when the plan does."""
    import gc
    import weakref

    cp = _cp()
    dec = __import__("importlib").import_module("cupaged._plan_launch")
    (q, k, v), table, host = batch(75, [300, 41, 1700], mid_page=False)
    gc.collect()
    before = len(dec.PLAN_STATES)
    for _ in range(5):
        out = cupaged.decode(q, k, v, table)
    gc.collect()
    assert len(dec.PLAN_STATES) == before
    plan = cupaged.plan_decode(table, 32, 8, 128, F16)
    for _ in range(2):
        out, lse = cupaged.decode(q, k, v, table, plan, return_lse=True)
    assert dec.plan_states(plan).last.hot is not None
    ref = weakref.ref(plan)
    cp.cuda.runtime.deviceSynchronize()
    del plan
    gc.collect()
    assert ref() is None and len(dec.PLAN_STATES) == before
    check_close(out.get().astype(np.float64), lse.get().astype(np.float64), *reference.decode(*host, table), F16)


@pytest.mark.parametrize("method", ["v2", "v1", "gather"])
def test_lse_buffer_is_written_and_returned(method, monkeypatch):
    """decode(lse=...) writes the LSE into the caller's buffer (returned with
    return_lse, the same object), on every method; on v2 the repeated call
    with another buffer of the same kind takes the hot path; a buffer of the
    wrong shape, dtype or layout is refused."""
    cp = _cp()
    counts = _count_launches(monkeypatch)
    (q, k, v), table, host = batch(77, [300, 41, 1700, 0], mid_page=True)
    plan = cupaged.plan_decode(table, 32, 8, 128, F16, target_ctas=10**6)
    want = reference.decode(*host, table)
    for step in range(2):
        buf = cp.full((4, 32), cp.nan, dtype=cp.float32)
        out, lse = cupaged.decode(q, k, v, table, plan, method=method, lse=buf, return_lse=True)
        assert lse is buf
        check_close(out.get().astype(np.float64), buf.get().astype(np.float64), *want, F16)
    if method == "v2":
        assert counts == {"checked": 1, "hot": 1}
        buf[...] = cp.nan
        assert cupaged.decode(q, k, v, table, plan, lse=buf) is not None  # written, not returned
        cp.cuda.runtime.deviceSynchronize()
        assert np.isfinite(buf.get()[:3]).all()
    for bad, err in ((cp.empty((4, 31), cp.float32), cupaged.ShapeError),
                     (cp.empty((4, 32), cp.float16), cupaged.DTypeError),
                     (cp.empty((32, 4), cp.float32).T, cupaged.LayoutError)):
        with pytest.raises(err):
            cupaged.decode(q, k, v, table, plan, method=method, lse=bad)


@pytest.mark.parametrize("num_kv_heads", [8, 1])
def test_per_layer_scale_and_sink_arrays_with_one_plan(num_kv_heads, monkeypatch):
    """Per layer its own k/v scale and sink arrays, one held plan (an fp8
    gpt-oss step): each new array object takes the checked path once
    (compared by identity, never elementwise: a several-element ``==``
    raised before, and a one-element one of equal values let the recorded
    array's pointer through) and gives that layer's answer; the plan keeps a
    record per layer's arrays, so the next step's layers are hot and each
    launches with its own scales and sinks (a stale pointer fails the
    reference check). A call with other strides drops the records."""
    cp = _cp()
    rng = np.random.default_rng(76)
    dev, table, host = batch(77, [300, 41, 1700], mid_page=True)
    q_h = make_query(rng, 3, 32, 128, F16)
    k_h, v_h = make_caches(rng, table, host[1].shape[0], num_kv_heads, 128, F16)
    q, k, v = cp.asarray(q_h), cp.asarray(k_h), cp.asarray(v_h)
    plan = cupaged.plan_decode(table, 32, num_kv_heads, 128, F16)
    counts = _count_launches(monkeypatch)
    layers = []
    for layer in range(3):  # equal values in layers 0 and 1: distinct arrays all the same
        scale = np.full(num_kv_heads, 0.5 if layer < 2 else 1.5, np.float32)
        sinks = np.full(32, 3.0 if layer < 2 else 5.0, np.float32)
        layers.append((scale, sinks, cp.asarray(scale), cp.asarray(sinks)))
    for _ in range(2):
        for scale, sinks, scale_d, sinks_d in layers:
            got = _decode(q, k, v, table, plan, k_scale=scale_d, v_scale=scale_d, sinks=sinks_d)
            check_close(*got, *reference.decode(q_h, k_h, v_h, table, k_scale=scale, v_scale=scale, sinks=sinks),
                        F16)
    assert counts == {"checked": 3, "hot": 3}
    assert len(_buffers(plan).hots) == 3
    del layers[0]  # (its record keeps the arrays alive: their pointers stay valid)
    for scale, sinks, scale_d, sinks_d in layers * 2:
        got = _decode(q, k, v, table, plan, k_scale=scale_d, v_scale=scale_d, sinks=sinks_d)
        check_close(*got, *reference.decode(q_h, k_h, v_h, table, k_scale=scale, v_scale=scale, sinks=sinks), F16)
    assert counts == {"checked": 3, "hot": 7}
    # out of other strides: checked, and the other layers' records (of the old strides) dropped
    scale, sinks, scale_d, sinks_d = layers[0]
    wide = cp.full((3, 40, 128), np.nan, dtype=cp.float16)
    want = reference.decode(q_h, k_h, v_h, table, k_scale=scale, v_scale=scale, sinks=sinks)
    for _ in range(2):
        res, lse = cupaged.decode(q, k, v, table, plan, out=wide[:, 4:36], return_lse=True, k_scale=scale_d,
                                  v_scale=scale_d, sinks=sinks_d)
        check_close(res.get().astype(np.float64), lse.get().astype(np.float64), *want, F16)
    assert counts == {"checked": 4, "hot": 8} and len(_buffers(plan).hots) == 1
    scale, sinks, scale_d, sinks_d = layers[1]
    got = _decode(q, k, v, table, plan, k_scale=scale_d, v_scale=scale_d, sinks=sinks_d)
    check_close(*got, *reference.decode(q_h, k_h, v_h, table, k_scale=scale, v_scale=scale, sinks=sinks), F16)
    assert counts == {"checked": 5, "hot": 8}


def test_strided_arrays_of_the_recorded_shapes(monkeypatch):
    """The record of a call with C-contiguous arrays checks contiguity, not
    strides: q, caches or out of the same shapes but other strides (views of
    wider buffers) take the checked path and give the right answer; the
    record of such a call compares strides, so a second view of those
    strides is hot and a contiguous one is checked again."""
    cp = _cp()
    rng = np.random.default_rng(78)
    dev, table, host = batch(79, [300, 41, 1700], mid_page=True)
    q, k, v = dev
    plan = cupaged.plan_decode(table, 32, 8, 128, F16, target_ctas=10**6)
    want = reference.decode(*host, table)
    counts = _count_launches(monkeypatch)
    for _ in range(2):
        check_close(*_decode(q, k, v, table, plan), *want, F16)
    assert counts == {"checked": 1, "hot": 1}

    def strided(a, axis):  # a of a's shape and values, inside a buffer 3 wider along axis (not the first)
        shape = list(a.shape)
        shape[axis] += 3
        buf = cp.full(shape, np.nan, dtype=a.dtype)
        view = buf[(slice(None),) * axis + (slice(1, 1 + a.shape[axis]),)]
        view[...] = a
        assert view.shape == a.shape and not view.flags.c_contiguous
        return view

    pages = host[1].shape[0]
    k2, v2 = make_caches(rng, table, pages, 8, 128, F16)
    want2 = reference.decode(host[0], k2, v2, table)
    for args, ref in (((strided(q, 1), k, v), want), ((q, strided(cp.asarray(k2), 1), strided(cp.asarray(v2), 2)), want2)):
        counts.update(checked=0, hot=0)
        for _ in range(2):  # checked, then hot (the record of the strided call compares strides)
            check_close(*_decode(*args, table, plan), *ref, F16)
        assert counts == {"checked": 1, "hot": 1}
        check_close(*_decode(q, k, v, table, plan), *want, F16)  # contiguous again: checked
        assert counts == {"checked": 2, "hot": 1}
    wide = cp.full((3, 40, 128), np.nan, dtype=cp.float16)
    counts.update(checked=0, hot=0)
    res, lse = cupaged.decode(q, k, v, table, plan, out=wide[:, 4:36], return_lse=True)
    check_close(res.get().astype(np.float64), lse.get().astype(np.float64), *want, F16)
    assert counts == {"checked": 1, "hot": 0}


@pytest.mark.parametrize("arg", ["qo_indptr", "window_left"])
def test_host_arrays_that_shape_the_table(arg, monkeypatch):
    """A NumPy ``qo_indptr`` or per-request ``window_left`` is recorded by
    content: a repeat (or an equal new array) is hot; the same array changed
    in place is checked again, so it is never launched with the recorded
    call's table (here its plan no longer fits: refused, or right)."""
    cp = _cp()
    rng = np.random.default_rng(80)
    dev, table, host = batch(81, [300, 41, 1700, 16], mid_page=True)
    _, k, v = dev
    if arg == "qo_indptr":
        value = np.array([0, 2, 3, 7, 8], dtype=np.int32)  # q_len 2, 1, 4, 1
        q_h = make_query(rng, 8, 32, 128, F16)
    else:
        value = np.array([50, -1, 200, 3])
        q_h = host[0]
    q = cp.asarray(q_h)
    plan = cupaged.plan_decode(table, 32, 8, 128, F16, **{arg: value})
    counts = _count_launches(monkeypatch)
    want = reference.decode(q_h, *host[1:], table, **{arg: value})
    for given in (value, value, value.copy()):
        check_close(*_decode(q, k, v, table, plan, **{arg: given}), *want, F16)
    assert counts == {"checked": 1, "hot": 2}
    if arg == "qo_indptr":
        value[1:] = [1, 3, 7, 8]  # q_len 1, 2, 4, 1: the same rows, other tokens
    else:
        value[0] = 20
    try:
        got = _decode(q, k, v, table, plan, **{arg: value})
    except cupaged.PlanMismatchError:
        pass
    else:
        check_close(*got, *reference.decode(q_h, *host[1:], table, **{arg: value}), F16)
    assert counts["hot"] == 2
    plan = cupaged.plan_decode(table, 32, 8, 128, F16, **{arg: value})
    want = reference.decode(q_h, *host[1:], table, **{arg: value})
    for _ in range(2):
        check_close(*_decode(q, k, v, table, plan, **{arg: value}), *want, F16)
    assert counts["hot"] == 3
