"""cupaged.append_kv: the new tokens' K and V written through the page table.

CPU half: the argument checks (a pure function of array attributes, so NumPy
arrays stand in for CuPy ones), the kernel's registration, and the NumPy
emulation the GPU half compares against (itself checked on a hand-worked
case). GPU half (marker ``gpu``): the kernel against that emulation, byte for
byte: caches start as random bytes, the emulation writes only the target
slots, and every other byte of both caches (and of the buffers they are views
of) must be unchanged. Then a full decode step through a real BlockPool
against the float64 reference, plain and under CUDA-graph capture.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import _configs, reference
from cupaged import append as append_module
from cupaged.append import _append_slots, check_append
from cupaged.errors import (ArgumentTypeError, DTypeError, InvalidArgumentError, LayoutError, NoGPUError,
                            PageTableError, ShapeError, UnsupportedConfigError)
from helpers import make_table, rel_errors, visible_mask

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)  # float8 e4m3fn bits


# ------------------------------------------------------------------ the emulation
def e4m3_bits(x32: np.ndarray) -> np.ndarray:
    """float32 -> float8 e4m3fn bits, round to nearest even, saturating to +-448."""
    try:
        from cupaged.fp8 import to_e4m3
    except ImportError:
        to_e4m3 = None
    if to_e4m3 is not None:
        return np.asarray(to_e4m3(np.asarray(x32, np.float32)), dtype=np.uint8)
    return np.clip(x32, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _e4m3_bits_ml_dtypes(x32):
    return np.clip(x32, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def quantize(row: np.ndarray, scale, cache_dtype) -> np.ndarray:
    """What the kernel stores for ``row`` [Hkv, D]: the bytes unchanged for a
    same-dtype cache without scale, else float32 ``x * (1 / scale)`` (the
    reciprocal rounded once, per head for an array) rounded into the cache
    dtype (float16 saturating finite values, fp8 saturating to +-448)."""
    cache_dtype = np.dtype(cache_dtype)
    if scale is None and cache_dtype == row.dtype:
        return row.copy()
    x = row.astype(np.float32)
    if scale is None:
        q = x
    else:
        s = np.asarray(scale, dtype=np.float32)
        inv = (np.float32(1.0) / s).astype(np.float32)
        q = (x * (inv[:, None] if inv.ndim else inv)).astype(np.float32)
    if cache_dtype == U8:
        return e4m3_bits(q)
    if cache_dtype == F16:
        q = np.where(np.isfinite(q) & (np.abs(q) > 65504), np.sign(q) * np.float32(65504), q)
    return q.astype(cache_dtype)


def emulate_append(k_cache, v_cache, k_new, v_new, table, append_indptr=None, kv_layout="NHD",
                   k_scale=None, v_scale=None):
    """Writes the new tokens into host caches in place, with the kernel's
    rules: token j of request i (rows append_indptr[i]:append_indptr[i+1] of
    k_new, or row i alone) goes to visible slot seq_len_i - n_i + j; a token
    whose slot is negative, or with no row in k_new, is skipped."""
    B, P = table.batch_size, table.page_size
    starts = np.arange(B + 1) if append_indptr is None else np.asarray(append_indptr, dtype=np.int64)
    for i in range(B):
        n, L = int(starts[i + 1] - starts[i]), int(table.seq_lens[i])
        for j in range(n):
            t, s = int(starts[i]) + j, L - n + j
            if s < 0 or t >= k_new.shape[0]:
                continue
            pos = int(table.first_page_offset[i]) + s
            page, entry = int(table.indices[table.indptr[i] + pos // P]), pos % P
            for cache, new, scale in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
                row = quantize(new[t], scale, cache.dtype)
                if kv_layout == "NHD":
                    cache[page, entry] = row
                else:
                    cache[page, :, entry] = row


def test_emulation_on_a_hand_worked_case():
    # P = 4; request 0: 6 visible tokens from entry 3 of page 5 (pages 5, 2, 7;
    # slots 0..5 at (5,3) (2,0) (2,1) (2,2) (2,3) (7,0)); request 1 appends
    # nothing; request 2: 2 tokens on page 0 (entries 0, 1).
    table = cupaged.PageTable([5, 2, 7, 9, 0], [0, 3, 4, 5], [1, 4, 2], [3, 0, 0], page_size=4)
    assert table.seq_lens.tolist() == [6, 4, 2]
    k = np.zeros((10, 4, 1, 8), np.float32)
    v = np.zeros_like(k)
    k_new = np.arange(1, 5, dtype=np.float32)[:, None, None] * np.ones((4, 1, 8), np.float32)
    emulate_append(k, v, k_new, -k_new, table, np.array([0, 2, 2, 4], np.int32))
    written = {(p, e): k[p, e, 0, 0] for p, e in zip(*np.nonzero(k[:, :, 0, 0]))}
    assert written == {(2, 3): 1.0, (7, 0): 2.0, (0, 0): 3.0, (0, 1): 4.0}
    assert (v == -k).all()
    hnd = np.zeros((10, 1, 4, 8), np.float32)
    emulate_append(hnd, hnd.copy(), k_new, k_new, table, np.array([0, 2, 2, 4], np.int32), kv_layout="HND")
    assert np.array_equal(hnd[:, 0], k[:, :, 0])


def test_quantize_rounding_cases():
    x = np.array([[1.0625, 1.1875, 464.0, -1e9, np.inf, 2.0**-10, 3 * 2.0**-10, -0.0]], np.float32)
    bits = quantize(x, None, U8)[0]
    #             1.0   1.25  448   -448  448   0     2^-8  -0
    assert bits.tolist() == [0x38, 0x3a, 0x7e, 0xfe, 0x7e, 0x00, 0x02, 0x80]
    assert quantize(x, 2.0, U8)[0, 0] == 0x30  # 0.53125 -> 0.5 (nearest even)
    per_head = quantize(np.ones((2, 16), F16), np.array([1.0, 4.0], np.float32), U8)
    assert per_head[0].tolist() == [0x38] * 16 and per_head[1].tolist() == [0x28] * 16  # 1.0, 0.25
    big = quantize(np.array([[60000.0, 1e30, np.inf]], np.float32), 0.5, F16)
    assert big.tolist() == [[65504.0, 65504.0, np.inf]]
    assert quantize(np.ones((1, 8), BF16), None, BF16).dtype == BF16


def test_e4m3_helper_agrees_with_ml_dtypes():
    fp8 = pytest.importorskip("cupaged.fp8")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-4, 3, 4096)).astype(np.float32)
    x = np.concatenate([x, [1.0625, 1.1875, 464.0, 500.0, -1e9, 2.0**-10, 3 * 2.0**-10, -0.0]]).astype(np.float32)
    assert np.array_equal(np.asarray(fp8.to_e4m3(x)), _e4m3_bits_ml_dtypes(x))


# ------------------------------------------------------------------ CPU: checks
def aligned(shape, dtype, fill=0):
    """A 16-byte aligned C-contiguous NumPy array."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    buf = np.zeros(n + 16, np.uint8)
    off = -buf.ctypes.data % 16
    a = buf[off:off + n].view(dtype).reshape(shape)
    a[...] = fill
    return a


