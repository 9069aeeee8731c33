"""Cascade decode (cupaged/cascade.py): the plan on the CPU, the kernels on the GPU.

The reference of request ``b`` in group ``j`` attends (float64,
``cupaged.reference.attend``) over the gathered visible tokens of
``shared_table``'s request ``j`` followed by ``unique_table``'s request ``b``.
The concatenation is not a valid CSR table when the prefix ends mid-page (its
last page is partly filled), so the reference works on gathered tokens, never
on a concatenated table.

CPU tests check plan_cascade's fields and its index arrays by running the
cascade on the host: the float64 reference decode of each level, the plan's
gathers, and the float64 reference merge must equal the reference of the
concatenation. GPU tests (marker ``gpu``) run cascade_decode on adversarial
batches: shuffled physical pages of one pool with slack, NaN in every slot no
request can see, prefixes and suffixes starting and ending mid-page, empty
prefixes and suffixes, outputs poisoned with NaN.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference
from cupaged.cascade import PrefixPass, pseudo_group_size
from cupaged.plan import MAX_HEADS_PER_CTA, heads_per_cta
from helpers import check_close, rel_errors, visible_mask

BF16 = np.dtype(ml_dtypes.bfloat16)


# --------------------------------------------------------------------- fixtures
def cascade_tables(rng, group_sizes, prefix_lens, suffix_lens, page_size=16, prefix_offsets=None, slack=2.0):
    """(shared, unique, group_indptr, num_pages): the prefixes, then the
    suffixes, on shuffled pages of one pool with slack; every other non-empty
    suffix starts mid-page."""
    prefix_lens = np.asarray(prefix_lens, dtype=np.int64)
    suffix_lens = np.asarray(suffix_lens, dtype=np.int64)
    assert len(prefix_lens) == len(group_sizes) and len(suffix_lens) == sum(group_sizes)
    poff = np.zeros_like(prefix_lens) if prefix_offsets is None else np.asarray(prefix_offsets, np.int64)
    soff = np.where((np.arange(len(suffix_lens)) % 2 == 1) & (suffix_lens > 0),
                    rng.integers(1, page_size, len(suffix_lens)), 0)
    ppages = np.where(prefix_lens > 0, -(-(prefix_lens + poff) // page_size), 0)
    spages = np.where(suffix_lens > 0, -(-(suffix_lens + soff) // page_size), 0)
    num_pages = int((ppages.sum() + spages.sum()) * slack) + 1
    ids = rng.permutation(num_pages).astype(np.int32)
    shared = cupaged.PageTable.from_seq_lens(prefix_lens, page_size, poff, page_ids=ids)
    unique = cupaged.PageTable.from_seq_lens(suffix_lens, page_size, soff, page_ids=ids[int(ppages.sum()):])
    group_indptr = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int32)
    return shared, unique, group_indptr, num_pages


def cascade_caches(rng, shared, unique, num_pages, num_kv_heads, head_dim, dtype):
    """Host K, V ``[num_pages, P, Hkv, D]`` in ``dtype``; NaN where neither table can see."""
    shape = (num_pages, shared.page_size, num_kv_heads, head_dim)
    mask = (visible_mask(shared, num_pages) | visible_mask(unique, num_pages))[:, :, None, None]
    k = np.where(mask, rng.standard_normal(shape, dtype=np.float32), np.nan).astype(dtype)
    v = np.where(mask, rng.standard_normal(shape, dtype=np.float32), np.nan).astype(dtype)
    return k, v


def cascade_reference(q, k, v, shared, unique, group_indptr, *, sm_scale=None, logits_soft_cap=None,
                      k_scale=None, v_scale=None):
    """Float64 ``(out [B, Hq, D], lse [B, Hq] log2)`` over prefix + suffix tokens."""
    batch, hq, d = q.shape
    out, lse = np.zeros((batch, hq, d)), np.full((batch, hq), -np.inf)
    group = np.repeat(np.arange(len(group_indptr) - 1), np.diff(group_indptr))
    for b in range(batch):
        j = int(group[b])
        kk = np.concatenate([reference.gather_kv(k, shared, j), reference.gather_kv(k, unique, b)])
        vv = np.concatenate([reference.gather_kv(v, shared, j), reference.gather_kv(v, unique, b)])
        out[b], lse[b] = reference.attend(q[b], kk, vv, sm_scale, logits_soft_cap=logits_soft_cap,
                                          k_scale=k_scale, v_scale=v_scale)
    return out, lse


def emulate_cascade(plan, q, k, v, shared, unique):
    """The cascade on the host: reference decodes of every level, the plan's
    gathers, the reference merge over ``plan.o_indptr``. Level rows no state
    reads stay NaN (a wrong index shows)."""
    batch, hq, d = q.shape
    qflat = np.asarray(q, dtype=np.float64).reshape(batch * hq, d)
    rows = plan.prefix_rows + batch * hq
    level_out, level_lse = np.full((rows, d), np.nan), np.full(rows, np.nan)
    pseudo_q = qflat[plan.q_index]
    for p, table in zip(plan.prefix_passes, plan.prefix_tables(shared)):
        sl = slice(p.row_offset, p.row_offset + p.num_rows)
        shape = (len(p.groups), plan.num_kv_heads * p.heads_per_kv_head, d)
        o, lse = reference.decode(pseudo_q[sl].reshape(shape), k, v, table)
        level_out[sl], level_lse[sl] = o.reshape(-1, d), lse.reshape(-1)
    o, lse = reference.decode(q, k, v, unique)
    level_out[plan.prefix_rows:], level_lse[plan.prefix_rows:] = o.reshape(-1, d), lse.reshape(-1)
    states_v = level_out[plan.state_index].reshape(plan.num_states, hq, d)
    states_lse = level_lse[plan.state_index].reshape(plan.num_states, hq)
    return reference.merge_states(states_v, states_lse, plan.o_indptr)


# ---------------------------------------------------------------- the heuristic
def test_pseudo_group_size_is_fewest_ctas():
    for h in range(1, 300):
        gp = pseudo_group_size(h)
        fewest = -(-h // MAX_HEADS_PER_CTA)
        assert gp >= h and gp // heads_per_cta(gp) == fewest, h
        if h // heads_per_cta(h) == fewest:
            assert gp == h, h  # no padding when none is needed
        else:
            assert gp == fewest * MAX_HEADS_PER_CTA, h
    assert [pseudo_group_size(h) for h in (1, 5, 11, 13, 256)] == [1, 5, 16, 16, 256]
    with pytest.raises(ValueError):
        pseudo_group_size(0)


# -------------------------------------------------------------------- the plan
def test_plan_of_one_group_reorders_heads():
    """64 requests, GQA 4: one pseudo-request with 256 heads per KV head."""
    shared = cupaged.PageTable.from_seq_lens([1000], 16)
    unique = cupaged.PageTable.from_seq_lens([16] * 64, 16, page_ids=np.arange(63, 127))
    plan = cupaged.plan_cascade(shared, unique, [0, 64], 32, 8, 128, np.float16)
    (p,) = plan.prefix_passes
    assert isinstance(p, PrefixPass)
    assert (p.heads_per_kv_head, p.row_offset, p.num_rows, p.groups.tolist()) == (256, 0, 2048, [0])
    assert (p.plan.batch_size, p.plan.num_qo_heads, p.plan.num_kv_heads, p.plan.heads_per_cta) == (1, 2048, 8, 8)
    assert (plan.batch_size, plan.num_groups, plan.group_size, plan.prefix_rows) == (64, 1, 4, 2048)
    assert plan.suffix_plan.batch_size == 64 and plan.suffix_plan.num_qo_heads == 32
    assert plan.dtype == np.float16 and plan.kv_dtype == np.float16 and plan.page_size == 16
    # qq[kvh*256 + r*4 + i] = q[r, kvh*4 + i]
    kvh, r, i = np.meshgrid(np.arange(8), np.arange(64), np.arange(4), indexing="ij")
    assert np.array_equal(plan.q_index.reshape(8, 64, 4), r * 32 + kvh * 4 + i)
    # states: request b's prefix (pseudo row) then suffix (level row 2048 + b*32 + h)
    assert plan.o_indptr.tolist() == list(range(0, 129, 2)) and plan.num_states == 128
    states = plan.state_index.reshape(64, 2, 32)
    h = np.arange(32)
    for b in (0, 1, 63):
        assert np.array_equal(states[b, 0], (h // 4) * 256 + b * 4 + h % 4)
        assert np.array_equal(states[b, 1], 2048 + b * 32 + h)
    assert plan.prefix_tables(shared) == (shared,)  # one pass over every group: the table itself


def test_plan_buckets_groups_by_pseudo_size():
    sizes = [3, 1, 3, 64, 1]  # GQA 4: 12, 4, 12, 256, 4 heads per KV head
    rng = np.random.default_rng(0)
    shared, unique, gi, _ = cascade_tables(rng, sizes, [40, 17, 33, 100, 5], [3] * 72)
    plan = cupaged.plan_cascade(shared, unique, gi, 32, 8, 64, np.float16)
    got = [(p.heads_per_kv_head, p.groups.tolist(), p.row_offset, p.num_rows) for p in plan.prefix_passes]
    assert got == [(12, [0, 2], 0, 192), (4, [1, 4], 192, 64), (256, [3], 256, 2048)]
    assert plan.prefix_rows == 2304 and plan.request_group.tolist() == [0] * 3 + [1] + [2] * 3 + [3] * 64 + [4]
    tables = plan.prefix_tables(shared)
    for p, table in zip(plan.prefix_passes, tables):
        assert table.seq_lens.tolist() == shared.seq_lens[p.groups].tolist()
        for t, j in enumerate(p.groups):
            a, b = shared.indptr[j], shared.indptr[j + 1]
            assert table.indices[table.indptr[t]:table.indptr[t + 1]].tolist() == shared.indices[a:b].tolist()
        assert p.plan.matches(table)


def test_plan_pads_prime_groups_and_drops_empty_prefixes():
    # GQA 1, a group of 11 (11 heads: padded to 16, 2 CTAs instead of 11) and a group without a prefix
    rng = np.random.default_rng(1)
    shared, unique, gi, _ = cascade_tables(rng, [11, 2], [50, 0], [4] * 13)
    plan = cupaged.plan_cascade(shared, unique, gi, 4, 4, 64, np.float32)
    (p,) = plan.prefix_passes
    assert p.heads_per_kv_head == 16 and p.plan.q_groups == 2 and p.num_rows == 4 * 16
    assert plan.prefix_nonempty.tolist() == [True, False]
    assert plan.o_indptr.tolist() == list(range(0, 23, 2)) + [23, 24]
    q_index = plan.q_index.reshape(4, 16)
    for kvh in range(4):
        assert q_index[kvh, :11].tolist() == [r * 4 + kvh for r in range(11)]
        assert (q_index[kvh, 11:] == kvh).all()  # padding repeats request 0's query of that kv head
    # every real pseudo row is read by exactly one state; no padded row is read
    prefix_reads = np.sort(plan.state_index[plan.state_index < plan.prefix_rows])
    real = (np.arange(4)[:, None] * 16 + np.arange(11)[None, :]).reshape(-1)
    assert np.array_equal(prefix_reads, real)


CPU_CASES = {
    # name: (group sizes, prefix lens, suffix lens, Hq, Hkv, prefix first_page_offset)
    "one-group-gqa4": ([5], [101], [0, 1, 15, 16, 17], 8, 2, None),
    "sizes-1-3-9-mha": ([1, 3, 9], [16, 37, 1], [3, 0, 5, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 4, None),
    "gqa8-mid-page-starts": ([2, 3], [70, 33], [9, 16, 0, 31, 2], 16, 2, [5, 15]),
    "empty-prefix-and-empty-both": ([2, 1, 2], [0, 45, 0], [4, 6, 0, 0, 9], 8, 4, None),
    "same-size-groups-share-a-pass": ([2, 2, 2], [17, 0, 64], [1, 2, 3, 4, 5, 6], 8, 8, [3, 0, 0]),
}


@pytest.mark.parametrize("case", list(CPU_CASES), ids=list(CPU_CASES))
def test_emulated_cascade_matches_reference(case):
    sizes, plens, slens, hq, hkv, poff = CPU_CASES[case]
    rng = np.random.default_rng(len(case))
    shared, unique, gi, num_pages = cascade_tables(rng, sizes, plens, slens, prefix_offsets=poff)
    k, v = cascade_caches(rng, shared, unique, num_pages, hkv, 64, np.float32)
    q = rng.standard_normal((sum(sizes), hq, 64)).astype(np.float32)
    plan = cupaged.plan_cascade(shared, unique, gi, hq, hkv, 64, np.float32)
    out, lse = emulate_cascade(plan, q, k, v, shared, unique)
    ref_out, ref_lse = cascade_reference(q, k, v, shared, unique, gi)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref_out, rtol=1e-9, atol=1e-12)
    assert np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-9, atol=1e-12)
    empty = (shared.seq_lens[np.repeat(np.arange(len(sizes)), sizes)] + unique.seq_lens) == 0
    assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()


def test_reference_helper_sees_the_concatenation():
    """The test's own reference: prefix + suffix tokens equal one decode when
    the prefix ends on a page boundary (then the concatenation is a table)."""
    rng = np.random.default_rng(2)
    shared, unique, gi, num_pages = cascade_tables(rng, [2, 1], [32, 16], [5, 0, 17])
    k, v = cascade_caches(rng, shared, unique, num_pages, 2, 64, np.float32)
    q = rng.standard_normal((3, 4, 64)).astype(np.float32)
    group = [0, 0, 1]
    idx, ptr, last, off = [], [0], [], []
    for b in range(3):
        j = group[b]
        ps, us = shared.indices[shared.indptr[j]:shared.indptr[j + 1]], unique.indices[unique.indptr[b]:unique.indptr[b + 1]]
        assert not (len(us) and unique.first_page_offset[b])  # no suffix starts mid-page with this seed
        idx += [*ps, *us]
        ptr.append(len(idx))
        last.append(unique.last_page_len[b] if len(us) else shared.last_page_len[j])
        off.append(0)
    concat = cupaged.PageTable(np.array(idx, np.int32), np.array(ptr, np.int32), np.array(last, np.int32),
                               np.array(off, np.int32), page_size=16)
    ref_out, ref_lse = reference.decode(q, k, v, concat)
    out, lse = cascade_reference(q, k, v, shared, unique, gi)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


def test_matches_and_reuse():
    rng = np.random.default_rng(3)
    shared, unique, gi, _ = cascade_tables(rng, [3, 2], [100, 0], [4, 5, 6, 7, 8])
    plan = cupaged.plan_cascade(shared, unique, gi, 8, 2, 64, np.float16)
    assert plan.matches(shared, unique, gi) and plan.matches(shared, unique, gi.tolist())
    longer = cupaged.PageTable.from_seq_lens(unique.seq_lens + 1, 16)  # next step, same chunk counts
    assert plan.matches(shared, longer, gi)
    assert not plan.matches(shared, unique, [0, 2, 5])  # other groups
    assert not plan.matches(shared, unique, [0, 3])
    assert not plan.matches(cupaged.PageTable.from_seq_lens([100, 3], 16), unique, gi)  # a prefix appeared
    assert not plan.matches(cupaged.PageTable.from_seq_lens([100], 16), unique, gi)  # one group fewer
    assert not plan.matches(shared, cupaged.PageTable.from_seq_lens([4] * 4, 16), gi)  # batch 4
    assert not plan.matches(shared, cupaged.PageTable.from_seq_lens([4] * 5, 32), gi)  # page size
    assert not plan.matches(shared.indices, unique, gi) and not plan.matches(shared, unique, object())
    (p,) = plan.prefix_passes
    c = p.plan.pages_per_chunk
    grown = cupaged.PageTable.from_seq_lens([100 + 16 * c, 0], 16)  # the prefix grows by c pages: one chunk more
    assert not plan.matches(grown, unique, gi)
    with pytest.raises(cupaged.PlanMismatchError, match="shared_table"):
        plan.prefix_tables(grown)


def test_plan_is_frozen_data():
    shared = cupaged.PageTable.from_seq_lens([40], 16)
    unique = cupaged.PageTable.from_seq_lens([4, 4], 16)
    plan = cupaged.plan_cascade(shared, unique, np.array([0, 2], np.int64), 8, 8, 64, BF16)
    assert plan.dtype == BF16
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch_size = 3
    for name in ("group_indptr", "request_group", "prefix_nonempty", "q_index", "state_index", "o_indptr"):
        arr = getattr(plan, name)
        assert not arr.flags.writeable, name
    assert plan.prefix_nonempty.dtype == bool and plan.o_indptr.dtype == np.int32
    assert not plan.prefix_passes[0].groups.flags.writeable
    other = cupaged.plan_cascade(shared, unique, [0, 2], 8, 8, 64, BF16)
    assert plan != other and len({plan, other}) == 2  # identity, like DecodePlan


def _tables():
    return cupaged.PageTable.from_seq_lens([40, 20], 16), cupaged.PageTable.from_seq_lens([4, 4, 4], 16)


class _DeviceLike:
    dtype = np.dtype(np.int32)
    shape = (3,)

    def get(self):
        return np.array([0, 2, 3], np.int32)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"shared_table": "not a table"}, cupaged.ArgumentTypeError, "shared_table"),
        ({"unique_table": None}, cupaged.ArgumentTypeError, "unique_table"),
        ({"unique_table": cupaged.PageTable.from_seq_lens([4, 4, 4], 32)}, cupaged.ShapeError, "page_size"),
        ({"unique_table": cupaged.PageTable.from_seq_lens([], 16), "group_indptr": [0, 0, 0]},
         cupaged.InvalidArgumentError, "batch size 0"),
        ({"group_indptr": [0, 3]}, cupaged.ShapeError, "G\\+1 = 3"),
        ({"group_indptr": [[0, 2, 3]]}, cupaged.ShapeError, "1-D"),
        ({"group_indptr": [0.0, 2.0, 3.0]}, cupaged.DTypeError, "integers"),
        ({"group_indptr": _DeviceLike()}, cupaged.ArgumentTypeError, "host array"),
        ({"group_indptr": [1, 2, 3]}, cupaged.InvalidArgumentError, "start at 0"),
        ({"group_indptr": [0, 0, 3]}, cupaged.InvalidArgumentError, "group 0: .*at least one request"),
        ({"group_indptr": [0, 2, 2]}, cupaged.InvalidArgumentError, "group 1"),
        ({"group_indptr": [0, 2, 4]}, cupaged.InvalidArgumentError, "end at B = 3"),
        ({"num_qo_heads": 12}, cupaged.ShapeError, "multiple"),
        ({"num_kv_heads": 0}, cupaged.InvalidArgumentError, "num_kv_heads"),
        ({"num_qo_heads": 8.0}, cupaged.InvalidArgumentError, "num_qo_heads"),
        ({"head_dim": 72}, cupaged.UnsupportedConfigError, "head_dim 72 has no merge kernel"),
        ({"dtype": np.int32}, ValueError, "dtype"),
    ],
)
def test_plan_rejects(change, error, match):
    shared, unique = _tables()
    args = {"shared_table": shared, "unique_table": unique, "group_indptr": [0, 2, 3], "num_qo_heads": 16,
            "num_kv_heads": 8, "head_dim": 64, "dtype": np.float16, **change}
    with pytest.raises(error, match=match):
        cupaged.plan_cascade(**args)


@pytest.mark.skipif(cupaged.has_gpu(), reason="checks the no-GPU behaviour")
def test_cascade_decode_needs_a_gpu():
    shared, unique = _tables()
    with pytest.raises(cupaged.NoGPUError, match="cascade_decode"):
        cupaged.cascade_decode(None, None, None, shared, unique, [0, 2, 3])


def test_cascade_decode_orchestration_with_host_fakes(monkeypatch):
    """cascade_decode's own code (buffers, gathers, views, the launch order)
    on the CPU: CuPy is NumPy, each level's decode is the float64 reference
    decode stored in q's dtype, the merge kernel is the reference merge."""
    import sys
    import types

    import cupaged._device
    import cupaged.merge

    decode_module = sys.modules["cupaged.decode"]
    fake = types.SimpleNamespace(ndarray=np.ndarray, empty=np.empty, asarray=np.asarray, take=np.take,
                                 float32=np.float32, int64=np.int64)
    calls = []

    def fake_decode(q, k, v, table, plan, *, out, return_lse, **kw):
        assert plan.matches(table) and plan.num_qo_heads == q.shape[1] and return_lse
        calls.append((q.shape, kw))
        o, lse = reference.decode(q, k, v, table, kw["sm_scale"])
        out[...] = o.astype(out.dtype)
        return out, lse.astype(np.float32)

    def fake_merge(v, lse, o_indptr, rows, out, lse_out):
        assert v.dtype == lse.dtype == np.float32 and rows == out.shape[0]
        o, l = reference.merge_states(v, lse, np.asarray(o_indptr))
        out[...] = o.astype(out.dtype)
        if lse_out is not None:
            lse_out[...] = l

    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cupaged._device, "has_gpu", lambda: True)
    monkeypatch.setattr(decode_module, "decode", fake_decode)
    monkeypatch.setattr(cupaged.merge, "launch_merge", fake_merge)
    rng = np.random.default_rng(7)
    sizes, hq, hkv = [3, 11, 1, 3], 8, 8  # passes of 3, 16 (padded 11) and 1 heads per kv head
    shared, unique, gi, num_pages = cascade_tables(rng, sizes, [40, 100, 0, 17], [3, 0, 20] + [5] * 15)
    k, v = cascade_caches(rng, shared, unique, num_pages, hkv, 64, np.float32)
    for dtype, tol in ((np.float32, 1e-6), (np.float16, 2e-3)):
        q, k, v = rng.standard_normal((18, hq, 64)).astype(dtype), k.astype(dtype), v.astype(dtype)
        ref_out, ref_lse = cascade_reference(q, k, v, shared, unique, gi, sm_scale=0.3)
        plan = cupaged.plan_cascade(shared, unique, gi, hq, hkv, 64, dtype)
        assert [p.heads_per_kv_head for p in plan.prefix_passes] == [3, 16]
        calls.clear()
        out, lse = cupaged.cascade_decode(q, k, v, shared, unique, gi, plan, sm_scale=0.3, return_lse=True)
        assert [c[0] for c in calls] == [(2, 24, 64), (1, 128, 64), (18, 8, 64)]  # two prefix passes, suffixes
        assert all(c[1]["sm_scale"] == 0.3 and c[1]["kv_layout"] == "NHD" for c in calls)
        assert out.dtype == dtype and lse.dtype == np.float32
        assert rel_errors(out, ref_out)[0] < tol
        finite = np.isfinite(ref_lse)
        assert np.array_equal(finite, np.isfinite(lse)) and np.allclose(lse[finite], ref_lse[finite], atol=1e-4)
        again = cupaged.cascade_decode(q, k, v, shared, unique, gi, plan, sm_scale=0.3)  # buffers reused
        assert np.array_equal(again, out)
        with pytest.raises(cupaged.PlanMismatchError, match="stale"):  # same tables, other groups
            cupaged.cascade_decode(q, k, v, shared, unique, [0, 4, 14, 15, 18], plan)


