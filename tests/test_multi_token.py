"""Several query tokens per request (issue 18: ``qo_indptr``), served by
``PageTable.query_rows``: one table row per query token, each row a request
prefix that ends at its token.

The CPU tests compare the float64 reference on the row table with the
reference's own multi-token definition (bitwise: the same slots in the same
order), alone and with windows, sinks, fp8 scales and HND, and check the plan
and the hot path's argument test. The GPU tests (marked ``gpu``) run decode,
plans and the runner against the reference on test_features_gpu's adversarial
batches: shuffled pages, half the requests starting mid-page, NaN in every
slot no request can see and in ``out``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import RAGGED_LENS, make_caches, make_query, make_table, rel_errors

import cupaged
from cupaged import plan as plan_mod
from cupaged import reference
from cupaged._plan_launch import args_match
from cupaged.page_table import kernel_table
from test_features_gpu import BF16, F16, FP8, _cp, check, differs, make_batch, run, tolerance

gpu = pytest.mark.gpu


def _qo_indptr(rng, seq_lens, max_q=16):
    """Random query tokens per request: 1..min(max_q, seq_len) (every seq_len >= 1)."""
    q_len = np.array([rng.integers(1, min(max_q, int(n)) + 1) for n in seq_lens])
    return np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)


# ------------------------------------------------------------- tables (CPU)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_query_rows_is_the_reference_definition(page_size, seed):
    rng = np.random.default_rng(seed * 10 + page_size)
    lens = np.array([*RAGGED_LENS, 2, 40])
    off = np.where(np.arange(len(lens)) % 2 == 1, rng.integers(0, page_size, len(lens)), 0)
    table, num_pages = make_table(rng, lens, page_size, off)
    ptr = _qo_indptr(rng, lens)
    rows = table.query_rows(ptr)
    rows.validate()
    q_len = np.diff(ptr)
    req = np.repeat(np.arange(len(lens)), q_len)
    j = np.arange(int(ptr[-1])) - ptr[:-1][req]
    np.testing.assert_array_equal(rows.seq_lens, lens[req] - q_len[req] + j + 1)
    np.testing.assert_array_equal(rows.first_page_offset, table.first_page_offset[req])
    for r in range(rows.batch_size):  # a row's pages are a prefix of its request's
        mine = rows.indices[rows.indptr[r]:rows.indptr[r + 1]]
        np.testing.assert_array_equal(mine, table.indices[table.indptr[req[r]]:table.indptr[req[r]] + len(mine)])
    k, v = make_caches(rng, table, num_pages, 2, 64, np.float32)
    q = make_query(rng, int(ptr[-1]), 4, 64, np.float32)
    for a, b in zip(reference.decode(q, k, v, rows), reference.decode(q, k, v, table, qo_indptr=ptr)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("window", [0, 1, 5, 16, 40, np.array([3, -1, 0, 100, 7, 16, 2, 1, 0, 5])])
def test_rows_with_windows_sinks_fp8_and_hnd(window):
    """Each token has its own window (a per-request window holds for all of
    its tokens); sinks, fp8 with per-head scales, HND and a soft cap ride along."""
    from helpers import make_fp8_caches, to_hnd

    rng = np.random.default_rng(7)
    lens = np.array([*RAGGED_LENS, 2, 40])
    table, num_pages = make_table(rng, lens, 16, np.where(np.arange(10) % 2 == 1, 5, 0))
    ptr = _qo_indptr(rng, lens, max_q=8)
    k, v, ks, vs = make_fp8_caches(rng, table, num_pages, 2, 64, "head")
    q = make_query(rng, int(ptr[-1]), 8, 64, np.float16)
    sinks = rng.uniform(2, 6, 8)
    kw = dict(k_scale=ks, v_scale=vs, logits_soft_cap=15.0, sinks=sinks, kv_layout="HND")
    got = reference.decode(q, to_hnd(k), to_hnd(v), kernel_table(table, ptr, window), **kw)
    want = reference.decode(q, to_hnd(k), to_hnd(v), table, qo_indptr=ptr, window_left=window, **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_rows_cache_identity_errors_and_plans():
    table = cupaged.PageTable.from_seq_lens([37, 5, 16], page_size=16, first_page_offset=[3, 0, 0])
    ptr = np.array([0, 3, 4, 6])
    rows = table.query_rows(ptr)
    assert rows.seq_lens.tolist() == [35, 36, 37, 5, 15, 16]
    assert table.query_rows([0, 3, 4, 6]) is rows and table.query_rows(None) is table
    assert table.query_rows(np.arange(4)) is table  # one token each: the table itself
    assert kernel_table(table) is table and kernel_table(table, [0, 1, 2, 3], -1) is table
    for bad, err, match in (
            ([0, 3, 4], cupaged.ShapeError, "batch \\+ 1 = 4"),
            ([1, 3, 4, 6], cupaged.InvalidArgumentError, "start at 0"),
            ([0, 0, 4, 6], cupaged.InvalidArgumentError, "1..16"),
            ([0, 17, 18, 19], cupaged.InvalidArgumentError, "1..16"),
            ([0, 1, 7, 8], cupaged.InvalidArgumentError, "request 1 has 6 query tokens but 5"),
            (np.array([0.0, 1, 2, 3]), cupaged.ShapeError, "integer")):
        with pytest.raises(err, match=match):
            table.query_rows(bad)
    with pytest.raises(cupaged.ArgumentTypeError):
        kernel_table(object(), ptr)
    plan = cupaged.plan_decode(table, 8, 2, 64, np.float16, qo_indptr=ptr, pages_per_chunk=1)
    assert plan.batch_size == 6 and plan.matches(rows) and not plan.matches(table)
    same = cupaged.plan_decode(rows, 8, 2, 64, np.float16, pages_per_chunk=1)
    np.testing.assert_array_equal(plan.request_chunks, same.request_chunks)
    windowed = cupaged.plan_decode(table, 8, 2, 64, np.float16, qo_indptr=ptr, window_left=4, pages_per_chunk=1)
    assert windowed.matches(rows.windowed(4)) and windowed.request_chunks.tolist() == [1, 1, 1, 1, 1, 1]


def test_row_groups_plan_image_and_checks(monkeypatch):
    """A plan of several query tokens per request groups each request's
    consecutive tokens (16-bit KV: 2 x 16 / heads_per_cta per CTA, on warp
    pairs; fp8: 8 / heads_per_cta; the CUDA-core core one), gives a group's
    rows its last row's split, launches units for a group's first row only, and its
    structure and tables are checked."""
    from cupaged import _launch, _validate

    monkeypatch.delenv("CUPAGED_CORE", raising=False)
    table = cupaged.PageTable.from_seq_lens([300, 5, 40, 90], page_size=16, first_page_offset=[3, 0, 9, 0])
    ptr = np.array([0, 6, 7, 9, 19])  # q_len 6, 1, 2, 10
    rows = table.query_rows(ptr)
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, pages_per_chunk=5, group_tokens=True)
    assert plan.heads_per_cta == 4  # 8 tokens per CTA (a group in at most PAIR_MAX_CHUNKS chunks)
    want = [5, 5, 5, 5, 5, 5, 6, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16, 18, 18]
    assert plan.group_last.tolist() == want and not plan.group_last.flags.writeable
    last = np.array(want)
    group_pages = rows.request_pages[last]
    np.testing.assert_array_equal(plan.request_chunks, -(-group_pages // 5))  # each row: its group's split
    # more chunks than PAIR_MAX_CHUNKS in a group: groups of one warp's 4 tokens
    assert plan_mod.PAIR_MAX_CHUNKS < 10 and int(rows.request_pages.max()) == 19
    small = cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, pages_per_chunk=2, group_tokens=True)
    assert small.group_last.tolist() == [3, 3, 3, 3, 5, 5, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 18, 18]
    lead = np.r_[True, last[1:] != last[:-1]]
    assert plan.num_units == int(plan.request_chunks[lead].sum()) < plan.num_chunks
    assert plan.grid == (plan.num_units * plan.heads_groups, 1, 1) and plan.matches(rows)
    _validate.check_plan_structure(plan)  # (trusted: made by plan_decode) and a copy made by hand
    _validate.check_plan_structure(dataclasses.replace(plan))
    units = _launch.plan_units(plan)
    assert units.shape == (plan.num_units, 4) and lead[units[:, 0]].all()
    assert sorted(units[:, 1].tolist()) == sorted(np.flatnonzero(lead[plan.chunk_request]).tolist())
    image = np.zeros(_launch.image_capacity(19, plan.num_chunks, int(rows.indptr[-1])), np.int32)
    offsets = _launch.image_offsets(19, plan.num_chunks)
    _launch.write_image(image, offsets, units, plan, rows)
    assert image[7] == offsets[4] and (image[offsets[4]:offsets[4] + 19][lead] == (last - np.arange(19) + 1)[lead]).all()

    # another table (a row on other pages than its group's last row, or not the next token) is refused
    indices = rows.indices.copy()
    indices[rows.indptr[5] - 1] += 1  # row 4's last page (row 5, the end of its group, has another there)
    other = cupaged.PageTable(indices, rows.indptr, rows.last_page_len, rows.first_page_offset, page_size=16)
    assert not plan.matches(other)
    shifted = cupaged.PageTable.from_seq_lens(rows.seq_lens + (np.arange(19) == 4), 16,
                                              first_page_offset=rows.first_page_offset)
    assert not plan.matches(shifted)
    with pytest.raises(cupaged.PlanMismatchError, match="consecutive query tokens"):
        plan.chunk_page_ranges(shifted)
    for bad in (np.arange(19), np.r_[want[:-1], 17], np.minimum(np.arange(19) + 20, 18)):
        with pytest.raises(cupaged.PlanMismatchError):
            _validate.check_plan_structure(dataclasses.replace(plan, group_last=bad))
    counts = plan.request_chunks.copy()
    counts[1] += 1  # one row of a group split otherwise
    with pytest.raises(cupaged.PlanMismatchError, match="one split"):
        _validate.check_plan_structure(dataclasses.replace(plan, request_chunks=counts))

    # tokens per CTA by kernel (the small-grid rule off: these small plans would leave pairs);
    # no groups with a window, group_tokens=False, or the CUDA-core core
    monkeypatch.setattr(plan_mod, "_pairs_underfill", lambda *args: False)
    grouped = {"qo_indptr": ptr, "group_tokens": True}
    fp8 = cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, kv_dtype=np.uint8)
    assert fp8.group_last.tolist()[:6] == [1, 1, 3, 3, 5, 5]  # 2 tokens (the transposed tile: no pairs)
    mha = cupaged.plan_decode(table, 8, 8, 64, np.float16, **grouped)  # one head per CTA: 16 tokens a warp
    assert mha.group_last.tolist() == [5] * 6 + [6, 8, 8] + [18] * 10
    g8 = cupaged.plan_decode(table, 64, 8, 128, np.float16, **grouped)  # 8 heads per CTA: 2 a warp, 4 a pair
    assert g8.group_last.tolist() == [3, 3, 3, 3, 5, 5, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 18, 18]
    g3 = cupaged.plan_decode(table, 24, 8, 128, np.float16, **grouped)  # 3 heads per CTA: 5 tokens, no pairs
    assert g3.group_last.tolist()[:9] == [4, 4, 4, 4, 4, 5, 6, 8, 8]
    for p in (cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, window_left=50),
              cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, group_tokens=False),
              cupaged.plan_decode(table, 32, 8, 128, np.float32, qo_indptr=ptr),
              cupaged.plan_decode(table, 32, 8, 128, np.float16)):
        assert p.group_last is None and p.num_units == p.num_chunks
    monkeypatch.setenv("CUPAGED_CORE", "simt")
    assert cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, group_tokens=True).group_last is None
    with pytest.raises(cupaged.InvalidArgumentError, match="group_tokens must be None, True or False"):
        cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, group_tokens=1)


def _rows_bytes(table, ptr, hkv, d, itemsize=2):
    """KV bytes the query rows of ``table`` and ``ptr`` read, each row its own pages (all kv heads)."""
    rows = table.query_rows(ptr)
    return int(rows.request_pages.sum()) * rows.page_size * 2 * d * itemsize * hkv


@pytest.mark.parametrize("q_len,batch,ctx,grouped", [
    (4, 1, 1024, False), (8, 1, 1024, False), (2, 4, 1024, False), (8, 2, 512, False),  # <= 32 MiB
    (4, 1, 4096, True), (4, 2, 2048, True), (2, 4, 2048, True), (8, 4, 512, True),      # above
])
def test_default_groups_only_steps_past_the_row_table_bound(q_len, batch, ctx, grouped):
    """group_tokens=None (the default) plans one row per token when the rows
    read at most ROW_TABLE_MAX_BYTES of a 16-bit cache, row groups above;
    True and deterministic plans always group, fp8 (not measured) too."""
    table = cupaged.PageTable.from_seq_lens([ctx] * batch, page_size=16)
    ptr = np.arange(batch + 1, dtype=np.int32) * q_len
    assert (_rows_bytes(table, ptr, 8, 128) > plan_mod.ROW_TABLE_MAX_BYTES) == grouped
    for dtype in (np.float16, BF16):
        plan = cupaged.plan_decode(table, 32, 8, 128, dtype, qo_indptr=ptr, num_sms=132)
        assert (plan.group_last is not None) == grouped
        if not grouped:
            rows = cupaged.plan_decode(table, 32, 8, 128, dtype, qo_indptr=ptr, num_sms=132, group_tokens=False)
            assert plan.request_chunks.tolist() == rows.request_chunks.tolist() and plan.grid == rows.grid
    for kw in ({"group_tokens": True}, {"deterministic": True}, {"kv_dtype": np.uint8}):
        assert cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, num_sms=132, **kw).group_last \
            is not None


def _group_sizes(plan) -> set:
    """The row-group sizes (tokens per group) of a plan."""
    return set(np.bincount(plan.group_last)[plan.group_last].tolist())


def test_small_grids_of_warp_pairs_fall_back_to_one_warp_groups():
    """A default plan of warp pairs with fewer CTAs than SMs forms one
    warp's groups instead (4 tokens at 4 heads per CTA, not 8); with a chunk
    knob, deterministic, or a grid that fills the SMs, the pairs stay."""
    table = cupaged.PageTable.from_seq_lens([512] * 4, page_size=16)
    ptr = np.arange(5, dtype=np.int32) * 8
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, num_sms=132)
    assert _group_sizes(plan) == {4}
    for kw in ({"pages_per_chunk": 32}, {"deterministic": True}, {"num_sms": 16}):
        kw = {"num_sms": 132, **kw}
        assert _group_sizes(cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, **kw)) == {8}, kw


def test_large_steps_keep_warp_pairs_on_eight_warps():
    """A default plan held to one CTA per SM (family rows8) keeps its warp
    pairs past PAIR_MAX_CHUNKS and on a grid just short of the SMs where
    the requests hold at least PAIR_WIDE_MIN_BYTES of 16-bit KV at head_dim
    128 and 4 or 8 heads per CTA in chunks of at least
    PAIR_WIDE_CHUNK_TOKENS; smaller steps, other head dims, 6 heads per CTA,
    fp8 and 2 per SM keep the fallback to one warp's groups."""

    def plan(lens, q_len, dtype=np.float16, d=128, **kw):
        table = cupaged.PageTable.from_seq_lens(lens, page_size=16)
        ptr = np.arange(len(lens) + 1, dtype=np.int32) * q_len
        return cupaged.plan_decode(table, 32, 8, d, dtype, qo_indptr=ptr, **{"num_sms": 132, **kw})

    for lens, q_len in (([32768], 8), ([32768], 5), ([16384], 6), ([8192] * 2, 8), ([1024] * 16, 8)):
        assert 2 * sum(lens) * 8 * 128 * 2 >= plan_mod.PAIR_WIDE_MIN_BYTES
        for dtype in (np.float16, BF16):
            p = plan(lens, q_len, dtype)
            assert _group_sizes(p) == {q_len} and p.ctas_per_sm == 1 and 2 * p.num_ctas >= 132, (lens, q_len)
            assert p.pages_per_chunk * 16 >= plan_mod.PAIR_WIDE_CHUNK_TOKENS
    assert int(plan([32768], 8).request_chunks.max()) > plan_mod.PAIR_MAX_CHUNKS
    assert _group_sizes(plan([8192], 8)) == {4}        # 32 MiB of KV
    assert _group_sizes(plan([16384], 8, d=64)) == {4}  # (rows8 has no head_dim 64: 2 per SM)
    assert _group_sizes(plan([32768], 8, num_sms=300)) == {4}  # a grid of fewer than half the SMs
    for lens in ([32768], [16384], [8192] * 2):  # 8 heads per CTA: pairs of 4 tokens (32 rows), as at 4 heads
        hq64 = cupaged.plan_decode(cupaged.PageTable.from_seq_lens(lens, page_size=16), 64, 8, 128, np.float16,
                                   qo_indptr=np.arange(len(lens) + 1, dtype=np.int32) * 4, num_sms=132)
        assert (_group_sizes(hq64), hq64.ctas_per_sm, hq64.heads_per_cta) == ({4}, 1, 8), lens
    hq48 = cupaged.plan_decode(cupaged.PageTable.from_seq_lens([32768], page_size=16), 48, 8, 128, np.float16,
                               qo_indptr=np.array([0, 4], np.int32), num_sms=132)
    assert hq48.heads_per_cta == 6 and max(_group_sizes(hq48)) < 4  # 6 heads per CTA: not timed, no wide pairs
    fp8 = plan([32768], 8, kv_dtype=np.uint8)
    assert fp8.group_last is not None and max(_group_sizes(fp8)) <= 4