# 3 requests at P = 16 (40, 90, 17 visible tokens), a cache of 16 pages, 2 KV heads, head_dim 128.
TABLE = cupaged.PageTable.from_seq_lens([40, 90, 17], 16)
NEW, CACHE = (3, 2, 128), (16, 16, 2, 128)


def args(k_new=None, v_new=None, k_cache=None, v_cache=None, table=TABLE, append_indptr=None, kv_layout="NHD",
         k_scale=None, v_scale=None, dtype=F16, cache_dtype=None):
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    return dict(
        k_new=aligned(NEW, dtype) if k_new is None else k_new,
        v_new=aligned(NEW, dtype) if v_new is None else v_new,
        k_cache=aligned(CACHE, cache_dtype) if k_cache is None else k_cache,
        v_cache=aligned(CACHE, cache_dtype) if v_cache is None else v_cache,
        table=table, append_indptr=append_indptr, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale)


def _check(a):
    return check_append(a["k_new"], a["v_new"], a["k_cache"], a["v_cache"], a["table"], a["append_indptr"],
                         a["kv_layout"], a["k_scale"], a["v_scale"])


def pool_table(*lengths_and_picks):
    """A BlockPool table at P = 16 in a 16-page pool: ``lengths`` for the
    sequences, then the indices of those listed (a sequence may repeat)."""
    *lengths, picks = lengths_and_picks
    pool = cupaged.BlockPool(16, 16)
    seqs = [pool.add_sequence() for _ in lengths]
    pool.advance(seqs, list(lengths))
    return pool.page_table([seqs[i] for i in picks])[0]


def forked_table():
    """Sequence 0 ends on a full page and is forked but neither grew: the
    table lists that full page's last slot for both."""
    pool = cupaged.BlockPool(16, 16)
    a, c = pool.add_sequence(), pool.add_sequence()
    pool.advance([a, c], [32, 3])
    b, copies = pool.fork(a)
    assert copies == ()
    return pool.page_table([a, b, c])[0]


