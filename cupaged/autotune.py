"""Autotuner for the split size ``pages_per_chunk``.

Enumerates the feasible chunk sizes (powers of two up to the longest request,
plus the heuristic's choice so the default is measured too), times real v2
launches under CUDA-graph replay (what a server sees; plain back-to-back
launches of a small cell would time the Python host path instead), and caches
the winner on disk per (device, dtype, head_dim, GQA group, page size,
bucketed batch, bucketed context).

The cache is a JSON file, ``$CUPAGED_CACHE_DIR/autotune.json`` (default
``~/.cache/cupaged``); delete it to re-tune.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from . import _configs, _env
from .page_table import PageTable
from .plan import DecodePlan, plan_decode
from .testing import graph_time_us  # re-exported: the timer lives in cupaged.testing

__all__ = ["bucket", "candidates", "cache_key", "graph_time_us", "TuneResult", "tune", "tuned_plan"]

ENV_CACHE_DIR = _env.CACHE_DIR


def bucket(n: int) -> int:
    """Next power of two >= n (the batch/context buckets of the cache key).

    >>> [bucket(n) for n in (1, 3, 4, 1000, 1024)]
    [1, 4, 4, 1024, 1024]
    """
    return 1 << max(0, int(n) - 1).bit_length()


def candidates(table: PageTable, heuristic: int) -> list[int]:
    """Powers of two from 1 to the longest request's page count, plus ``heuristic``.

    >>> from cupaged import PageTable
    >>> candidates(PageTable.from_seq_lens([100, 40], 16), 3)
    [1, 2, 3, 4, 7]
    """
    longest = max(1, int(table.request_pages.max(initial=1)))
    sizes = {1 << i for i in range(longest.bit_length()) if 1 << i <= longest}
    return sorted(sizes | {longest, int(heuristic)})


def cache_key(device_name: str, dtype, head_dim: int, group_size: int, table: PageTable, kv_dtype=None) -> str:
    """Key of the on-disk cache: device, dtype (``<q>+float8_e4m3fn`` for an
    fp8 cache: ``kv_dtype`` uint8 or float8_e4m3fn), head_dim, GQA group,
    page size, bucketed batch and bucketed longest request, joined by ``|``.

    Raises ``ValueError`` for a dtype other than float16, bfloat16 or float32.

    >>> import numpy as np
    >>> from cupaged import PageTable
    >>> cache_key("NVIDIA H200", np.float16, 128, 4, PageTable.from_seq_lens([1000, 40], 16))
    'NVIDIA H200|float16|128|4|16|2|1024'
    """
    name = _configs.dtype_name(dtype)
    if kv_dtype is not None and _fp8(kv_dtype):
        name = _configs.variant(name, _configs.FP8)
    return "|".join(map(str, (device_name, name, head_dim, group_size, table.page_size,
                              bucket(table.batch_size), bucket(int(table.seq_lens.max(initial=1))))))


def _fp8(kv_dtype) -> bool:
    return np.dtype(kv_dtype) in (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn))


def _kv_dtype(q, k_cache):
    """plan_decode's kv_dtype for these arrays: fp8 for uint8 caches, else None."""
    return _configs.FP8 if k_cache.dtype == np.uint8 and q.dtype != np.uint8 else None


def _cache_path() -> Path:
    return _env.cache_dir() / "autotune.json"