# ------------------------------------------------------------------------- GPU
def _cp():
    import cupy

    return cupy


def gpu_case(seed, sizes, plens, slens, hq=32, hkv=8, head_dim=128, dtype=np.float16, prefix_offsets=None):
    rng = np.random.default_rng(seed)
    shared, unique, gi, num_pages = cascade_tables(rng, sizes, plens, slens, prefix_offsets=prefix_offsets)
    k, v = cascade_caches(rng, shared, unique, num_pages, hkv, head_dim, dtype)
    q = rng.standard_normal((sum(sizes), hq, head_dim), dtype=np.float32).astype(dtype)
    return (q, k, v), (shared, unique, gi)


def run_cascade(q, k, v, shared, unique, gi, plan=None, **kw):
    """cascade_decode of host arrays with a NaN-poisoned out -> host (out, lse) float64."""
    cp = _cp()
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    if kw.get("kv_layout") == "HND":
        dk, dv = (cp.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (dk, dv))
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupaged.cascade_decode(dq, dk, dv, shared, unique, gi, plan, out=out, return_lse=True, **kw)
    cp.cuda.runtime.deviceSynchronize()  # an asynchronous fault fails here
    assert res is out
    out_h = out.get().astype(np.float64)
    assert np.isfinite(out_h).all(), "output not fully written (NaN left from the poison)"
    return out_h, lse.get().astype(np.float64)