_SAME = aligned(CACHE, F16)
# row -> (class, message fragment, args)
REJECTIONS = {
    "table_not_a_page_table": (ArgumentTypeError, "table must be a cupaged.PageTable", args(table=TABLE.indptr)),
    "unknown_layout": (LayoutError, "kv_layout must be one of ('NHD', 'HND')", args(kv_layout="NDH")),
    "new_rank": (ShapeError, "k_new and v_new must be 3-D",
                 args(k_new=aligned((3, 256), F16), v_new=aligned((3, 256), F16))),
    "new_shapes_differ": (ShapeError, "k_new and v_new must have one shape", args(v_new=aligned((3, 2, 64), F16))),
    "cache_rank": (ShapeError, "must be 4-D [num_pages, num_kv_heads, page_size, head_dim] (HND)",
                   args(kv_layout="HND", k_cache=aligned((16, 16, 256), F16), v_cache=aligned((16, 16, 256), F16))),
    "cache_shapes_differ": (ShapeError, "k_cache and v_cache must have one shape",
                            args(v_cache=aligned((15, 16, 2, 128), F16))),
    "new_dtypes_differ": (DTypeError, "k_new and v_new must share one dtype", args(v_new=aligned(NEW, F32))),
    "unsupported_new_dtype": (DTypeError, "supported: float16, bfloat16, float32",
                              args(dtype=np.float64, cache_dtype=U8)),
    "cache_dtypes_differ": (DTypeError, "k_cache and v_cache must share one dtype",
                            args(v_cache=aligned(CACHE, U8))),
    "cache_dtype_not_new_or_fp8": (DTypeError, "must be k_new's (float16) or uint8 (float8 e4m3fn bits)",
                                   args(cache_dtype=F32)),
    "zero_heads": (ShapeError, "num_kv_heads >= 1 and head_dim >= 1",
                   args(k_new=aligned((3, 0, 128), F16), v_new=aligned((3, 0, 128), F16),
                        k_cache=aligned((16, 16, 0, 128), F16), v_cache=aligned((16, 16, 0, 128), F16))),
    "heads_differ": (ShapeError, "(num_kv_heads, head_dim) = (2, 128) must equal the caches' (4, 64)",
                     args(k_cache=aligned((16, 16, 4, 64), F16), v_cache=aligned((16, 16, 4, 64), F16))),
    "hnd_read_as_nhd": (ShapeError, "must equal the caches' (16, 128)",
                        args(k_cache=aligned((16, 2, 16, 128), F16), v_cache=aligned((16, 2, 16, 128), F16))),
    "page_size_differs": (ShapeError, "page_size (k_cache.shape[1] = 8, NHD) must equal table.page_size (16)",
                          args(k_cache=aligned((16, 8, 2, 128), F16), v_cache=aligned((16, 8, 2, 128), F16))),
    "batch_differs": (ShapeError, "k_new.shape[0] = 2 must equal table.batch_size (3)",
                      args(k_new=aligned((2, 2, 128), F16), v_new=aligned((2, 2, 128), F16))),
    "head_dim_not_whole_vectors": (UnsupportedConfigError, "it must be a multiple of 16",
                                   args(k_new=aligned((3, 2, 8), F16), v_new=aligned((3, 2, 8), F16),
                                        k_cache=aligned((16, 16, 2, 8), U8), v_cache=aligned((16, 16, 2, 8), U8))),
    "head_dim_not_contiguous": (LayoutError, "k_new's head_dim must be contiguous",
                                args(k_new=aligned((3, 2, 256), F16)[:, :, ::2])),
    "misaligned_pointer": (LayoutError, "v_cache must have a 16-byte aligned base pointer",
                           args(v_cache=aligned((16 * 16 * 2 * 128 + 4,), F16)[4:].reshape(CACHE))),
    "misaligned_stride": (LayoutError, "k_new must have a 16-byte aligned base pointer and strides",
                          args(k_new=aligned((3, 2, 132), F16)[:, :, :128])),
    "same_memory": (LayoutError, "k_cache and v_cache are the same memory", args(k_cache=_SAME, v_cache=_SAME)),
    "scale_zero": (InvalidArgumentError, "k_scale must be positive, finite", args(k_scale=0.0)),
    "scale_negative": (InvalidArgumentError, "v_scale must be positive, finite", args(v_scale=-1.0)),
    "scale_nan": (InvalidArgumentError, "k_scale must be positive, finite", args(k_scale=float("nan"))),
    "scale_subnormal": (InvalidArgumentError, "normal float32", args(k_scale=1e-40)),
    "scale_bool": (ArgumentTypeError, "k_scale must be None, a float", args(k_scale=True)),
    "scale_list": (ArgumentTypeError, "v_scale must be None, a float", args(v_scale=[1.0, 2.0])),
    "scale_shape": (ShapeError, "k_scale must have shape (2,) (one per kv head) or (1,)",
                    args(k_scale=aligned((3,), F32, 1))),
    "scale_dtype": (DTypeError, "v_scale must be float32", args(v_scale=aligned((2,), np.float64, 1))),
    "indptr_not_an_array": (ArgumentTypeError, "append_indptr must be None or a 1-D int32",
                            args(append_indptr=[0, 1, 2, 3])),
    "indptr_length": (ShapeError, "append_indptr must be 1-D [batch + 1] = [4]",
                      args(append_indptr=np.array([0, 3], np.int32))),
    "indptr_int64": (DTypeError, "append_indptr must be int32", args(append_indptr=np.array([0, 1, 2, 3]))),
    "indptr_start": (InvalidArgumentError, "append_indptr must start at 0",
                     args(append_indptr=np.array([1, 1, 2, 3], np.int32))),
    "indptr_decreases": (InvalidArgumentError, "append_indptr[1]=2 > append_indptr[2]=1",
                         args(append_indptr=np.array([0, 2, 1, 3], np.int32))),
    "indptr_end": (InvalidArgumentError, "must end at k_new.shape[0] = 3",
                   args(append_indptr=np.array([0, 1, 2, 2], np.int32))),
    "more_new_tokens_than_slots": (InvalidArgumentError, "request 2: appends 18 tokens but the table shows only 17",
                                   args(k_new=aligned((20, 2, 128), F16), v_new=aligned((20, 2, 128), F16),
                                        append_indptr=np.array([0, 1, 2, 20], np.int32))),
    "one_token_but_empty_request": (InvalidArgumentError, "request 1: has no visible slot",
                                    args(table=cupaged.PageTable.from_seq_lens([4, 0, 5], 16))),
    "one_sequence_twice": (InvalidArgumentError, "requests 0 and 2 would both write their new token to entry 3 of "
                           "page 1: two writes to one cache slot race on the GPU",
                           args(table=pool_table(20, 5, (0, 1, 0)))),
    "one_sequence_twice_several_tokens": (InvalidArgumentError, "request 0's new token 0 and request 2's new token 1 "
                                          "would both write entry 3 of page 1",
                                          args(table=pool_table(20, 5, (0, 1, 0)),
                                               append_indptr=np.array([0, 1, 1, 3], np.int32))),
    "fork_not_grown": (InvalidArgumentError, "requests 0 and 1 would both write their new token to entry 15 of page 1",
                       args(table=forked_table())),
    "one_page_twice_in_a_request": (InvalidArgumentError, "request 0's new token 0 and request 0's new token 16 would "
                                    "both write entry 15 of page 4",
                                    args(table=cupaged.PageTable([4, 4], [0, 2], [16], page_size=16),
                                         k_new=aligned((17, 2, 128), F16), v_new=aligned((17, 2, 128), F16),
                                         append_indptr=np.array([0, 17], np.int32))),
    "page_id_out_of_range": (PageTableError, "out of range for a cache of num_pages=10",
                             args(k_cache=aligned((10, 16, 2, 128), F16), v_cache=aligned((10, 16, 2, 128), F16))),
}


