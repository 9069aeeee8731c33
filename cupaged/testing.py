"""Helpers to test and benchmark cupaged on your own shapes.

* :func:`make_paged_batch`: a random paged batch (page table with shuffled
  physical pages out of a pool with slack, K/V caches, ``q``) for given
  sequence lengths, heads, head_dim, dtype, page size and seed; on the GPU
  (CuPy) or on the host (NumPy, for :mod:`cupaged.reference`).
* :func:`graph_time_us` and :class:`GraphTimer`: GPU time of a callable
  under CUDA-graph replay, timed with CUDA events (what a server that
  replays graphs sees; a Python loop of launches would time the host).
* :func:`benchmark_graph`: the same inside ``pytest-benchmark``: the
  benchmarked callable is one graph replay, and ``benchmark.extra_info``
  carries the GPU time per call, TB/s and the share of the roofline.
* :func:`kv_bytes`, :func:`decode_bytes`, :func:`bandwidth` and
  :data:`ROOFLINE_BPS`: the bytes a decode must move and what they give.

Nothing here touches the GPU at import; the GPU functions raise
:class:`~cupaged.errors.NoGPUError` without one.

Example (needs a GPU)::

    import cupaged
    from cupaged import testing

    batch = testing.make_paged_batch([4096] * 8, 32, 8, 128, "float16", page_size=16, seed=0)
    plan = cupaged.plan_decode(batch.table, 32, 8, 128, batch.dtype)
    out = batch.q.copy()
    us = testing.graph_time_us(lambda: cupaged.decode(batch.q, batch.k_cache, batch.v_cache,
                                                      batch.table, plan, out=out))
    tbps, pct = testing.bandwidth(batch.kv_bytes, us)   # TB/s and % of 4.6 TB/s
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

from ._device import require_gpu
from .errors import DTypeError, InvalidArgumentError
from .page_table import PageTable

__all__ = [
    "ROOFLINE_BPS",
    "PagedBatch",
    "make_paged_batch",
    "fill_random",
    "kv_bytes",
    "decode_bytes",
    "bandwidth",
    "GraphTimer",
    "graph_time_us",
    "benchmark_graph",
]

#: Read roofline of the H200 in bytes/s (4.6 TB/s, docs/benchmarks/): the
#: denominator of every "% of roofline".
ROOFLINE_BPS = 4.6e12

# Random fill on the GPU is generated in float32 chunks of this many elements,
# so a multi-GiB cache never needs a float32 temporary of its full size.
FILL_CHUNK = 1 << 26  # elements per random-fill step (bounds the float32 temporary)


# ------------------------------------------------------------------- bytes
def kv_bytes(total_tokens: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of every visible K and V element, read once.

    >>> kv_bytes(1000, 8, 128, 2)   # 1000 tokens, 8 kv heads, head_dim 128, fp16
    4096000
    """
    return 2 * int(total_tokens) * int(num_kv_heads) * int(head_dim) * int(itemsize)


def decode_bytes(total_tokens: int, total_pages: int, batch_size: int, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, itemsize: int) -> int:
    """Bytes one decode must move: visible K and V once, ``q`` read and
    ``out`` written, and the int32 page table (indices, indptr,
    last_page_len, first_page_offset).

    >>> decode_bytes(1000, 63, 1, 32, 8, 128, 2) - kv_bytes(1000, 8, 128, 2)   # q + out + table
    16652
    """
    qo = 2 * int(batch_size) * int(num_qo_heads) * int(head_dim) * int(itemsize)
    table = 4 * (int(total_pages) + 3 * int(batch_size) + 1)
    return kv_bytes(total_tokens, num_kv_heads, head_dim, itemsize) + qo + table


def bandwidth(num_bytes: float, us: float, roofline_bps: float = ROOFLINE_BPS) -> tuple[float, float]:
    """``(TB/s, % of the roofline)`` of moving ``num_bytes`` in ``us`` µs.

    >>> bandwidth(4.6e6, 1.0)   # 4.6 MB in 1 µs: the H200 roofline
    (4.6, 100.0)
    """
    bps = float(num_bytes) / (float(us) * 1e-6)
    return bps / 1e12, 100.0 * bps / roofline_bps


