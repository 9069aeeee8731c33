"""pytest-benchmark suite of cupaged.decode (methods v2, v1, gather).

    python3 -m pytest -m gpu --benchmark-only tests/bench --benchmark-json=bench.json

Representative shapes: fp16, 32 query / 8 KV heads, head_dim 128, page 16,
physical pages in random order out of a pool with 2x slack
(:func:`cupaged.testing.make_paged_batch`). The plan is built outside the
timed function. Two kinds of test per (shape, method):

* ``test_decode_gpu_time``: GPU time as a server sees it. The decode is
  captured 20 times into a CUDA graph (:func:`cupaged.testing.benchmark_graph`);
  pytest-benchmark times synchronized replays of the graph (so its statistics
  are per 20 calls), and ``extra_info`` carries ``gpu_us`` (µs per call from
  CUDA events), ``tbps`` and ``pct_roofline`` (of 4.6 TB/s), from the bytes of
  the visible K and V.
* ``test_decode_wall_time``: one Python call plus a stream synchronize per
  round: host overhead plus GPU time (what a loop without graphs sees).

Time your own shapes the same way with :mod:`cupaged.testing` (docs/api.md).
Skips cleanly without a GPU: the check runs in a fixture (test setup), never
at import, and nothing here touches the device at collection time.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_benchmark")

pytestmark = pytest.mark.gpu

# (batch, ctx) cells; the other parameters are fixed below
SHAPES = ((1, 16384), (8, 4096), (32, 4096))
METHODS = ("v2", "v1", "gather")
GRAPH_METHODS = ("v2", "v1")  # gather calls cuBLAS, which CuPy cannot capture into a graph
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 16, "float16"


def _free_gpu_memory(cupy) -> None:
    cupy.cuda.get_current_stream().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


@pytest.fixture(scope="module")
def gpu():
    import cupaged

    if not cupaged.has_gpu():
        pytest.skip("no CUDA GPU on this machine")
    import cupy

    yield cupy
    _free_gpu_memory(cupy)


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"b{s[0]}-ctx{s[1]}")
def decode_case(request, gpu):
    import cupaged
    from cupaged import testing

    batch_size, ctx = request.param
    batch = testing.make_paged_batch([ctx] * batch_size, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE,
                                     page_size=PAGE_SIZE, seed=0)
    plan = cupaged.plan_decode(batch.table, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, batch.dtype)
    yield batch, plan, ctx
    del batch, plan
    _free_gpu_memory(gpu)


def _extra_info(benchmark, batch, plan, ctx, method):
    benchmark.extra_info.update(
        batch=batch.table.batch_size,
        ctx=ctx,
        method=method,
        kv_bytes=batch.kv_bytes,
        pages_per_chunk=int(plan.pages_per_chunk),
        num_chunks=int(plan.num_chunks),
        needs_merge=bool(plan.needs_merge),
    )


@pytest.mark.parametrize("method", GRAPH_METHODS)
def test_decode_gpu_time(benchmark, decode_case, method, gpu):
    import cupaged
    from cupaged import testing

    batch, plan, ctx = decode_case
    out = gpu.empty_like(batch.q)
    _extra_info(benchmark, batch, plan, ctx, method)
    us = testing.benchmark_graph(
        benchmark,
        lambda: cupaged.decode(batch.q, batch.k_cache, batch.v_cache, batch.table, plan, method=method, out=out),
        num_bytes=batch.kv_bytes)
    assert us > 0 and 0 < benchmark.extra_info["pct_roofline"] < 110
    assert bool(gpu.isfinite(out).all())


@pytest.mark.parametrize("method", METHODS)
def test_decode_wall_time(benchmark, decode_case, method, gpu):
    import cupaged

    batch, plan, ctx = decode_case
    out = gpu.empty_like(batch.q)
    stream = gpu.cuda.get_current_stream()

    def call():
        cupaged.decode(batch.q, batch.k_cache, batch.v_cache, batch.table, plan, method=method, out=out)
        stream.synchronize()

    call()  # compile and cache the device table outside the timing
    _extra_info(benchmark, batch, plan, ctx, method)
    benchmark(call)
    assert bool(gpu.isfinite(out).all())