def test_runner_plans_keep_four_warp_choices():
    """DecodeRunner's captured rows kernel has 4 warps: its plans
    (plan._plan_decode(..., eight_warps=False)) keep warp pairs at the
    kernel's 2 CTAs per SM and within PAIR_MAX_CHUNKS, where decode's plans
    take 8-warp CTAs (one per SM) and keep the pairs of a large step."""
    for lens, runner_held, runner_sizes, decode_held, decode_sizes in (
            ([32768], 2, {4}, 1, {8}),    # a large step: wide pairs for decode only
            ([1024] * 8, 2, {8}, 1, {4})):  # pairs at 2 per SM for the runner, one warp's groups at 1 for decode
        table = cupaged.PageTable.from_seq_lens(lens, page_size=16)
        kw = {"qo_indptr": np.arange(len(lens) + 1, dtype=np.int32) * 8, "num_sms": 132, "group_tokens": True}
        runner = plan_mod._plan_decode(table, 32, 8, 128, np.float16, eight_warps=False, **kw)
        plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, **kw)
        assert (runner.ctas_per_sm, _group_sizes(runner)) == (runner_held, runner_sizes), lens
        assert (plan.ctas_per_sm, _group_sizes(plan)) == (decode_held, decode_sizes), lens
        assert int(runner.request_chunks.max()) <= plan_mod.PAIR_MAX_CHUNKS or runner_sizes == {4}


