"""NumPy float64 reference of paged-attention decode (never calls a kernel).

Every function casts its inputs to float64 and is numerically stable (scores
have their maximum subtracted before exponentiation).  Inputs may be NumPy
arrays of float16, float32, float64 or ``ml_dtypes.bfloat16``; objects with a
``.get()`` method (cupy arrays) are copied to the host first.  KV caches are
``[num_pages, page_size, num_kv_heads, head_dim]`` ("NHD", the default) or
``[num_pages, num_kv_heads, page_size, head_dim]`` (``kv_layout="HND"``) and
may be non-contiguous views (e.g. a slice of a larger cache).

**Serving features** (keyword-only, same meaning as in :func:`cupaged.decode`):

* fp8 KV: a cache (or ``k``/``v`` of :func:`attend`) may be **uint8**
  float8_e4m3fn bit patterns (how CuPy holds an fp8 cache) or an
  ``ml_dtypes.float8_e4m3fn`` array; it is dequantized exactly to float64
  (``0x7f``/``0xff`` are NaN, so a kernel reading an invisible slot filled
  with them fails loudly).  ``q`` stays a float array.
* ``k_scale`` / ``v_scale``: ``None`` (1.0), a float (per tensor) or a 1-D
  array ``[num_kv_heads]`` (per KV head), for any cache dtype: the real K is
  ``float64(k_cache) * k_scale[kv_head]``, likewise V.
* ``logits_soft_cap``: ``None`` or ``0`` is off; ``c > 0`` replaces each
  logit ``s = sm_scale * q.k`` by ``c * tanh(s / c)`` before the softmax, and
  the LSE is of the capped logits.

**LSE units.**  Every log-sum-exp here is in **log2 units**, like the kernels:
``lse = log2(sum_t 2**(s_t * log2(e)))`` for the scaled scores ``s_t``, so the
natural-log LSE is ``lse * ln 2`` (and ``lse = lse_natural * LOG2E``).

Conventions: query head ``h`` reads KV head ``h // g`` with
``g = num_qo_heads // num_kv_heads``; the softmax scale defaults to
``1 / sqrt(head_dim)``; a request with no visible token yields an output of
zeros and an LSE of ``-inf``.

**Errors** are those of the kernels' path: bad input raises a
:class:`~cupaged.errors.CupagedError` subclass that is also the builtin a
generic handler expects (``ShapeError``, ``DTypeError``, ``PageTableError``,
``InvalidArgumentError``: ``ValueError``; ``ArgumentTypeError``:
``TypeError``), naming the argument and the rule.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from . import _configs
from ._validate import plan_mismatch_reason
from .errors import (
    ArgumentTypeError,
    DTypeError,
    InvalidArgumentError,
    PageTableError,
    PlanMismatchError,
    ShapeError,
)
from .page_table import PageTable, qo_indptr_array

__all__ = [
    "LOG2E",
    "KV_LAYOUTS",
    "gather_kv",
    "attend",
    "decode",
    "merge_states",
    "decode_split",
]

#: log2(e) = 1 / ln 2: multiply a natural-log quantity by it to get log2 units.
LOG2E = 1.0 / math.log(2.0)

#: The KV-cache layouts: "NHD" = [num_pages, page_size, Hkv, D] (default),
#: "HND" = [num_pages, Hkv, page_size, D].
KV_LAYOUTS = ("NHD", "HND")

_FLOAT_DTYPES = (
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(ml_dtypes.bfloat16),
)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _host(x: Any, name: str, fp8: bool = False) -> np.ndarray:
    """``x`` as a NumPy array (cupy arrays are fetched), dtype checked.  With
    ``fp8`` (KV tensors) uint8 bits and float8_e4m3fn are accepted too and
    come back as a float8_e4m3fn view."""
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    arr = np.asarray(x)
    fmt = _configs.stored_format(arr.dtype) if fp8 else None  # (uint8: fp8 e4m3fn bits)
    if fmt is not None:
        return arr.view(np.dtype(fmt.name))  # same itemsize: any strides stay valid
    if fp8 and arr.dtype == _E4M3:
        return arr
    if arr.dtype not in _FLOAT_DTYPES:
        extra = (", or fp8 e4m3 (uint8 bits or ml_dtypes.float8_e4m3fn)"
                 if fp8 else "")
        raise DTypeError(
            f"{name} must be float16, float32, float64 or bfloat16{extra}, "
            f"got dtype {arr.dtype}")
    return arr


def _check_layout(kv_layout: Any) -> str:
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise InvalidArgumentError(
            f"kv_layout must be one of {', '.join(map(repr, KV_LAYOUTS))} "
            f"(NHD = [num_pages, page_size, num_kv_heads, head_dim], "
            f"HND = [num_pages, num_kv_heads, page_size, head_dim]), "
            f"got {kv_layout!r}")
    return kv_layout


def _nhd(cache: np.ndarray, name: str, kv_layout: str) -> np.ndarray:
    """A 4-D cache of ``kv_layout`` as an NHD view (no copy)."""
    if cache.ndim != 4:
        dims = ("[num_pages, page_size, num_kv_heads, head_dim]"
                if kv_layout == "NHD" else
                "[num_pages, num_kv_heads, page_size, head_dim]")
        raise ShapeError(
            f"{name} must be {dims} (kv_layout={kv_layout!r}), "
            f"got shape {cache.shape}")
    return cache if kv_layout == "NHD" else cache.transpose(0, 2, 1, 3)


def _check_cap(logits_soft_cap: Any) -> float | None:
    """None (off) or the cap as a positive float."""
    if logits_soft_cap is None:
        return None
    if isinstance(logits_soft_cap, bool) or not isinstance(
            logits_soft_cap, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(
            f"logits_soft_cap must be None or a real number >= 0, got "
            f"{logits_soft_cap!r}")
    cap = float(logits_soft_cap)
    if not math.isfinite(cap) or cap < 0:
        raise InvalidArgumentError(
            f"logits_soft_cap must be None, 0 (off) or a finite positive "
            f"number, got {cap}")
    return cap if cap > 0 else None


def _check_scale(scale: Any, name: str, num_kv_heads: int
                 ) -> np.ndarray | None:
    """None (1.0) or the scale as float64 ``[num_kv_heads]``."""
    if scale is None:
        return None
    if isinstance(scale, bool):
        raise InvalidArgumentError(
            f"{name} must be None, a float or a [num_kv_heads] array, got "
            f"{scale!r}")
    if not isinstance(scale, np.ndarray) and hasattr(scale, "get"):
        scale = scale.get()
    s = np.asarray(scale)
    if s.dtype.kind not in "fiu" and s.dtype != np.dtype(ml_dtypes.bfloat16):
        raise DTypeError(
            f"{name} must be a real number or a float array, got dtype "
            f"{s.dtype}")
    if s.ndim == 0:
        s = np.full(num_kv_heads, float(s))
    elif s.shape != (num_kv_heads,):
        raise ShapeError(
            f"{name} must be a float (per tensor) or an array of shape "
            f"[num_kv_heads] = ({num_kv_heads},) (per head), got shape "
            f"{s.shape}")
    s = s.astype(np.float64)
    if not np.isfinite(s).all():
        raise InvalidArgumentError(f"{name} must be finite, got {s.tolist()}")
    return s


def _f64(x: Any, name: str, fp8: bool = False) -> np.ndarray:
    a = _host(x, name, fp8)
    if a.dtype.itemsize < 4:  # 8/16-bit floats: NumPy widens to float32 far
        a = a.astype(np.float32)  # faster than to float64; the step is exact
    return a.astype(np.float64)


def _check_table(table: Any) -> None:
    if not isinstance(table, PageTable):
        raise ArgumentTypeError(
            f"table must be a cupaged.PageTable, got {type(table).__name__}")


def _check_sm_scale(sm_scale: Any, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` for None, else a finite real."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, (bool, np.bool_)) or not isinstance(
            sm_scale, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(
            f"sm_scale must be a real number or None, got {sm_scale!r}")
    if not math.isfinite(float(sm_scale)):
        raise InvalidArgumentError(f"sm_scale must be finite, got {sm_scale!r}")
    return float(sm_scale)


def _check_heads(hq: int, hkv: int, d: int) -> None:
    if not (hq and hkv and d):
        raise ShapeError(
            f"num_qo_heads ({hq}), num_kv_heads ({hkv}) and head_dim ({d}) "
            f"must be >= 1")
    if hq % hkv:
        raise ShapeError(
            f"num_qo_heads ({hq}) must be divisible by num_kv_heads ({hkv})")


def _check_cache(cache: np.ndarray, name: str, table: Any) -> None:
    _check_table(table)
    if cache.ndim != 4:
        raise ShapeError(
            f"{name} must be [num_pages, page_size, num_kv_heads, head_dim], "
            f"got shape {cache.shape}")
    if cache.shape[1] != int(table.page_size):
        raise ShapeError(
            f"{name} page size {cache.shape[1]} != table.page_size "
            f"{int(table.page_size)}")


def _gather(cache: np.ndarray, table: Any, i: int) -> np.ndarray:
    """Visible tokens of request ``i`` in ``cache``'s own dtype."""
    indptr = table.indptr
    lo, hi = int(indptr[i]), int(indptr[i + 1])
    nkv, d = cache.shape[2], cache.shape[3]
    seq = int(table.seq_lens[i])
    if hi == lo or seq == 0:
        return np.zeros((0, nkv, d), dtype=cache.dtype)
    pages = np.asarray(table.indices[lo:hi], dtype=np.int64)
    if pages.min() < 0 or pages.max() >= cache.shape[0]:
        raise PageTableError(
            f"request {i}: page id out of range [0, {cache.shape[0]}) "
            f"(ids {pages.min()}..{pages.max()})")
    tokens = cache[pages].reshape(-1, nkv, d)  # fancy index copies
    off = int(table.first_page_offset[i])
    return tokens[off:off + seq]