# ------------------------------------------------------------------- batch
@dataclass
class PagedBatch:
    """A random paged batch from :func:`make_paged_batch`.

    Fields: ``table`` (:class:`~cupaged.PageTable`), ``q [B, Hq, D]``,
    ``k_cache``, ``v_cache`` ``[num_pages, page_size, Hkv, D]`` (NHD; CuPy
    arrays, or NumPy with ``device=False``), ``num_pages`` (the pool size:
    ``slack`` times the pages in use), ``num_qo_heads``, ``num_kv_heads``,
    ``head_dim``, ``dtype`` (``np.dtype``). Properties: ``kv_bytes`` and
    ``decode_bytes`` (see the functions of those names).
    """

    table: PageTable
    q: Any
    k_cache: Any
    v_cache: Any
    num_pages: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype

    @property
    def kv_bytes(self) -> int:
        """Bytes of the visible K and V, read once."""
        return kv_bytes(int(self.table.seq_lens.sum()), self.num_kv_heads, self.head_dim, self.dtype.itemsize)

    @property
    def decode_bytes(self) -> int:
        """Bytes one decode of this batch moves (K/V, q, out, table)."""
        t = self.table
        return decode_bytes(int(t.seq_lens.sum()), int(t.indptr[-1]), t.batch_size, self.num_qo_heads,
                            self.num_kv_heads, self.head_dim, self.dtype.itemsize)


_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))


def _dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)  # "bfloat16" too: importing ml_dtypes registers it
    except TypeError:
        dt = None
    if dt not in _DTYPES:
        raise DTypeError(f"dtype must be float16, bfloat16 or float32, got {dtype!r}")
    return dt


def fill_random(shape: Sequence[int], dtype: Any, rs) -> Any:
    """A CuPy array of ``shape`` and ``dtype`` with standard normal values
    drawn in float32 on the GPU by ``rs`` (a ``cupy.random.RandomState``),
    in chunks (no full-size float32 temporary)."""
    import cupy

    out = cupy.empty(tuple(shape), dtype=dtype)
    flat = out.reshape(-1)
    n = flat.size
    for start in range(0, n, FILL_CHUNK):
        stop = min(n, start + FILL_CHUNK)
        flat[start:stop] = rs.standard_normal(stop - start, dtype=cupy.float32).astype(dtype)
    return out