@pytest.mark.parametrize("row", list(REJECTIONS))
def test_rejections_cpu(row):
    cls, fragment, a = REJECTIONS[row]
    with pytest.raises(cls, match=re.escape(fragment)):
        _check(a)


@pytest.mark.parametrize("dtype, cache_dtype, chunks, instance", [
    (F16, F16, 16, 0), (BF16, BF16, 16, 0), (F32, F32, 32, 0), (F16, U8, 8, 1), (F32, U8, 8, 1)])
def test_valid_calls_cpu(dtype, cache_dtype, chunks, instance):
    launch = _check(args(dtype=dtype, cache_dtype=cache_dtype))
    assert (launch.dtype, launch.instance, launch.num_tokens, launch.chunks) == (
        _configs.dtype_name(dtype), instance, 3, chunks)
    assert launch.k_scale == 1.0 and launch.v_scale == 1.0 and launch.append_indptr is None


def test_valid_variants_cpu():
    # HND, strided views, several tokens per request with n_i = 0, scales
    hnd = aligned((16, 2, 32, 256), F16)[:, :, ::2, :128]  # slot stride doubled, head rows padded
    k_new = aligned((9, 5, 128), F16)[:, 1:3]  # a slice of a fused projection
    ap = np.array([0, 4, 4, 9], np.int32)
    scale = aligned((2,), F32, 0.5)
    v_hnd = aligned(hnd.shape, F16)
    launch = _check(args(k_new=k_new, v_new=k_new, k_cache=hnd, v_cache=v_hnd, kv_layout="HND",
                         append_indptr=ap, k_scale=scale, v_scale=np.float32(2)))
    assert launch.num_tokens == 9 and launch.append_indptr is ap
    assert launch.k_scale is scale and launch.v_scale == 2.0
    strided, single = aligned((4,), F32, 1)[::2], aligned((1,), F32, 3)
    launch = _check(args(k_scale=strided, v_scale=single))  # the launch repeats / copies them
    assert launch.k_scale is strided and launch.v_scale is single
    # zero new tokens
    empty = aligned((0, 2, 128), F16)
    assert _check(args(k_new=empty, v_new=empty, append_indptr=np.zeros(4, np.int32))).num_tokens == 0
    # a request may get exactly seq_len new tokens (its prefill)
    full = aligned((147, 2, 128), F16)
    assert _check(args(k_new=full, v_new=full, append_indptr=np.array([0, 40, 130, 147], np.int32))).num_tokens == 147
    # a sequence listed twice is fine when only one of its entries appends (the slots are distinct)
    twice = pool_table(20, 5, (0, 1, 0))
    assert _check(args(table=twice, append_indptr=np.array([0, 1, 3, 3], np.int32))).num_tokens == 3


def visible_slots(table):
    """Every visible slot (page * P + entry) per request, walking the CSR view
    the way a kernel does (independent of _append_slots' arithmetic)."""
    P, out = table.page_size, []
    for i in range(table.batch_size):
        lo, hi = int(table.indptr[i]), int(table.indptr[i + 1])
        slots = []
        for j in range(lo, hi):
            first = int(table.first_page_offset[i]) if j == lo else 0
            end = int(table.last_page_len[i]) if j == hi - 1 else P
            slots += [int(table.indices[j]) * P + e for e in range(first, end)]
        out.append(slots)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_append_slots_are_each_requests_last_visible_slots(seed):
    rng = np.random.default_rng(seed)
    P = int(rng.choice([1, 5, 16]))
    lens = rng.integers(1, 4 * P, 9)
    lens[:3] = [1, P, P + 1]
    table, _ = make_table(rng, lens, P, first_page_offset=rng.integers(0, P, 9))
    slots = visible_slots(table)
    assert _append_slots(table, None).tolist() == [s[-1] for s in slots]
    counts = [int(rng.integers(0, n + 1)) for n in table.seq_lens.tolist()]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    assert _append_slots(table, indptr).tolist() == [x for s, n in zip(slots, counts) for x in s[len(s) - n:]]


