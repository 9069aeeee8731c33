"""CPU tests of the NumPy float64 reference (cupaged.reference)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cupaged.errors import (
    DTypeError,
    InvalidArgumentError,
    PlanMismatchError,
    ShapeError,
)
from cupaged.page_table import PageTable
from cupaged.plan import plan_decode
from cupaged.reference import (
    LOG2E,
    attend,
    decode,
    decode_split,
    gather_kv,
    merge_states,
)


# --------------------------------------------------------------------------
# helpers (written independently of the code under test)
# --------------------------------------------------------------------------
def dense_attention(q_row, k_tok, v_tok, scale):
    """Per head: natural-exp softmax, LSE converted to log2 at the end."""
    hq, d = q_row.shape
    t, hkv, _ = k_tok.shape
    g = hq // hkv
    out = np.zeros((hq, d))
    lse2 = np.full(hq, -np.inf)
    if t == 0:
        return out, lse2
    for h in range(hq):
        kvh = h // g
        s = np.array([scale * float(np.dot(q_row[h], k_tok[j, kvh]))
                      for j in range(t)])
        mx = s.max()
        e = np.exp(s - mx)
        out[h] = (e[:, None] * v_tok[:, kvh, :]).sum(axis=0) / e.sum()
        lse_nat = mx + math.log(e.sum())
        lse2[h] = lse_nat / math.log(2.0)
    return out, lse2


class Scenario:
    """Random paged KV: logical tokens per request scattered into a shuffled
    pool with slack; slots outside the visible window hold poison (NaN)."""

    def __init__(self, rng, seq_lens, page_size, offsets=None, hq=8, hkv=2,
                 d=16, slack=5, poison=np.nan):
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        if offsets is None:
            offsets = np.zeros_like(seq_lens)
        offsets = np.where(seq_lens > 0, np.asarray(offsets, np.int64), 0)
        pages = np.where(seq_lens > 0, -(-(offsets + seq_lens) // page_size), 0)
        pool = int(pages.sum()) + slack
        ids = rng.permutation(pool).astype(np.int32)
        self.table = PageTable.from_seq_lens(
            seq_lens.tolist(), page_size, offsets.tolist(), page_ids=ids)
        self.k_cache = np.full((pool, page_size, hkv, d), poison)
        self.v_cache = np.full((pool, page_size, hkv, d), poison)
        self.k_tok, self.v_tok = [], []
        cursor = 0
        for i, (n, off, npg) in enumerate(zip(seq_lens, offsets, pages)):
            kt = rng.standard_normal((int(n), hkv, d))
            vt = rng.standard_normal((int(n), hkv, d))
            self.k_tok.append(kt)
            self.v_tok.append(vt)
            phys = ids[cursor:cursor + int(npg)]
            cursor += int(npg)
            for tok in range(int(n)):
                slot = int(off) + tok
                pg, e = divmod(slot, page_size)
                self.k_cache[phys[pg], e] = kt[tok]
                self.v_cache[phys[pg], e] = vt[tok]
        self.q = rng.standard_normal((len(seq_lens), hq, d))
        self.d = d

    def expected(self, scale=None):
        scale = 1.0 / math.sqrt(self.d) if scale is None else scale
        outs, lses = zip(*(dense_attention(self.q[i], self.k_tok[i],
                                           self.v_tok[i], scale)
                           for i in range(len(self.k_tok))))
        return np.stack(outs), np.stack(lses)


def random_scenario(rng, **kw):
    b = int(rng.integers(1, 7))
    P = int(rng.choice([1, 3, 4, 16]))
    lens = rng.integers(0, 70, size=b)
    lens[rng.random(b) < 0.2] = 0
    offs = np.where(rng.random(b) < 0.5, rng.integers(0, P, size=b), 0)
    hkv = int(rng.choice([1, 2]))
    g = int(rng.choice([1, 3, 4]))
    return Scenario(rng, lens, P, offs, hq=hkv * g, hkv=hkv, d=8, **kw)


# --------------------------------------------------------------------------
# attend / decode
# --------------------------------------------------------------------------
def test_attend_matches_dense_softmax():
    rng = np.random.default_rng(0)
    for t, hq, hkv, d in [(1, 4, 4, 8), (7, 8, 2, 16), (33, 6, 3, 24),
                          (100, 16, 1, 64)]:
        q = rng.standard_normal((hq, d)) * 3
        k = rng.standard_normal((t, hkv, d)) * 3
        v = rng.standard_normal((t, hkv, d))
        out, lse = attend(q, k, v, 1 / math.sqrt(d))
        want_out, want_lse = dense_attention(q, k, v, 1 / math.sqrt(d))
        assert out.dtype == np.float64 and lse.dtype == np.float64
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
        # LSE is log2: natural log = lse * ln 2
        g = hq // hkv
        s_nat = np.einsum("hd,thd->ht", q, k[:, np.arange(hq) // g]) / math.sqrt(d)
        lse_nat = np.logaddexp.reduce(s_nat, axis=1)
        np.testing.assert_allclose(lse * math.log(2), lse_nat, rtol=1e-12)
        assert LOG2E == pytest.approx(1 / math.log(2), rel=1e-15)


def test_attend_numerically_stable_large_scores():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 8)) * 1e3
    k = rng.standard_normal((5, 1, 8)) * 1e3
    v = rng.standard_normal((5, 1, 8))
    out, lse = attend(q, k, v, 1.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    want_out, want_lse = dense_attention(q, k, v, 1.0)
    np.testing.assert_allclose(out, want_out, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_decode_matches_dense_on_shuffled_pages_with_offsets():
    rng = np.random.default_rng(2)
    for _ in range(30):
        s = random_scenario(rng)
        out, lse = decode(s.q, s.k_cache, s.v_cache, s.table)
        want_out, want_lse = s.expected()
        assert not np.isnan(out).any()            # poison never read
        np.testing.assert_allclose(out, want_out, rtol=1e-11, atol=1e-12)
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-11,
                                   atol=1e-12)
        for i in range(s.table.batch_size):
            np.testing.assert_array_equal(gather_kv(s.k_cache, s.table, i),
                                          s.k_tok[i])
            np.testing.assert_array_equal(gather_kv(s.v_cache, s.table, i),
                                          s.v_tok[i])


def test_exactly_full_last_page_and_mid_page_start():
    rng = np.random.default_rng(3)
    # 32 tokens in page 16 -> full last page; 13 tokens from offset 3 -> 1 page
    s = Scenario(rng, [32, 13, 17], 16, [0, 3, 15])
    assert s.table.last_page_len.tolist() == [16, 16, 16]
    out, lse = decode(s.q, s.k_cache, s.v_cache, s.table)
    want_out, want_lse = s.expected()
    np.testing.assert_allclose(out, want_out, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-11)


def test_gqa_mapping_uses_kv_head_h_div_g():
    rng = np.random.default_rng(4)
    hq, hkv, d, t = 8, 2, 8, 9          # g = 4: heads 0..3 -> kv 0, 4..7 -> kv 1
    s = Scenario(rng, [t], 4, [1], hq=hq, hkv=hkv, d=d)
    # make the two kv heads very different
    s.v_tok[0][:, 0, :] += 10.0
    s.v_tok[0][:, 1, :] -= 10.0
    for tok in range(t):
        pg, e = divmod(1 + tok, 4)
        phys = s.table.indices[pg]
        s.v_cache[phys, e] = s.v_tok[0][tok]
    out, _ = decode(s.q, s.k_cache, s.v_cache, s.table)
    want, _ = s.expected()
    np.testing.assert_allclose(out, want, rtol=1e-11, atol=1e-12)
    assert (out[0, :4] > 5).all() and (out[0, 4:] < -5).all()
    # the wrong mapping (h % hkv) gives a different answer
    k_tok, v_tok = s.k_tok[0], s.v_tok[0]
    wrong = np.stack([dense_attention(s.q[0][h:h + 1], k_tok[:, [h % hkv]],
                                      v_tok[:, [h % hkv]],
                                      1 / math.sqrt(d))[0][0]
                      for h in range(hq)])
    assert np.abs(wrong - out[0]).max() > 1.0


def test_sm_scale():
    rng = np.random.default_rng(5)
    s = Scenario(rng, [20, 5], 4, [2, 0], hq=4, hkv=4, d=16)
    default, _ = decode(s.q, s.k_cache, s.v_cache, s.table)
    explicit, _ = decode(s.q, s.k_cache, s.v_cache, s.table, sm_scale=0.25)
    np.testing.assert_array_equal(default, explicit)   # 1/sqrt(16)
    out, lse = decode(s.q, s.k_cache, s.v_cache, s.table, sm_scale=0.9)
    want_out, want_lse = s.expected(0.9)
    np.testing.assert_allclose(out, want_out, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-11)
    assert np.abs(out - default).max() > 1e-3


def test_empty_request_zeros_and_neg_inf_without_poisoning_neighbours():
    rng = np.random.default_rng(6)
    s = Scenario(rng, [9, 0, 21, 0], 4, [1, 0, 3, 0])
    assert s.table.request_pages.tolist()[1] == 0
    out, lse = decode(s.q, s.k_cache, s.v_cache, s.table)
    for i in (1, 3):
        assert (out[i] == 0).all() and np.isneginf(lse[i]).all()
    assert np.isfinite(out).all()
    # neighbours equal the same requests decoded alone
    for i in (0, 2):
        tab = PageTable.from_seq_lens(
            [int(s.table.seq_lens[i])], 4, [int(s.table.first_page_offset[i])],
            page_ids=np.asarray(s.table.indices[s.table.indptr[i]:
                                                s.table.indptr[i + 1]],
                                np.int32))
        o1, l1 = decode(s.q[i:i + 1], s.k_cache, s.v_cache, tab)
        np.testing.assert_array_equal(o1[0], out[i])
        np.testing.assert_array_equal(l1[0], lse[i])
    gk = gather_kv(s.k_cache, s.table, 1)
    assert gk.shape == (0, 2, 16)


# --------------------------------------------------------------------------
# merge_states
# --------------------------------------------------------------------------
def test_merge_states_closed_form_hand_computed():
    # the -inf partial's v is garbage (NaN/inf): it must contribute nothing
    v = np.array([[[1.0, 2.0]], [[3.0, -4.0]], [[np.nan, np.inf]]])  # [3,1,2]
    lse = np.array([[1.0], [3.0], [-np.inf]])
    out, lo = merge_states(v, lse, np.array([0, 3]))
    # weights 2**1 = 2 and 2**3 = 8, the -inf partial contributes nothing
    np.testing.assert_allclose(out[0, 0], [0.2 * 1 + 0.8 * 3, 0.2 * 2 - 0.8 * 4],
                               rtol=1e-15)
    np.testing.assert_allclose(lo[0, 0], math.log2(10.0), rtol=1e-15)
    # a single partial is returned unchanged
    out, lo = merge_states(v[:1], lse[:1], [0, 1])
    np.testing.assert_array_equal(out, v[:1])
    np.testing.assert_array_equal(lo, lse[:1])
    # equal LSEs average, lse + 1 (log2 of 2)
    out, lo = merge_states(v[:2], np.array([[5.0], [5.0]]), [0, 2])
    np.testing.assert_allclose(out[0, 0], [2.0, -1.0])
    np.testing.assert_allclose(lo[0, 0], 6.0)


def test_merge_states_all_neg_inf_and_empty_rows():
    v = np.array([[[np.nan, 1.0]], [[2.0, np.inf]], [[7.0, 8.0]]])
    lse = np.array([[-np.inf], [-np.inf], [0.5]])
    with np.errstate(all="raise"):
        out, lo = merge_states(v, lse, [0, 2, 2, 3])
    assert not np.isnan(out).any() and not np.isnan(lo).any()
    assert (out[0] == 0).all() and np.isneginf(lo[0]).all()   # all -inf
    assert (out[1] == 0).all() and np.isneginf(lo[1]).all()   # no partial
    np.testing.assert_array_equal(out[2], v[2])
    assert lo[2, 0] == 0.5
    # mixed per head: head 0 has a finite partial, head 1 has none
    v2 = np.ones((2, 2, 3))
    l2 = np.array([[-np.inf, -np.inf], [2.0, -np.inf]])
    out, lo = merge_states(v2, l2, [0, 2])
    np.testing.assert_array_equal(out[0, 0], 1.0)
    np.testing.assert_array_equal(out[0, 1], 0.0)
    assert lo[0, 0] == 2.0 and np.isneginf(lo[0, 1])


def test_merge_states_associative_under_regrouping():
    rng = np.random.default_rng(7)
    for _ in range(100):
        n = int(rng.integers(1, 12))
        h, d = 3, 5
        v = rng.standard_normal((n, h, d))
        lse = rng.standard_normal((n, h)) * 20
        lse[rng.random((n, h)) < 0.3] = -np.inf
        whole_v, whole_l = merge_states(v, lse, [0, n])
        # random split into consecutive groups, merge each, then merge those
        cuts = np.sort(rng.choice(np.arange(1, n), size=int(
            rng.integers(0, n)), replace=False)) if n > 1 else []
        ptr = np.concatenate([[0], cuts, [n]]).astype(np.int64)
        part_v, part_l = merge_states(v, lse, ptr)
        two_v, two_l = merge_states(part_v, part_l, [0, len(ptr) - 1])
        np.testing.assert_allclose(two_v, whole_v, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(two_l), np.isneginf(whole_l))
        fin = np.isfinite(whole_l)
        np.testing.assert_allclose(two_l[fin], whole_l[fin], rtol=1e-12,
                                   atol=1e-12)
        assert not np.isnan(two_v).any()


def test_merge_states_validation():
    v = np.zeros((2, 1, 4))
    lse = np.zeros((2, 1))
    for bad in ([1, 2], [0, 1], [0, 2, 1, 2], [[0, 2]], [0.0, 2.0]):
        with pytest.raises(ValueError, match="o_indptr"):
            merge_states(v, lse, bad)
    with pytest.raises(ValueError, match="lse"):
        merge_states(v, np.array([[np.nan], [0.0]]), [0, 2])
    with pytest.raises(ValueError, match="lse"):
        merge_states(v, np.array([[np.inf], [0.0]]), [0, 2])
    with pytest.raises(ValueError):
        merge_states(v, np.zeros((2, 2)), [0, 2])


# --------------------------------------------------------------------------
# decode_split
# --------------------------------------------------------------------------
def test_decode_split_equals_decode_across_random_plans():
    rng = np.random.default_rng(8)
    checked = 0
    for _ in range(60):
        s = random_scenario(rng)
        out, lse = decode(s.q, s.k_cache, s.v_cache, s.table)
        t = s.table
        maxp = max(1, int(t.request_pages.max()))
        for c in set(rng.integers(1, maxp + 1, size=4).tolist()) | {1, maxp}:
            hq, hkv = s.q.shape[1], s.k_cache.shape[2]
            plan = plan_decode(t, hq, hkv, 8, "float16", pages_per_chunk=c)
            o2, l2, pv, pl = decode_split(s.q, s.k_cache, s.v_cache, t, plan)
            assert pv.shape == (plan.num_chunks, hq, 8)
            assert pl.shape == (plan.num_chunks, hq)
            np.testing.assert_allclose(o2, out, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(np.isneginf(l2), np.isneginf(lse))
            fin = np.isfinite(lse)
            np.testing.assert_allclose(l2[fin], lse[fin], rtol=1e-12, atol=1e-12)
            # chunks with no token (only those of empty requests): zeros / -inf
            start, end = plan.chunk_token_ranges(t)
            empty = end == start
            assert (pv[empty] == 0).all() and np.isneginf(pl[empty]).all()
            assert np.isfinite(pl[~empty]).all()
            checked += 1
    assert checked >= 150


def test_decode_split_rejects_mismatched_plan():
    rng = np.random.default_rng(9)
    s = Scenario(rng, [40, 3], 4, hq=8, hkv=2, d=16)
    plan = plan_decode(s.table, 8, 2, 16, "float32", pages_per_chunk=2)
    s2 = Scenario(rng, [60, 3], 4, hq=8, hkv=2, d=16)
    with pytest.raises(PlanMismatchError):
        decode_split(s2.q, s2.k_cache, s2.v_cache, s2.table, plan)
    other = plan_decode(s.table, 8, 1, 16, "float32", pages_per_chunk=2)
    with pytest.raises(PlanMismatchError):
        decode_split(s.q, s.k_cache, s.v_cache, s.table, other)


# --------------------------------------------------------------------------
# layouts and dtypes
# --------------------------------------------------------------------------
def test_non_contiguous_cache_views():
    rng = np.random.default_rng(10)
    s = Scenario(rng, [30, 0, 11], 4, [2, 0, 3], hq=4, hkv=2, d=8)
    base_out, base_lse = decode(s.q, s.k_cache, s.v_cache, s.table)
    n = s.k_cache.shape[0]
    # 1) page stride larger than a page: every other page of a larger cache
    bigk = np.full((2 * n, 4, 2, 8), np.nan)
    bigv = np.full((2 * n, 4, 2, 8), np.nan)
    bigk[::2], bigv[::2] = s.k_cache, s.v_cache
    # 2) head_dim slice of a wider buffer (strided last axes)
    widek = np.full((n, 4, 2, 16), np.nan)
    widev = np.full((n, 4, 2, 16), np.nan)
    widek[..., 3:11], widev[..., 3:11] = s.k_cache, s.v_cache
    # 3) an HND buffer seen through a transpose
    hndk = np.ascontiguousarray(s.k_cache.transpose(0, 2, 1, 3))
    hndv = np.ascontiguousarray(s.v_cache.transpose(0, 2, 1, 3))
    views = [(bigk[::2], bigv[::2]), (widek[..., 3:11], widev[..., 3:11]),
             (hndk.transpose(0, 2, 1, 3), hndv.transpose(0, 2, 1, 3))]
    plan = plan_decode(s.table, 4, 2, 8, "float32", pages_per_chunk=2)
    for kv, vv in views:
        assert not kv.flags.c_contiguous
        out, lse = decode(s.q, kv, vv, s.table)
        np.testing.assert_array_equal(out, base_out)
        np.testing.assert_array_equal(lse, base_lse)
        o2, l2, _, _ = decode_split(s.q, kv, vv, s.table, plan)
        np.testing.assert_allclose(o2, base_out, rtol=1e-12, atol=1e-12)
        for i in range(3):
            np.testing.assert_array_equal(gather_kv(kv, s.table, i), s.k_tok[i])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_accepted(dtype):
    rng = np.random.default_rng(11)
    s = Scenario(rng, [25, 7, 0], 8, [5, 0, 0], hq=4, hkv=2, d=16, poison=0.0)
    q = s.q.astype(dtype)
    k = s.k_cache.astype(dtype)
    v = s.v_cache.astype(dtype)
    out, lse = decode(q, k, v, s.table)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    # identical to decoding the exactly-upcast inputs
    want_out, want_lse = decode(q.astype(np.float64), k.astype(np.float64),
                                v.astype(np.float64), s.table)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    assert gather_kv(k, s.table, 0).dtype == np.float64
    plan = plan_decode(s.table, 4, 2, 16, dtype, pages_per_chunk=1)
    o2, _, _, _ = decode_split(q, k, v, s.table, plan)
    np.testing.assert_allclose(o2, out, rtol=1e-12, atol=1e-12)


def test_input_validation():
    rng = np.random.default_rng(12)
    s = Scenario(rng, [10], 4, hq=4, hkv=2, d=8)
    with pytest.raises(ValueError, match="k_cache"):
        decode(s.q, np.zeros(s.k_cache.shape, np.int32), s.v_cache, s.table)
    with pytest.raises(ValueError, match="batch"):
        decode(np.zeros((2, 4, 8)), s.k_cache, s.v_cache, s.table)
    with pytest.raises(ValueError, match="head_dim"):
        decode(np.zeros((1, 4, 16)), s.k_cache, s.v_cache, s.table)
    with pytest.raises(ValueError, match="divisible"):
        decode(np.zeros((1, 3, 8)), s.k_cache, s.v_cache, s.table)
    with pytest.raises(ValueError, match="page size"):
        decode(s.q, s.k_cache[:, :2], s.v_cache[:, :2], s.table)
    with pytest.raises(ValueError):
        decode(s.q, s.k_cache[:1], s.v_cache[:1], s.table)  # page ids too big
    with pytest.raises(ValueError, match="divisible"):
        attend(np.zeros((3, 8)), np.zeros((2, 2, 8)), np.zeros((2, 2, 8)), 1.0)
    out, lse = attend(np.zeros((4, 8)), np.zeros((0, 2, 8)), np.zeros((0, 2, 8)))
    assert (out == 0).all() and np.isneginf(lse).all()


# --------------------------------------------------------------------------
# serving features: soft cap, HND layout, fp8 caches, k/v scales (issue 6)
# --------------------------------------------------------------------------
def e4m3_by_hand(bits):
    """float64 value of e4m3fn bit patterns, from the format (not ml_dtypes):
    sign, 4 exponent bits (bias 7), 3 mantissa bits, S.1111.111 is NaN."""
    out = []
    for b in np.asarray(bits, dtype=np.uint8).ravel().tolist():
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 15 and m == 7:
            out.append(np.nan)
        elif e == 0:
            out.append(sign * m * 2.0 ** -9)
        else:
            out.append(sign * (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out).reshape(np.shape(bits))


def capped_attention(q_row, k_tok, v_tok, scale, cap):
    """Per head and token: logit = cap * tanh(scale * q.k / cap); natural
    softmax; LSE converted to log2 at the end."""
    hq, d = q_row.shape
    g = hq // k_tok.shape[1]
    out = np.zeros((hq, d))
    lse2 = np.zeros(hq)
    for h in range(hq):
        logits = np.array([cap * math.tanh(scale * float(q_row[h] @ k_tok[j, h // g]) / cap)
                           for j in range(k_tok.shape[0])])
        w = np.exp(logits)
        out[h] = (w[:, None] * v_tok[:, h // g]).sum(axis=0) / w.sum()
        lse2[h] = math.log(w.sum()) / math.log(2.0)
    return out, lse2


def to_hnd(cache):
    return np.ascontiguousarray(np.asarray(cache).transpose(0, 2, 1, 3))


def test_soft_cap_matches_direct_formula():
    rng = np.random.default_rng(20)
    q = rng.standard_normal((4, 8)) * 3
    k = rng.standard_normal((6, 2, 8)) * 3
    v = rng.standard_normal((6, 2, 8))
    for cap in (0.5, 5.0, 30.0):
        out, lse = attend(q, k, v, 0.7, logits_soft_cap=cap)
        want_out, want_lse = capped_attention(q, k, v, 0.7, cap)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    # the cap bites: logits of |s| ~ 10 under a cap of 5 change the result
    plain, plain_lse = attend(q, k, v, 0.7)
    capped, capped_lse = attend(q, k, v, 0.7, logits_soft_cap=5.0)
    assert np.abs(plain - capped).max() > 0.1 and np.abs(plain_lse - capped_lse).max() > 1
    # None and 0 are off; a huge cap is (numerically) off too
    for off in (None, 0, 0.0):
        o, l_ = attend(q, k, v, 0.7, logits_soft_cap=off)
        np.testing.assert_array_equal(o, plain)
        np.testing.assert_array_equal(l_, plain_lse)
    o, _ = attend(q, k, v, 0.7, logits_soft_cap=1e9)
    np.testing.assert_allclose(o, plain, rtol=1e-9, atol=1e-12)


def test_soft_cap_through_decode_and_split():
    rng = np.random.default_rng(21)
    s = Scenario(rng, [30, 0, 9, 1], 4, [1, 0, 3, 2], hq=6, hkv=2, d=8)
    s.q *= 6  # logits large enough for the cap to matter
    cap, scale = 4.0, 0.5
    out, lse = decode(s.q, s.k_cache, s.v_cache, s.table, scale, logits_soft_cap=cap)
    assert not np.isnan(out).any()
    for i in range(4):
        if s.table.seq_lens[i] == 0:
            assert (out[i] == 0).all() and np.isneginf(lse[i]).all()
            continue
        wo, wl = capped_attention(s.q[i], s.k_tok[i], s.v_tok[i], scale, cap)
        np.testing.assert_allclose(out[i], wo, rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(lse[i], wl, rtol=1e-11, atol=1e-12)
    plan = plan_decode(s.table, 6, 2, 8, "float32", pages_per_chunk=1)
    o2, l2, _, _ = decode_split(s.q, s.k_cache, s.v_cache, s.table, plan, scale, logits_soft_cap=cap)
    np.testing.assert_allclose(o2, out, rtol=1e-12, atol=1e-12)
    fin = np.isfinite(lse)
    np.testing.assert_allclose(l2[fin], lse[fin], rtol=1e-12)
    uncapped, _ = decode(s.q, s.k_cache, s.v_cache, s.table, scale)
    assert np.abs(uncapped - out).max() > 0.05


def test_hnd_equals_nhd_transposed():
    rng = np.random.default_rng(22)
    for _ in range(10):
        s = random_scenario(rng)
        kh, vh = to_hnd(s.k_cache), to_hnd(s.v_cache)
        out, lse = decode(s.q, s.k_cache, s.v_cache, s.table, logits_soft_cap=3.0)
        o_h, l_h = decode(s.q, kh, vh, s.table, logits_soft_cap=3.0, kv_layout="HND")
        np.testing.assert_array_equal(o_h, out)
        np.testing.assert_array_equal(l_h, lse)
        assert not np.isnan(o_h).any()  # the NaN poison is still never read
        for i in range(s.table.batch_size):
            np.testing.assert_array_equal(gather_kv(kh, s.table, i, kv_layout="HND"), s.k_tok[i])
        hq, hkv = s.q.shape[1], s.k_cache.shape[2]
        plan = plan_decode(s.table, hq, hkv, 8, "float32", pages_per_chunk=2)
        o2, _, pv, _ = decode_split(s.q, kh, vh, s.table, plan, kv_layout="HND")
        o3, _, pv3, _ = decode_split(s.q, s.k_cache, s.v_cache, s.table, plan)
        np.testing.assert_array_equal(o2, o3)
        np.testing.assert_array_equal(pv, pv3)
    # attend: HND tokens are [Hkv, T, D]
    k_tok, v_tok = s.k_tok[0], s.v_tok[0]
    a = attend(s.q[0], k_tok, v_tok)
    b = attend(s.q[0], k_tok.transpose(1, 0, 2), v_tok.transpose(1, 0, 2), kv_layout="HND")
    np.testing.assert_array_equal(a[0], b[0])
    # an HND cache read as NHD is a different (wrongly shaped) cache
    s = Scenario(rng, [10], 4, hq=4, hkv=2, d=8)
    with pytest.raises(ValueError, match="page size"):
        decode(s.q, to_hnd(s.k_cache), to_hnd(s.v_cache), s.table)


def test_fp8_cache_dequantized_exactly():
    rng = np.random.default_rng(23)
    s = Scenario(rng, [23, 0, 8, 40], 8, [3, 0, 0, 7], hq=4, hkv=2, d=16)
    from cupaged import fp8
    vis = ~np.isnan(s.k_cache)
    kbits = np.where(vis, fp8.to_e4m3(np.nan_to_num(s.k_cache) * 20), np.uint8(0x7F)).astype(np.uint8)
    vbits = np.where(vis, fp8.to_e4m3(np.nan_to_num(s.v_cache) * 20), np.uint8(0x7F)).astype(np.uint8)
    # the same values by hand, as float64 (NaN where invisible)
    kman, vman = e4m3_by_hand(kbits), e4m3_by_hand(vbits)
    assert np.isnan(kman[~vis]).all() and np.isfinite(kman[vis]).all()
    assert len(np.unique(kbits[vis])) > 100  # many distinct codes exercised
    want_out, want_lse = decode(s.q, kman, vman, s.table)
    for kk, vv in ((kbits, vbits), (kbits.view(ml_dtypes.float8_e4m3fn), vbits.view(ml_dtypes.float8_e4m3fn))):
        out, lse = decode(s.q, kk, vv, s.table)
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)
        assert np.isfinite(out).all()  # NaN sentinels in invisible slots never read
        for i in range(4):
            np.testing.assert_array_equal(gather_kv(kk, s.table, i), gather_kv(kman, s.table, i))
    # fp8 in the HND layout and through decode_split
    out_h, _ = decode(s.q, to_hnd(kbits), to_hnd(vbits), s.table, kv_layout="HND")
    np.testing.assert_array_equal(out_h, want_out)
    plan = plan_decode(s.table, 4, 2, 16, "float16", pages_per_chunk=1)
    o2, _, _, _ = decode_split(s.q, kbits, vbits, s.table, plan)
    np.testing.assert_allclose(o2, want_out, rtol=1e-12, atol=1e-12)
    # attend reads fp8 token arrays too (every finite code, both signs)
    codes = np.concatenate([np.arange(0x7F), np.arange(0x80, 0xFF)]).astype(np.uint8)
    k_tok = rng.permutation(np.resize(codes, 9 * 2 * 16)).reshape(9, 2, 16).astype(np.uint8)
    v_tok = rng.permutation(np.resize(codes, 9 * 2 * 16)).reshape(9, 2, 16).astype(np.uint8)
    got = attend(s.q[0] / 64, k_tok, v_tok)
    want = attend(s.q[0] / 64, e4m3_by_hand(k_tok), e4m3_by_hand(v_tok))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert gather_kv(kbits, s.table, 0).dtype == np.float64


def test_per_head_scale_equals_prescaled_cache():
    rng = np.random.default_rng(24)
    s = Scenario(rng, [19, 33, 0], 4, [2, 0, 0], hq=6, hkv=3, d=8)
    ks = np.array([0.5, 2.0, 3.0], np.float32)
    vs = np.array([4.0, 0.25, 1.5], np.float32)
    pre_k = s.k_cache * ks[None, None, :, None].astype(np.float64)
    pre_v = s.v_cache * vs[None, None, :, None].astype(np.float64)
    want_out, want_lse = decode(s.q, pre_k, pre_v, s.table)
    out, lse = decode(s.q, s.k_cache, s.v_cache, s.table, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(out, want_out, rtol=1e-13, atol=1e-13)
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-13)
    # HND and decode_split agree; per-tensor scales broadcast to every head
    out_h, _ = decode(s.q, to_hnd(s.k_cache), to_hnd(s.v_cache), s.table, k_scale=ks, v_scale=vs,
                      kv_layout="HND")
    np.testing.assert_array_equal(out_h, out)
    plan = plan_decode(s.table, 6, 3, 8, "float32", pages_per_chunk=3)
    o2, _, _, _ = decode_split(s.q, s.k_cache, s.v_cache, s.table, plan, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(o2, out, rtol=1e-12, atol=1e-12)
    t_out, _ = decode(s.q, s.k_cache, s.v_cache, s.table, k_scale=0.5, v_scale=np.float32(3.0))
    w_out, _ = decode(s.q, s.k_cache * 0.5, s.v_cache * 3.0, s.table)
    np.testing.assert_allclose(t_out, w_out, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(gather_kv(s.k_cache, s.table, 1, scale=ks), s.k_tok[1] * ks[None, :, None])
    # scales and fp8 together: the per-head scale multiplies the exact dequantized value
    from cupaged import fp8
    vis = ~np.isnan(s.k_cache)
    kbits = np.where(vis, fp8.to_e4m3(np.nan_to_num(s.k_cache), ks, head_axis=2), np.uint8(0x7F))
    out8, _ = decode(s.q, kbits.astype(np.uint8), s.v_cache, s.table, k_scale=ks)
    want8, _ = decode(s.q, e4m3_by_hand(kbits) * ks[None, None, :, None].astype(np.float64), s.v_cache, s.table)
    np.testing.assert_allclose(out8, want8, rtol=1e-13, atol=1e-13)
    # a per-head scale that is wrong for one head changes only that head's queries
    ks_bad = ks.copy()
    ks_bad[1] *= 4
    o_bad, _ = decode(s.q, s.k_cache, s.v_cache, s.table, k_scale=ks_bad, v_scale=vs)
    diff = np.abs(o_bad - out).max(axis=(0, 2))  # per query head (g = 2)
    assert (diff[[0, 1, 4, 5]] == 0).all() and (diff[[2, 3]] > 1e-3).all()


def test_feature_argument_validation():
    rng = np.random.default_rng(25)
    s = Scenario(rng, [10], 4, hq=4, hkv=2, d=8)
    args = (s.q, s.k_cache, s.v_cache, s.table)
    plan = plan_decode(s.table, 4, 2, 8, "float32")
    for bad in ("XYZ", "nhd", None, 0):
        with pytest.raises(InvalidArgumentError, match="kv_layout must be one of 'NHD', 'HND'"):
            decode(*args, kv_layout=bad)
        with pytest.raises(InvalidArgumentError, match="kv_layout"):
            decode_split(*args, plan, kv_layout=bad)
    for bad in (-1.0, np.inf, np.nan, -np.inf):
        with pytest.raises(InvalidArgumentError, match="logits_soft_cap"):
            decode(*args, logits_soft_cap=bad)
        with pytest.raises(InvalidArgumentError, match="logits_soft_cap"):
            attend(s.q[0], s.k_tok[0], s.v_tok[0], logits_soft_cap=bad)
    for bad in ("30", True, [30.0]):
        with pytest.raises(InvalidArgumentError, match="logits_soft_cap"):
            decode(*args, logits_soft_cap=bad)
    for bad in (np.ones(3), np.ones(4), np.ones((2, 1)), np.ones((1, 2))):
        with pytest.raises(ShapeError, match=r"k_scale .*\(2,\)"):
            decode(*args, k_scale=bad)
        with pytest.raises(ShapeError, match="v_scale"):
            decode_split(*args, plan, v_scale=bad)
    with pytest.raises(InvalidArgumentError, match="k_scale must be finite"):
        decode(*args, k_scale=np.array([1.0, np.nan]))
    with pytest.raises(InvalidArgumentError, match="v_scale must be finite"):
        decode(*args, v_scale=np.inf)
    with pytest.raises(DTypeError, match="k_scale"):
        decode(*args, k_scale=np.array(["a", "b"]))
    with pytest.raises(ShapeError, match="scale"):
        gather_kv(s.k_cache, s.table, 0, scale=np.ones(5))
    # q may not be fp8 (only caches are); other integer caches are still refused
    with pytest.raises(ValueError, match="q must be"):
        decode(np.zeros(s.q.shape, np.uint8), s.k_cache, s.v_cache, s.table)
    with pytest.raises(ValueError, match="k_cache .*fp8"):
        decode(s.q, np.zeros(s.k_cache.shape, np.int8), s.v_cache, s.table)
    # an HND cache that is not 4-D names the HND dims
    with pytest.raises(ValueError, match=r"num_kv_heads, page_size"):
        decode(s.q, s.k_cache[0], s.v_cache[0], s.table, kv_layout="HND")
    # every new error is a ValueError
    assert issubclass(InvalidArgumentError, ValueError) and issubclass(ShapeError, ValueError)


def test_errors_are_the_kernels_classes():
    """Issue 16: every bad input raises the CupagedError subclass the kernels'
    path raises (never a bare builtin ValueError, nor AttributeError for a
    table that is not a PageTable)."""
    import cupaged
    from cupaged.errors import (ArgumentTypeError, CupagedError, DTypeError, InvalidArgumentError,
                                PageTableError, PlanMismatchError, ShapeError)
    from cupaged.reference import merge_states

    rng = np.random.default_rng(16)
    s = Scenario(rng, [10, 3], 4, hq=4, hkv=2, d=8)
    q, k, v, t = s.q, s.k_cache, s.v_cache, s.table
    plan = plan_decode(t, 4, 2, 8, np.float32, pages_per_chunk=1)
    table_dict = {"indices": t.indices, "indptr": t.indptr, "last_page_len": t.last_page_len,
                  "page_size": t.page_size}
    cases = [
        (ArgumentTypeError, "table must be a cupaged.PageTable", lambda: decode(q, k, v, table_dict)),
        (ArgumentTypeError, "table must be a cupaged.PageTable", lambda: gather_kv(k, table_dict, 0)),
        (ArgumentTypeError, "table must be a cupaged.PageTable", lambda: decode_split(q, k, v, table_dict, plan)),
        (ArgumentTypeError, "plan must be a cupaged.DecodePlan", lambda: decode_split(q, k, v, t, "plan")),
        (ArgumentTypeError, "sm_scale", lambda: decode(q, k, v, t, "0.1")),
        (ArgumentTypeError, "i must be an int", lambda: gather_kv(k, t, 0.5)),
        (InvalidArgumentError, "sm_scale must be finite", lambda: decode(q, k, v, t, float("nan"))),
        (InvalidArgumentError, "request 2 out of range", lambda: gather_kv(k, t, 2)),
        (DTypeError, "k_cache", lambda: decode(q, np.zeros(k.shape, np.int32), v, t)),
        (DTypeError, "q_row", lambda: attend(np.zeros((4, 8), np.int8), k[0], v[0])),
        (ShapeError, "batch", lambda: decode(np.zeros((3, 4, 8)), k, v, t)),
        (ShapeError, "head_dim", lambda: decode(np.zeros((2, 4, 16)), k, v, t)),
        (ShapeError, "divisible", lambda: decode(np.zeros((2, 3, 8)), k, v, t)),
        (ShapeError, "page size", lambda: decode(q, k[:, :2], v[:, :2], t)),
        (ShapeError, "k_cache shape", lambda: decode(q, k, v[:-1], t)),
        (ShapeError, "q must be", lambda: decode(q[0], k, v, t)),
        (ShapeError, "cache must be", lambda: gather_kv(k[0], t, 0)),
        (ShapeError, "attend expects", lambda: attend(q, k, v)),
        (ShapeError, ">= 1", lambda: attend(np.zeros((4, 8)), np.zeros((2, 0, 8)), np.zeros((2, 0, 8)))),
        (PageTableError, "out of range", lambda: decode(q, k[:1], v[:1], t)),
        (ShapeError, "merge_states expects", lambda: merge_states(np.ones((3, 2)), np.zeros((3, 2)), [0, 3])),
        (InvalidArgumentError, "lse must be finite",
         lambda: merge_states(np.ones((1, 1, 4)), np.full((1, 1), np.nan), [0, 1])),
        (ShapeError, "o_indptr", lambda: merge_states(np.ones((1, 1, 4)), np.zeros((1, 1)), [[0, 1]])),
        (DTypeError, "o_indptr", lambda: merge_states(np.ones((1, 1, 4)), np.zeros((1, 1)), [0.0, 1.0])),
        (InvalidArgumentError, "o_indptr must start at 0",
         lambda: merge_states(np.ones((1, 1, 4)), np.zeros((1, 1)), [0, 2])),
        (PlanMismatchError, r"request 0: chunk count 3 -> 1",
         lambda: decode_split(q, k, v, cupaged.PageTable.from_seq_lens([2, 3], 4), plan)),
    ]
    for cls, match, call in cases:
        with pytest.raises(cls, match=match) as info:
            call()
        assert isinstance(info.value, CupagedError), (match, type(info.value))
        # ... and still the builtin a generic handler expects
        assert isinstance(info.value, TypeError if cls is ArgumentTypeError else ValueError), match