def test_hot_path_argument_test_compares_arrays_by_identity():
    """decode's hot path compares its keyword arguments with the recorded
    call's: numbers by value, arrays by identity (never elementwise: a new
    array of equal values must not reuse the recorded one's pointer, and a
    multi-element ``==`` has no truth value)."""
    w, w2, one, one2 = np.array([3, 4]), np.array([3, 4]), np.array([5]), np.array([5])
    rec = (0.5, None, w, one, "NHD")
    assert args_match((0.5, None, w, one, "NHD"), rec)
    assert args_match((float("0.5"), None, w, one, "NHD"), rec)  # an equal float, another object
    assert not args_match((0.5, None, w2, one, "NHD"), rec)      # would raise with ==
    assert not args_match((0.5, None, w, one2, "NHD"), rec)      # == would say equal
    assert not args_match((0.5, None, np.array([1, 2, 3]), one, "NHD"), rec)  # would not broadcast
    assert not args_match((1, None, w, one, "NHD"), (1.0, None, w, one, "NHD"))  # int vs float


# -------------------------------------------------------------------- GPU


def _multi(b, seed, max_q=16):
    """``b`` with q of one row per query token (random 1..max_q per request)."""
    cp = _cp()
    rng = np.random.default_rng(seed)
    ptr = _qo_indptr(rng, b.table.seq_lens, max_q)
    q = make_query(rng, int(ptr[-1]), b.num_qo_heads, b.head_dim, b.dtype)
    b.q, b.host = cp.asarray(q), (q, *b.host[1:])
    return ptr


