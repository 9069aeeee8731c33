"""The float64 reference of issue 18's decode features: several query tokens
per request (qo_indptr), attention sinks and sliding windows. Each is checked
against an independent construction: plain decode over a truncated or
front-trimmed table, or a brute-force softmax written out here. CPU only."""

import numpy as np
import pytest

import cupaged
from cupaged import reference

LOG2E = 1.0 / np.log(2.0)


def _batch(seed, seq_lens, page_size=4, hq=8, hkv=2, d=16, offsets=None):
    rng = np.random.default_rng(seed)
    seq_lens = np.asarray(seq_lens)
    off = np.zeros_like(seq_lens) if offsets is None else np.asarray(offsets)
    pages = np.where(seq_lens > 0, -(-(seq_lens + off) // page_size), 0)
    num_pages = int(pages.sum()) + 3
    ids = rng.permutation(num_pages).astype(np.int32)
    table = cupaged.PageTable.from_seq_lens(seq_lens.astype(np.int32), page_size, off.astype(np.int32),
                                            page_ids=ids)
    k = rng.standard_normal((num_pages, page_size, hkv, d))
    v = rng.standard_normal((num_pages, page_size, hkv, d))
    return table, k, v, rng


def _slots(table, i, lo, hi):
    """A one-request table seeing visible slots [lo, hi) of request ``i``."""
    P = table.page_size
    a = int(table.indptr[i])
    start = int(table.first_page_offset[i]) + lo
    end = int(table.first_page_offset[i]) + hi
    pages = np.asarray(table.indices[a + start // P: a + -(-end // P)], dtype=np.int32)
    return cupaged.PageTable.from_seq_lens([hi - lo], P, [start % P], page_ids=pages)


def _brute(q_row, k, v, sm_scale, lo, hi, sink=None, cap=None):
    """out, lse (log2) of one query row over tokens [lo, hi) of k/v [T, Hkv, D], written out."""
    hq, hkv = q_row.shape[0], k.shape[1]
    g = hq // hkv
    out = np.zeros_like(q_row, dtype=np.float64)
    lse = np.full(hq, -np.inf)
    for h in range(hq):
        logits = [float(q_row[h] @ k[t, h // g]) * sm_scale for t in range(lo, hi)]
        if cap:
            logits = [cap * np.tanh(x / cap) for x in logits]
        weights = [np.exp(x) for x in logits]
        denom = sum(weights) + (np.exp(sink[h]) if sink is not None else 0.0)
        if denom == 0:
            continue
        out[h] = sum(w * v[t, h // g] for w, t in zip(weights, range(lo, hi))) / denom
        lse[h] = np.log2(denom)
    return out, lse


def test_one_token_per_request_is_plain_decode():
    table, k, v, rng = _batch(1, [9, 1, 20])
    q = rng.standard_normal((3, 8, 16))
    plain = reference.decode(q, k, v, table)
    same = reference.decode(q, k, v, table, qo_indptr=np.array([0, 1, 2, 3], np.int32), window_left=-1)
    assert all(np.array_equal(a, b) for a, b in zip(plain, same))


def test_several_tokens_are_causal_over_the_last_slots():
    table, k, v, rng = _batch(2, [11, 4, 30], offsets=[0, 3, 1])
    qo = np.array([0, 3, 7, 23], np.int32)  # q_len 3, 4 (all of its slots), 16
    q = rng.standard_normal((23, 8, 16))
    out, lse = reference.decode(q, k, v, table, qo_indptr=qo)
    for i, seq in enumerate(table.seq_lens.tolist()):
        q_len = qo[i + 1] - qo[i]
        for j in range(q_len):
            r = qo[i] + j
            sub = _slots(table, i, 0, seq - q_len + j + 1)
            ref, ref_lse = reference.decode(q[r:r + 1], k, v, sub)
            np.testing.assert_allclose(out[r], ref[0], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(lse[r], ref_lse[0], rtol=1e-12)


@pytest.mark.parametrize("window", [0, 1, 3, 5, 100])
def test_window_sees_the_last_w_plus_one_slots(window):
    # windows smaller than a page, starting mid-page, and past the start
    table, k, v, rng = _batch(3, [13, 2, 26], offsets=[2, 0, 3])
    qo = np.array([0, 2, 3, 7], np.int32)
    q = rng.standard_normal((7, 8, 16))
    out, lse = reference.decode(q, k, v, table, qo_indptr=qo, window_left=window)
    for i, seq in enumerate(table.seq_lens.tolist()):
        q_len = qo[i + 1] - qo[i]
        for j in range(q_len):
            r, pos = qo[i] + j, seq - q_len + j
            sub = _slots(table, i, max(0, pos - window), pos + 1)
            ref, ref_lse = reference.decode(q[r:r + 1], k, v, sub)
            np.testing.assert_allclose(out[r], ref[0], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(lse[r], ref_lse[0], rtol=1e-12)


def test_window_per_request():
    table, k, v, rng = _batch(4, [10, 10])
    q = rng.standard_normal((2, 8, 16))
    both = reference.decode(q, k, v, table, window_left=np.array([2, -1]))
    first = reference.decode(q, k, v, table, window_left=2)
    plain = reference.decode(q, k, v, table)
    assert np.array_equal(both[0][0], first[0][0]) and np.array_equal(both[0][1], plain[0][1])
    assert not np.allclose(first[0][0], plain[0][0])


def test_sinks_add_to_the_denominator_only():
    table, k, v, rng = _batch(5, [7, 0, 12])
    q = rng.standard_normal((3, 8, 16))
    sinks = rng.standard_normal(8).astype(np.float32) * 2
    out, lse = reference.decode(q, k, v, table, sinks=sinks, logits_soft_cap=3.0)
    for i, seq in enumerate(table.seq_lens.tolist()):
        kk = reference.gather_kv(k, table, i)
        vv = reference.gather_kv(v, table, i)
        ref, ref_lse = _brute(q[i], kk, vv, 1 / 4.0, 0, seq, sink=sinks.astype(np.float64), cap=3.0)
        np.testing.assert_allclose(out[i], ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[i], ref_lse, rtol=1e-10)
    # the empty request: zeros, and the sink alone in the LSE (log2 units)
    assert (out[1] == 0).all() and np.allclose(lse[1], sinks * LOG2E)


def test_everything_together_against_the_brute_force():
    table, k, v, rng = _batch(6, [17, 9], offsets=[1, 2])
    qo = np.array([0, 4, 6], np.int32)
    q = rng.standard_normal((6, 8, 16))
    sinks = np.linspace(-1, 1, 8)
    k_scale = np.array([0.5, 2.0])
    out, lse = reference.decode(q, k, v, table, 0.3, qo_indptr=qo, sinks=sinks, window_left=np.array([3, 100]),
                                k_scale=k_scale)
    for i, (seq, w) in enumerate(zip(table.seq_lens.tolist(), (3, 100))):
        kk = reference.gather_kv(k, table, i, scale=k_scale)
        vv = reference.gather_kv(v, table, i)
        q_len = qo[i + 1] - qo[i]
        for j in range(q_len):
            r, pos = qo[i] + j, seq - q_len + j
            ref, ref_lse = _brute(q[r], kk, vv, 0.3, max(0, pos - w), pos + 1, sink=sinks)
            np.testing.assert_allclose(out[r], ref, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(lse[r], ref_lse, rtol=1e-10)


@pytest.mark.parametrize("kw, error, match", [
    (dict(qo_indptr=np.array([0, 0, 2])), cupaged.InvalidArgumentError, "1..16"),
    (dict(qo_indptr=np.array([0, 17, 18])), cupaged.InvalidArgumentError, "1..16"),
    (dict(qo_indptr=np.array([0, 1])), cupaged.ShapeError, "batch"),
    (dict(qo_indptr=np.array([0, 1, 5])), cupaged.InvalidArgumentError, "request 1 has 4 query tokens"),
    (dict(sinks=np.zeros(3)), cupaged.ShapeError, "sinks"),
    (dict(sinks=np.array([np.inf] * 8)), cupaged.InvalidArgumentError, "finite"),
    (dict(window_left=-2), cupaged.InvalidArgumentError, "window_left"),
    (dict(window_left=np.array([1, 2, 3])), cupaged.ShapeError, "window_left"),
])
def test_feature_arguments_are_checked(kw, error, match):
    table, k, v, rng = _batch(7, [20, 3])
    rows = int(kw["qo_indptr"][-1]) if "qo_indptr" in kw else 2
    q = rng.standard_normal((max(rows, 1), 8, 16))
    with pytest.raises(error, match=match):
        reference.decode(q, k, v, table, **kw)
