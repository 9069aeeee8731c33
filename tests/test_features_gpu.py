"""GPU tests of the serving features (issue 6) against the float64 reference.

fp8 KV caches (uint8 e4m3 bits under float16/bfloat16 q; no, per-tensor and
per-head scales), ``logits_soft_cap``, the HND layout, head_dim 96, GQA groups
1..8 and 16, page sizes 1, 3, 16 and 256, a custom ``sm_scale``, and k/v
scales on 16/32-bit caches, each checked with ``cupaged.decode`` against
``cupaged.reference.decode`` with the same arguments. The batches are
adversarial (tests/helpers.py): shuffled physical pages from a pool with 2x
slack, ragged lengths, half the requests starting mid-page, and every slot no
request can see holds NaN (fp8: the e4m3 NaN bits 0x7f). ``out`` is poisoned
with NaN before each launch, ``return_lse=True`` every time, and the device is
synchronized after the launch.

The generator tests at the end run on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from helpers import (
    E4M3_NAN,
    HEAD_MAGNITUDES,
    RAGGED_LENS,
    check_close,
    make_caches,
    make_fp8_caches,
    make_query,
    make_table,
    rel_errors,
    to_hnd,
    tolerance,
    visible_mask,
)

import cupaged
from cupaged import fp8, reference

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
DTYPES = [F16, BF16, F32]
FP8 = "float8_e4m3fn"
METHODS = ["v2", "v1", "gather"]

gpu = pytest.mark.gpu


def _cp():
    import cupy

    return cupy


@dataclass
class Batch:
    """Device and host tensors of one batch plus the feature arguments (host
    ones for the reference, device ones for decode)."""

    table: Any
    q: Any
    k: Any
    v: Any
    host: tuple
    dtype: np.dtype
    kv_dtype: Any
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    ref_kw: dict = field(default_factory=dict)
    dev_kw: dict = field(default_factory=dict)

    def plan(self, pages_per_chunk=None, **kw):
        extra = {} if self.kv_dtype is None else {"kv_dtype": self.kv_dtype}
        return cupaged.plan_decode(self.table, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.dtype,
                                   pages_per_chunk=pages_per_chunk, **extra, **kw)

    def reference(self, **kw):
        return reference.decode(*self.host, self.table, **{**self.ref_kw, **kw})

    @property
    def dev(self):
        return self.q, self.k, self.v


def make_batch(seed, seq_lens, *, page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=F16,
               kv_dtype=None, scale_mode="none", kv_layout="NHD", mid_page=True):
    """An adversarial batch. ``kv_dtype=FP8`` gives uint8 e4m3 caches
    (helpers.make_fp8_caches, whose scales follow ``scale_mode``); a 16/32-bit
    cache with ``scale_mode`` "tensor" or "head" gets scales 0.37 / 1.9 or
    HEAD_MAGNITUDES (K) and their reverse (V)."""
    cp = _cp()
    rng = np.random.default_rng(seed)
    seq_lens = np.asarray(seq_lens)
    off = None
    if mid_page and page_size > 1:  # half the requests start mid-page
        off = np.where(np.arange(len(seq_lens)) % 2 == 1, rng.integers(1, page_size, len(seq_lens)), 0)
        off = np.where(seq_lens > 0, off, 0)
    table, num_pages = make_table(rng, seq_lens, page_size, off)
    if kv_dtype == FP8:
        k, v, k_scale, v_scale = make_fp8_caches(rng, table, num_pages, num_kv_heads, head_dim, scale_mode)
    else:
        k, v = make_caches(rng, table, num_pages, num_kv_heads, head_dim, dtype)
        k_scale = v_scale = None
        if scale_mode == "tensor":
            k_scale, v_scale = 0.37, 1.9
        elif scale_mode == "head":
            k_scale = np.resize(np.array(HEAD_MAGNITUDES, np.float32), num_kv_heads)
            v_scale = k_scale[::-1].copy()
    if kv_layout == "HND":
        k, v = to_hnd(k), to_hnd(v)
    q = make_query(rng, len(seq_lens), num_qo_heads, head_dim, dtype)
    b = Batch(table, cp.asarray(q), cp.asarray(k), cp.asarray(v), (q, k, v), np.dtype(dtype), kv_dtype,
              num_qo_heads, num_kv_heads, head_dim)
    if kv_layout != "NHD":
        b.ref_kw["kv_layout"] = b.dev_kw["kv_layout"] = kv_layout
    if k_scale is not None:
        b.ref_kw.update(k_scale=k_scale, v_scale=v_scale)
        b.dev_kw.update({name: s if isinstance(s, float) else cp.asarray(s, dtype=cp.float32)
                         for name, s in (("k_scale", k_scale), ("v_scale", v_scale))})
    return b


def run(method, b: Batch, plan=None, **kw):
    """decode with a NaN-poisoned out and return_lse; host (out, lse) float64."""
    cp = _cp()
    out = cp.full(b.q.shape, np.nan, dtype=b.q.dtype)
    res, lse = cupaged.decode(b.q, b.k, b.v, b.table, plan, method=method, out=out, return_lse=True,
                              **{**b.dev_kw, **kw})
    cp.cuda.runtime.deviceSynchronize()  # surfaces asynchronous kernel faults here
    assert res is out
    out_h = out.get().astype(np.float64)
    assert np.isfinite(out_h).all(), "output not fully written (NaN left from the poison) or a NaN slot read"
    return out_h, lse.get().astype(np.float64)


def check(got, want, dtype):
    """``got``, ``want``: (out, lse). The tolerance of q's dtype (fp8 caches:
    the kernels compute in float32 from the exact dequantized values)."""
    return check_close(*got, *want, dtype)[0]


def differs(a, b, tol):
    """True when the two float64 outputs differ by more than 3x ``tol`` (so a
    kernel that ignored the feature would fail ``check``)."""
    return rel_errors(a, b)[0] > 3 * tol


# --------------------------------------------------------------------- fp8 KV


@gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])  # (80 and 256: no fp8 instance, gather)
@pytest.mark.parametrize("scale_mode", ["none", "tensor", "head"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_fp8_kv_matches_reference(dtype, scale_mode, head_dim):
    b = make_batch(40, [*RAGGED_LENS, 0], head_dim=head_dim, dtype=dtype, kv_dtype=FP8, scale_mode=scale_mode)
    assert b.k.dtype == np.uint8
    want = b.reference()
    # one chunk per page (merged) and one chunk per request (no merge)
    merged, single = b.plan(pages_per_chunk=1), b.plan(pages_per_chunk=10**6)
    assert merged.needs_merge and not single.needs_merge
    assert merged.kv_dtype == single.kv_dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    for plan in (merged, single, None):
        check(run("v2", b, plan), want, dtype)
    if scale_mode != "none":  # the scales matter: without them the answer is far off
        assert differs(want[0], reference.decode(*b.host, b.table)[0], tolerance(dtype))


@gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_fp8_every_code_widens_exactly(dtype, head_dim):
    """Requests of one visible token: the output is that token's V row exactly
    (the softmax of one score is 1, and every e4m3 value is an f16 and a bf16
    value) and the LSE its score, for every finite e4m3 code. KV head 0 holds
    the positive subnormals alone, so a widening that flushed them, or got the
    exponent bias wrong, zeroes or scales its rows and scores."""
    cp = _cp()
    hkv, group = 8, 4
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    rows = np.empty((hkv, head_dim), np.uint8)
    rows[0] = np.resize(np.arange(1, 8, dtype=np.uint8), head_dim)
    rows[1:] = np.resize(finite, (hkv - 1, head_dim))
    assert set(finite) <= set(rows[1:].ravel().tolist())
    table, num_pages = make_table(np.random.default_rng(7), [1, 1, 1], 16)
    k = np.broadcast_to(rows, (num_pages, 16, hkv, head_dim)).copy()
    v = np.broadcast_to(np.roll(rows, 3, axis=1), k.shape).copy()
    q = np.ones((3, hkv * group, head_dim), dtype)
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    _, lse = cupaged.decode(cp.asarray(q), cp.asarray(k), cp.asarray(v), table, sm_scale=1.0, out=out,
                            return_lse=True)
    cp.cuda.runtime.deviceSynchronize()
    want_v = np.repeat(fp8.from_e4m3(v[0, 0]).astype(np.float64), group, axis=0)  # [Hq, D]
    np.testing.assert_array_equal(out.get().astype(np.float64), np.broadcast_to(want_v, q.shape))
    _, want_lse = reference.decode(q, k, v, table, sm_scale=1.0)
    k_abs = np.repeat(np.abs(fp8.from_e4m3(rows).astype(np.float64)).sum(axis=1), group) * math.log2(math.e)
    # (tensor-core f32 accumulation of exact products: far inside 1e-4 of sum |k|)
    ratio = np.abs(lse.get() - want_lse) / (1e-4 * k_abs + 1e-6)
    worst = np.unravel_index(ratio.argmax(), ratio.shape)
    assert ratio.max() < 1, f"LSE off by {ratio.max():.3g}x the tolerance at (request, head) {worst}"
    assert np.abs(want_lse[:, :group]).min() > 0.5  # (the subnormal head's score is not negligible)


@gpu
@pytest.mark.parametrize("method", ["v1", "gather"])
@pytest.mark.parametrize("scale_mode", ["tensor", "head"])
def test_fp8_kv_other_methods(method, scale_mode):
    b = make_batch(41, [1, 17, 300, 0, 1021], kv_dtype=FP8, scale_mode=scale_mode, dtype=BF16)
    check(run(method, b), b.reference(), BF16)


@gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_fp8_kv_with_hnd_soft_cap_and_gqa(dtype):
    b = make_batch(42, [5, 1000, 16, 257], num_qo_heads=48, num_kv_heads=8, head_dim=96, dtype=dtype,
                   kv_dtype=FP8, scale_mode="head", kv_layout="HND", page_size=32)
    kw = {"logits_soft_cap": 20.0, "sm_scale": 6 / math.sqrt(96)}
    want = b.reference(**kw)
    assert differs(want[0], b.reference(sm_scale=kw["sm_scale"])[0], tolerance(dtype))  # the cap bites
    for c in (1, None):
        check(run("v2", b, b.plan(pages_per_chunk=c), **kw), want, dtype)


# ----------------------------------------------------------------- soft cap


@gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cap", [5.0, 30.0])
def test_soft_cap_every_method(method, dtype, cap):
    b = make_batch(43, [*RAGGED_LENS, 0], dtype=dtype)
    sm_scale = 8 / math.sqrt(128)  # logits of std ~8: the cap changes the result
    want = b.reference(sm_scale=sm_scale, logits_soft_cap=cap)
    assert differs(want[0], b.reference(sm_scale=sm_scale)[0], tolerance(dtype))
    plans = (b.plan(pages_per_chunk=1), None) if method == "v2" else (None,)
    for plan in plans:
        check(run(method, b, plan, sm_scale=sm_scale, logits_soft_cap=cap), want, dtype)


@gpu
def test_soft_cap_zero_and_none_are_off():
    b = make_batch(44, [100, 37, 1])
    want = b.reference()
    for off in (None, 0, 0.0):
        check(run("v2", b, logits_soft_cap=off), want, F16)


# --------------------------------------------------------------- HND layout


@gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hnd_layout_every_method(method, dtype):
    b = make_batch(45, [*RAGGED_LENS, 0], dtype=dtype, kv_layout="HND")
    assert b.k.shape[1] == 8 and b.k.shape[2] == 16  # [num_pages, Hkv, P, D]
    want = b.reference()
    # the same numbers as the NHD reference of the transposed caches
    nhd = reference.decode(b.host[0], b.host[1].transpose(0, 2, 1, 3), b.host[2].transpose(0, 2, 1, 3), b.table)
    np.testing.assert_array_equal(want[0], nhd[0])
    plans = (b.plan(pages_per_chunk=1), b.plan(pages_per_chunk=10**6)) if method == "v2" else (None,)
    for plan in plans:
        check(run(method, b, plan), want, dtype)


@gpu
def test_hnd_strided_slice_of_a_larger_buffer():
    cp = _cp()
    b = make_batch(46, [100, 257, 31], kv_layout="HND")
    want = b.reference()
    big_k = cp.full((b.k.shape[0] * 2, *b.k.shape[1:]), np.nan, dtype=b.k.dtype)
    big_v = cp.full_like(big_k, np.nan)
    big_k[::2], big_v[::2] = b.k, b.v
    b.k, b.v = big_k[::2], big_v[::2]
    assert not b.k.flags.c_contiguous
    check(run("v2", b), want, F16)


# ------------------------------------------------------------- head_dim 96


@gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dim_96(method, dtype):
    b = make_batch(47, [*RAGGED_LENS, 0], head_dim=96, dtype=dtype)
    want = b.reference()
    plans = (b.plan(pages_per_chunk=1), b.plan(pages_per_chunk=10**6), None) if method == "v2" else (None,)
    for plan in plans:
        check(run(method, b, plan), want, dtype)


# --------------------------------------------------------------- GQA groups


def _ragged(rng, n=32, page_size=16):
    """n ragged lengths: 1, page-1, page, page+1 and random ones up to 700."""
    fixed = [1, page_size - 1, page_size, page_size + 1]
    return np.array(fixed + list(rng.integers(1, 700, n - len(fixed))))


@gpu
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_gqa_groups(group, dtype):
    lens = _ragged(np.random.default_rng(48 + group))
    b = make_batch(48, lens, num_qo_heads=4 * group, num_kv_heads=4, dtype=dtype)
    want = b.reference()
    for plan in (b.plan(pages_per_chunk=1), b.plan(pages_per_chunk=10**6), None):
        check(run("v2", b, plan), want, dtype)
    check(run("v1", b), want, dtype)


@gpu
@pytest.mark.parametrize("group", [3, 5, 7, 16])
def test_gqa_groups_fp8(group):
    lens = _ragged(np.random.default_rng(49 + group))
    b = make_batch(49, lens, num_qo_heads=2 * group, num_kv_heads=2, kv_dtype=FP8, scale_mode="head")
    want = b.reference()
    for plan in (b.plan(pages_per_chunk=1), None):
        check(run("v2", b, plan), want, F16)


# --------------------------------------------------------------- page sizes


@gpu
@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
@pytest.mark.parametrize("kv", ["float16", FP8])
def test_page_sizes(page_size, kv):
    lens = [1, page_size + 1, 3 * page_size - 1, 1000, 0]
    b = make_batch(50, lens, page_size=page_size, kv_dtype=FP8 if kv == FP8 else None,
                   scale_mode="tensor" if kv == FP8 else "none")
    want = b.reference()
    for plan in (b.plan(pages_per_chunk=1), b.plan(pages_per_chunk=10**6), None):
        check(run("v2", b, plan), want, F16)
    if kv != FP8:
        for method in ("v1", "gather"):
            check(run(method, b), want, F16)


# ---------------------------------------------------- sm_scale and k/v scales


@gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("sm_scale", [0.02, 0.3])
def test_custom_sm_scale(method, sm_scale):
    b = make_batch(51, [*RAGGED_LENS, 0])
    want = b.reference(sm_scale=sm_scale)
    assert differs(want[0], b.reference()[0], 2e-2)
    check(run(method, b, sm_scale=sm_scale), want, F16)


@gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale_mode", ["tensor", "head"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scales_on_16_and_32_bit_caches(method, scale_mode, dtype):
    b = make_batch(52, [*RAGGED_LENS, 0], dtype=dtype, scale_mode=scale_mode)
    want = b.reference()
    assert differs(want[0], reference.decode(*b.host, b.table)[0], tolerance(dtype))
    check(run(method, b), want, dtype)


# ---------------------------------------------------- unsupported combinations


@gpu
def test_unsupported_combinations_raise_listing_what_is_supported():
    cp = _cp()
    b = make_batch(53, [40, 90], kv_dtype=FP8)
    q32 = b.q.astype(cp.float32)
    # an fp8 cache under a float32 q
    with pytest.raises(ValueError, match=r"(?s)float16.*bfloat16|bfloat16.*float16"):
        cupaged.decode(q32, b.k, b.v, b.table)
    with pytest.raises(ValueError, match=r"(?s)float16.*bfloat16|bfloat16.*float16"):
        cupaged.plan_decode(b.table, 32, 8, 128, np.float32, kv_dtype=FP8)
    # an unknown layout
    with pytest.raises(ValueError, match=r"(?s)NHD.*HND|HND.*NHD"):
        cupaged.decode(b.q, b.k, b.v, b.table, kv_layout="XYZ")
    # scales of the wrong shape (8 KV heads)
    for bad in (cp.ones(3, dtype=cp.float32), cp.ones((8, 1), dtype=cp.float32), cp.ones(32, dtype=cp.float32)):
        with pytest.raises(ValueError, match="k_scale"):
            cupaged.decode(b.q, b.k, b.v, b.table, k_scale=bad)
        with pytest.raises(ValueError, match="v_scale"):
            cupaged.decode(b.q, b.k, b.v, b.table, v_scale=bad)
    # per-tensor scales outside the normal float32 range (inf or 0 in the kernel)
    for bad in (1e39, 1e-50, 0.0, -2.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="v_scale"):
            cupaged.decode(b.q, b.k, b.v, b.table, v_scale=bad)
        with pytest.raises(ValueError, match="k_scale"):
            cupaged.decode(b.q, b.k, b.v, b.table, k_scale=bad)
    # a negative or non-finite soft cap
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            cupaged.decode(b.q, b.k, b.v, b.table, logits_soft_cap=bad)
    # a plan for 16-bit caches used with an fp8 cache (and the reverse)
    f16_plan = cupaged.plan_decode(b.table, 32, 8, 128, np.float16)
    with pytest.raises(ValueError):
        cupaged.decode(b.q, b.k, b.v, b.table, f16_plan, method="v2")
    # mixed caches: one fp8, one float16
    with pytest.raises(ValueError):
        cupaged.decode(b.q, b.k, b.v.astype(cp.float16), b.table)



@gpu
def test_empty_batch_with_out():
    """A batch of zero requests with ``out`` given: CuPy gives the empty
    arrays all-zero strides, which the layout check must not reject."""
    cp = _cp()
    table = cupaged.PageTable.from_seq_lens([], 16)
    q = cp.empty((0, 32, 128), dtype=cp.float16)
    k = cp.zeros((4, 16, 8, 128), dtype=cp.float16)
    for method in METHODS:
        out = cp.empty_like(q)
        assert cupaged.decode(q, k, k, table, method=method, out=out) is out


@gpu
def test_autotune_hnd(tmp_path, monkeypatch):
    """tune / tuned_plan read num_kv_heads from the layout's head axis and time
    the kernel on HND caches: the tuned plan decodes them correctly."""
    from cupaged import autotune

    monkeypatch.setenv(autotune.ENV_CACHE_DIR, str(tmp_path))
    b = make_batch(61, [300, 2000, 45], kv_layout="HND")
    result = autotune.tune(*b.dev, b.table, kv_layout="HND")
    assert result.best in result.timings_us and all(t > 0 for t in result.timings_us.values())
    plan = autotune.tuned_plan(*b.dev, b.table, kv_layout="HND")
    assert plan.pages_per_chunk == result.best and plan.num_kv_heads == 8
    out, lse = run("v2", b, plan)
    check_close(out, lse, *b.reference(), b.dtype)


@gpu
def test_fp8_below_cc89_declines_to_gather(monkeypatch):
    """The e4m3 conversions need compute capability 8.9: on an older GPU (the
    capability faked here) fp8 decode takes the gather path, and says why."""
    import importlib

    checks = importlib.import_module("cupaged._checks")
    b = make_batch(62, [70, 500], kv_dtype=FP8, scale_mode="tensor")
    monkeypatch.setattr(checks, "compute_capability", lambda device_id: 80)
    sel = cupaged.select_method(*b.dev, b.table, method="v2")
    assert sel.method == "gather" and "8.9" in sel.reason
    out, lse = run("v2", b)
    check_close(out, lse, *b.reference(), b.dtype)

# ------------------------------------------------ the generators (CPU only)


def test_make_fp8_caches_generator():
    rng = np.random.default_rng(0)
    table, num_pages = make_table(rng, [5, 17, 0, 1], 4, [1, 0, 0, 3])
    mask = visible_mask(table, num_pages)[:, :, None, None]
    for mode in ("none", "tensor", "head"):
        k, v, ks, vs = make_fp8_caches(rng, table, num_pages, 3, 8, mode)
        assert k.dtype == v.dtype == np.uint8 and k.shape == (num_pages, 4, 3, 8)
        invisible = np.broadcast_to(~mask, k.shape)
        assert (k[invisible] == E4M3_NAN).all() and (v[invisible] == E4M3_NAN).all()
        assert not ((k[~invisible] & 0x7F) == 0x7F).any()  # no NaN where visible
        real = fp8.from_e4m3(k, ks, head_axis=2 if mode == "head" else None)
        if mode == "none":
            assert ks is None and vs is None
        elif mode == "tensor":
            assert isinstance(ks, float) and np.nanmax(np.abs(real)) == pytest.approx(448 * ks, rel=1e-6)
        else:
            assert ks.shape == (3,) and ks.dtype == np.float32
            # each head's largest visible |value| is stored as 448 (0x7e / 0xfe)
            for h in range(3):
                assert (k[:, :, h][~invisible[:, :, h]] & 0x7F).max() == 0x7E
            # the heads' magnitudes follow HEAD_MAGNITUDES (0.5, 1, 2): their scales grow with them
            assert ks[0] < ks[1] < ks[2]
        if mode == "tensor":  # the largest visible |value| is stored as 448
            assert (k[~invisible] & 0x7F).max() == 0x7E
    with pytest.raises(ValueError, match="scale_mode"):
        make_fp8_caches(rng, table, num_pages, 3, 8, "row")


def test_to_hnd_and_reference_agree():
    rng = np.random.default_rng(1)
    table, num_pages = make_table(rng, [9, 30], 4, [2, 0])
    k, v = make_caches(rng, table, num_pages, 2, 8, np.float32)
    q = make_query(rng, 2, 4, 8, np.float32)
    kh, vh = to_hnd(k), to_hnd(v)
    assert kh.shape == (num_pages, 2, 4, 8) and kh.flags.c_contiguous
    np.testing.assert_array_equal(kh[:, 1, 3], k[:, 3, 1])
    np.testing.assert_array_equal(reference.decode(q, kh, vh, table, kv_layout="HND")[0],
                                  reference.decode(q, k, v, table)[0])