def _multi_refs(b, seed):
    """:func:`_multi` (``seed``) and random sinks (``seed + 1``) with the
    float64 references without and with them: ``(ptr, sinks, want, want_sinks)``."""
    ptr = _multi(b, seed)
    sinks = np.random.default_rng(seed + 1).uniform(-1, 3, b.num_qo_heads).astype(np.float32)
    return ptr, sinks, b.reference(qo_indptr=ptr), b.reference(qo_indptr=ptr, sinks=sinks)


@gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("kv", ["same", "fp8"])
def test_multi_token_matches_reference(dtype, kv):
    b = make_batch(300, [*RAGGED_LENS, 3000], dtype=dtype, kv_dtype=FP8 if kv == "fp8" else None,
                   scale_mode="head" if kv == "fp8" else "none")
    ptr = _multi(b, 301)
    want = b.reference(qo_indptr=ptr)
    assert want[0].shape[0] == int(ptr[-1])
    for plan in (b.plan(pages_per_chunk=1, qo_indptr=ptr), b.plan(qo_indptr=ptr), None):
        for _ in range(2):  # (a qo_indptr call is not recorded for the hot path: its array could change in place)
            check(run("v2", b, plan, qo_indptr=ptr), want, dtype)
    check(run("gather", b, qo_indptr=ptr), want, dtype)
    sel = cupaged.select_method(b.q, b.k, b.v, b.table, qo_indptr=ptr, kv_layout="NHD")
    assert sel.method == "v2", sel
    with pytest.raises(cupaged.ShapeError):  # q's rows are the query tokens, not the requests
        cupaged.select_method(b.q, b.k, b.v, b.table)
    with pytest.raises(cupaged.PlanMismatchError):  # a plan of the request table, a multi-token call
        cupaged.decode(b.q, b.k, b.v, b.table, b.plan(), qo_indptr=ptr, **b.dev_kw)