def gather_kv(cache: Any, table: Any, i: int, *, scale: Any = None,
              kv_layout: str = "NHD") -> np.ndarray:
    """The visible tokens of request ``i``, in order, as float64
    ``[seq_len_i, num_kv_heads, head_dim]`` (token-major whatever the cache
    layout), dequantized and multiplied by ``scale``.

    Pages ``indices[indptr[i]:indptr[i+1]]`` are concatenated and the range
    ``[first_page_offset[i], first_page_offset[i] + seq_len_i)`` kept.

    ``cache`` is ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or,
    with ``kv_layout="HND"``, ``[num_pages, num_kv_heads, page_size,
    head_dim]``; float16, float32, float64, bfloat16 or fp8 e4m3 (uint8 bits
    or ``ml_dtypes.float8_e4m3fn``; a CuPy array is copied to the host);
    ``table`` a :class:`~cupaged.PageTable`; ``i`` the request index;
    ``scale`` (keyword-only) ``None``, a float or a ``[num_kv_heads]`` array.

    Raises (each a :class:`~cupaged.errors.CupagedError`, as on the kernels'
    path) ``ArgumentTypeError`` [TypeError] (``table`` not a
    :class:`~cupaged.PageTable`, ``i`` not an int), ``DTypeError`` (an
    unsupported dtype), ``ShapeError`` (a cache that is not 4-D, or whose
    page size differs from ``table.page_size``; a ``scale`` neither a float
    nor ``[num_kv_heads]``), ``InvalidArgumentError`` (``i`` outside ``[0,
    B)``, an unknown ``kv_layout``, a non-finite ``scale``),
    ``PageTableError`` (one of request ``i``'s page ids ``>= num_pages``);
    all but the first are ``ValueError``.

    Example: one request of 5 tokens starting at entry 2 of page 0:

    >>> import numpy as np
    >>> import cupaged
    >>> from cupaged import reference
    >>> table = cupaged.PageTable.from_seq_lens([5], page_size=4, first_page_offset=[2])
    >>> cache = np.arange(8, dtype=np.float32).reshape(2, 4, 1, 1)  # value = slot
    >>> reference.gather_kv(cache, table, 0)[:, 0, 0].tolist()
    [2.0, 3.0, 4.0, 5.0, 6.0]
    >>> reference.gather_kv(cache, table, 1)
    Traceback (most recent call last):
        ...
    cupaged.errors.InvalidArgumentError: request 1 out of range for batch size 1
    """
    layout = _check_layout(kv_layout)
    c = _nhd(_host(cache, "cache", fp8=True), "cache", layout)
    _check_cache(c, "cache", table)
    s = _check_scale(scale, "scale", c.shape[2])
    if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
        raise ArgumentTypeError(f"i must be an int (a request index), got {i!r}")
    i = int(i)
    if not 0 <= i < int(table.batch_size):
        raise InvalidArgumentError(f"request {i} out of range for batch size "
                                   f"{int(table.batch_size)}")
    tokens = _f64(_gather(c, table, i), "cache", fp8=True)
    return tokens if s is None else tokens * s[None, :, None]


