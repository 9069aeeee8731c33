"""Writes the new tokens' K and V into their KV-cache pages in one launch
(cuda_src/append_kv.cu).

The decode step of a server: the pool grows each sequence (``pool.append``),
its page table then includes the new tokens, :func:`append_kv` writes them
through that table and :func:`cupaged.decode` reads them, with no device->host
copy anywhere in between.
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import NamedTuple

import numpy as np

from . import _configs, _loader
from ._launch import elem_strides
from ._typing import DeviceArray, IndexArray, Scale
from ._device import require_gpu
from ._arrays import as_cupy as _as_cupy
from ._checks import KV_LAYOUTS, check_scale_array, compute_capability, scale_value
from .errors import (ArgumentTypeError, DeviceMismatchError, DTypeError, InvalidArgumentError, LayoutError,
                     ShapeError, UnsupportedConfigError)
from .page_table import PageTable

__all__ = ["append_kv"]

_THREADS = 128  # APPEND_THREADS in cuda_src/append_kv.cu
_NULL = np.uint64(0)
_INT32_MAX = int(np.iinfo(np.int32).max)
_GRID_X_MAX = 2**31 - 1


class _Launch(NamedTuple):
    """What the checks hand the launch: the module's dtype, the instance,
    new tokens, chunks of a head row, and the scale arguments."""

    dtype: str  # k_new's dtype name (the module)
    instance: int  # index into _configs.APPEND_CACHE_TYPES
    num_tokens: int
    chunks: int  # 16-byte chunks of one head row (head_dim / ELEMS)
    k_scale: object  # float, or a per-head float32 array
    v_scale: object
    append_indptr: object  # None, a validated NumPy array, or a device array


def append_kv(k_new: DeviceArray, v_new: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray,
              table: PageTable, *, append_indptr: IndexArray | None = None, kv_layout: str = "NHD",
              k_scale: Scale = None, v_scale: Scale = None) -> None:
    """Writes the new tokens' K and V of every request into their pages, in one launch.

    Call it after the pool has grown the sequences (``pool.append`` for each,
    then ``pool.page_table``): ``table`` already includes the new tokens, and
    the ``n_i`` new tokens of request ``i`` go to its **last** ``n_i`` visible
    slots. Visible slot ``s`` of request ``i`` (counted from
    ``first_page_offset[i]``) is entry ``(first_page_offset[i] + s) % P`` of
    page ``indices[indptr[i] + (first_page_offset[i] + s) // P]``. Nothing else
    in either cache is written.

    Args:
        k_new, v_new: the new tokens, CuPy arrays (or CUDA arrays via
            ``__cuda_array_interface__`` / DLPack) of one shape and dtype
            (float16, ``ml_dtypes.bfloat16`` or float32). One token per
            request (``append_indptr`` None): ``[batch, num_kv_heads,
            head_dim]``. Several: ``[total_new, num_kv_heads, head_dim]``,
            token ``j`` of request ``i`` at row ``append_indptr[i] + j``.
            Any strides with head_dim contiguous and 16-byte aligned rows
            (e.g. slices of a fused QKV projection).
        k_cache, v_cache: the caches, written in place: ``[num_pages,
            page_size, num_kv_heads, head_dim]`` ("NHD") or ``[num_pages,
            num_kv_heads, page_size, head_dim]`` ("HND"), one shape; k_new's
            dtype, or uint8 holding float8 e4m3fn bits (quantized here). Any
            strides with head_dim contiguous; pointers and strides multiples
            of 16 bytes.
        table: the batch's :class:`~cupaged.PageTable`, new tokens included
            (uploaded once by ``table.device()``, which ``decode`` reuses).
        append_indptr: None (one token per request) or ``[batch + 1]`` int32,
            from 0, non-decreasing, ending at ``total_new``; ``n_i =
            append_indptr[i+1] - append_indptr[i]`` may be 0. A NumPy array is
            checked on the host (including ``n_i <= seq_len_i``) and copied to
            the device on every call; a CuPy array costs no host->device copy
            and is not checked: its values are the caller's contract. Either
            way the kernel never writes out of bounds: a token whose slot
            would not be visible (``n_i > seq_len_i``, or a token no request
            owns) is skipped.
        kv_layout: ``"NHD"`` (default) or ``"HND"``.
        k_scale, v_scale: None (1.0), a positive finite float (per tensor), or
            a float32 CuPy array ``[num_kv_heads]`` (per head) or ``[1]``; an
            array's values are not checked (they stay on the device). The cache stores ``x / scale`` so that ``cache *
            scale`` is the real value; computed in float32 as ``x *
            (1 / scale)`` (a correctly rounded reciprocal; exactly ``x /
            scale`` for a power of two), then rounded to nearest even into the
            cache dtype: fp8 saturates to +-448 (infinities too, NaN stays
            NaN), float16 saturates finite values to +-65504. Without a scale
            a same-dtype cache receives the bytes unchanged. Allowed for every
            cache dtype.

    Returns:
        None (the caches are written in place, on the current stream).

    CUDA graphs: under stream capture pass ``append_indptr`` as a CuPy array
    and scales as floats or contiguous float32 ``[num_kv_heads]`` CuPy arrays
    that outlive the graph: a NumPy ``append_indptr`` is copied to the device
    (a host copy cannot be captured), and a ``[1]`` or strided scale array is
    expanded into a temporary that is freed after the call.

    Raises:
        Each a :class:`~cupaged.errors.CupagedError` and the builtin in
        brackets. ArgumentTypeError [TypeError] (an array that is not a
        CuPy/CUDA array, NumPy scale arrays included; ``table`` not a
        PageTable; ``append_indptr`` not a NumPy/CuPy array; a scale that is
        neither a number nor an array), ShapeError [ValueError] (ranks,
        ``k_new`` vs ``v_new`` or ``k_cache`` vs ``v_cache`` shapes, heads,
        head_dim, page size, batch or ``append_indptr`` length disagreeing;
        zero heads or head_dim), DTypeError [ValueError] (unsupported or
        mixed dtypes, ``append_indptr`` not int32, a scale array not
        float32), LayoutError [ValueError] (an unknown ``kv_layout``,
        head_dim not contiguous, a pointer or stride not a multiple of 16
        bytes, ``k_cache`` and ``v_cache`` the same memory, a strided device
        ``append_indptr``), UnsupportedConfigError [ValueError] (a head_dim
        whose rows are not whole 16-byte vectors; an fp8 cache on a GPU
        below compute capability 8.9; a launch beyond the grid limit),
        InvalidArgumentError [ValueError] (a scale not positive and finite;
        a NumPy ``append_indptr`` not starting at 0, decreasing, not ending
        at ``total_new`` or giving a request more new tokens than it has
        visible slots; one token per request but a request with no visible
        slot; two new tokens for one cache slot, a write race, e.g. from a
        table listing one sequence twice, ``pool.page_table([s, s])``:
        checked once per table unless ``append_indptr`` is a device array),
        DeviceMismatchError [ValueError] (arrays on different devices
        or not on the current one), PageTableError [ValueError] (a page id
        ``>= num_pages``), NoGPUError [RuntimeError] (no CUDA device;
        checked first).

    Example (needs a GPU): one decode step, no device->host copy::

        import cupy, numpy, cupaged

        pool = cupaged.BlockPool(num_pages=64, page_size=16)
        seqs = [pool.add_sequence() for _ in range(2)]
        for s, n in zip(seqs, (40, 7)):
            pool.append(s, n)                                  # the prompts
        k_cache = cupy.zeros((64, 16, 8, 128), dtype=cupy.float16)
        v_cache = cupy.zeros_like(k_cache)
        # ... prefill fills the caches ...
        for s in seqs:
            pool.append(s, 1)                                  # room for one new token each
        table, rope_offsets = pool.page_table(seqs)
        k_new = cupy.ones((2, 8, 128), dtype=cupy.float16)    # [batch, Hkv, D]
        v_new = cupy.ones((2, 8, 128), dtype=cupy.float16)
        cupaged.append_kv(k_new, v_new, k_cache, v_cache, table)
        q = cupy.ones((2, 32, 128), dtype=cupy.float16)
        out = cupaged.decode(q, k_cache, v_cache, table)       # sees the new tokens
    """
    require_gpu("cupaged.append_kv")
    import cupy

    k_new, v_new = _as_cupy(k_new, "k_new"), _as_cupy(v_new, "v_new")
    k_cache, v_cache = _as_cupy(k_cache, "k_cache"), _as_cupy(v_cache, "v_cache")
    k_scale, v_scale = scale_as_cupy(k_scale, "k_scale"), scale_as_cupy(v_scale, "v_scale")
    if append_indptr is not None and not isinstance(append_indptr, np.ndarray):
        append_indptr = _as_cupy(append_indptr, "append_indptr")
    launch = check_append(k_new, v_new, k_cache, v_cache, table, append_indptr, kv_layout, k_scale, v_scale)

    device = k_new.data.device_id
    arrays = [("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache)]
    for name, a in (("k_scale", launch.k_scale), ("v_scale", launch.v_scale), ("append_indptr", append_indptr)):
        if isinstance(a, cupy.ndarray):
            arrays.append((name, a))
    for name, a in arrays:
        if a.data.device_id != device:
            raise DeviceMismatchError(f"{name} must be on k_new's device {device}, got device {a.data.device_id}")
    current = cupy.cuda.runtime.getDevice()
    if device != current:
        raise DeviceMismatchError(
            f"k_new, v_new, k_cache and v_cache are on device {device} but the current device is {current}; "
            f"call append_kv inside `with cupy.cuda.Device({device}):`"
        )
    if launch.instance and compute_capability(device) < 89:
        raise UnsupportedConfigError(
            f"an fp8 (e4m3) cache needs compute capability 8.9 or newer (cvt.rn.satfinite.e4m3x2); "
            f"device {device} has {compute_capability(device) / 10:.1f}"
        )
    if launch.num_tokens == 0 or table.batch_size == 0:  # nothing to write (a device append_indptr may
        return None                                     # pair an empty batch with new tokens)
    launch_append(k_new, v_new, k_cache, v_cache, table, kv_layout, launch)
    return None


# --------------------------------------------------------------------------- checks
def scale_as_cupy(scale, name: str):
    """A scale array as a CuPy array (a NumPy one is refused with a hint);
    anything without a shape, or a 0-d NumPy value, is left to _check_scale."""
    if not hasattr(scale, "shape") or (isinstance(scale, (np.ndarray, np.generic)) and scale.ndim == 0):
        return scale
    return _as_cupy(scale, name)


def _address(a) -> int:
    """Base address of a CuPy (``.data.ptr``) or NumPy array."""
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    return int(a.data.ptr)


def check_append(k_new, v_new, k_cache, v_cache, table, append_indptr, kv_layout, k_scale, v_scale) -> _Launch:
    """Every check of append_kv that reads no device memory; pure host code
    over array attributes (shape, dtype, strides, base address), so NumPy
    arrays stand in for CuPy ones in CPU tests. Returns the launch facts.
    On the hot path (one token per request, no scale): attribute reads and
    comparisons, one OR-ed alignment test, no allocation."""
    if not isinstance(table, PageTable):
        raise ArgumentTypeError(f"table must be a cupaged.PageTable, got {type(table).__name__}")
    if kv_layout != "NHD" and kv_layout != "HND":
        raise LayoutError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    _check_append_ranks(k_new, v_new, k_cache, v_cache, kv_layout)
    dtype, instance = _append_instance(k_new, v_new, k_cache, v_cache)
    tokens, num_kv_heads, head_dim = k_new.shape
    num_pages = _check_append_geometry(k_new.shape, k_cache.shape, kv_layout, table.page_size)
    elems = _check_append_layout(k_new, v_new, k_cache, v_cache, head_dim)
    k_scale = 1.0 if k_scale is None else _check_scale(k_scale, "k_scale", num_kv_heads)
    v_scale = 1.0 if v_scale is None else _check_scale(v_scale, "v_scale", num_kv_heads)
    append_indptr = _check_tokens_per_request(table, append_indptr, tokens)
    _check_distinct_slots(table, append_indptr)
    table.check_page_ids(num_pages)
    chunks = head_dim // elems
    grid = -(-tokens * num_kv_heads * chunks // _THREADS)
    if grid > _GRID_X_MAX:
        raise UnsupportedConfigError(
            f"{tokens} tokens x {num_kv_heads} heads need {grid} CTAs, beyond the grid limit {_GRID_X_MAX}; "
            "split the call"
        )
    return _Launch(dtype, instance, tokens, chunks, k_scale, v_scale, append_indptr)


def _check_append_ranks(k_new, v_new, k_cache, v_cache, kv_layout: str) -> None:
    """k_new/v_new 3-D and the caches 4-D, each pair of one shape."""
    new_shape, cache_shape = k_new.shape, k_cache.shape
    if len(new_shape) != 3 or v_new.ndim != 3:
        raise ShapeError(
            "k_new and v_new must be 3-D [tokens, num_kv_heads, head_dim], "
            f"got shapes {tuple(new_shape)} and {tuple(v_new.shape)}"
        )
    if new_shape != v_new.shape:
        raise ShapeError(f"k_new and v_new must have one shape, got {tuple(new_shape)} and {tuple(v_new.shape)}")
    if len(cache_shape) != 4 or v_cache.ndim != 4:
        layout = "[num_pages, page_size, num_kv_heads, head_dim]" if kv_layout == "NHD" else \
            "[num_pages, num_kv_heads, page_size, head_dim]"
        raise ShapeError(
            f"k_cache and v_cache must be 4-D {layout} ({kv_layout}), "
            f"got shapes {tuple(cache_shape)} and {tuple(v_cache.shape)}"
        )
    if cache_shape != v_cache.shape:
        raise ShapeError(
            f"k_cache and v_cache must have one shape, got {tuple(cache_shape)} and {tuple(v_cache.shape)}"
        )


def _append_instance(k_new, v_new, k_cache, v_cache) -> tuple[str, int]:
    """The new tokens' dtype name and the kernel instance: 0 stores them as
    they are, 1 converts them to fp8 (uint8 caches)."""
    new_dtype, cache_dtype = k_new.dtype, k_cache.dtype
    if new_dtype != v_new.dtype:
        raise DTypeError(f"k_new and v_new must share one dtype, got {new_dtype} and {v_new.dtype}")
    try:
        dtype = _configs.dtype_name(new_dtype)
    except ValueError:
        dtype = None
    if dtype not in _configs.APPEND_DTYPES:
        raise DTypeError(f"k_new and v_new have dtype {new_dtype}; supported: {', '.join(_configs.APPEND_DTYPES)}")
    if cache_dtype != v_cache.dtype:
        raise DTypeError(f"k_cache and v_cache must share one dtype, got {cache_dtype} and {v_cache.dtype}")
    if cache_dtype == new_dtype:
        return dtype, 0
    fmt = _configs.stored_format(cache_dtype)  # (uint8: fp8 e4m3fn bits)
    if fmt is not None and fmt.name in _configs.APPEND_CACHE_TYPES:
        return dtype, _configs.APPEND_CACHE_TYPES.index(fmt.name)
    raise DTypeError(
        f"the caches' dtype must be k_new's ({new_dtype}) or uint8 (float8 e4m3fn bits), got {cache_dtype}"
    )


def _check_append_geometry(new_shape, cache_shape, kv_layout: str, table_page_size: int) -> int:
    """Heads, head_dim and page size agree between k_new, the caches and
    the table, and the token count fits an int; returns the caches' pages."""
    tokens, num_kv_heads, head_dim = new_shape
    if kv_layout == "NHD":
        num_pages, page_size, cache_heads, cache_dim = cache_shape
    else:
        num_pages, cache_heads, page_size, cache_dim = cache_shape
    if num_kv_heads < 1 or head_dim < 1:
        raise ShapeError(f"k_new must have num_kv_heads >= 1 and head_dim >= 1, got shape {tuple(new_shape)}")
    if cache_heads != num_kv_heads or cache_dim != head_dim:
        raise ShapeError(
            f"k_new's (num_kv_heads, head_dim) = {(num_kv_heads, head_dim)} must equal the caches' "
            f"{(cache_heads, cache_dim)} (k_cache.shape = {tuple(cache_shape)}, {kv_layout})"
        )
    if page_size != table_page_size:
        raise ShapeError(
            f"the caches' page_size (k_cache.shape[{1 if kv_layout == 'NHD' else 2}] = {page_size}, {kv_layout}) "
            f"must equal table.page_size ({table_page_size})"
        )
    if tokens > _INT32_MAX:
        raise UnsupportedConfigError(f"at most {_INT32_MAX} new tokens per call, got {tokens}")
    return num_pages


def _check_append_layout(k_new, v_new, k_cache, v_cache, head_dim: int) -> int:
    """head_dim contiguous and whole 16-byte vectors, 16-byte aligned
    pointers and strides, K and V not one memory; returns the elements per
    16-byte vector."""
    isz, csz = k_new.itemsize, k_cache.itemsize
    elems = 16 // min(isz, csz)
    if head_dim % elems:
        raise UnsupportedConfigError(
            f"head_dim {head_dim} is not a whole number of 16-byte vectors for {k_new.dtype} -> {k_cache.dtype}: "
            f"it must be a multiple of {elems}"
        )
    ks, vs, kcs, vcs = k_new.strides, v_new.strides, k_cache.strides, v_cache.strides
    k_ptr, v_ptr, kc_ptr, vc_ptr = _address(k_new), _address(v_new), _address(k_cache), _address(v_cache)
    # (an empty k_new/v_new has all-zero strides in CuPy and is never read)
    new_bad = k_new.size and (ks[2] != isz or vs[2] != isz or (k_ptr | ks[0] | ks[1] | v_ptr | vs[0] | vs[1]) & 15)
    if (new_bad or kcs[3] != csz or vcs[3] != csz
            or (kc_ptr | kcs[0] | kcs[1] | kcs[2] | vc_ptr | vcs[0] | vcs[1] | vcs[2]) & 15):
        news = ((k_new, k_ptr), (v_new, v_ptr)) if new_bad else ()
        _raise_layout((*news, (k_cache, kc_ptr), (v_cache, vc_ptr)))
    if kc_ptr == vc_ptr and kcs == vcs and k_cache.size:
        raise LayoutError("k_cache and v_cache are the same memory: V would overwrite K")
    return elems


def _check_tokens_per_request(table: PageTable, append_indptr, tokens: int):
    """One new token per request (append_indptr None) with a visible slot
    each, or append_indptr's rules; returns the checked append_indptr."""
    batch = table.batch_size
    if append_indptr is not None:
        return _check_append_indptr(append_indptr, batch, tokens, table.seq_lens)
    if tokens != batch:
        raise ShapeError(
            f"with one token per request (append_indptr None), k_new.shape[0] = {tokens} must equal "
            f"table.batch_size ({batch}); pass append_indptr for several tokens per request"
        )
    if batch and _min_seq_len(table) < 1:
        i = int(np.argmin(table.seq_lens))
        raise InvalidArgumentError(
            f"request {i}: has no visible slot for its new token (seq_len 0 in the table); grow it first "
            "(pool.append(seq, 1), then pool.page_table)"
        )
    return None


def _raise_layout(arrays) -> None:
    """The LayoutError for the first array whose head_dim is not contiguous
    or whose pointer or strides are not multiples of 16 bytes."""
    names = ("k_new", "v_new", "k_cache", "v_cache")[4 - len(arrays):]
    for name, (a, ptr) in zip(names, arrays):
        strides = tuple(int(x) for x in a.strides)
        if strides[-1] != a.itemsize:
            raise LayoutError(
                f"{name}'s head_dim must be contiguous (last stride {a.itemsize} bytes), got strides {strides}"
            )
        if (ptr | functools.reduce(operator.or_, strides[:-1], 0)) & 15:
            raise LayoutError(
                f"{name} must have a 16-byte aligned base pointer and strides that are multiples of 16 bytes "
                f"(the kernel moves 16-byte vectors), got pointer {ptr:#x} and strides {strides}"
            )
    raise AssertionError("unreachable: some array broke a layout rule")  # pragma: no cover


# The smallest seq_len of a table (append_kv runs once per layer on one table).
_min_seq_lens: "weakref.WeakKeyDictionary[PageTable, int]" = weakref.WeakKeyDictionary()


def _min_seq_len(table: PageTable) -> int:
    m = _min_seq_lens.get(table)
    if m is None:
        m = _min_seq_lens[table] = int(table.seq_lens.min())
    return m


# Tables whose one-token-per-request slots are known distinct, and the last
# NumPy append_indptr (its bytes) found distinct for a table: append_kv runs
# once per layer with one table, so the check runs once per step.
_distinct_last_slots: "weakref.WeakSet[PageTable]" = weakref.WeakSet()
_distinct_indptr: "weakref.WeakKeyDictionary[PageTable, bytes]" = weakref.WeakKeyDictionary()


def _append_slots(table: PageTable, append_indptr: np.ndarray | None) -> np.ndarray:
    """The cache slot, ``page * page_size + entry`` (int64), that each new
    token goes to, in k_new's row order: the last visible slot of every
    request (``append_indptr`` None), or the last ``n_i`` of request ``i``.
    For arguments check_append has accepted (each request has the slots).

    >>> t = PageTable([3, 5, 5], [0, 2, 3], [2, 4], page_size=4)
    >>> _append_slots(t, None).tolist()                  # page 5 entry 1, page 5 entry 3
    [21, 23]
    >>> _append_slots(t, np.array([0, 3, 4], np.int32)).tolist()
    [15, 20, 21, 23]
    """
    P, indices = table.page_size, table.indices
    if append_indptr is None:  # the last used entry of each request's last page
        return indices[table.indptr[1:] - 1].astype(np.int64) * P + table.last_page_len - 1
    counts = np.diff(append_indptr.astype(np.int64))
    req = np.repeat(np.arange(table.batch_size), counts)
    token = np.arange(req.shape[0]) - append_indptr[req]  # j of request i's new token j
    pos = table.first_page_offset[req] + table.seq_lens[req] - counts[req] + token  # from its first page
    return indices[table.indptr[req] + pos // P].astype(np.int64) * P + pos % P


def _check_distinct_slots(table: PageTable, append_indptr) -> None:
    """Refuse two new tokens for one cache slot (a write race on the GPU):
    a table listing one sequence twice, a fork that did not grow before both
    write, or a request listing one page twice. Checked on the host for
    ``append_indptr`` None or a NumPy array, remembered per table; a device
    ``append_indptr`` stays the caller's contract."""
    if append_indptr is None:
        if table in _distinct_last_slots:
            return
    elif isinstance(append_indptr, np.ndarray):
        key = append_indptr.tobytes()
        if _distinct_indptr.get(table) == key:
            return
    else:
        return
    slots = _append_slots(table, append_indptr)
    ranked = np.sort(slots)
    if (ranked[1:] == ranked[:-1]).any():
        order = np.argsort(slots, kind="stable")
        dup = (slots[order[1:]] == slots[order[:-1]]).nonzero()[0]
        k = int(dup[np.argmin(order[dup + 1])])  # the pair whose second token comes first
        raise InvalidArgumentError(_slot_race_message(table, append_indptr, int(order[k]), int(order[k + 1]),
                                                      int(slots[order[k]])))
    if append_indptr is None:
        _distinct_last_slots.add(table)
    else:
        _distinct_indptr[table] = key


def _slot_race_message(table: PageTable, append_indptr, a: int, b: int, slot: int) -> str:
    """Name the two new tokens (rows ``a`` < ``b`` of k_new) and their slot."""
    P = table.page_size
    where = f"entry {slot % P} of page {slot // P}"
    if append_indptr is None:
        who = f"requests {a} and {b} would both write their new token to {where}"
    else:
        i, j = (int(np.searchsorted(append_indptr, t, side="right")) - 1 for t in (a, b))
        who = (f"request {i}'s new token {a - int(append_indptr[i])} and request {j}'s new token "
               f"{b - int(append_indptr[j])} would both write {where}")
    return (f"{who}: two writes to one cache slot race on the GPU. List each sequence once in an appending "
            "batch (pool.page_table([s, s]) gives both requests s's last slot) and grow a fork before it "
            "writes (pool.advance or pool.append, then pool.page_table)")


def _check_scale(scale, name: str, num_kv_heads: int):
    """A number (or 0-d NumPy value) -> a float; an array -> itself after its
    metadata checks (the launch makes it a contiguous [num_kv_heads]). The
    rules are decode's (_checks.scale_value, check_scale_array)."""
    if isinstance(scale, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be None, a float or a float32 array [num_kv_heads], got {scale!r}")
    if isinstance(scale, (int, float, np.number)) or (isinstance(scale, np.ndarray) and scale.ndim == 0):
        return scale_value(scale, name)
    if not (hasattr(scale, "shape") and hasattr(scale, "dtype") and hasattr(scale, "strides")):
        raise ArgumentTypeError(
            f"{name} must be None, a float or a float32 array [num_kv_heads], got {type(scale).__name__}"
        )
    check_scale_array(scale, name, num_kv_heads)
    return scale


def _check_append_indptr(append_indptr, batch: int, tokens: int, seq_lens: np.ndarray):
    """Metadata checks for any array; value checks for a NumPy one."""
    dtype = getattr(append_indptr, "dtype", None)
    if dtype is None or not hasattr(append_indptr, "shape"):
        raise ArgumentTypeError(
            f"append_indptr must be None or a 1-D int32 NumPy or CuPy array, got {type(append_indptr).__name__}"
        )
    if append_indptr.ndim != 1 or append_indptr.shape[0] != batch + 1:
        raise ShapeError(
            f"append_indptr must be 1-D [batch + 1] = [{batch + 1}], got shape {tuple(append_indptr.shape)}"
        )
    if dtype != np.int32:
        raise DTypeError(f"append_indptr must be int32 (the kernel reads int32), got {dtype}; it is never cast")
    if not isinstance(append_indptr, np.ndarray):  # a device array: the caller's contract
        if batch and int(append_indptr.strides[0]) != 4:
            raise LayoutError(f"a device append_indptr must be contiguous, got strides {tuple(append_indptr.strides)}")
        return append_indptr
    host = append_indptr
    if int(host[0]) != 0:
        raise InvalidArgumentError(f"append_indptr must start at 0, got append_indptr[0]={int(host[0])}")
    counts = np.diff(host.astype(np.int64))
    bad = np.flatnonzero(counts < 0)
    if bad.size:
        r = int(bad[0])
        raise InvalidArgumentError(
            f"append_indptr must never decrease, but append_indptr[{r}]={int(host[r])} > "
            f"append_indptr[{r + 1}]={int(host[r + 1])}"
        )
    if int(host[-1]) != tokens:
        raise InvalidArgumentError(
            f"append_indptr must end at k_new.shape[0] = {tokens} (the new tokens), got append_indptr[-1]="
            f"{int(host[-1])}"
        )
    over = np.flatnonzero(counts > seq_lens)
    if over.size:
        i = int(over[0])
        raise InvalidArgumentError(
            f"request {i}: appends {int(counts[i])} tokens but the table shows only {int(seq_lens[i])} visible "
            "slots; the table must already include the new tokens (pool.append, then pool.page_table)"
        )
    return host


# --------------------------------------------------------------------------- launch
def _per_head(scale, num_kv_heads: int):
    """A float as it is; a scale array as a contiguous [num_kv_heads] one
    (a [1] array is repeated, a strided one copied: device work, no sync)."""
    if isinstance(scale, float):
        return scale
    if scale.shape[0] != num_kv_heads:
        scale = scale.repeat(num_kv_heads)
    return scale if scale.flags.c_contiguous else scale.copy()


def launch_append(k_new, v_new, k_cache, v_cache, table: PageTable, kv_layout: str, launch: _Launch,
                   image: tuple | None = None) -> None:
    """Launches append_kv. ``image``: ``(table pointers (indices, indptr,
    last_page_len, first_page_offset), device batch pointer, tokens)`` of a
    DecodeRunner's plan image, in place of ``table.device()`` and the
    table's batch (a graph captured once, replayed for other tables)."""
    import cupy

    cache_axes = (0, 1, 2) if kv_layout == "NHD" else (0, 2, 1)  # (page, slot, head)
    append_indptr = launch.append_indptr
    if isinstance(append_indptr, np.ndarray):
        append_indptr = cupy.asarray(append_indptr)  # host->device copy: a device array avoids it
    num_kv_heads = k_new.shape[1]
    k_scale, v_scale = (_per_head(s, num_kv_heads) for s in (launch.k_scale, launch.v_scale))
    kernel = _loader.get_kernel("append", launch.dtype, _configs.APPEND_ANY_HEAD_DIM, launch.instance)
    tokens, table_args, device_batch = launch.num_tokens, table.device() if image is None else image[0], _NULL
    if image is not None:
        device_batch, tokens = np.uint64(image[1]), image[2]
    items = tokens * num_kv_heads * launch.chunks
    kernel(
        (-(-items // _THREADS), 1, 1), (_THREADS, 1, 1),
        (k_new, *elem_strides(k_new, (0, 1)), v_new, *elem_strides(v_new, (0, 1)),
         k_cache, *elem_strides(k_cache, cache_axes), v_cache, *elem_strides(v_cache, cache_axes),
         *table_args, _NULL if append_indptr is None else append_indptr, np.int32(table.batch_size),
         device_batch, np.int32(tokens), np.int32(num_kv_heads), np.int32(k_new.shape[2]), np.int32(table.page_size),
         _NULL if isinstance(k_scale, float) else k_scale, _NULL if isinstance(v_scale, float) else v_scale,
         np.float32(k_scale if isinstance(k_scale, float) else 1.0),
         np.float32(v_scale if isinstance(v_scale, float) else 1.0)),
    )