def _load_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store(key: str, value: int) -> None:
    path = _cache_path()
    cache = _load_cache()
    cache[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: concurrent tuners never see half a file


@dataclass(frozen=True)
class TuneResult:
    """What :func:`tune` measured (a frozen dataclass).

    Fields:

    * ``key`` (``str``): the :func:`cache_key` of the tuned shape bucket.
    * ``best`` (``int``): the fastest ``pages_per_chunk``.
    * ``heuristic`` (``int``): the ``pages_per_chunk`` that
      :func:`~cupaged.plan_decode` picks by default, for comparison.
    * ``timings_us`` (``dict[int, float]``): µs per decode for every
      candidate ``pages_per_chunk``.

    Example (needs a GPU)::

        result = autotune.tune(q, k_cache, v_cache, table, store=False)
        result.timings_us[result.best] <= result.timings_us[result.heuristic]   # True
    """

    key: str
    best: int  # pages_per_chunk
    heuristic: int
    timings_us: dict  # pages_per_chunk -> µs per decode


def tune(q, k_cache, v_cache, table: PageTable, *, store: bool = True, kv_layout: str = "NHD") -> TuneResult:
    """Times every candidate chunk size on these tensors and returns the best.

    Each candidate of :func:`candidates` (powers of two up to the longest
    request's page count, that count, and the ``plan_decode`` default) gets a
    ``plan_decode(..., pages_per_chunk=c)`` plan and is timed with
    :func:`graph_time_us` (default ``launches``/``reps``) as
    ``decode(q, k_cache, v_cache, table, plan, method="v2", out=out)``. Env
    ``CUPAGED_CORE``, if set, pins the core being timed.

    Only meaningful for shapes the kernels serve (head_dim 64, 96, 128 or 256,
    head_dim contiguous, 16-byte aligned): for any other shape ``decode``
    silently runs the gather path, which ignores the chunk size, so every
    timing would be gather's. Check with :func:`cupaged.select_method` first.

    Args:
        q: ``[B, Hq, D]`` CuPy array, float16, bfloat16 or float32.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` (NHD; HND with
            ``kv_layout="HND"``) CuPy arrays of q's dtype or fp8 uint8 bits
            (as for :func:`cupaged.decode`).
        table: the batch's :class:`~cupaged.PageTable` (``B >= 1``).
        kv_layout: keyword-only, ``"NHD"`` (default) or ``"HND"``.
        store: keyword-only, default True: write the winner under
            :func:`cache_key` to ``$CUPAGED_CACHE_DIR/autotune.json``
            (default ``~/.cache/cupaged/autotune.json``).

    Returns:
        A :class:`TuneResult`.

    Raises:
        Without a GPU, CuPy's ``cupy.cuda.runtime.CUDARuntimeError`` (e.g.
        ``cudaErrorNoDevice``), not ``NoGPUError``: there is no GPU check of
        its own. ``ValueError`` from ``plan_decode`` (empty batch, heads not
        divisible, unsupported dtype, ...); what ``decode`` raises for bad
        tensors (``TypeError``, ``ValueError``, ``PageTableError``);
        ``OSError`` if the cache file cannot be written.

    Example (needs a GPU)::

        result = autotune.tune(q, k_cache, v_cache, table, store=False)
        result.best, result.heuristic   # the fastest and the default pages_per_chunk
        result.timings_us                # {pages_per_chunk: µs per decode}
    """
    import cupy

    from .decode import decode

    num_qo_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2 if kv_layout == "NHD" else 1]
    kv = _kv_dtype(q, k_cache)
    heuristic = plan_decode(table, num_qo_heads, num_kv_heads, head_dim, q.dtype, kv_dtype=kv).pages_per_chunk
    out = cupy.empty_like(q)
    timings = {}
    for c in candidates(table, heuristic):
        plan = plan_decode(table, num_qo_heads, num_kv_heads, head_dim, q.dtype, kv_dtype=kv, pages_per_chunk=c)
        timings[c] = graph_time_us(
            lambda: decode(q, k_cache, v_cache, table, plan, method="v2", kv_layout=kv_layout, out=out))
    best = min(timings, key=timings.get)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    key = cache_key(name, q.dtype, head_dim, num_qo_heads // num_kv_heads, table, k_cache.dtype)
    if store:
        _store(key, best)
    return TuneResult(key, best, heuristic, timings)


def tuned_plan(q, k_cache, v_cache, table: PageTable, *, kv_layout: str = "NHD") -> DecodePlan:
    """A plan whose chunk size is the cached winner for this shape bucket,
    tuning (and caching) first when the bucket has none.

    Looks up :func:`cache_key` (device name, ``q.dtype``, ``D``,
    ``Hq // Hkv``, page size, bucketed batch and longest request) in
    ``$CUPAGED_CACHE_DIR/autotune.json`` (default
    ``~/.cache/cupaged/autotune.json``; a missing or unreadable file counts as
    empty); on a miss runs :func:`tune` with ``store=True``. Tables of one
    bucket share the winner. Arguments as :func:`tune` (``q [B, Hq, D]``,
    caches ``[num_pages, page_size, Hkv, D]`` CuPy arrays, the batch's
    table); the same caveat holds: for shapes the kernels decline the tuned
    timings are the gather path's.

    Returns:
        ``plan_decode(table, Hq, Hkv, D, q.dtype, pages_per_chunk=best)``:
        a :class:`~cupaged.DecodePlan`, held while ``plan.matches(table)``
        like any plan.

    Raises:
        Without a GPU, CuPy's ``cupy.cuda.runtime.CUDARuntimeError`` (from
        the device-name lookup, before anything else), not ``NoGPUError``;
        otherwise what :func:`tune` and ``plan_decode`` raise.

    Example (needs a GPU)::

        plan = autotune.tuned_plan(q, k_cache, v_cache, table)   # tunes once per bucket
        out = cupaged.decode(q, k_cache, v_cache, table, plan)
    """
    import cupy

    num_qo_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2 if kv_layout == "NHD" else 1]
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    key = cache_key(name, q.dtype, head_dim, num_qo_heads // num_kv_heads, table, k_cache.dtype)
    best = _load_cache().get(key)
    if best is None:
        best = tune(q, k_cache, v_cache, table, kv_layout=kv_layout).best
    return plan_decode(table, num_qo_heads, num_kv_heads, head_dim, np.dtype(q.dtype), kv_dtype=_kv_dtype(q, k_cache),
                       pages_per_chunk=int(best))