def test_slot_check_runs_once_per_table_and_indptr(monkeypatch):
    """append_kv runs once per layer with one table: the slot check computes
    once per table (and NumPy append_indptr), then remembers the answer."""
    calls = []
    monkeypatch.setattr(append_module, "_append_slots", lambda t, a: calls.append(a) or _append_slots(t, a))
    table = cupaged.PageTable.from_seq_lens([40, 90, 17], 16)
    for _ in range(3):
        _check(args(table=table))
    assert len(calls) == 1
    ap = np.array([0, 1, 2, 3], np.int32)
    for _ in range(3):
        _check(args(table=table, append_indptr=ap.copy()))
    _check(args(table=table, append_indptr=np.array([0, 0, 2, 3], np.int32)))
    assert len(calls) == 3
    twice = pool_table(20, 5, (0, 1, 0))
    for _ in range(2):                                # a refusal is not remembered: it stays refused
        with pytest.raises(InvalidArgumentError, match="race on the GPU"):
            _check(args(table=twice))
    assert len(calls) == 5


@pytest.mark.skipif(cupaged.has_gpu(), reason="checks the no-GPU behaviour")
def test_no_gpu_raises_first():
    with pytest.raises(NoGPUError, match="cupaged.append_kv"):
        cupaged.append_kv(None, None, None, None, None)


def test_registered_for_the_compile_check():
    for dtype in ("float16", "bfloat16", "float32"):
        names = _configs.name_expressions("append", dtype, _configs.APPEND_ANY_HEAD_DIM)
        t = _configs.DTYPES[dtype]
        assert names == [f"cupaged::append_kv<{t}, {t}>", f"cupaged::append_kv<{t}, cupaged::e4m3>"]
        assert ("append", dtype, _configs.APPEND_ANY_HEAD_DIM) in _configs.all_modules()
    assert sum(m[0] == "append" for m in _configs.all_modules()) == 3
    assert "append_kv" in cupaged.__all__


# ------------------------------------------------------------------ GPU
def _cp():
    import cupy

    return cupy


def random_bytes(rng, shape, dtype):
    """Random bit patterns (NaNs and infs included) of ``dtype``."""
    dtype = np.dtype(dtype)
    return rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def new_tokens(rng, shape, dtype, specials=False, spread=True):
    """Values spread over many binades (``spread``; else standard normal);
    with ``specials`` fp8's rounding and saturation cases first."""
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:
        x *= np.float32(10.0) ** rng.uniform(-3, 3, shape).astype(np.float32)
    if specials and shape[0]:
        cases = np.array([1.0625, 1.1875, 464.0, -1e4, np.inf, -np.inf, 2.0**-10, 3 * 2.0**-10, -0.0, 0.0,
                          448.0, 0.001953125], np.float32)
        flat = x.reshape(-1)
        flat[:cases.size] = cases
    return x.astype(dtype)


def assert_same_bytes(got, expected):
    g, e = np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(expected).view(np.uint8)
    diff = np.flatnonzero(g.reshape(-1) != e.reshape(-1))
    assert diff.size == 0, f"{diff.size} bytes differ, first at byte {diff[:8].tolist()}"


def run_case(seed, seq_lens, n_new, page_size, kv_layout="NHD", dtype=F16, cache_dtype=None, num_kv_heads=2,
             head_dim=128, k_scale=None, v_scale=None, device_indptr=False, mid_page=True, specials=False):
    """append_kv on random-byte caches vs the emulation, byte for byte.

    ``n_new[i]`` new tokens for request i (None: one token each, no
    append_indptr); ``seq_lens`` already include them."""
    cp = _cp()
    cache_dtype = np.dtype(dtype if cache_dtype is None else cache_dtype)
    rng = np.random.default_rng(seed)
    seq_lens = np.asarray(seq_lens)
    off = None
    if mid_page:
        off = np.where((np.arange(len(seq_lens)) % 2 == 1) & (seq_lens > 0),
                       rng.integers(0, page_size, len(seq_lens)), 0)
    table, num_pages = make_table(rng, seq_lens, page_size, off)
    shape = (num_pages, page_size, num_kv_heads, head_dim) if kv_layout == "NHD" else \
        (num_pages, num_kv_heads, page_size, head_dim)
    k_host, v_host = random_bytes(rng, shape, cache_dtype), random_bytes(rng, shape, cache_dtype)
    ap = None if n_new is None else np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    total = len(seq_lens) if ap is None else int(ap[-1])
    k_new = new_tokens(rng, (total, num_kv_heads, head_dim), dtype, specials)
    v_new = new_tokens(rng, (total, num_kv_heads, head_dim), dtype, specials)
    k_dev, v_dev = cp.asarray(k_host), cp.asarray(v_host)
    scales = [cp.asarray(s) if isinstance(s, np.ndarray) else s for s in (k_scale, v_scale)]
    indptr_arg = cp.asarray(ap) if device_indptr and ap is not None else ap
    result = cupaged.append_kv(cp.asarray(k_new), cp.asarray(v_new), k_dev, v_dev, table, append_indptr=indptr_arg,
                               kv_layout=kv_layout, k_scale=scales[0], v_scale=scales[1])
    cp.cuda.runtime.deviceSynchronize()
    assert result is None
    emulate_append(k_host, v_host, k_new, v_new, table, ap, kv_layout, k_scale, v_scale)
    assert_same_bytes(k_dev.get(), k_host)  # the new tokens hold no NaN, so every byte is exact
    assert_same_bytes(v_dev.get(), v_host)
    return table