@gpu
@pytest.mark.parametrize("hq,hkv,d,dtype,kv", [
    (32, 8, 128, F16, "same"),    # 4 heads per CTA: 4 tokens per CTA
    (8, 8, 64, BF16, "same"),     # one head per CTA: 16 tokens
    (64, 8, 128, F16, "same"),    # 8 heads per CTA: 2 tokens
    (28, 4, 96, BF16, "same"),    # 7 heads per CTA: 2 tokens, rows 14 and 15 padding
    (32, 8, 128, F16, "fp8"),     # fp8: 8 columns, 2 tokens
    (16, 8, 64, BF16, "fp8"),     # fp8, 2 heads per CTA: 4 tokens
    (32, 8, 80, F16, "same"),     # head_dim 80: an odd k-step count (ldmatrix.x2 for the last)
    (32, 8, 192, BF16, "fp8"),    # fp8 head_dim 192 on the tensor cores
    (32, 8, 192, F16, "same"),    # 16-bit 192: the transposed tile's 8 columns, 2 tokens
    (8, 8, 192, BF16, "same"),    # 16-bit 192, one head per CTA: 8 tokens
], ids=str)
def test_row_groups_match_reference(hq, hkv, d, dtype, kv, monkeypatch):
    """Plans with row groups (a request's tokens as extra MMA rows, each with
    its own causal end) against the float64 reference and against the same
    call planned one row per token: merged (one page per chunk) and not,
    with sinks, and on the CUDA-core core (the env pinned after planning: the
    rows kernel then serves a group one token at a time)."""
    cp = _cp()
    b = make_batch(310, [*RAGGED_LENS, 3000, 17], num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                   kv_dtype=FP8 if kv == "fp8" else None, scale_mode="head" if kv == "fp8" else "none")
    ptr, sinks, want, want_sinks = _multi_refs(b, 311)
    for knobs in ({"pages_per_chunk": 1}, {}, {"pages_per_chunk": 3}):
        plan = b.plan(qo_indptr=ptr, group_tokens=True, **knobs)
        assert plan.group_last is not None and plan.num_units < plan.num_chunks
        check(run("v2", b, plan, qo_indptr=ptr), want, dtype)
        check(run("v2", b, plan, qo_indptr=ptr, sinks=cp.asarray(sinks)), want_sinks, dtype)
        check(run("v2", b, b.plan(qo_indptr=ptr, group_tokens=False, **knobs), qo_indptr=ptr), want, dtype)
    if kv == "same":
        plan = b.plan(qo_indptr=ptr, group_tokens=True, pages_per_chunk=2)
        monkeypatch.setenv("CUPAGED_CORE", "simt")
        check(run("v2", b, plan, qo_indptr=ptr), want, dtype)