def make_paged_batch(seq_lens: Sequence[int], num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: Any = "float16", *, page_size: int = 16, seed: int = 0,
                     first_page_offset: Sequence[int] | None = None, slack: int = 2,
                     device: bool = True) -> PagedBatch:
    """A random paged batch for benchmarks and tests.

    Request ``i`` sees ``seq_lens[i]`` tokens starting at entry
    ``first_page_offset[i]`` (default 0) of its first page. Its pages are
    distinct physical ids drawn at random (NumPy ``default_rng(seed)``) out
    of a pool of ``slack`` times the pages in use, so a kernel that ignored
    the table would read the wrong pages. ``q`` and both caches hold
    standard normal values drawn in float32 and rounded to ``dtype``; the
    slack pages hold random values too.

    Args:
        seq_lens: visible tokens per request (``>= 0``; 0 is an empty request).
        num_qo_heads, num_kv_heads, head_dim: the attention shape
            (``num_qo_heads`` a multiple of ``num_kv_heads``).
        dtype: ``"float16"`` (default), ``"bfloat16"`` or ``"float32"`` (or
            the NumPy / ml_dtypes dtype).
        page_size: tokens per page (default 16).
        seed: the seed of the page ids and of the values.
        first_page_offset: per request, where its first visible token sits
            in its first page (``[0, page_size)``); default all 0.
        slack: pool size over pages in use (``>= 1``; default 2).
        device: True (default): CuPy arrays on the current GPU (values drawn
            there by ``cupy.random.RandomState(seed)``); False: NumPy arrays
            (values by ``numpy.random.default_rng(seed)``), e.g. for
            :mod:`cupaged.reference`.

    Returns:
        A :class:`PagedBatch`.

    Raises:
        InvalidArgumentError (``slack < 1``, heads or head_dim ``< 1``, heads
        not divisible), DTypeError (another dtype), PageTableError (bad
        lengths or offsets, from :meth:`PageTable.from_seq_lens`),
        NoGPUError (``device=True`` without a GPU).

    Example (on the host):

    >>> import numpy as np
    >>> from cupaged import reference, testing
    >>> b = testing.make_paged_batch([100, 1, 37], 8, 2, 64, "float16", page_size=16, seed=1, device=False)
    >>> b.table.request_pages.tolist(), b.num_pages, b.k_cache.shape, b.q.dtype
    ([7, 1, 3], 22, (22, 16, 2, 64), dtype('float16'))
    >>> out, lse = reference.decode(b.q, b.k_cache, b.v_cache, b.table)
    """
    if not isinstance(slack, (int, np.integer)) or slack < 1:
        raise InvalidArgumentError(f"slack must be an int >= 1, got {slack!r}")
    hq, hkv, d = int(num_qo_heads), int(num_kv_heads), int(head_dim)
    if min(hq, hkv, d) < 1 or hq % hkv:
        raise InvalidArgumentError(
            f"num_qo_heads ({hq}), num_kv_heads ({hkv}) and head_dim ({d}) must be >= 1, "
            "and num_qo_heads a multiple of num_kv_heads")
    dt = _dtype(dtype)
    lens = PageTable.from_seq_lens(seq_lens, page_size, first_page_offset)  # validates the geometry
    total = int(lens.indptr[-1])
    num_pages = max(1, int(slack) * total)
    rng = np.random.default_rng(seed)
    ids = rng.permutation(num_pages)[:total]
    table = PageTable.from_seq_lens(seq_lens, page_size, first_page_offset, page_ids=ids)
    cache_shape = (num_pages, int(page_size), hkv, d)
    q_shape = (table.batch_size, hq, d)
    if device:
        require_gpu("cupaged.testing.make_paged_batch(device=True)")
        import cupy

        rs = cupy.random.RandomState(seed)
        k, v = fill_random(cache_shape, dt, rs), fill_random(cache_shape, dt, rs)
        q = fill_random(q_shape, dt, rs)
    else:
        k, v, q = (rng.standard_normal(s, dtype=np.float32).astype(dt) for s in (cache_shape, cache_shape, q_shape))
    return PagedBatch(table, q, k, v, num_pages, hq, hkv, d, dt)


# ------------------------------------------------------------------- timing
class GraphTimer:
    """``fn`` captured ``launches`` times into one CUDA graph, replayed on
    demand.

    On construction, on a fresh non-blocking stream (current while ``fn``
    runs): one warm-up call outside capture (compiles kernels, uploads
    tables and workspaces), then ``launches`` calls captured into one graph,
    replayed once untimed. :meth:`replay` launches the graph and waits for
    it; :meth:`time_us` times replays between CUDA events.

    ``fn`` must be capturable: no synchronization or host transfers, and
    preallocated outputs (pass ``out=`` to :func:`cupaged.decode`). The
    timer keeps ``fn`` (attribute ``fn``), and with it what its calls use.
    Raises :class:`~cupaged.errors.NoGPUError` without a GPU; CuPy's errors
    for work that cannot be captured.

    Example (needs a GPU)::

        timer = testing.GraphTimer(lambda: cupaged.decode(q, k, v, table, plan, out=out))
        timer.time_us()   # median µs per decode
        timer.replay()    # one replay of 20 decodes, synchronized
    """

    def __init__(self, fn: Callable[[], Any], launches: int = 20):
        require_gpu("cupaged.testing.GraphTimer")
        import cupy

        if not isinstance(launches, (int, np.integer)) or launches < 1:
            raise InvalidArgumentError(f"launches must be an int >= 1, got {launches!r}")
        self.launches = int(launches)
        # The graph replays the buffers fn's calls reached (a decode plan's launch
        # state: its image, workspace and counters; out): holding fn holds them, so
        # a closure over its own plan stays valid as long as the timer.
        self.fn = fn
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            fn()  # warm-up outside capture: compiles, uploads tables and workspaces
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                for _ in range(self.launches):
                    fn()
            except BaseException:
                self.stream.end_capture()  # leave capture: the stream (and later work) stays usable
                raise
            self.graph = self.stream.end_capture()
        self.graph.launch(self.stream)
        self.stream.synchronize()

    def replay(self) -> None:
        """Launch the graph (``launches`` calls of ``fn``) and wait for it."""
        self.graph.launch(self.stream)
        self.stream.synchronize()

    def time_us(self, reps: int = 5) -> float:
        """Median over ``reps`` replays of (elapsed GPU time / ``launches``),
        in µs per ``fn()`` call, from CUDA events around each replay."""
        import cupy

        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(max(1, int(reps))):
            start.record(self.stream)
            self.graph.launch(self.stream)
            stop.record(self.stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / self.launches)
        return statistics.median(times)