@pytest.mark.gpu
@pytest.mark.parametrize("kv_layout, page_size, dtype", [
    ("NHD", 16, F16), ("HND", 16, BF16), ("NHD", 1, F32), ("HND", 1, F16), ("NHD", 256, BF16), ("HND", 256, F32)])
def test_one_token_per_request(kv_layout, page_size, dtype):
    # lengths around the page size, so new tokens land first, mid and last in a page
    lens = [1, page_size, page_size + 1, 2 * page_size - 1, 97, 1021]
    run_case(1, lens, None, page_size, kv_layout, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_layout, page_size, dtype, device_indptr", [
    ("NHD", 16, F16, False), ("HND", 16, F32, True), ("NHD", 1, BF16, True), ("HND", 256, F16, False),
    ("NHD", 256, F32, True)])
def test_several_tokens_per_request(kv_layout, page_size, dtype, device_indptr):
    # n_i = 0 (a zero-length request and a live one), n_i = seq_len (a
    # prefill), runs crossing page boundaries, half the requests mid-page
    lens = [5, 0, 40, 300, 17, 33, 1]
    n_new = [3, 0, 40, 37, 0, 20, 1]
    run_case(2, lens, n_new, page_size, kv_layout, dtype, device_indptr=device_indptr)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
@pytest.mark.parametrize("scales", ["none", "per_tensor", "per_head"])
def test_fp8_cache_bits(dtype, scales):
    k_scale, v_scale = {"none": (None, None), "per_tensor": (0.37, 3.0),
                        "per_head": (np.array([0.5, 0.013, 7.0, 1.0], np.float32),
                                     np.array([2.0, 0.3, 1.0, 100.0], np.float32))}[scales]
    for layout, n_new in (("NHD", None), ("HND", [2, 0, 31, 5])):
        run_case(3, [9, 4, 64, 5], n_new, 16, layout, dtype, U8, num_kv_heads=4, head_dim=64,
                 k_scale=k_scale, v_scale=v_scale, specials=True)


@pytest.mark.gpu
def test_fp8_nan_stays_nan():
    cp = _cp()
    table = cupaged.PageTable.from_seq_lens([3, 1], 16)
    new = np.full((2, 1, 16), np.nan, F16)
    new[:, :, 8:] = -np.nan
    k = cp.zeros((2, 16, 1, 16), cp.uint8)
    v = cp.zeros_like(k)
    cupaged.append_kv(cp.asarray(new), cp.asarray(new), k, v, table, k_scale=2.0)
    for got in (k.get(), v.get()):
        assert ((got[0, 2, 0] & 0x7F) == 0x7F).all() and ((got[1, 0, 0] & 0x7F) == 0x7F).all()
        got[0, 2], got[1, 0] = 0, 0
        assert not got.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
def test_same_dtype_with_scales(dtype):
    # x / scale rounded into the cache dtype (float16 saturates at 65504)
    run_case(4, [3, 20, 17], [1, 19, 2], 16, "NHD", dtype, k_scale=np.array([0.25, 1e-3], np.float32), v_scale=0.7)
    run_case(5, [3, 20, 17], None, 16, "HND", dtype, k_scale=3.0, v_scale=np.array([1.0, 0.01], np.float32))


@pytest.mark.gpu
def test_scale_arrays_of_one_or_strided():
    cp = _cp()
    rng = np.random.default_rng(11)
    table, num_pages = make_table(rng, [7, 30], 16, [0, 3])
    k_host, v_host = random_bytes(rng, (num_pages, 16, 2, 64), U8), random_bytes(rng, (num_pages, 16, 2, 64), U8)
    k_new, v_new = new_tokens(rng, (2, 2, 64), BF16), new_tokens(rng, (2, 2, 64), BF16)
    k_dev, v_dev = cp.asarray(k_host), cp.asarray(v_host)
    k_scale = cp.asarray(np.array([0.25, 9.0, 3.0, 9.0], np.float32))[::2]  # [0.25, 3.0], strided
    v_scale = cp.asarray(np.array([0.05], np.float32))  # one for every head
    cupaged.append_kv(cp.asarray(k_new), cp.asarray(v_new), k_dev, v_dev, table, k_scale=k_scale, v_scale=v_scale)
    cp.cuda.runtime.deviceSynchronize()
    emulate_append(k_host, v_host, k_new, v_new, table, k_scale=np.array([0.25, 3.0], np.float32),
                   v_scale=np.array([0.05, 0.05], np.float32))
    assert_same_bytes(k_dev.get(), k_host)
    assert_same_bytes(v_dev.get(), v_host)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [F16, U8], ids=str)
