"""cupaged.testing (issue 16, item 10): the paged-batch factory on the host,
the byte and bandwidth helpers, the GPU timers' no-GPU behaviour; on a GPU
(marker ``gpu``) the device batch against the reference and the timers."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import cupaged
import cupaged.autotune
from cupaged import reference, testing
from cupaged.errors import DTypeError, InvalidArgumentError, NoGPUError, PageTableError

from helpers import check_close

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------- host batch
def test_host_batch_is_a_shuffled_paged_batch():
    lens, off = [100, 0, 1, 17, 64], [3, 0, 15, 0, 0]
    b = testing.make_paged_batch(lens, 8, 2, 64, "bfloat16", page_size=16, seed=7, first_page_offset=off,
                                 device=False)
    t = b.table
    assert t.seq_lens.tolist() == lens and t.first_page_offset.tolist() == off
    assert t.request_pages.tolist() == [7, 0, 1, 2, 4]
    total = int(t.indptr[-1])
    assert b.num_pages == 2 * total and b.k_cache.shape == b.v_cache.shape == (2 * total, 16, 2, 64)
    ids = t.indices.tolist()
    assert len(set(ids)) == total and max(ids) < b.num_pages
    assert ids != sorted(ids)  # shuffled, not 0, 1, 2, ...
    assert b.q.shape == (5, 8, 64) and b.dtype == np.dtype(ml_dtypes.bfloat16)
    assert all(a.dtype == b.dtype for a in (b.q, b.k_cache, b.v_cache))
    assert all(np.isfinite(a.astype(np.float32)).all() for a in (b.q, b.k_cache, b.v_cache))
    again = testing.make_paged_batch(lens, 8, 2, 64, "bfloat16", page_size=16, seed=7, first_page_offset=off,
                                     device=False)
    other = testing.make_paged_batch(lens, 8, 2, 64, "bfloat16", page_size=16, seed=8, first_page_offset=off,
                                     device=False)
    assert again.table.indices.tolist() == ids and np.array_equal(again.k_cache, b.k_cache)
    assert other.table.indices.tolist() != ids
    out, lse = reference.decode(b.q, b.k_cache, b.v_cache, t)
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()  # the empty request


def test_host_batch_bytes():
    b = testing.make_paged_batch([100, 37], 32, 8, 128, np.float16, device=False)
    assert b.kv_bytes == testing.kv_bytes(137, 8, 128, 2) == 2 * 137 * 8 * 128 * 2
    pages = int(b.table.indptr[-1])
    assert b.decode_bytes == b.kv_bytes + 2 * 2 * 32 * 128 * 2 + 4 * (pages + 3 * 2 + 1)
    tbps, pct = testing.bandwidth(b.kv_bytes, 1.0)
    assert tbps == pytest.approx(b.kv_bytes / 1e6) and pct == pytest.approx(100 * tbps / 4.6)


def test_scripts_share_the_helpers():
    """scripts/_common and the autotuner use cupaged.testing's pieces."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        common = importlib.import_module("_common")
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert common.fill_random is testing.fill_random and common.ROOFLINE_BPS == testing.ROOFLINE_BPS
    lay = common.plan_layout(4, 1000, 16, seed=0)
    assert common.decode_bytes(lay, 32, 8, 128, 2) == testing.decode_bytes(
        lay.total_tokens, lay.total_pages, lay.batch_size, 32, 8, 128, 2)
    assert cupaged.autotune.graph_time_us is testing.graph_time_us


@pytest.mark.parametrize("kwargs, cls, match", [
    (dict(slack=0), InvalidArgumentError, "slack"),
    (dict(dtype="float64"), DTypeError, "float16, bfloat16 or float32"),
    (dict(dtype="int8"), DTypeError, "float16, bfloat16 or float32"),
    (dict(num_qo_heads=6), InvalidArgumentError, "multiple of num_kv_heads"),
    (dict(head_dim=0), InvalidArgumentError, ">= 1"),
    (dict(first_page_offset=[16]), PageTableError, "first_page_offset"),
    (dict(seq_lens=[-1]), PageTableError, "seq_len"),
])
def test_bad_arguments(kwargs, cls, match):
    args = dict(seq_lens=[10], num_qo_heads=8, num_kv_heads=4, head_dim=64, dtype="float16", device=False)
    args.update(kwargs)
    with pytest.raises(cls, match=match):
        testing.make_paged_batch(**args)


@pytest.mark.skipif(cupaged.has_gpu(), reason="checks the no-GPU behaviour")
def test_gpu_helpers_without_a_gpu_raise_no_gpu_error():
    calls = []
    with pytest.raises(NoGPUError, match="make_paged_batch"):
        testing.make_paged_batch([10], 8, 4, 64)
    with pytest.raises(NoGPUError):
        testing.graph_time_us(lambda: calls.append(1))
    with pytest.raises(NoGPUError):
        testing.GraphTimer(lambda: calls.append(1))
    bench = SimpleNamespace(extra_info={}, pedantic=lambda *a, **k: calls.append(2))
    with pytest.raises(NoGPUError):
        testing.benchmark_graph(bench, lambda: calls.append(1))
    assert calls == [] and bench.extra_info == {}