def graph_time_us(fn: Callable[[], Any], launches: int = 20, reps: int = 5) -> float:
    """Median GPU time of one ``fn()`` call under CUDA-graph replay, in µs.

    ``GraphTimer(fn, launches).time_us(reps)``: one warm-up call outside
    capture, ``launches`` calls captured into one graph, one untimed replay,
    then ``reps`` replays between CUDA events; the median of (elapsed /
    ``launches``).

    Args:
        fn: a callable of no arguments that enqueues GPU work on the current
            stream and is capturable (no synchronization or host transfers;
            pass ``out=`` to :func:`cupaged.decode`).
        launches: calls captured per graph (default 20).
        reps: timed replays (default 5).

    Returns:
        ``float``, microseconds per ``fn()`` call.

    Raises:
        NoGPUError without a GPU; whatever ``fn`` raises, and CuPy's errors
        for work that cannot be captured.

    Example (needs a GPU)::

        plan = cupaged.plan_decode(table, 32, 8, 128, "float16")
        out = cupy.empty_like(q)
        us = testing.graph_time_us(lambda: cupaged.decode(q, k_cache, v_cache, table, plan, out=out))
    """
    return GraphTimer(fn, launches).time_us(reps)


def benchmark_graph(benchmark, fn: Callable[[], Any], *, num_bytes: int | None = None, launches: int = 20,
                    reps: int = 5, rounds: int = 20) -> float:
    """GPU time of ``fn`` inside a ``pytest-benchmark`` test.

    Captures ``fn`` into a :class:`GraphTimer`, measures the GPU time per
    call with CUDA events (``reps`` replays), then lets ``benchmark`` time
    ``rounds`` synchronized replays (``benchmark.pedantic``). So the
    pytest-benchmark statistics are the wall time of **one replay of
    ``launches`` calls** (GPU time plus one launch and one sync, no Python
    per call), and ``benchmark.extra_info`` gets ``gpu_us`` (µs per call,
    CUDA events), ``launches_per_round``, and with ``num_bytes`` (e.g.
    :attr:`PagedBatch.kv_bytes`) ``tbps`` and ``pct_roofline`` (of
    :data:`ROOFLINE_BPS`, 4.6 TB/s).

    Returns ``gpu_us``. Raises :class:`~cupaged.errors.NoGPUError` without a
    GPU.

    Example (a pytest-benchmark test; needs a GPU)::

        def test_my_shape(benchmark):
            batch = testing.make_paged_batch([8192] * 4, 32, 8, 128, "bfloat16")
            plan = cupaged.plan_decode(batch.table, 32, 8, 128, batch.dtype)
            out = batch.q.copy()
            testing.benchmark_graph(benchmark, lambda: cupaged.decode(
                batch.q, batch.k_cache, batch.v_cache, batch.table, plan, out=out), num_bytes=batch.kv_bytes)
    """
    timer = GraphTimer(fn, launches)
    us = timer.time_us(reps)
    info = {"gpu_us": us, "launches_per_round": timer.launches, "roofline_tbps": ROOFLINE_BPS / 1e12}
    if num_bytes is not None:
        tbps, pct = bandwidth(num_bytes, us)
        info.update(num_bytes=int(num_bytes), tbps=tbps, pct_roofline=pct)
    benchmark.extra_info.update(info)
    benchmark.pedantic(timer.replay, rounds=rounds, iterations=1, warmup_rounds=1)
    return us