@gpu
@pytest.mark.parametrize("hq,hkv,d,dtype", [
    (32, 8, 128, F16),   # 4 heads per CTA: 4 tokens a warp, 8 a pair
    (8, 8, 64, BF16),    # one head per CTA: 16 a warp (q_len 16 fits one warp: no pairs)
    (64, 8, 128, BF16),  # 8 heads per CTA: 2 a warp, 4 a pair
    (16, 8, 80, F16),    # 2 heads, head_dim 80: an odd copy-pass count, split between the pair
], ids=str)
def test_warp_pairs_match_reference(hq, hkv, d, dtype, monkeypatch):
    """Row groups on warp pairs (two warps sharing each K/V tile, each with
    its own rows) at every split, PAIR_MAX_CHUNKS and the small-grid rule
    lifted: one page per chunk (many chunks, merged), the default, and one
    chunk per request (the final rows written straight), with sinks, against
    the float64 reference."""
    cp = _cp()
    monkeypatch.setattr(plan_mod, "PAIR_MAX_CHUNKS", 1 << 30)
    monkeypatch.setattr(plan_mod, "_pairs_underfill", lambda *args: False)
    b = make_batch(330, [*RAGGED_LENS, 2000, 40], num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                   page_size=16 if d != 80 else 4)
    ptr, sinks, want, want_sinks = _multi_refs(b, 331)
    single = 16 // (hq // hkv)
    for knobs in ({"pages_per_chunk": 1}, {}, {"pages_per_chunk": 4096}):
        plan = b.plan(qo_indptr=ptr, group_tokens=True, **knobs)
        sizes = np.bincount(plan.group_last)
        assert (sizes > single).any() == (int(np.diff(ptr).max()) > single)  # some group on pairs
        check(run("v2", b, plan, qo_indptr=ptr), want, dtype)
        check(run("v2", b, plan, qo_indptr=ptr, sinks=cp.asarray(sinks)), want_sinks, dtype)