def attend(q_row: Any, k: Any, v: Any, sm_scale: float | None = None, *,
           logits_soft_cap: float | None = None, k_scale: Any = None,
           v_scale: Any = None, kv_layout: str = "NHD"
           ) -> tuple[np.ndarray, np.ndarray]:
    """Dense attention of one request's query over its tokens.

    ``q_row [Hq, D]``, ``k, v [T, Hkv, D]`` (``kv_layout="HND"``:
    ``[Hkv, T, D]``) -> ``(out [Hq, D], lse [Hq])`` float64; query head ``h``
    uses KV head ``h // (Hq // Hkv)``; ``lse`` in log2 units.  ``T == 0``
    gives zeros and ``-inf``.  ``sm_scale`` defaults to ``1/sqrt(D)``.

    ``k`` and ``v`` may be fp8 e4m3 (uint8 bits or float8_e4m3fn), and are
    multiplied by ``k_scale`` / ``v_scale`` (``None``, a float, or
    ``[Hkv]``) after the exact float64 dequantization.  With
    ``logits_soft_cap = c > 0`` the logits are ``c * tanh(sm_scale * q.k /
    c)``, and the LSE is ``log2(sum exp(logit))`` of the capped logits.

    Raises (each a :class:`~cupaged.errors.CupagedError` and a
    ``ValueError`` but the first): ``ArgumentTypeError`` [TypeError]
    (``sm_scale`` not a real number); ``DTypeError`` (an unsupported dtype);
    ``ShapeError`` (``q_row`` not 2-D or ``k``, ``v`` not 3-D, ``k`` and
    ``v`` of different shapes, head_dims that differ, zero heads, ``Hq`` not
    a multiple of ``Hkv``, a scale neither a float nor ``[Hkv]``);
    ``InvalidArgumentError`` (an unknown ``kv_layout``, a negative or
    non-finite ``logits_soft_cap``, a non-finite ``sm_scale`` or scale).

    Example:

    >>> import numpy as np
    >>> from cupaged import reference
    >>> rng = np.random.default_rng(0)
    >>> q_row = rng.standard_normal((4, 64))
    >>> k, v = rng.standard_normal((10, 2, 64)), rng.standard_normal((10, 2, 64))
    >>> out, lse = reference.attend(q_row, k, v)
    >>> out.shape, lse.shape
    ((4, 64), (4,))
    >>> s = np.einsum("hd,thd->ht", q_row, np.repeat(k, 2, axis=1)) / 8.0  # head h reads kv head h // 2
    >>> bool(np.allclose(lse / reference.LOG2E, np.log(np.exp(s).sum(axis=1))))  # log2 -> natural
    True
    >>> reference.attend(np.zeros((3, 64)), k, v)
    Traceback (most recent call last):
        ...
    cupaged.errors.ShapeError: num_qo_heads (3) must be divisible by num_kv_heads (2)

    A soft cap of 5 bounds every logit to (-5, 5):

    >>> big = 100 * q_row
    >>> _, lse_capped = reference.attend(big, k, v, logits_soft_cap=5.0)
    >>> bool((lse_capped / reference.LOG2E <= 5 + np.log(10)).all())  # <= max logit + ln T
    True
    """
    layout = _check_layout(kv_layout)
    cap = _check_cap(logits_soft_cap)
    q = _f64(q_row, "q_row")
    kk = _f64(k, "k", fp8=True)
    vv = _f64(v, "v", fp8=True)
    if q.ndim != 2 or kk.ndim != 3 or vv.ndim != 3:
        dims = "[T, Hkv, D]" if layout == "NHD" else "[Hkv, T, D]"
        raise ShapeError(
            f"attend expects q_row [Hq, D], k/v {dims}; got "
            f"{q.shape}, {kk.shape}, {vv.shape}")
    if layout == "HND":
        kk, vv = kk.transpose(1, 0, 2), vv.transpose(1, 0, 2)
    if kk.shape != vv.shape:
        raise ShapeError(f"k shape {kk.shape} != v shape {vv.shape}")
    hq, d = q.shape
    t, hkv, dk = kk.shape
    if dk != d:
        raise ShapeError(f"head_dim of k ({dk}) != head_dim of q ({d})")
    _check_heads(hq, hkv, d)
    scale = _check_sm_scale(sm_scale, d)
    ks = _check_scale(k_scale, "k_scale", hkv)
    vs = _check_scale(v_scale, "v_scale", hkv)
    if t == 0:
        return np.zeros((hq, d)), np.full(hq, -np.inf)
    if ks is not None:
        kk = kk * ks[None, :, None]
    if vs is not None:
        vv = vv * vs[None, :, None]
    g = hq // hkv
    # [Hkv, g, D] @ [Hkv, D, T]: query head h = kv * g + j uses kv head kv;
    # batched matmuls (BLAS) instead of repeating K/V per query head.
    qg = q.reshape(hkv, g, d)
    kt = kk.transpose(1, 2, 0)  # [Hkv, D, T] views: matmul handles the strides
    vt = vv.transpose(1, 0, 2)  # [Hkv, T, D]
    if cap is None:
        # base-2 scores: log2(e) folded into the scale, like the kernels
        s = np.matmul(qg, kt).reshape(hq, t) * (scale * LOG2E)  # [Hq, T]
    else:  # cap the natural-units logits, then go to base 2
        s = cap * np.tanh(np.matmul(qg, kt).reshape(hq, t) * (scale / cap))
        s *= LOG2E
    m = s.max(axis=1, keepdims=True)
    p = np.exp2(s - m)
    denom = p.sum(axis=1)
    out = np.matmul(p.reshape(hkv, g, t), vt).reshape(hq, d) / denom[:, None]
    lse = m[:, 0] + np.log2(denom)
    return out, lse