def test_strided_views_leave_the_rest_of_the_buffer_alone(cache_dtype):
    cp = _cp()
    rng = np.random.default_rng(6)
    P, H, D = 16, 2, 64
    table, num_pages = make_table(rng, [30, 3, 50], P, [0, 5, 9])
    # caches: every other page of a larger buffer, head rows padded by 16 elements
    buf_shape = (2 * num_pages, P, H, D + 16)
    bufs = [random_bytes(rng, buf_shape, cache_dtype) for _ in range(2)]
    view = (slice(None, None, 2), slice(None), slice(None), slice(0, D))
    # k_new and v_new: slices of one fused [tokens, Hq + 2 Hkv, D] projection
    qkv = new_tokens(rng, (3, 8 + 2 * H, D), F16)
    d_bufs = [cp.asarray(b) for b in bufs]
    d_qkv = cp.asarray(qkv)
    cupaged.append_kv(d_qkv[:, 8:8 + H], d_qkv[:, 8 + H:], d_bufs[0][view], d_bufs[1][view], table)
    cp.cuda.runtime.deviceSynchronize()
    emulate_append(bufs[0][view], bufs[1][view], qkv[:, 8:8 + H], qkv[:, 8 + H:], table)
    for got, expected in zip(d_bufs, bufs):
        assert_same_bytes(got.get(), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["too_many_for_the_slots", "ends_short", "ends_long", "starts_late", "decreasing"])
def test_device_append_indptr_never_writes_out_of_bounds(bad):
    """A device append_indptr is not checked: whatever its values, only
    visible slots are written (and exactly the emulated ones when it is
    monotone)."""
    cp = _cp()
    rng = np.random.default_rng(8)
    P, H, D = 16, 2, 64
    table, num_pages = make_table(rng, [4, 20, 9], P, [3, 0, 15])
    ap = {"too_many_for_the_slots": [0, 9, 10, 12], "ends_short": [0, 1, 3, 4], "ends_long": [0, 4, 8, 40],
          "starts_late": [3, 5, 9, 12], "decreasing": [0, 10, 2, 12]}[bad]
    ap = np.array(ap, np.int32)
    k_host = random_bytes(rng, (num_pages, P, H, D), F16)
    v_host = random_bytes(rng, (num_pages, P, H, D), F16)
    k_new, v_new = new_tokens(rng, (12, H, D), F16), new_tokens(rng, (12, H, D), F16)
    k_dev, v_dev = cp.asarray(k_host), cp.asarray(v_host)
    with pytest.raises(InvalidArgumentError):  # the same values from the host are refused
        cupaged.append_kv(cp.asarray(k_new), cp.asarray(v_new), k_dev, v_dev, table, append_indptr=ap)
    cupaged.append_kv(cp.asarray(k_new), cp.asarray(v_new), k_dev, v_dev, table, append_indptr=cp.asarray(ap))
    cp.cuda.runtime.deviceSynchronize()
    invisible = ~visible_mask(table, num_pages)
    for got, before in ((k_dev.get(), k_host), (v_dev.get(), v_host)):
        assert_same_bytes(got[invisible], before[invisible])
    if bad != "decreasing":
        emulate_append(k_host, v_host, k_new, v_new, table, ap)
        assert_same_bytes(k_dev.get(), k_host)
        assert_same_bytes(v_dev.get(), v_host)


@pytest.mark.gpu
def test_empty_calls_write_nothing():
    cp = _cp()
    table = cupaged.PageTable.from_seq_lens([5, 0], 16)
    k = cp.full((2, 16, 2, 64), 7, dtype=cp.float16)
    empty = cp.zeros((0, 2, 64), dtype=cp.float16)
    cupaged.append_kv(empty, empty, k, k.copy(), table, append_indptr=np.zeros(3, np.int32))
    cupaged.append_kv(empty, empty, k, k.copy(), cupaged.PageTable.from_seq_lens([], 16))
    # an empty batch with new tokens and a device append_indptr (unchecked): nothing to write
    new = cp.ones((3, 2, 64), dtype=cp.float16)
    cupaged.append_kv(new, new, k, k.copy(), cupaged.PageTable.from_seq_lens([], 16),
                      append_indptr=cp.zeros(1, cp.int32))
    cp.cuda.runtime.deviceSynchronize()
    assert (k.get() == 7).all()


@pytest.mark.gpu
def test_gpu_rejections():
    cp = _cp()
    table = cupaged.PageTable.from_seq_lens([5, 3], 16)
    k = cp.zeros((2, 16, 2, 64), dtype=cp.float16)
    new = cp.zeros((2, 2, 64), dtype=cp.float16)
    with pytest.raises(ArgumentTypeError, match="k_new must be a CuPy array"):
        cupaged.append_kv(new.get(), new, k, k.copy(), table)
    with pytest.raises(ArgumentTypeError, match="k_scale must be a CuPy array"):
        cupaged.append_kv(new, new, k, k.copy(), table, k_scale=np.ones(2, np.float32))
    with pytest.raises(LayoutError, match="same memory"):
        cupaged.append_kv(new, new, k, k, table)
    with pytest.raises(DTypeError, match="append_indptr must be int32"):
        cupaged.append_kv(new, new, k, k.copy(), table, append_indptr=cp.arange(3))