@gpu
@pytest.mark.parametrize("hq,dtype", [(32, F16), (64, BF16), (8, F16)], ids=str)  # 4, 8 and 1 heads per CTA
def test_eight_warp_row_groups_match_reference(hq, dtype, monkeypatch):
    """Row-group plans held to one CTA per SM launch family rows8 (8-warp
    CTAs, 16-bit head_dim 128; _configs.rows_family): merged (one page per
    chunk), the default split and unsplit, one warp's groups and warp pairs
    (PAIR_MAX_CHUNKS lifted), with sinks, against the float64 reference; a
    plan of 2 per SM keeps family rows."""
    from cupaged._plan_launch import plan_states

    cp = _cp()
    monkeypatch.setattr(plan_mod, "PAIR_MAX_CHUNKS", 1 << 30)
    monkeypatch.setattr(plan_mod, "_pairs_underfill", lambda *args: False)
    b = make_batch(340, [*RAGGED_LENS, 2500, 33], num_qo_heads=hq, dtype=dtype)
    ptr, sinks, want, want_sinks = _multi_refs(b, 341)
    for knobs in ({"pages_per_chunk": 1}, {}, {"pages_per_chunk": 4096}):
        two = b.plan(qo_indptr=ptr, group_tokens=True, **knobs)
        plan = dataclasses.replace(two, ctas_per_sm=1)
        assert plan.group_last is not None
        check(run("v2", b, plan, qo_indptr=ptr), want, dtype)
        check(run("v2", b, plan, qo_indptr=ptr, sinks=cp.asarray(sinks)), want_sinks, dtype)
        assert [s.family for s in plan_states(plan).values()] == ["rows8"]
        if two.ctas_per_sm == 2:
            check(run("v2", b, two, qo_indptr=ptr), want, dtype)
            assert [s.family for s in plan_states(two).values()] == ["rows"]


@gpu
@pytest.mark.parametrize("hq,q_len", [(32, 5), (64, 4)])
def test_default_wide_pairs_match_reference(hq, q_len):
    """The default plan of a long request's query tokens on warp pairs on
    8-warp CTAs (16 chunks, one CTA per SM) against the float64 reference,
    with sinks: 5 tokens at 4 heads per CTA (pairs of 20 rows) and 4 at 8
    heads per CTA (pairs of 32 rows)."""
    from cupaged._plan_launch import plan_states

    cp = _cp()
    b = make_batch(350, [32768], dtype=F16, mid_page=False, num_qo_heads=hq)
    ptr = np.array([0, q_len], np.int32)
    q = make_query(np.random.default_rng(351), q_len, b.num_qo_heads, b.head_dim, b.dtype)
    b.q, b.host = cp.asarray(q), (q, *b.host[1:])
    sinks = np.random.default_rng(352).uniform(-1, 3, b.num_qo_heads).astype(np.float32)
    plan = b.plan(qo_indptr=ptr, num_sms=132)
    assert plan.ctas_per_sm == 1 and int(np.bincount(plan.group_last).max()) == q_len
    assert plan.heads_per_cta == hq // 8 and int(plan.request_chunks.max()) > plan_mod.PAIR_MAX_CHUNKS
    check(run("v2", b, plan, qo_indptr=ptr), b.reference(qo_indptr=ptr), F16)
    check(run("v2", b, plan, qo_indptr=ptr, sinks=cp.asarray(sinks)), b.reference(qo_indptr=ptr, sinks=sinks), F16)
    assert [s.family for s in plan_states(plan).values()] == ["rows8"]


@gpu
@pytest.mark.parametrize("kv", ["same", "fp8"])
def test_row_group_merge_of_many_chunks(kv):
    """The fused merge of row groups split into a thousand chunks and more:
    the last CTA of a group merges every row's partials (16 rows of 4 heads
    at 16-bit, 8 for fp8's transposed tile), one page per chunk, groups of
    1-16 tokens, with sinks, and tokens whose last chunk holds none of their
    slots (LSE -inf partials, which the merge must skip whatever their v
    holds). (Written for a two-phase merge through shared memory, measured
    and not kept, docs/architecture.md; the lengths straddle its capacity.)"""
    cp = _cp()
    lens = [14000, 18000, 5, 40] if kv == "same" else [28000, 36000, 33, 2]
    b = make_batch(320, lens, dtype=F16, kv_dtype=FP8 if kv == "fp8" else None, mid_page=False)
    q_len = [16, 13, 4, 1] if kv == "same" else [16, 7, 2, 1]
    ptr = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
    q = make_query(np.random.default_rng(321), int(ptr[-1]), b.num_qo_heads, b.head_dim, b.dtype)
    b.q, b.host = cp.asarray(q), (q, *b.host[1:])
    sinks = np.random.default_rng(322).uniform(-1, 3, b.num_qo_heads).astype(np.float32)
    plan = b.plan(qo_indptr=ptr, group_tokens=True, pages_per_chunk=1)
    assert plan.group_last is not None and int(plan.request_chunks.max()) >= (1125 if kv == "same" else 2250)
    check(run("v2", b, plan, qo_indptr=ptr), b.reference(qo_indptr=ptr), F16)
    check(run("v2", b, plan, qo_indptr=ptr, sinks=cp.asarray(sinks)), b.reference(qo_indptr=ptr, sinks=sinks), F16)