check = check_close


RAGGED = [0, 1, 15, 16, 17, 31, 97, 257]
GPU_CASES = {
    # name: (group sizes, prefix lens (mid-page ends), suffix lens, Hq, Hkv, dtype)
    "sizes-1-3-64-gqa4-fp16": ([1, 3, 64], [37, 1021, 300], RAGGED * 8 + [5, 0, 3, 12], 32, 8, np.float16),
    "sizes-1-3-64-gqa4-bf16": ([1, 3, 64], [513, 17, 999], RAGGED * 8 + [1, 1, 0, 2], 32, 8, BF16),
    "gqa1-padded-11-fp16": ([11, 3, 1], [250, 1, 16], RAGGED + [3, 4, 5, 6, 7, 8, 9], 8, 8, np.float16),
    "gqa8-bf16": ([2, 5], [700, 129], [0, 16, 1, 33, 0, 2, 64], 64, 8, BF16),
    "gqa4-fp32": ([3, 2], [100, 45], [7, 0, 16, 3, 40], 32, 8, np.float32),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_cascade_matches_reference(case):
    sizes, plens, slens, hq, hkv, dtype = GPU_CASES[case]
    host, tables = gpu_case(10, sizes, plens, slens, hq, hkv, dtype=dtype, prefix_offsets=[i % 5 for i in plens])
    plan = cupaged.plan_cascade(*tables, hq, hkv, 128, dtype)
    out, lse = run_cascade(*host, *tables, plan)
    check(out, lse, *cascade_reference(*host, *tables), dtype)


@pytest.mark.gpu
def test_empty_levels_do_not_poison_neighbours():
    # group 0 has no prefix; request 2 (group 0) has neither prefix nor suffix; group 1's suffixes are empty
    host, tables = gpu_case(11, [3, 2], [0, 77], [9, 40, 0, 0, 0])
    out, lse = run_cascade(*host, *tables)
    ref_out, ref_lse = cascade_reference(*host, *tables)
    check(out, lse, ref_out, ref_lse, np.float16)
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all()


@pytest.mark.gpu
def test_split_levels_and_plan_reuse(monkeypatch):
    """A huge CTA target splits both levels into chunks (each decode merges
    inside); the plan then serves the next step's tables."""
    monkeypatch.setenv("CUPAGED_TARGET_CTAS", str(10**6))
    host, (shared, unique, gi) = gpu_case(12, [4, 1], [2000, 333], [100, 0, 64, 17, 250])
    plan = cupaged.plan_cascade(shared, unique, gi, 32, 8, 128, np.float16)
    assert plan.suffix_plan.needs_merge and all(p.plan.needs_merge for p in plan.prefix_passes)
    out, lse = run_cascade(*host, shared, unique, gi, plan)
    check(out, lse, *cascade_reference(*host, shared, unique, gi), np.float16)
    # another step with new table objects: each suffix that can loses its last token
    pages, last, off = unique.request_pages, unique.last_page_len, unique.first_page_offset
    shrink = (last > 1) & ((pages > 1) | (last - 1 > off))
    shorter = cupaged.PageTable(unique.indices, unique.indptr, np.where(shrink, last - 1, last).astype(np.int32),
                                off, page_size=16)
    shared2 = cupaged.PageTable(shared.indices, shared.indptr, shared.last_page_len, shared.first_page_offset,
                                page_size=16)
    assert plan.matches(shared2, shorter, gi) and (shorter.seq_lens < unique.seq_lens).sum() >= 3
    out2, lse2 = run_cascade(*host, shared2, shorter, gi, plan)
    check(out2, lse2, *cascade_reference(*host, shared2, shorter, gi), np.float16)


@pytest.mark.gpu
def test_stale_plan_and_bad_calls_raise():
    host, (shared, unique, gi) = gpu_case(13, [2, 1], [50, 20], [3, 4, 5])
    cp = _cp()
    q, k, v = (cp.asarray(a) for a in host)
    plan = cupaged.plan_cascade(shared, unique, gi, 32, 8, 128, np.float16)
    with pytest.raises(cupaged.PlanMismatchError, match="stale"):
        cupaged.cascade_decode(q, k, v, shared, unique, [0, 1, 3], plan)
    with pytest.raises(cupaged.PlanMismatchError, match="built for"):
        cupaged.cascade_decode(q[:, :16], k, v, shared, unique, gi, plan)
    with pytest.raises(cupaged.ArgumentTypeError):
        cupaged.cascade_decode(q, k, v, shared, unique, gi, plan.suffix_plan)
    with pytest.raises(cupaged.ShapeError):
        cupaged.cascade_decode(q[:2], k, v, shared, unique, gi)
    with pytest.raises(cupaged.LayoutError):
        cupaged.cascade_decode(q, k, v, shared, unique, gi, kv_layout="NDH")
    with pytest.raises(cupaged.ArgumentTypeError):
        cupaged.cascade_decode(host[0], k, v, shared, unique, gi)
    # decode's dtype rule; a plan for 16-bit caches used with fp8 ones
    with pytest.raises(cupaged.DTypeError):
        cupaged.cascade_decode(q, k.astype(cp.float32), v, shared, unique, gi)
    k8, v8 = (cp.zeros(a.shape, dtype=cp.uint8) for a in (k, v))
    with pytest.raises(cupaged.PlanMismatchError, match="kv_dtype"):
        cupaged.cascade_decode(q, k8, v8, shared, unique, gi, plan)
    with pytest.raises(cupaged.ShapeError):
        cupaged.cascade_decode(q, k, v, shared, unique, gi, out=cp.empty((3, 32, 64), dtype=q.dtype))


@pytest.mark.gpu
def test_equals_plain_decode_of_the_concatenation():
    """With a page-aligned prefix the concatenation is a table: plain decode
    and cascade decode agree (both within fp16 rounding of float64)."""
    cp = _cp()
    rng = np.random.default_rng(14)
    prefix, suffixes, num_pages = 64 * 16, [16, 100, 0, 255], 200
    ids = rng.permutation(num_pages).astype(np.int32)
    shared = cupaged.PageTable.from_seq_lens([prefix], 16, page_ids=ids)
    unique = cupaged.PageTable.from_seq_lens(suffixes, 16, page_ids=ids[64:])
    pages = [np.concatenate([shared.indices, unique.indices[unique.indptr[b]:unique.indptr[b + 1]]])
             for b in range(4)]
    concat = cupaged.PageTable.from_seq_lens([prefix + s for s in suffixes], 16, page_ids=np.concatenate(pages))
    k = cp.asarray(rng.standard_normal((num_pages, 16, 8, 128), dtype=np.float32).astype(np.float16))
    v = cp.asarray(rng.standard_normal((num_pages, 16, 8, 128), dtype=np.float32).astype(np.float16))
    q = cp.asarray(rng.standard_normal((4, 32, 128), dtype=np.float32).astype(np.float16))
    out, lse = cupaged.cascade_decode(q, k, v, shared, unique, [0, 4], return_lse=True)
    plain, plain_lse = cupaged.decode(q, k, v, concat, return_lse=True)
    assert rel_errors(out.get(), plain.get().astype(np.float64))[0] < 1e-2
    assert np.allclose(lse.get(), plain_lse.get(), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_soft_cap_and_hnd_pass_through(dtype):
    host, tables = gpu_case(15, [3, 1], [400, 61], [5, 0, 33, 17], dtype=dtype)
    out, lse = run_cascade(*host, *tables, logits_soft_cap=1.5, kv_layout="HND", sm_scale=0.2)
    ref_out, ref_lse = cascade_reference(*host, *tables, logits_soft_cap=1.5, sm_scale=0.2)
    check(out, lse, ref_out, ref_lse, dtype)
    uncapped, _ = cascade_reference(*host, *tables, sm_scale=0.2)
    assert rel_errors(uncapped, ref_out)[0] > 0.05  # the cap matters at this scale


@pytest.mark.gpu
def test_per_head_kv_scales_pass_through():
    cp = _cp()
    host, tables = gpu_case(16, [2, 2], [90, 0], [5, 6, 7, 8])
    k_scale = np.linspace(0.5, 2.0, 8).astype(np.float32)
    v_scale = np.linspace(1.5, 0.25, 8).astype(np.float32)
    out, lse = run_cascade(*host, *tables, k_scale=cp.asarray(k_scale), v_scale=cp.asarray(v_scale))
    check(out, lse, *cascade_reference(*host, *tables, k_scale=k_scale, v_scale=v_scale), np.float16)
