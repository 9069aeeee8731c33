"""pytest-benchmark suite of cupaged.decode (methods v2, v1, gather).

    PYTHONPATH=$PWD python3 -m pytest -m gpu --benchmark-only tests/bench \
        --benchmark-json=bench.json

Representative shapes: fp16, 32 query / 8 KV heads, head_dim 128, page 16,
random physical page order out of a pool with 2x slack, first_page_offset 0.
The plan is built outside the timed function; the timed function launches one
decode and synchronizes the stream, so each round is one call's wall time
(host overhead + GPU time). ``scripts/microbench.py`` is the tool for GPU time
under CUDA-graph replay and TB/s.

Skips cleanly without a GPU: the check runs in a fixture (test setup), never
at import, and nothing here touches the device at collection time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import _common  # noqa: E402

pytestmark = pytest.mark.gpu

# (batch, ctx) cells; the other parameters are fixed below
SHAPES = ((1, 16384), (8, 4096), (32, 4096))
METHODS = ("v2", "v1", "gather")
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 16, "float16"


@pytest.fixture(scope="module")
def gpu():
    if not _common.has_gpu():
        pytest.skip("no CUDA GPU on this machine")
    import cupy

    yield cupy
    _common.free_gpu_memory()


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"b{s[0]}-ctx{s[1]}")
def decode_case(request, gpu):
    import cupaged

    batch_size, ctx = request.param
    dtype = _common.resolve_dtype(DTYPE)
    layout = _common.plan_layout(batch_size, ctx, PAGE_SIZE, seed=0, mid_page=False, page_order="random")
    batch = _common.make_device_batch(layout, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype, seed=0)
    plan = cupaged.plan_decode(batch.table, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype)
    yield batch, plan, ctx
    del batch, plan
    _common.free_gpu_memory()


@pytest.mark.parametrize("method", METHODS)
def test_decode(benchmark, decode_case, method, gpu):
    import cupaged

    batch, plan, ctx = decode_case
    out = gpu.empty_like(batch.q)
    stream = gpu.cuda.get_current_stream()

    def call():
        cupaged.decode(batch.q, batch.k_cache, batch.v_cache, batch.table, plan, method=method, out=out)
        stream.synchronize()

    call()  # compile and cache the device table outside the timing
    benchmark.extra_info.update(
        batch=batch.layout.batch_size,
        ctx=ctx,
        method=method,
        kv_bytes=_common.kv_bytes(batch.layout, NUM_KV_HEADS, HEAD_DIM, batch.dtype.itemsize),
        pages_per_chunk=int(plan.pages_per_chunk),
        num_chunks=int(plan.num_chunks),
        needs_merge=bool(plan.needs_merge),
    )
    benchmark(call)
    assert bool(gpu.isfinite(out).all())