@gpu
def test_sixteen_tokens_windows_sinks_hnd_soft_cap():
    cp = _cp()
    b = make_batch(302, [16, 17, 40, 1021, 300], dtype=F16, kv_layout="HND", page_size=32)
    ptr = np.array([0, 16, 32, 35, 51, 52], np.int32)  # q_len 16, 16, 3, 16, 1
    q = make_query(np.random.default_rng(303), 52, 32, 128, F16)
    b.q, b.host = cp.asarray(q), (q, *b.host[1:])
    sinks = np.random.default_rng(304).uniform(2, 8, 32).astype(np.float32)
    kw = {"logits_soft_cap": 20.0, "sm_scale": 4 / math.sqrt(128)}
    for window in (None, 0, 7, 33, np.array([5, -1, 0, 64, 2])):
        want = b.reference(qo_indptr=ptr, sinks=sinks, window_left=window, **kw)
        if window is not None and np.min(window) >= 0:
            assert differs(want[0], b.reference(qo_indptr=ptr, sinks=sinks, **kw)[0], tolerance(F16))
        plan = b.plan(qo_indptr=ptr, window_left=window, pages_per_chunk=2)
        check(run("v2", b, plan, qo_indptr=ptr, window_left=window, sinks=cp.asarray(sinks), **kw), want, F16)


@gpu
@pytest.mark.parametrize("group_tokens", [False, True])
def test_runner_appends_and_decodes_query_rows_in_a_graph(group_tokens):
    """A draft/verify step through the runner: plan(table, qo_indptr=), then
    append_kv writes each query token's K/V at its slot and run decodes
    every token; a graph captured at the first step replays the later ones."""
    cp = _cp()
    rng = np.random.default_rng(305)
    hq, hkv, d, P = 16, 4, 128, 16
    table0, num_pages = make_table(rng, [300, 20, 900], P, [0, 3, 0], slack=2.0)
    k, v = make_caches(rng, table0, num_pages, hkv, d, np.float16)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    k_d, v_d = cp.asarray(k), cp.asarray(v)
    rows_max = 3 * 4
    q = cp.zeros((rows_max, hq, d), cp.float16)
    kn = cp.zeros((rows_max, hkv, d), cp.float16)
    vn = cp.zeros_like(kn)
    out = cp.zeros_like(q)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        runner = cupaged.DecodeRunner(hq, hkv, d, np.float16, page_size=P, max_batch=rows_max, max_pages=2000,
                                      group_tokens=group_tokens)
        runner.plan(table0, qo_indptr=[0, 4, 5, 9])
        stream.begin_capture()
        runner.append_kv(kn, vn, k_d, v_d)
        runner.run(q, k_d, v_d, out)
        graph = stream.end_capture()
        for ptr in ([0, 4, 5, 9], [0, 1, 2, 3], [0, 2, 6, 10]):
            n = ptr[-1]
            qh = make_query(rng, n, hq, d, np.float16)
            knh, vnh = make_query(rng, n, hkv, d, np.float16), make_query(rng, n, hkv, d, np.float16)
            q[:n], kn[:n], vn[:n] = cp.asarray(qh), cp.asarray(knh), cp.asarray(vnh)
            plan = runner.plan(table0, qo_indptr=ptr)
            assert (plan.group_last is not None) == (group_tokens and ptr != [0, 1, 2, 3])
            graph.launch(stream)
            stream.synchronize()
            rows = table0.query_rows(ptr)
            for r in range(n):  # the host copy gets each token at its row's last slot
                s = int(rows.seq_lens[r]) - 1 + int(rows.first_page_offset[r])
                page = rows.indices[rows.indptr[r] + s // P]
                k[page, s % P], v[page, s % P] = knh[r], vnh[r]
            want = reference.decode(qh, k, v, table0, qo_indptr=ptr)
            got = out[:n].get().astype(np.float64)
            np.testing.assert_array_equal(k_d.get(), k)
            np.testing.assert_array_equal(v_d.get(), v)
            assert np.isfinite(got).all() and rel_errors(got, want[0])[0] <= tolerance(F16)