@pytest.mark.gpu
def test_gpu_two_tokens_for_one_slot_are_refused_before_the_launch():
    cp = _cp()
    pool = cupaged.BlockPool(8, 16)
    s = pool.add_sequence()
    pool.advance([s], 5)
    table, _ = pool.page_table([s, s])
    k, v = cp.zeros((8, 16, 2, 64), dtype=cp.float16), cp.zeros((8, 16, 2, 64), dtype=cp.float16)
    new = cp.ones((2, 2, 64), dtype=cp.float16)
    with pytest.raises(InvalidArgumentError, match="requests 0 and 1 would both write their new token to entry 4 "
                                                   "of page 0"):
        cupaged.append_kv(new, new, k, v, table)
    cp.cuda.Device().synchronize()
    assert not bool(k.any()) and not bool(v.any())


def _decode_step_setup(rng, P=16, Hkv=2, D=128, dtype=F16, num_pages=48):
    pool = cupaged.BlockPool(num_pages=num_pages, page_size=P)
    prompts = [1, 15, 16, 33, 100]
    seqs = [pool.add_sequence() for _ in prompts]
    for s, n in zip(seqs, prompts):
        pool.append(s, n)
    pool.trim_front(seqs[4], 37)  # a sliding window now starting mid-page
    shape = (num_pages, P, Hkv, D)
    k_host = rng.standard_normal(shape, dtype=np.float32).astype(dtype)  # "the prefill"
    v_host = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return pool, seqs, k_host, v_host


@pytest.mark.gpu
def test_decode_step_through_a_pool():
    """pool.append -> page_table -> append_kv -> decode, three steps; the
    caches equal the emulation's and decode equals the float64 reference."""
    cp = _cp()
    rng = np.random.default_rng(9)
    Hq, Hkv, D = 8, 2, 128
    pool, seqs, k_host, v_host = _decode_step_setup(rng, Hkv=Hkv, D=D)
    k_dev, v_dev = cp.asarray(k_host), cp.asarray(v_host)
    for step in range(3):
        for s in seqs:
            pool.append(s, 1)
        table, _ = pool.page_table(seqs)
        k_new = new_tokens(rng, (len(seqs), Hkv, D), F16, spread=False)
        v_new = new_tokens(rng, (len(seqs), Hkv, D), F16, spread=False)
        q = rng.standard_normal((len(seqs), Hq, D), dtype=np.float32).astype(F16)
        cupaged.append_kv(cp.asarray(k_new), cp.asarray(v_new), k_dev, v_dev, table)
        out = cupaged.decode(cp.asarray(q), k_dev, v_dev, table).get()
        emulate_append(k_host, v_host, k_new, v_new, table)
        assert_same_bytes(k_dev.get(), k_host)
        assert_same_bytes(v_dev.get(), v_host)
        ref, _ = reference.decode(q, k_host, v_host, table)
        max_rel, rel_rms = rel_errors(out, ref)
        assert max_rel <= 2e-2 and rel_rms <= 2e-2, (step, max_rel, rel_rms)


@pytest.mark.gpu
def test_decode_step_captures_in_a_cuda_graph():
    """append_kv + decode need no host round trip: both capture into one
    CUDA graph (a sync or a host copy would fail the capture), and each
    replay writes and reads the current new tokens."""
    cp = _cp()
    rng = np.random.default_rng(10)
    Hq, Hkv, D = 8, 2, 128
    pool, seqs, k_host, v_host = _decode_step_setup(rng, Hkv=Hkv, D=D)
    k_dev, v_dev = cp.asarray(k_host), cp.asarray(v_host)
    for s in seqs:
        pool.append(s, 1)
    table, _ = pool.page_table(seqs)
    plan = cupaged.plan_decode(table, Hq, Hkv, D, F16)
    B = len(seqs)
    k_new, v_new = cp.zeros((B, Hkv, D), cp.float16), cp.zeros((B, Hkv, D), cp.float16)
    q, out = cp.zeros((B, Hq, D), cp.float16), cp.empty((B, Hq, D), cp.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        table.device()
        cupaged.append_kv(k_new, v_new, k_dev, v_dev, table)  # warm-up: compile, plan buffers
        cupaged.decode(q, k_dev, v_dev, table, plan, out=out)
        stream.synchronize()
        stream.begin_capture()
        cupaged.append_kv(k_new, v_new, k_dev, v_dev, table)
        cupaged.decode(q, k_dev, v_dev, table, plan, out=out)
        graph = stream.end_capture()
        for replay in range(2):  # the same slots, new values each time
            kn, vn = new_tokens(rng, (B, Hkv, D), F16, spread=False), new_tokens(rng, (B, Hkv, D), F16, spread=False)
            qh = rng.standard_normal((B, Hq, D), dtype=np.float32).astype(F16)
            k_new.set(kn, stream=stream)
            v_new.set(vn, stream=stream)
            q.set(qh, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            emulate_append(k_host, v_host, kn, vn, table)
            assert_same_bytes(k_dev.get(), k_host)
            ref, _ = reference.decode(qh, k_host, v_host, table)
            assert rel_errors(out.get(), ref)[0] <= 2e-2, replay
