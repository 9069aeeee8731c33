"""Autotuner for the split size ``pages_per_chunk``.

Enumerates the feasible chunk sizes (powers of two up to the longest request,
plus the heuristic's choice so the default is measured too), times real v2
launches under CUDA-graph replay (what a server sees; plain back-to-back
launches of a small cell would time the Python host path instead), and caches
the winner on disk per (device, dtype, head_dim, GQA group, page size,
bucketed batch, bucketed context).

The cache is a JSON file, ``$CUPAGED_CACHE_DIR/autotune.json`` (default
``~/.cache/cupaged``); delete it to re-tune. It is safe to share between
processes and careful with what it finds:

* A write takes an exclusive ``flock`` on ``autotune.json.lock`` in the
  directory, reads the file, adds its key and replaces the file through a
  unique temporary file (``tempfile.mkstemp`` + ``os.replace``), so
  concurrent tuners neither lose each other's keys nor see half a file.
* A directory not owned by the current user, or writable by others, is not
  used (a warning; nothing is read or written), and a cache file that is a
  symlink is never followed (a warning; it counts as empty and is not
  written through).
* A malformed file (not JSON, not an object, nested too deeply, over 16 MiB)
  counts as empty, and an entry whose value is not an int in
  ``[1, 2**31 - 1]`` (a valid ``pages_per_chunk``) is ignored, each with a
  warning (``UserWarning``).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from . import _configs, _env
from .page_table import PageTable
from .plan import MAX_PAGES_PER_CHUNK, DecodePlan, plan_decode
from .testing import graph_time_us  # re-exported: the timer lives in cupaged.testing

__all__ = ["bucket", "candidates", "cache_key", "cache_path", "graph_time_us", "TuneResult", "tune", "tuned_plan"]

try:
    import fcntl
except ImportError:  # pragma: no cover (not POSIX: writes are not locked)
    fcntl = None  # type: ignore[assignment]

ENV_CACHE_DIR = _env.CACHE_DIR

_LOCK_NAME = "autotune.json.lock"
_MAX_CACHE_BYTES = 16 << 20  # a few hundred bytes per key; anything larger is not ours
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a planted FIFO must not block the open


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
    return _configs.stored_format(kv_dtype) is not None or np.dtype(kv_dtype) == np.dtype(ml_dtypes.float8_e4m3fn)


def _kv_dtype(q, k_cache):
    """plan_decode's kv_dtype for these arrays: the scaled format a cache of
    its storage dtype holds (fp8 for uint8), else None."""
    fmt = _configs.stored_format(k_cache.dtype) if k_cache.dtype != q.dtype else None
    return None if fmt is None else fmt.name


def cache_path() -> Path:
    """The cache file: ``$CUPAGED_CACHE_DIR/autotune.json`` (default
    ``~/.cache/cupaged/autotune.json``), read at call time."""
    return _env.cache_dir() / "autotune.json"


def _warn(message: str) -> None:
    warnings.warn(f"cupaged autotune cache: {message}", UserWarning, stacklevel=3)


def _current_uid() -> int | None:
    """The user who must own the cache directory (None where there are no uids)."""
    return os.getuid() if hasattr(os, "getuid") else None


def _unsafe_dir(directory: Path) -> str | None:
    """Why ``directory`` must not hold the cache (another user's, or writable
    by others), or None when it may."""
    try:
        st = os.stat(directory)
    except OSError as e:
        return f"cannot stat {directory} ({e})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    uid = _current_uid()
    if uid is not None and st.st_uid != uid:
        return f"{directory} is owned by uid {st.st_uid}, not by the current user (uid {uid})"
    if st.st_mode & stat.S_IWOTH:
        return f"{directory} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _valid_winner(value) -> bool:
    """A cached winner: an int (not a bool) that is a valid ``pages_per_chunk``."""
    return type(value) is int and 1 <= value <= MAX_PAGES_PER_CHUNK


def _read(path: Path) -> dict[str, int]:
    """The valid entries of the cache file at ``path``; {} (with a warning
    unless the file is simply missing) for a symlink, an unreadable or a
    malformed file."""
    if os.path.islink(path):
        _warn(f"{path} is a symlink; it is not followed (the cache counts as empty)")
        return {}
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK)
    except FileNotFoundError:
        return {}
    except OSError as e:
        _warn(f"cannot read {path} ({e}); the cache counts as empty")
        return {}
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            _warn(f"{path} is not a regular file; the cache counts as empty")
            return {}
        raw = f.read(_MAX_CACHE_BYTES + 1)
    if len(raw) > _MAX_CACHE_BYTES:
        _warn(f"{path} is larger than {_MAX_CACHE_BYTES} bytes; the cache counts as empty")
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, huge ints; deep nesting
        _warn(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:100]}); the cache counts as empty")
        return {}
    if not isinstance(data, dict):
        _warn(f"{path} holds a JSON {type(data).__name__}, not an object; the cache counts as empty")
        return {}
    cache = {key: value for key, value in data.items() if _valid_winner(value)}
    if len(cache) != len(data):
        _warn(f"{path}: ignored {len(data) - len(cache)} entries whose value is not an int in "
              f"[1, {MAX_PAGES_PER_CHUNK}] (a pages_per_chunk)")
    return cache


def _load_cache() -> dict[str, int]:
    """The cached winners, ``{cache_key: pages_per_chunk}``; {} when there is
    no cache, and (with a warning) when the directory or file is unsafe or
    malformed (see the module docstring)."""
    path = cache_path()
    if not os.path.isdir(path.parent):
        return {}
    why = _unsafe_dir(path.parent)
    if why is not None:
        _warn(f"{why}; the cache is not read")
        return {}
    return _read(path)


@contextlib.contextmanager
def _write_lock(directory: Path):
    """Hold an exclusive ``flock`` on the directory's lock file."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _store(key: str, value: int) -> None:
    """Add ``key: value`` to the cache file: read, merge and replace under
    the directory's lock, through a unique temporary file. An unsafe
    directory or a symlinked cache file is left alone, with a warning."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    why = _unsafe_dir(path.parent)
    if why is not None:
        _warn(f"{why}; the winner for {key!r} is not stored")
        return
    with _write_lock(path.parent):
        if os.path.islink(path):
            _warn(f"{path} is a symlink; it is not written through (the winner for {key!r} is not stored)")
            return
        cache = _read(path)
        cache[key] = value
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".autotune.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f, indent=1, sort_keys=True)
            os.replace(tmp, path)  # atomic: readers never see half a file
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


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

    Only meaningful for shapes the kernels serve (head_dim 64, 80, 96, 128, 192 or 256,
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
        ``OSError`` if the cache file cannot be written (an unsafe cache
        directory or a symlinked cache file is a warning and no write).

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
    ``~/.cache/cupaged/autotune.json``; a missing, unreadable or malformed
    file counts as empty, and a bad entry as missing, the latter two with a
    warning: see the module docstring); on a miss runs :func:`tune` with ``store=True``. Tables of one
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
    best = _load_cache().get(key)  # only valid winners: an int in [1, 2**31 - 1]
    if best is None:
        best = tune(q, k_cache, v_cache, table, kv_layout=kv_layout).best
    return plan_decode(table, num_qo_heads, num_kv_heads, head_dim, np.dtype(q.dtype), kv_dtype=_kv_dtype(q, k_cache),
                       pages_per_chunk=int(best))