# ------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_device_batch_decodes_like_the_reference(dtype):
    import cupy

    b = testing.make_paged_batch([1, 15, 16, 17, 257, 0], 16, 4, 128, dtype, page_size=16, seed=3,
                                 first_page_offset=[0, 1, 0, 15, 7, 0])
    assert all(isinstance(a, cupy.ndarray) for a in (b.q, b.k_cache, b.v_cache))
    assert b.k_cache.shape == (b.num_pages, 16, 4, 128) and b.q.dtype == b.dtype
    plan = cupaged.plan_decode(b.table, 16, 4, 128, b.dtype)
    out, lse = cupaged.decode(b.q, b.k_cache, b.v_cache, b.table, plan, return_lse=True)
    ref, ref_lse = reference.decode(b.q, b.k_cache, b.v_cache, b.table)
    check_close(out.get(), lse.get(), ref, ref_lse, b.dtype)


@pytest.mark.gpu
def test_graph_timer_times_and_replays_decode():
    import cupy

    b = testing.make_paged_batch([4096] * 4, 32, 8, 128, "float16", seed=0)
    plan = cupaged.plan_decode(b.table, 32, 8, 128, b.dtype)
    out = cupy.full(b.q.shape, np.nan, dtype=b.q.dtype)

    def call():
        cupaged.decode(b.q, b.k_cache, b.v_cache, b.table, plan, out=out)

    timer = testing.GraphTimer(call, launches=10)
    us = timer.time_us(reps=3)
    assert 0 < us < 10_000
    out.fill(np.nan)
    timer.replay()  # the graph writes out again
    assert bool(cupy.isfinite(out).all())
    assert 0 < testing.graph_time_us(call, launches=5, reps=2) < 10_000


@pytest.mark.gpu
def test_graph_timer_keeps_what_its_calls_use():
    # A graph replays the buffers its captured calls reached: here the plan's
    # launch state (image, workspace, counters), owned by a plan only the
    # closure holds. The timer must hold the closure; it did not (2026-12-04),
    # and a replay after CuPy's pool returned its free blocks to the driver
    # read freed memory (an illegal address).
    import gc
    import weakref

    import cupy

    b = testing.make_paged_batch([4096, 1000, 33], 32, 8, 128, "float16", seed=4)

    def build():
        plan = cupaged.plan_decode(b.table, 32, 8, 128, b.dtype)
        out = cupy.empty_like(b.q)
        lse = cupy.empty(b.q.shape[:2], dtype=cupy.float32)
        timer = testing.GraphTimer(lambda: cupaged.decode(b.q, b.k_cache, b.v_cache, b.table, plan, out=out,
                                                          lse=lse, return_lse=True), launches=2)
        return timer, out, lse, weakref.ref(plan)

    timer, out, lse, plan_ref = build()
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    assert plan_ref() is not None
    out.fill(np.nan)
    lse.fill(np.nan)
    timer.replay()
    ref, ref_lse = reference.decode(b.q, b.k_cache, b.v_cache, b.table)
    check_close(out.get(), lse.get(), ref, ref_lse, b.dtype)


@pytest.mark.gpu
def test_graph_timer_leaves_capture_when_the_call_raises():
    # gather calls cuBLAS, which cannot be captured: the timer must end the
    # capture it began, or every later CUDA call in the process fails
    import cupy

    b = testing.make_paged_batch([64, 40], 8, 2, 64, "float16", seed=2)
    plan = cupaged.plan_decode(b.table, 8, 2, 64, b.dtype)
    out = cupy.empty_like(b.q)
    with pytest.raises(Exception):
        testing.GraphTimer(lambda: cupaged.decode(b.q, b.k_cache, b.v_cache, b.table, plan, method="gather",
                                                  out=out), launches=2)
    cupy.cuda.runtime.deviceSynchronize()
    assert float(cupy.arange(4).sum()) == 6.0  # the device still runs work


@pytest.mark.gpu
def test_benchmark_graph_fills_extra_info():
    import cupy

    b = testing.make_paged_batch([8192] * 2, 32, 8, 128, "bfloat16", seed=1)
    plan = cupaged.plan_decode(b.table, 32, 8, 128, b.dtype)
    out = cupy.empty_like(b.q)
    seen = []

    def pedantic(fn, rounds, iterations, warmup_rounds):  # pytest-benchmark's signature, no timing
        seen.append((rounds, iterations, warmup_rounds))
        for _ in range(rounds + warmup_rounds):
            fn()

    bench = SimpleNamespace(extra_info={}, pedantic=pedantic)
    us = testing.benchmark_graph(bench, lambda: cupaged.decode(b.q, b.k_cache, b.v_cache, b.table, plan, out=out),
                                 num_bytes=b.kv_bytes, rounds=3)
    assert seen == [(3, 1, 1)]
    info = bench.extra_info
    assert info["gpu_us"] == us > 0 and info["launches_per_round"] == 20 and info["num_bytes"] == b.kv_bytes
    assert info["tbps"] == pytest.approx(b.kv_bytes / us / 1e6)
    assert info["pct_roofline"] == pytest.approx(100 * info["tbps"] / 4.6) and 0 < info["pct_roofline"] < 110