def _check_inputs(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  table: Any) -> None:
    _check_cache(k, "k_cache", table)
    _check_cache(v, "v_cache", table)
    if k.shape != v.shape:
        raise ShapeError(f"k_cache shape {k.shape} != v_cache shape {v.shape}")
    if q.ndim != 3:
        raise ShapeError(
            f"q must be [batch, num_qo_heads, head_dim], got shape {q.shape}")
    b, hq, d = q.shape
    if b != int(table.batch_size):
        raise ShapeError(
            f"q batch {b} != table.batch_size {int(table.batch_size)}")
    if d != k.shape[3]:
        raise ShapeError(f"q head_dim {d} != cache head_dim {k.shape[3]}")
    _check_heads(hq, k.shape[2], d)
    table.check_page_ids(k.shape[0])


def decode(q: Any, k_cache: Any, v_cache: Any, table: Any,
           sm_scale: float | None = None, *,
           logits_soft_cap: float | None = None, k_scale: Any = None,
           v_scale: Any = None, kv_layout: str = "NHD", qo_indptr: Any = None,
           sinks: Any = None, window_left: Any = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """Paged decode: ``q [B, Hq, D]`` against the visible tokens of each
    request -> ``(out [B, Hq, D] float64, lse [B, Hq] float64, log2 units)``.

    ``k_cache``, ``v_cache`` are ``[num_pages, page_size, Hkv, D]`` (NHD) or,
    with ``kv_layout="HND"``, ``[num_pages, Hkv, page_size, D]``; inputs may
    be float16, float32, float64 or bfloat16, and the caches also fp8 e4m3
    (uint8 bits or ``ml_dtypes.float8_e4m3fn``, dequantized exactly); CuPy
    arrays are copied to the host. A zero-length request gives zeros and
    ``-inf``. ``sm_scale`` defaults to ``1/sqrt(D)``.

    Keyword-only: ``k_scale`` / ``v_scale`` (``None`` = 1, a float per
    tensor, or a ``[Hkv]`` array per KV head) multiply the dequantized caches;
    ``logits_soft_cap`` (``None``/``0`` off, ``c > 0``: logit ``= c *
    tanh(sm_scale * q.k / c)``; the LSE is of the capped logits).

    Decode features of issue 18 (this is their definition; the kernels serve
    them through :meth:`~cupaged.PageTable.query_rows` and
    :meth:`~cupaged.PageTable.windowed`, and fold the sinks into their last write):

    * ``qo_indptr`` (int ``[B+1]``, from 0, non-decreasing, ``q_len_i =
      qo_indptr[i+1] - qo_indptr[i]`` in ``[1, 16]``): several query tokens per
      request. ``q`` (and ``out``, ``lse``) are ``[qo_indptr[-1], Hq, ...]``.
      Request ``i``'s new tokens are its last ``q_len_i`` visible slots
      (``q_len_i <= seq_len_i``); its token ``j`` sees visible slots ``0 ..
      seq_len_i - q_len_i + j`` (causal among the new tokens).
    * ``sinks`` (``[Hq]`` floats, natural-log logits in the units of
      ``q.k * sm_scale``, not soft-capped): each adds ``exp(sinks[h])`` to head
      ``h``'s softmax denominator and nothing to the numerator; the LSE
      includes it (an empty request then has zeros and LSE ``sinks[h] *
      log2(e)``).
    * ``window_left`` (``None``/``-1`` none, an int ``W >= 0``, or an int
      ``[B]`` array, ``-1`` = none for that request): the query at position
      ``p`` (counted from the first visible slot) sees only slots ``p - W ..
      p``; with several query tokens each has its own window.

    Raises the :class:`~cupaged.errors.CupagedError` subclasses of the
    kernels' path (all ``ValueError`` but the first):
    ``ArgumentTypeError`` [TypeError] (``table`` not a
    :class:`~cupaged.PageTable`, ``sm_scale`` not a number), ``DTypeError``
    (an unsupported dtype), ``ShapeError`` (caches not 4-D, of different
    shapes, or whose page size differs from the table's; ``q`` not 3-D or
    whose batch or head_dim differs; zero heads; ``Hq`` not a multiple of
    ``Hkv``; a scale neither a float nor ``[Hkv]``), ``PageTableError`` (a
    page id ``>= num_pages``), ``InvalidArgumentError`` (an unknown
    ``kv_layout``, a negative or non-finite ``logits_soft_cap``, a
    non-finite ``sm_scale`` or scale).

    Example:

    >>> import numpy as np
    >>> import cupaged
    >>> from cupaged import reference
    >>> rng = np.random.default_rng(0)
    >>> table = cupaged.PageTable.from_seq_lens([37, 0, 5], page_size=16)  # 3 + 0 + 1 pages
    >>> k = rng.standard_normal((4, 16, 2, 64)).astype(np.float16)
    >>> v = rng.standard_normal((4, 16, 2, 64)).astype(np.float16)
    >>> q = rng.standard_normal((3, 8, 64)).astype(np.float16)
    >>> out, lse = reference.decode(q, k, v, table)
    >>> out.shape, lse.shape, out.dtype
    ((3, 8, 64), (3, 8), dtype('float64'))
    >>> bool((out[1] == 0).all() and np.isneginf(lse[1]).all())  # the empty request
    True
    >>> reference.decode(q, k[:3], v[:3], table)
    Traceback (most recent call last):
        ...
    cupaged.errors.PageTableError: request 2: page id 3 at indices[3] is out of range for a cache of num_pages=3

    The same caches as fp8 with per-head scales, in the HND layout:

    >>> from cupaged import fp8
    >>> k_scale = np.abs(k).max(axis=(0, 1, 3)).astype(np.float32) / fp8.E4M3_MAX  # [Hkv]
    >>> k8 = fp8.to_e4m3(k, k_scale, head_axis=2)  # uint8 bits [pages, P, Hkv, D]
    >>> hnd = (0, 2, 1, 3)                             # -> [pages, Hkv, P, D]
    >>> out8, _ = reference.decode(q, k8.transpose(hnd), v.transpose(hnd), table, k_scale=k_scale, kv_layout="HND")
    >>> deq, _ = reference.decode(q, fp8.from_e4m3(k8, k_scale, head_axis=2), v, table)
    >>> bool(np.allclose(out8, deq, rtol=0, atol=1e-6)), bool(np.abs(out8 - out).max() < 0.1)
    (True, True)
    >>> reference.decode(q, k, v, table, kv_layout="NDH")
    Traceback (most recent call last):
        ...
    cupaged.errors.InvalidArgumentError: kv_layout must be one of 'NHD', 'HND' (NHD = [num_pages, page_size, num_kv_heads, head_dim], HND = [num_pages, num_kv_heads, page_size, head_dim]), got 'NDH'
    """
    if qo_indptr is None and sinks is None and window_left is None:
        qh, k, v, cap, ks, vs = _prepare(q, k_cache, v_cache, table, kv_layout,
                                         logits_soft_cap, k_scale, v_scale)
        b, hq, d = qh.shape
        sm_scale = _check_sm_scale(sm_scale, d)
        out = np.zeros((b, hq, d))
        lse = np.full((b, hq), -np.inf)
        for i in range(b):
            out[i], lse[i] = attend(qh[i], _gather(k, table, i),
                                    _gather(v, table, i), sm_scale,
                                    logits_soft_cap=cap, k_scale=ks, v_scale=vs)
        return out, lse
    return _decode_features(q, k_cache, v_cache, table, sm_scale, logits_soft_cap, k_scale, v_scale,
                            kv_layout, qo_indptr, sinks, window_left)




def _decode_features(q, k_cache, v_cache, table, sm_scale, logits_soft_cap, k_scale, v_scale, kv_layout,
                     qo_indptr, sinks, window_left) -> tuple[np.ndarray, np.ndarray]:
    """:func:`decode` with several query tokens, sinks or a sliding window."""
    _check_table(table)
    batch = int(table.batch_size)
    seq = np.asarray(table.seq_lens, dtype=np.int64)
    starts = _check_qo_indptr(qo_indptr, batch, seq)
    rows = int(starts[-1])
    qh = _host(q, "q")
    if qh.ndim != 3 or qh.shape[0] != rows:
        raise ShapeError(f"q must be [qo_indptr[-1] = {rows}, num_qo_heads, head_dim], got shape {qh.shape}")
    # one query row per request for the shared checks, then every row
    qh_first = qh[starts[:-1]] if batch else qh[:0]
    _, k, v, cap, ks, vs = _prepare(qh_first, k_cache, v_cache, table, kv_layout, logits_soft_cap,
                                    k_scale, v_scale)
    hq, d = qh.shape[1], qh.shape[2]
    sm_scale = _check_sm_scale(sm_scale, d)
    sink2 = _check_sinks(sinks, hq)
    window = _check_window(window_left, batch)
    out = np.zeros((rows, hq, d))
    lse = np.full((rows, hq), -np.inf)
    for i in range(batch):
        ki, vi = _gather(k, table, i), _gather(v, table, i)
        q_len = int(starts[i + 1] - starts[i])
        for j in range(q_len):
            pos = int(seq[i]) - q_len + j  # this token's slot, counted from the first visible one
            lo = 0 if window[i] < 0 else max(0, pos - int(window[i]))
            r = int(starts[i]) + j
            out[r], lse[r] = attend(qh[r], ki[lo:pos + 1], vi[lo:pos + 1], sm_scale,
                                    logits_soft_cap=cap, k_scale=ks, v_scale=vs)
            if sink2 is not None:  # one more denominator term per head
                total = np.logaddexp2(lse[r], sink2)
                out[r] *= np.exp2(lse[r] - total)[:, None]
                lse[r] = total
    return out, lse


def _check_qo_indptr(qo_indptr: Any, batch: int, seq: np.ndarray) -> np.ndarray:
    """``qo_indptr`` as int64 ``[B+1]`` (one token each when None)."""
    ptr = qo_indptr_array(qo_indptr, batch, seq)
    return np.arange(batch + 1, dtype=np.int64) if ptr is None else ptr


def _check_sinks(sinks: Any, num_qo_heads: int) -> np.ndarray | None:
    """Sinks as base-2 logits ``[Hq]`` (None: none)."""
    if sinks is None:
        return None
    arr = _host(sinks, "sinks") if hasattr(sinks, "get") else np.asarray(sinks, dtype=np.float64)
    if arr.shape != (num_qo_heads,):
        raise ShapeError(f"sinks must be [num_qo_heads = {num_qo_heads}], got shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise InvalidArgumentError("sinks must be finite")
    return arr * LOG2E


def _check_window(window_left: Any, batch: int) -> np.ndarray:
    """Per request the window ``W`` (``-1``: none), int64 ``[B]``."""
    from .page_table import window_array

    arr = window_array(window_left, batch)
    return np.full(batch, -1, dtype=np.int64) if arr is None else arr


def _prepare(q: Any, k_cache: Any, v_cache: Any, table: Any, kv_layout: Any,
             logits_soft_cap: Any, k_scale: Any, v_scale: Any):
    """Checked host ``q``, the caches as NHD views, the cap (None = off) and
    the scales as float64 ``[Hkv]`` (None = 1)."""
    _check_table(table)
    layout = _check_layout(kv_layout)
    cap = _check_cap(logits_soft_cap)
    qh = _host(q, "q")
    k = _nhd(_host(k_cache, "k_cache", fp8=True), "k_cache", layout)
    v = _nhd(_host(v_cache, "v_cache", fp8=True), "v_cache", layout)
    _check_inputs(qh, k, v, table)
    ks = _check_scale(k_scale, "k_scale", k.shape[2])
    vs = _check_scale(v_scale, "v_scale", k.shape[2])
    return qh, k, v, cap, ks, vs


def merge_states(v: Any, lse: Any, o_indptr: Any
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Merge partial attention states.

    ``v [N, H, D]`` (each partial normalized by its own denominator),
    ``lse [N, H]`` (log2), ``o_indptr [M+1]`` (rows ``o_indptr[m]:o_indptr[m+1]``
    form output ``m``) -> ``(v_out [M, H, D], lse_out [M, H])`` float64::

        L = max_n lse_n
        w_n = 2**(lse_n - L)
        v_out = sum_n w_n v_n / sum_n w_n
        lse_out = L + log2(sum_n w_n)

    A ``-inf`` partial contributes nothing (even if its ``v`` is NaN); an
    output with no finite partial is zeros and ``-inf`` — never NaN.  The
    result is associative under regrouping and stays in log2, so merges chain.

    Raises (each a :class:`~cupaged.errors.CupagedError` and a
    ``ValueError``): ``DTypeError`` (``v`` or ``lse`` of an unsupported
    dtype, ``o_indptr`` not integer), ``ShapeError`` (``v`` not 3-D, ``lse``
    not ``[N, H]``, ``o_indptr`` not a non-empty 1-D array),
    ``InvalidArgumentError`` (NaN or ``+inf`` in ``lse``; ``o_indptr`` not
    starting at 0, decreasing, or not ending exactly at ``N``: stricter than
    :func:`cupaged.merge_states`, which allows ending before ``N``).

    Example:

    >>> import numpy as np
    >>> from cupaged import reference
    >>> v_out, lse_out = reference.merge_states(np.ones((3, 2, 4)), np.zeros((3, 2)), np.array([0, 2, 3]))
    >>> v_out.shape, lse_out.tolist()   # log2(2**0 + 2**0) = 1
    ((2, 2, 4), [[1.0, 1.0], [0.0, 0.0]])
    >>> reference.merge_states(np.ones((3, 2, 4)), np.zeros((3, 2)), np.array([0, 2]))
    Traceback (most recent call last):
        ...
    cupaged.errors.InvalidArgumentError: o_indptr must start at 0, be non-decreasing and end at N = 3
    """
    vv = _f64(v, "v")
    ll = _f64(lse, "lse")
    if not isinstance(o_indptr, np.ndarray) and hasattr(o_indptr, "get"):
        o_indptr = o_indptr.get()
    ptr = np.asarray(o_indptr)
    if vv.ndim != 3 or ll.shape != vv.shape[:2]:
        raise ShapeError(
            f"merge_states expects v [N, H, D] and lse [N, H], got "
            f"{vv.shape} and {ll.shape}")
    if np.isnan(ll).any() or np.isposinf(ll).any():
        raise InvalidArgumentError("lse must be finite or -inf (got NaN or +inf)")
    if ptr.ndim != 1 or ptr.size < 1:
        raise ShapeError(
            f"o_indptr must be a 1-D integer array [M+1], got shape {ptr.shape}")
    if not np.issubdtype(ptr.dtype, np.integer):
        raise DTypeError(
            f"o_indptr must be a 1-D integer array [M+1], got dtype {ptr.dtype}")
    ptr = ptr.astype(np.int64)
    if ptr[0] != 0 or ptr[-1] != vv.shape[0] or (np.diff(ptr) < 0).any():
        raise InvalidArgumentError(
            f"o_indptr must start at 0, be non-decreasing and end at N = "
            f"{vv.shape[0]}")
    m = ptr.size - 1
    h, d = vv.shape[1], vv.shape[2]
    v_out = np.zeros((m, h, d))
    lse_out = np.full((m, h), -np.inf)
    for r in range(m):
        lo, hi = int(ptr[r]), int(ptr[r + 1])
        if hi == lo:
            continue
        l_r = ll[lo:hi]                       # [n, H]
        finite = np.isfinite(l_r)
        has = finite.any(axis=0)              # [H]
        mx = np.where(has, np.max(np.where(finite, l_r, -np.inf), axis=0), 0.0)
        w = np.where(finite, np.exp2(np.where(finite, l_r, 0.0) - mx), 0.0)
        wv = w[:, :, None]
        with np.errstate(invalid="ignore", over="ignore"):
            # a partial with zero weight contributes nothing, whatever its v
            num = np.where(wv > 0, wv * vv[lo:hi], 0.0).sum(axis=0)
        den = w.sum(axis=0)                   # >= 1 where has (max term is 1)
        safe = np.where(has, den, 1.0)
        v_out[r] = np.where(has[:, None], num / safe[:, None], 0.0)
        lse_out[r] = np.where(has, mx + np.log2(safe), -np.inf)
    return v_out, lse_out


def decode_split(q: Any, k_cache: Any, v_cache: Any, table: Any, plan: Any,
                 sm_scale: float | None = None, *,
                 logits_soft_cap: float | None = None, k_scale: Any = None,
                 v_scale: Any = None, kv_layout: str = "NHD"
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Emulate the split-KV kernels: per chunk of ``plan`` a normalized partial
    output and its log2 LSE, then :func:`merge_states` over ``plan.o_indptr``.
    The keyword-only ``logits_soft_cap``, ``k_scale``, ``v_scale`` and
    ``kv_layout`` (fp8 caches included) are those of :func:`decode`.

    Returns ``(out [B, Hq, D], lse [B, Hq], partial_v [N, Hq, D],
    partial_lse [N, Hq])`` float64 with ``N = plan.num_chunks``.  A chunk with
    no visible token has zeros and ``-inf``.  ``plan`` is a
    :class:`~cupaged.DecodePlan` from :func:`~cupaged.plan_decode`; its dtype
    is not checked.

    Raises what :func:`decode` raises for the tensors and the keyword
    arguments, then :class:`~cupaged.errors.ArgumentTypeError` (``plan`` not
    a :class:`~cupaged.DecodePlan`) and
    :class:`~cupaged.errors.PlanMismatchError` (a ``ValueError``, saying
    what changed) when ``plan.matches(table)`` is false or the plan is for
    other ``(Hq, Hkv, D)``.

    Example: one page per chunk gives 3 + 1 + 1 chunks (the empty request
    still gets one):

    >>> import numpy as np
    >>> import cupaged
    >>> from cupaged import reference
    >>> rng = np.random.default_rng(0)
    >>> table = cupaged.PageTable.from_seq_lens([37, 0, 5], page_size=16)
    >>> k = rng.standard_normal((4, 16, 2, 64)).astype(np.float16)
    >>> v = rng.standard_normal((4, 16, 2, 64)).astype(np.float16)
    >>> q = rng.standard_normal((3, 8, 64)).astype(np.float16)
    >>> plan = cupaged.plan_decode(table, 8, 2, 64, np.float16, pages_per_chunk=1)
    >>> out, lse, partial_v, partial_lse = reference.decode_split(q, k, v, table, plan)
    >>> ref_out, ref_lse = reference.decode(q, k, v, table)
    >>> partial_v.shape, bool(np.allclose(out, ref_out) and np.allclose(lse, ref_lse))
    ((5, 8, 64), True)
    >>> other = cupaged.PageTable.from_seq_lens([10, 0, 5], page_size=16)  # request 0: 1 chunk, not 3
    >>> reference.decode_split(q, k, v, other, plan)
    Traceback (most recent call last):
        ...
    cupaged.errors.PlanMismatchError: plan does not match the page table (request 0: chunk count 3 -> 1 (1 pages at pages_per_chunk=1)); build a new plan
    """
    qh, k, v, cap, ks, vs = _prepare(q, k_cache, v_cache, table, kv_layout,
                                     logits_soft_cap, k_scale, v_scale)
    b, hq, d = qh.shape
    from .plan import DecodePlan  # (plan imports nothing of reference; lazy all the same)

    if not isinstance(plan, DecodePlan):
        raise ArgumentTypeError(
            f"plan must be a cupaged.DecodePlan, got {type(plan).__name__}")
    if not plan.matches(table):
        raise PlanMismatchError(
            f"plan does not match the page table "
            f"({plan_mismatch_reason(plan, table)}); build a new plan")
    if (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim) != (
            hq, k.shape[2], d):
        raise PlanMismatchError(
            f"plan is for (num_qo_heads, num_kv_heads, head_dim) = "
            f"({plan.num_qo_heads}, {plan.num_kv_heads}, {plan.head_dim}), "
            f"tensors have ({hq}, {k.shape[2]}, {d})")
    start, end = plan.chunk_token_ranges(table)
    n = int(plan.num_chunks)
    pv = np.zeros((n, hq, d))
    pl = np.full((n, hq), -np.inf)
    cache_req = -1
    kt = vt = None
    for c in range(n):
        i = int(plan.chunk_request[c])
        if i != cache_req:
            kt, vt, cache_req = _gather(k, table, i), _gather(v, table, i), i
        s, e = int(start[c]), int(end[c])
        pv[c], pl[c] = attend(qh[i], kt[s:e], vt[s:e], sm_scale,
                              logits_soft_cap=cap, k_scale=ks, v_scale=vs)
    out, lse = merge_states(pv, pl, plan.o_indptr)
    return out, lse, pv, pl
