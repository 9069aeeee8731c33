"""CPU tests of cupaged.plan: heuristics, plan geometry, reuse, validation."""

from __future__ import annotations

import dataclasses
import itertools
import types
import weakref

import ml_dtypes
import numpy as np
import pytest

from cupaged import plan as plan_mod
from cupaged import schedule
from cupaged.errors import InvalidArgumentError, PlanMismatchError
from cupaged.page_table import PageTable
from cupaged.plan import (
    CTAS_PER_SM,
    MAX_GRID_X,
    MAX_HEADS_PER_CTA,
    DecodePlan,
    choose_pages_per_chunk,
    default_target_ctas,
    heads_per_cta,
    num_chunks,
    plan_decode,
)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def make_table(rng, seq_lens, page_size, offsets=None, slack=7):
    """PageTable over a shuffled permutation of a pool with ``slack`` spare
    pages; ``offsets`` are first_page_offset (forced to 0 for empty requests)."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if offsets is None:
        offsets = np.zeros_like(seq_lens)
    offsets = np.where(seq_lens > 0, np.asarray(offsets, dtype=np.int64), 0)
    pages = np.where(seq_lens > 0, -(-(offsets + seq_lens) // page_size), 0)
    pool = int(pages.sum()) + slack
    ids = rng.permutation(pool).astype(np.int32)
    return PageTable.from_seq_lens(seq_lens.tolist(), page_size,
                                   offsets.tolist(), page_ids=ids)


def random_table(rng, max_batch=9, page_sizes=(1, 2, 3, 8, 16), max_len=200,
                 p_empty=0.2, p_offset=0.5):
    b = int(rng.integers(1, max_batch + 1))
    P = int(rng.choice(page_sizes))
    lens = rng.integers(0, max_len + 1, size=b)
    lens[rng.random(b) < p_empty] = 0
    offs = np.where(rng.random(b) < p_offset, rng.integers(0, P, size=b), 0)
    return make_table(rng, lens, P, offs)


def table_from_pages(rng, request_pages, page_size=16):
    """A table whose requests have exactly ``request_pages`` pages."""
    pages = np.asarray(request_pages, dtype=np.int64)
    lens = np.where(pages > 0, (pages - 1) * page_size + 1, 0)
    return make_table(rng, lens, page_size)


def brute_force_c(request_pages, ctas_per_chunk, target):
    pages = np.asarray(request_pages, dtype=np.int64)
    maxp = int(pages.max()) if pages.size else 0
    feasible = []
    for c in range(1, maxp + 2):
        n = sum(max(1, -(-int(p) // c)) for p in pages)
        feasible.append(n * ctas_per_chunk >= target)
    # feasibility is a prefix (monotone), so the binary search is valid
    assert feasible == sorted(feasible, reverse=True)
    cands = [c for c, ok in zip(range(1, maxp + 2), feasible)
             if ok and c <= max(1, maxp)]
    return max(cands) if cands else 1


@pytest.fixture
def no_device(monkeypatch):
    """Pretend there is no CUDA device so the env variable is consulted."""
    monkeypatch.setattr(plan_mod, "device_num_sms", lambda: None)
    monkeypatch.delenv("CUPAGED_NUM_SMS", raising=False)
    monkeypatch.delenv("CUPAGED_TARGET_CTAS", raising=False)


# --------------------------------------------------------------------------
# heuristics
# --------------------------------------------------------------------------
EXPECTED_HPC = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 7: 7, 8: 8, 9: 3, 10: 5,
                11: 1, 12: 6, 13: 1, 14: 7, 15: 5, 16: 8}


@pytest.mark.parametrize("g", range(1, 17))
def test_heads_per_cta(g):
    h = heads_per_cta(g)
    assert h == EXPECTED_HPC[g]
    assert g % h == 0 and 1 <= h <= MAX_HEADS_PER_CTA
    assert not any(g % d == 0 for d in range(h + 1, MAX_HEADS_PER_CTA + 1))


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4", None])
def test_heads_per_cta_rejects(bad):
    with pytest.raises(ValueError, match="group_size"):
        heads_per_cta(bad)


def test_default_target_ctas():
    assert CTAS_PER_SM == 2
    assert default_target_ctas(132) == 264
    assert default_target_ctas(np.int64(1)) == 2
    with pytest.raises(ValueError, match="num_sms"):
        default_target_ctas(0)


def test_num_chunks_values_and_zero_pages():
    assert num_chunks([256], 3) == 86
    assert num_chunks([256], 4) == 64
    assert num_chunks([0, 0, 0], 5) == 3          # one chunk per empty request
    assert num_chunks([0, 1, 5], 2) == 1 + 1 + 3
    assert num_chunks(np.array([7], np.int32), 10**12) == 1  # no overflow
    with pytest.raises(ValueError, match="pages_per_chunk"):
        num_chunks([3], 0)
    with pytest.raises(ValueError, match="request_pages"):
        num_chunks([3, -1], 1)


def test_num_chunks_monotonic_non_increasing():
    rng = np.random.default_rng(1)
    for _ in range(200):
        pages = rng.integers(0, 80, size=int(rng.integers(1, 12)))
        counts = [num_chunks(pages, c) for c in range(1, int(pages.max()) + 3)]
        assert all(a >= b for a, b in zip(counts, counts[1:]))
        assert counts[-1] == len(pages)           # every request one chunk


def test_choose_worked_example():
    # batch 1, ctx 4096, page 16 -> 256 pages; 8 kv heads x 1 q group; 528
    assert num_chunks([256], 3) * 8 == 688 >= 528
    assert num_chunks([256], 4) * 8 == 512 < 528
    assert choose_pages_per_chunk([256], 8, 528) == 3


def test_choose_pages_per_chunk_is_maximal_bruteforce():
    rng = np.random.default_rng(2)
    cases = 0
    for trial in range(400):
        b = int(rng.integers(1, 14))
        pages = rng.integers(0, int(rng.choice([3, 20, 90])), size=b)
        if trial % 5 == 0:
            pages[rng.random(b) < 0.5] = 0        # many zero-page requests
        if trial % 37 == 0:
            pages[:] = 0
        cpc = int(rng.choice([1, 2, 8, 32]))
        targets = [1, 7, 64, 528, 2000, int(rng.integers(1, 3000)),
                   num_chunks(pages, 1) * cpc]    # exactly reachable at c=1
        for target in targets:
            got = choose_pages_per_chunk(pages, cpc, target)
            assert got == brute_force_c(pages, cpc, target), (pages, cpc, target)
            cases += 1
    assert cases >= 2000


def test_choose_falls_short_returns_one():
    pages = [4, 9, 1]
    assert num_chunks(pages, 1) * 8 < 10_000
    assert choose_pages_per_chunk(pages, 8, 10_000) == 1
    assert choose_pages_per_chunk([0, 0], 8, 1) == 1     # nothing to split
    assert choose_pages_per_chunk([5], 1, 1) == 5        # trivially reached
    assert choose_pages_per_chunk([5], 1, 6) == 1        # even c=1 falls short


def test_choose_validates():
    with pytest.raises(ValueError, match="ctas_per_chunk"):
        choose_pages_per_chunk([3], 0, 10)
    with pytest.raises(ValueError, match="target_ctas"):
        choose_pages_per_chunk([3], 1, 0)
    with pytest.raises(ValueError, match="request_pages"):
        choose_pages_per_chunk([[3]], 1, 1)
    with pytest.raises(ValueError, match="request_pages"):
        choose_pages_per_chunk([1.5], 1, 1)


# --------------------------------------------------------------------------
# plan geometry
# --------------------------------------------------------------------------
def test_plan_at_least_one_chunk_per_request_including_empty():
    rng = np.random.default_rng(3)
    t = make_table(rng, [0, 5, 0, 300, 0], 16, [0, 3, 0, 15, 0])
    assert t.request_pages.tolist()[0] == 0
    for c in (1, 2, 7, 100):
        p = plan_decode(t, 32, 8, 128, "float16", pages_per_chunk=c)
        assert p.request_chunks.min() >= 1
        assert p.request_chunks[0] == p.request_chunks[2] == 1
        assert (np.bincount(p.chunk_request, minlength=5) == p.request_chunks).all()
        assert p.num_chunks == int(p.request_chunks.sum())


def test_plan_chunk_maps_consistent():
    rng = np.random.default_rng(4)
    for _ in range(150):
        t = random_table(rng)
        c = int(rng.integers(1, 12))
        p = plan_decode(t, 8, 2, 64, np.float32, pages_per_chunk=c)
        b = t.batch_size
        pages = t.request_pages.astype(np.int64)
        assert p.o_indptr.shape == (b + 1,) and p.o_indptr[0] == 0
        assert p.o_indptr[-1] == p.num_chunks
        assert (np.diff(p.o_indptr) == p.request_chunks).all()
        assert (p.request_chunks == np.maximum(1, -(-pages // c))).all()
        assert (np.diff(p.chunk_request) >= 0).all()
        for i in range(b):
            lo, hi = p.o_indptr[i], p.o_indptr[i + 1]
            assert (p.chunk_request[lo:hi] == i).all()
            assert p.chunk_index[lo:hi].tolist() == list(range(hi - lo))
        for arr in (p.chunk_request, p.chunk_index, p.o_indptr, p.request_chunks):
            assert arr.dtype == np.int32 and arr.flags.c_contiguous


def test_plan_chunk_page_ranges_cover_exactly_once():
    rng = np.random.default_rng(5)
    for _ in range(150):
        t = random_table(rng)
        c = int(rng.integers(1, 15))
        p = plan_decode(t, 4, 4, 32, "float16", pages_per_chunk=c)
        start, end = p.chunk_page_ranges(t)
        indptr = t.indptr.astype(np.int64)
        covered = np.zeros(len(t.indices), dtype=np.int64)
        for k in range(p.num_chunks):
            i = p.chunk_request[k]
            j = p.chunk_index[k]
            # contract: pages [j*c, min((j+1)*c, pages_i)) of request i
            lo = indptr[i] + j * c
            hi = min(indptr[i] + (j + 1) * c, indptr[i + 1])
            if t.request_pages[i] == 0:
                assert start[k] == end[k] == indptr[i]
                continue
            assert (start[k], end[k]) == (lo, hi)
            assert indptr[i] <= lo < hi <= indptr[i + 1]   # non-empty, inside
            covered[lo:hi] += 1
        assert (covered == 1).all()


def test_plan_grid_bounds():
    rng = np.random.default_rng(6)
    for _ in range(100):
        t = random_table(rng)
        hkv = int(rng.choice([1, 2, 8, 40]))
        g = int(rng.integers(1, 17))
        p = plan_decode(t, hkv * g, hkv, 128, "bfloat16",
                        target_ctas=int(rng.integers(1, 5000)))
        x, y, z = p.grid
        assert p.heads_groups == hkv * p.q_groups
        assert x == p.num_chunks * p.heads_groups == p.num_ctas and 1 <= x <= MAX_GRID_X
        assert (y, z) == (1, 1)
        assert p.q_groups * p.heads_per_cta == p.group_size == g
        assert p.heads_per_cta == heads_per_cta(g)
    t = make_table(rng, [160], 16)  # 10 pages
    # a grid exactly at the limit is fine ...
    h = MAX_GRID_X // 10
    p = plan_decode(t, h, h, 8, "float16", pages_per_chunk=1)
    assert p.grid[0] == 10 * h <= MAX_GRID_X
    # ... one CTA more per chunk is rejected, through kv heads and through q groups
    with pytest.raises(ValueError, match="grid"):
        plan_decode(t, h + 1, h + 1, 8, "float16", pages_per_chunk=1)
    with pytest.raises(ValueError, match="grid"):
        plan_decode(t, (h // 10) * 11, h // 10, 8, "float16", pages_per_chunk=1)  # g=11 -> 11 q groups


def test_needs_merge_and_workspace_bytes():
    rng = np.random.default_rng(7)
    t = make_table(rng, [33, 0, 16], 16)        # 3, 0, 1 pages
    p = plan_decode(t, 32, 8, 128, "float16", pages_per_chunk=3)
    assert not p.needs_merge and p.workspace_bytes == 0
    assert p.num_chunks == 3
    p = plan_decode(t, 32, 8, 128, "float16", pages_per_chunk=2)
    assert p.needs_merge
    assert p.num_chunks == 2 + 1 + 1
    assert p.workspace_bytes == (4 * 32 * 128 + 4 * 32) * 4
    p = plan_decode(t, 32, 8, 128, "float16", pages_per_chunk=1)
    assert p.workspace_bytes == (5 * 32 * 128 + 5 * 32) * 4


def test_matches_across_decode_steps():
    rng = np.random.default_rng(8)
    P = 16
    lens = np.array([100, 1, 0, 47, 160])
    offs = np.array([5, 0, 0, 15, 0])
    t0 = make_table(rng, lens, P, offs)
    p = plan_decode(t0, 8, 8, 64, "float16", pages_per_chunk=2)
    assert p.matches(t0)
    # one decode step: lengths grow by one, no request crosses a chunk edge
    # (100+5 -> 106 tokens is still 7 pages; 1 -> 2; 47+15 -> 63 still 4 pages)
    lens1 = lens + np.array([1, 1, 0, 1, 0])
    t1 = make_table(rng, lens1, P, offs)
    assert (t1.request_pages == t0.request_pages).all()
    assert p.matches(t1)
    # a new page that does not change the chunk count still matches
    t2b = make_table(rng, lens + np.array([11, 0, 0, 0, 0]), P, offs)
    assert t2b.request_pages[0] == 8 and p.matches(t2b)   # 4 chunks either way
    # a new page that changes a chunk count does not
    t2 = make_table(rng, lens + np.array([0, 0, 0, 0, 1]), P, offs)
    assert t2.request_pages[4] == 11 and p.request_chunks[4] == 5
    assert not p.matches(t2)                          # 11 pages -> 6 chunks
    t3 = make_table(rng, lens + np.array([0, 0, 0, 3, 0]), P, offs)
    assert t3.request_pages[3] == 5 and p.request_chunks[3] == 2
    assert not p.matches(t3)                          # 5 pages -> 3 chunks
    t4 = make_table(rng, lens + np.array([0, 16, 0, 0, 0]), P, offs)
    assert t4.request_pages[1] == 2 and p.matches(t4)  # 2 pages, still 1 chunk
    # the empty request gets a page: chunk count stays 1 -> still matches
    t5 = make_table(rng, lens + np.array([0, 0, 3, 0, 0]), P, offs)
    assert p.matches(t5)
    # batch size or page size changes
    assert not p.matches(make_table(rng, lens[:4], P, offs[:4]))
    assert not p.matches(make_table(rng, np.append(lens, 1), P, np.append(offs, 0)))
    t8 = make_table(rng, lens, 8, np.minimum(offs, 7))
    assert not p.matches(t8)
    with pytest.raises(PlanMismatchError):
        p.chunk_token_ranges(t2)
    with pytest.raises(PlanMismatchError):
        p.chunk_page_ranges(t8)


def test_pages_per_chunk_override():
    rng = np.random.default_rng(9)
    t = table_from_pages(rng, [256])
    auto = plan_decode(t, 8, 8, 128, "float16", target_ctas=528)
    assert auto.pages_per_chunk == 3 and auto.num_chunks == 86
    for c in (1, 5, 256, 10_000):
        p = plan_decode(t, 8, 8, 128, "float16", pages_per_chunk=c,
                        target_ctas=528)
        assert p.pages_per_chunk == c
        assert p.num_chunks == num_chunks([256], c)
        assert p.target_ctas == 528
    assert not plan_decode(t, 8, 8, 128, "float16",
                           pages_per_chunk=10_000).needs_merge
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="pages_per_chunk"):
            plan_decode(t, 8, 8, 128, "float16", pages_per_chunk=bad)


def test_plan_uses_choose_pages_per_chunk():
    rng = np.random.default_rng(10)
    for _ in range(100):
        t = random_table(rng, max_len=2000)
        hkv = int(rng.choice([1, 4, 8]))
        g = int(rng.choice([1, 4, 12, 16]))
        target = int(rng.integers(1, 3000))
        p = plan_decode(t, hkv * g, hkv, 64, "float16", target_ctas=target)
        want = brute_force_c(t.request_pages, hkv * p.q_groups, target)
        assert p.pages_per_chunk == want
        assert p.target_ctas == target


def test_env_num_sms(no_device, monkeypatch):
    rng = np.random.default_rng(11)
    t = table_from_pages(rng, [400, 3])
    assert plan_decode(t, 8, 8, 64, "float16").target_ctas == 264
    monkeypatch.setenv("CUPAGED_NUM_SMS", "10")           # read at call time
    p = plan_decode(t, 8, 8, 64, "float16")
    assert p.target_ctas == 20
    cap = schedule.choose_max_pages_per_chunk(np.array([400, 3]), 8, 2 * 10, 16 * 2 * 64 * 2, 8)
    assert p.pages_per_chunk == int(schedule.split_pages(np.array([400]), cap)[0][0])
    # the argument beats the env variable
    assert plan_decode(t, 8, 8, 64, "float16", num_sms=20).target_ctas == 40
    monkeypatch.setenv("CUPAGED_NUM_SMS", "zero")
    with pytest.raises(ValueError, match="CUPAGED_NUM_SMS"):
        plan_decode(t, 8, 8, 64, "float16")
    monkeypatch.setenv("CUPAGED_NUM_SMS", "0")
    with pytest.raises(ValueError, match="CUPAGED_NUM_SMS"):
        plan_decode(t, 8, 8, 64, "float16")


def test_device_sm_count_beats_env(monkeypatch):
    monkeypatch.setattr(plan_mod, "device_num_sms", lambda: 100)
    monkeypatch.setenv("CUPAGED_NUM_SMS", "10")
    monkeypatch.delenv("CUPAGED_TARGET_CTAS", raising=False)
    assert plan_mod.resolve_num_sms() == 100
    assert plan_mod.resolve_num_sms(7) == 7
    assert plan_mod.resolve_target_ctas() == 200


def test_device_num_sms_without_gpu_is_none_or_positive():
    sms = plan_mod.device_num_sms()          # must never raise
    assert sms is None or (isinstance(sms, int) and sms > 0)


def test_env_target_ctas(no_device, monkeypatch):
    rng = np.random.default_rng(12)
    t = table_from_pages(rng, [256])
    monkeypatch.setenv("CUPAGED_TARGET_CTAS", "528")
    p = plan_decode(t, 8, 8, 64, "float16", num_sms=1)   # env beats num_sms
    assert p.target_ctas == 528 and p.pages_per_chunk == 3
    monkeypatch.setenv("CUPAGED_TARGET_CTAS", "8")
    p = plan_decode(t, 8, 8, 64, "float16")
    assert p.target_ctas == 8 and p.pages_per_chunk == 256
    # the argument beats the env variable
    assert plan_decode(t, 8, 8, 64, "float16",
                       target_ctas=1024).pages_per_chunk == 2
    monkeypatch.setenv("CUPAGED_TARGET_CTAS", "-5")
    with pytest.raises(ValueError, match="CUPAGED_TARGET_CTAS"):
        plan_decode(t, 8, 8, 64, "float16")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_qo_heads=12, num_kv_heads=8), "divisible"),
    (dict(num_qo_heads=0), "num_qo_heads"),
    (dict(num_qo_heads=-8), "num_qo_heads"),
    (dict(num_qo_heads=8.0), "num_qo_heads"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(num_kv_heads=True), "num_kv_heads"),
    (dict(head_dim=0), "head_dim"),
    (dict(head_dim=-64), "head_dim"),
    (dict(head_dim=100), "head_dim"),
    (dict(head_dim=12), "head_dim"),
    (dict(head_dim=64.0), "head_dim"),
    (dict(dtype="float64"), "dtype"),
    (dict(dtype=np.int8), "dtype"),
    (dict(dtype="not-a-dtype"), "dtype"),
    (dict(dtype=ml_dtypes.float8_e4m3fn), "dtype"),
    (dict(pages_per_chunk=0), "pages_per_chunk"),
    (dict(pages_per_chunk=-2), "pages_per_chunk"),
    (dict(target_ctas=0), "target_ctas"),
    (dict(target_ctas=2.5), "target_ctas"),
    (dict(num_sms=0), "num_sms"),
    (dict(num_sms=-1), "num_sms"),
    (dict(num_qo_heads=2**31, num_kv_heads=2**30), "grid"),
])
def test_plan_decode_value_errors(kwargs, match):
    rng = np.random.default_rng(13)
    t = make_table(rng, [40, 0, 7], 16)
    args = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype="float16")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_decode(t, args.pop("num_qo_heads"), args.pop("num_kv_heads"),
                    args.pop("head_dim"), args.pop("dtype"), **args)


def test_plan_decode_empty_batch_rejected():
    empty = types.SimpleNamespace(batch_size=0, page_size=16,
                                  request_pages=np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="batch"):
        plan_decode(empty, 8, 8, 64, "float16")


@pytest.mark.parametrize("dtype", ["float16", np.float16, "float32",
                                   np.dtype(np.float32), ml_dtypes.bfloat16,
                                   "bfloat16", np.dtype(ml_dtypes.bfloat16)])
def test_plan_dtype_forms(dtype):
    rng = np.random.default_rng(14)
    p = plan_decode(make_table(rng, [5], 4), 4, 2, 8, dtype)
    assert isinstance(p.dtype, np.dtype) and p.dtype == np.dtype(dtype)


def test_chunk_token_ranges():
    rng = np.random.default_rng(15)
    for _ in range(200):
        t = random_table(rng, p_offset=0.7)
        c = int(rng.integers(1, 10))
        p = plan_decode(t, 2, 1, 16, "float32", pages_per_chunk=c)
        start, end = p.chunk_token_ranges(t)
        assert start.dtype == np.int64 and end.dtype == np.int64
        P = t.page_size
        sums = np.zeros(t.batch_size, dtype=np.int64)
        np.add.at(sums, p.chunk_request, end - start)
        assert (sums == t.seq_lens).all()
        for i in range(t.batch_size):
            lo, hi = p.o_indptr[i], p.o_indptr[i + 1]
            s, e = start[lo:hi], end[lo:hi]
            # tile [0, seq_len) in order
            assert s[0] == 0 and e[-1] == t.seq_lens[i]
            assert (s[1:] == e[:-1]).all()
            off = int(t.first_page_offset[i])
            last = int(t.last_page_len[i])
            npg = int(t.request_pages[i])
            for k in range(lo, hi):
                j = int(p.chunk_index[k])
                # independent: slots of the chunk's pages, intersected with the
                # visible slots [off, (npg-1)*P + last) of the request
                slots = set(range(j * c * P, min((j + 1) * c, npg) * P))
                vis = set(range(off, (npg - 1) * P + last)) if npg else set()
                toks = sorted(x - off for x in slots & vis)
                assert list(range(start[k], end[k])) == toks
                if npg:
                    assert end[k] > start[k]   # every chunk of a request works


def test_plan_is_frozen_readonly_and_identity_hashed():
    rng = np.random.default_rng(16)
    t = make_table(rng, [50, 3], 16)
    p = plan_decode(t, 32, 8, 128, "float16", pages_per_chunk=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.pages_per_chunk = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.o_indptr = np.zeros(3, np.int32)
    for name in ("chunk_request", "chunk_index", "o_indptr", "request_chunks"):
        arr = getattr(p, name)
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 7
    q = plan_decode(t, 32, 8, 128, "float16", pages_per_chunk=1)
    assert p != q and p == p                       # identity equality
    assert len({p: 1, q: 2}) == 2                  # hashable
    assert weakref.ref(p)() is p                   # weak-referenceable


def test_plan_direct_construction_copies_arrays():
    req = np.array([0, 0, 1], dtype=np.int64)
    p = DecodePlan(
        batch_size=2, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
        dtype="float16", group_size=2, heads_per_cta=2, q_groups=1,
        pages_per_chunk=1, target_ctas=4, num_chunks=3, chunk_request=req,
        chunk_index=[0, 1, 0], o_indptr=[0, 2, 3], request_chunks=[2, 1],
        num_ctas=3, grid=[3, 1, 1], needs_merge=True,
        workspace_bytes=(3 * 2 * 8 + 3 * 2) * 4)
    req[0] = 5                                     # caller's array untouched
    assert p.chunk_request.tolist() == [0, 0, 1]
    assert p.chunk_request.dtype == np.int32 and not p.chunk_request.flags.writeable
    assert p.grid == (3, 1, 1) and p.dtype == np.dtype(np.float16)


def smallest_c_within(request_pages, ctas_per_chunk, limit):
    """Brute force: smallest c whose chunks give at most ``limit`` CTAs,
    else one chunk per request."""
    pages = np.asarray(request_pages, dtype=np.int64)
    maxp = max(1, int(pages.max()))
    for c in range(1, maxp + 1):
        if sum(max(1, -(-int(p) // c)) for p in pages) * ctas_per_chunk <= limit:
            return c
    return maxp


def brute_split(pages, cap):
    """Fewest chunks of at most ``cap`` pages per request, made equal; an
    unsplit request's chunk size is the cap (it may grow into it)."""
    out = []
    for p in pages:
        n = max(1, -(-int(p) // cap))
        out.append((cap if n == 1 else -(-int(p) // n), n))
    return out


def test_default_plan_is_balanced_and_minimizes_the_model():
    rng = np.random.default_rng(5)
    for _ in range(200):
        pages = rng.integers(0, 3000, size=int(rng.integers(1, 70)))
        if rng.random() < 0.3:
            pages[0] = int(rng.integers(3000, 20000))  # one long request among short ones
        hkv = int(rng.choice([1, 8, 32]))
        t = table_from_pages(rng, pages)
        p = plan_decode(t, 4 * hkv, hkv, 128, "float16", num_sms=132)
        # the count and cap the model picks, over the same ladder, from the outside: at 2 CTAs per SM and
        # at 1, each with its constants (2 on ties)
        caps = schedule.candidate_caps(max(1, int(pages.max())), 8)
        picks = []
        for count, costs in ((2, schedule.H200_COSTS), (1, schedule.H200_COSTS_1)):
            model = schedule.predict_step_us(pages, caps, hkv, count * 132, 16 * 2 * 128 * 2, costs)
            i = int(np.argmin(model))  # ties: the largest cap (caps descend), as the planner documents
            picks.append((float(model[i]), count, caps[i]))
        _, count, best = picks[1] if picks[1][0] < picks[0][0] else picks[0]
        assert p.ctas_per_sm == count, pages.tolist()
        assert [tuple(x) for x in zip(p.request_chunk_pages.tolist(), p.request_chunks.tolist())] == \
            brute_split(pages, best), pages.tolist()
        assert p.pages_per_chunk == max(c for c, _ in brute_split(pages, best))
        # every request has its chunks, even an empty one; chunks of a request differ by at most its last
        assert (p.request_chunks >= 1).all() and p.num_chunks == p.request_chunks.sum()
        start, end = p.chunk_page_ranges(t)
        sizes = end - start
        assert (sizes <= p.request_chunk_pages[p.chunk_request]).all()
        # launch order: a permutation of the chunks, longest first
        assert sorted(p.launch_order.tolist()) == list(range(p.num_chunks))
        assert (np.diff(sizes[p.launch_order]) <= 0).all()


def test_default_plan_splits_the_long_request_of_a_ragged_batch():
    # one request of 131072 tokens among 63 of 512 (page 16): the long one is
    # split into equal chunks, the short ones stay whole and fill the SMs
    t = table_from_pages(np.random.default_rng(1), [8192] + [32] * 63)
    p = plan_decode(t, 32, 8, 128, "float16", num_sms=132)
    assert p.request_chunks[0] > 16 and (p.request_chunks[1:] == 1).all()
    assert p.pages_per_chunk == p.request_chunk_pages[0] and p.pages_per_chunk * p.request_chunks[0] >= 8192
    assert p.chunk_request[p.launch_order[: p.request_chunks[0]]].tolist() == [0] * int(p.request_chunks[0])
    # uniform batches: wave-aligned even splits, or none when the batch fills the device
    assert plan_decode(table_from_pages(np.random.default_rng(2), [2048] * 4), 32, 8, 128, "float16",
                       num_sms=132).num_ctas == 256
    assert plan_decode(table_from_pages(np.random.default_rng(2), [2048] * 128), 32, 8, 128, "float16",
                       num_sms=132).request_chunks.max() == 1
    # ... except one wave of CTAs that read >= 4 MB each (32 x 2048 pages: 8 MB unsplit), which goes to two
    # full waves (schedule.fill_waves): 66 chunks of 8 CTAs on 132 SMs x 2
    p = plan_decode(table_from_pages(np.random.default_rng(2), [2048] * 32), 32, 8, 128, "float16", num_sms=132)
    assert p.num_ctas == 528 and sorted(set(p.request_chunks.tolist())) == [2, 3]
    assert (p.request_chunk_pages * p.request_chunks >= 2048).all() and p.pages_per_chunk == 1024
    # and a lone request of >= 2 MB chunks into one full wave: 8192 pages in 33 chunks of 249
    p = plan_decode(table_from_pages(np.random.default_rng(2), [8192]), 32, 8, 128, "float16", num_sms=132)
    assert (p.num_ctas, p.pages_per_chunk) == (264, 249)
    # not at head_dim 64 (not measured there)
    assert plan_decode(table_from_pages(np.random.default_rng(2), [2048] * 32), 32, 8, 64, "float16",
                       num_sms=132).num_ctas < 528
    # never below MIN_CHUNK_TOKENS (capped at the longest request)
    assert plan_decode(table_from_pages(np.random.default_rng(2), [64]), 32, 8, 128, "float16",
                       num_sms=132).pages_per_chunk >= 8
    assert plan_decode(table_from_pages(np.random.default_rng(2), [0, 0]), 32, 8, 128, "float16",
                       num_sms=132).pages_per_chunk == 1


def test_plan_matches_equals_recounting_every_request():
    """``matches`` (a per-request page range, cached per plan) says exactly
    what recounting says: every request's max(1, ceil(p / c_i)) equals its
    chunk count. Default, uniform, capped and deterministic plans, against
    tables whose requests grew, shrank or emptied."""
    rng = np.random.default_rng(21)
    for trial in range(300):
        pages = rng.integers(0, 400, size=int(rng.integers(1, 40)))
        if trial % 4 == 0:
            pages[0] = int(rng.integers(2000, 9000))
        knobs = [{}, {"pages_per_chunk": int(rng.integers(1, 50))}, {"max_pages_per_chunk": int(rng.integers(1, 90))},
                 {"deterministic": True}][trial % 4]
        plan = plan_decode(table_from_pages(rng, pages), 32, 8, 128, "float16", num_sms=132, **knobs)
        for _ in range(4):
            grown = np.maximum(pages + rng.integers(-1, 2 if rng.random() < 0.6 else 40, size=pages.shape), 0)
            if rng.random() < 0.3:
                grown[int(rng.integers(len(grown)))] = 0
            counts = np.maximum(1, -(-grown // plan.request_chunk_pages.astype(np.int64)))
            want = bool(np.array_equal(counts, plan.request_chunks))
            assert plan.matches(table_from_pages(rng, grown)) is want, (trial, knobs)


def test_plan_matches_with_balanced_chunks():
    rng = np.random.default_rng(8)
    t = table_from_pages(rng, [100, 7])
    p = plan_decode(t, 32, 8, 128, "float16", max_pages_per_chunk=30)
    # the unsplit request's chunk is the cap: the plan serves it as it grows to 30 pages
    assert p.request_chunk_pages.tolist() == [25, 30] and p.request_chunks.tolist() == [4, 1]
    assert p.matches(table_from_pages(rng, [98, 6]))        # still 4 chunks of 25 and 1 of 30
    assert p.matches(table_from_pages(rng, [100, 30]))      # the short one grew into its chunk
    assert not p.matches(table_from_pages(rng, [101, 7]))   # 101 pages need a 5th chunk of 25
    assert not p.matches(table_from_pages(rng, [75, 7]))    # 3 chunks now
    assert not p.matches(table_from_pages(rng, [100, 31]))  # the short one outgrew the cap


# --------------------------------------------------------------------------
# kv_dtype (fp8 caches)
# --------------------------------------------------------------------------
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("dtype", ["float16", ml_dtypes.bfloat16])
@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", ml_dtypes.float8_e4m3fn, FP8, np.uint8, "uint8"])
def test_plan_kv_dtype_fp8_spellings(dtype, kv_dtype):
    t = make_table(np.random.default_rng(30), [40, 3], 16)
    p = plan_decode(t, 8, 2, 128, dtype, kv_dtype=kv_dtype)
    assert isinstance(p.kv_dtype, np.dtype) and p.kv_dtype == FP8 and p.kv_dtype.name == "float8_e4m3fn"
    assert p.dtype == np.dtype(dtype)
    assert "kv_dtype=dtype(" in repr(p) and "float8_e4m3fn" in repr(p)
    # the chunking does not depend on the cache dtype
    same = plan_decode(t, 8, 2, 128, dtype, pages_per_chunk=p.pages_per_chunk)
    assert (same.request_chunks == p.request_chunks).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_plan_kv_dtype_defaults_to_dtype(dtype):
    t = make_table(np.random.default_rng(31), [40], 16)
    assert plan_decode(t, 4, 4, 64, dtype).kv_dtype == np.dtype(dtype)
    assert plan_decode(t, 4, 4, 64, dtype, kv_dtype=dtype).kv_dtype == np.dtype(dtype)
    assert plan_decode(t, 4, 4, 64, dtype).deterministic is False


@pytest.mark.parametrize("dtype, kv_dtype", [
    ("float32", "float8_e4m3fn"),            # fp8 only under a 16-bit q
    ("float32", np.uint8),
    ("float16", "bfloat16"),                 # mixed 16-bit: no kernel
    ("bfloat16", np.float16),
    ("float16", np.float32),
    ("float16", np.int8),
    ("float16", ml_dtypes.float8_e5m2),      # another fp8 format
    ("float16", "not-a-dtype"),
])
def test_plan_kv_dtype_rejects_unsupported_pairs(dtype, kv_dtype):
    t = make_table(np.random.default_rng(32), [40], 16)
    with pytest.raises(InvalidArgumentError, match="kv_dtype") as e:
        plan_decode(t, 4, 4, 64, dtype, kv_dtype=kv_dtype)
    for pair in ("float16 q with float8_e4m3fn KV", "bfloat16 q with float8_e4m3fn KV", "float32 q with float32 KV"):
        assert pair in str(e.value)            # the message lists what is supported


def test_supported_dtype_pairs_table():
    pairs = {(q.name, kv.name) for q, kv in plan_mod.SUPPORTED_DTYPE_PAIRS}
    assert pairs == {("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32"),
                     ("float16", "float8_e4m3fn"), ("bfloat16", "float8_e4m3fn")}
    assert plan_mod.FLOAT8_E4M3 == FP8


def test_plan_direct_construction_kv_dtype_and_deterministic_optional():
    kw = dict(batch_size=1, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
              dtype="bfloat16", group_size=2, heads_per_cta=2, q_groups=1, pages_per_chunk=1,
              target_ctas=4, num_chunks=1, chunk_request=[0], chunk_index=[0], o_indptr=[0, 1],
              request_chunks=[1], num_ctas=1, grid=(1, 1, 1), needs_merge=False, workspace_bytes=0)
    p = DecodePlan(**kw)                                   # the pre-fp8 field set still builds
    assert p.kv_dtype == np.dtype(ml_dtypes.bfloat16) and p.deterministic is False
    p = DecodePlan(**kw, kv_dtype=np.uint8, deterministic=1)
    assert p.kv_dtype == FP8 and p.deterministic is True
    assert "deterministic=True" in repr(p)


# --------------------------------------------------------------------------
# deterministic (batch-invariant) plans
# --------------------------------------------------------------------------
def test_deterministic_pages_per_chunk():
    assert plan_mod.DETERMINISTIC_CHUNK_TOKENS == 1024
    for P in (1, 2, 3, 7, 16, 32, 100, 1024, 1025, 65536):
        c = plan_mod.deterministic_pages_per_chunk(P)
        assert c == max(1, 1024 // P)
        assert c * P <= 1024 or c == 1
    with pytest.raises(ValueError, match="page_size"):
        plan_mod.deterministic_pages_per_chunk(0)


def csr_table(requests, page_size):
    """PageTable of ``requests``, each ``(page_ids, last_page_len, first_page_offset)``."""
    indptr = np.cumsum([0] + [len(r[0]) for r in requests]).astype(np.int32)
    indices = np.concatenate([np.asarray(r[0], np.int32) for r in requests] + [np.zeros(0, np.int32)])
    last = np.array([r[1] for r in requests], np.int32)
    off = np.array([r[2] for r in requests], np.int32)
    return PageTable(indices, indptr, last, off, page_size=page_size)


def random_request(rng, page_size, max_len, ids):
    """A request over fresh page ids drawn from the iterator ``ids``."""
    n = int(rng.integers(0, max_len + 1))
    if n == 0:
        return ([], 0, 0)
    off = int(rng.integers(0, page_size)) if rng.random() < 0.5 else 0
    pages = -(-(off + n) // page_size)
    return ([next(ids) for _ in range(pages)], off + n - (pages - 1) * page_size, off)


def request_layout(plan, table, i):
    """Everything about request ``i``'s chunks that the kernels see."""
    lo, hi = int(plan.o_indptr[i]), int(plan.o_indptr[i + 1])
    ts, te = plan.chunk_token_ranges(table)
    ps, pe = plan.chunk_page_ranges(table)
    pages = [tuple(table.indices[a:b].tolist()) for a, b in zip(ps[lo:hi], pe[lo:hi])]
    return (plan.pages_per_chunk, hi - lo, plan.chunk_index[lo:hi].tolist(),
            ts[lo:hi].tolist(), te[lo:hi].tolist(), pages)


def test_deterministic_layout_is_batch_invariant(monkeypatch):
    """A request's chunk layout is the same alone and at any position of
    random batches, whatever the batch, the SM count or the env target."""
    rng = np.random.default_rng(40)
    changed = 0
    for trial in range(60):
        P = int(rng.choice([1, 3, 16, 32, 100]))
        ids = itertools.count(int(rng.integers(0, 1000)))
        target = random_request(rng, P, 6000, ids)
        alone_t = csr_table([target], P)
        alone = plan_decode(alone_t, 32, 8, 128, "float16", deterministic=True, num_sms=132)
        want = request_layout(alone, alone_t, 0)
        default_alone = plan_decode(alone_t, 32, 8, 128, "float16", num_sms=132)
        for _ in range(4):
            b = int(rng.choice([2, 5, 33, 130]))
            longest = 40000 if P >= 16 else 4000
            others = [random_request(rng, P, int(rng.choice([50, 1000, longest])), ids) for _ in range(b - 1)]
            pos = int(rng.integers(0, b))
            batch_t = csr_table(others[:pos] + [target] + others[pos:], P)
            if trial % 3 == 1:
                monkeypatch.setenv("CUPAGED_TARGET_CTAS", str(int(rng.integers(1, 5000))))
            sms = int(rng.choice([8, 132, 1000]))
            plan = plan_decode(batch_t, 32, 8, 128, "float16", deterministic=True, num_sms=sms)
            monkeypatch.delenv("CUPAGED_TARGET_CTAS", raising=False)
            assert plan.deterministic
            assert request_layout(plan, batch_t, pos) == want, (trial, P, b, pos)
            # control: the default plan's chunking does depend on the batch
            default = plan_decode(batch_t, 32, 8, 128, "float16", num_sms=132)
            changed += default.pages_per_chunk != default_alone.pages_per_chunk
    assert changed > 100  # so the invariance above is not vacuous


def test_deterministic_plan_fields(monkeypatch):
    rng = np.random.default_rng(41)
    t = make_table(rng, [3000, 1024, 1025, 1, 0], 16)        # 188, 64, 65, 1, 0 pages
    p = plan_decode(t, 32, 8, 128, "bfloat16", deterministic=True)
    assert p.pages_per_chunk == 64 and p.deterministic
    assert p.request_chunks.tolist() == [3, 1, 2, 1, 1]
    assert p.needs_merge and p.matches(t)
    # env and device facts that steer the default play no part
    monkeypatch.setenv("CUPAGED_TARGET_CTAS", "100000")
    assert plan_decode(t, 32, 8, 128, "bfloat16", deterministic=True, num_sms=1).pages_per_chunk == 64
    monkeypatch.delenv("CUPAGED_TARGET_CTAS")
    # an explicit pages_per_chunk is used as given (it is batch-invariant too)
    p = plan_decode(t, 32, 8, 128, "bfloat16", deterministic=True, pages_per_chunk=5)
    assert p.pages_per_chunk == 5 and p.deterministic
    for bad in (1, "yes", None):
        with pytest.raises(InvalidArgumentError, match="deterministic"):
            plan_decode(t, 32, 8, 128, "bfloat16", deterministic=bad)
    assert plan_decode(t, 32, 8, 128, "bfloat16", deterministic=np.bool_(True)).deterministic is True
    # page size 1 and 4096: 1024 pages per chunk, and one page per chunk
    assert plan_decode(make_table(rng, [2049], 1), 8, 8, 64, "float16", deterministic=True).request_chunks[0] == 3
    big = plan_decode(make_table(rng, [9000], 4096), 8, 8, 64, "float16", deterministic=True)
    assert big.pages_per_chunk == 1 and big.request_chunks[0] == 3


@pytest.mark.parametrize("arg", ["pages_per_chunk", "max_pages_per_chunk"])
def test_chunk_size_beyond_int32_is_rejected(arg):
    """The kernels read the chunk size as a C ``int``: 2**32 would arrive as 0
    (zero output, LSE -inf), so it is refused; 2**31 - 1 is still a valid size
    (under a cap, the unsplit requests' chunk size)."""
    table = PageTable.from_seq_lens([100, 7], 16)
    for bad in (2**31, 2**32):
        with pytest.raises(InvalidArgumentError, match=rf"^{arg} must be .* <= 2147483647, got {bad}"):
            plan_decode(table, 8, 8, 128, np.float16, num_sms=132, **{arg: bad})
    plan = plan_decode(table, 8, 8, 128, np.float16, num_sms=132, **{arg: 2**31 - 1})
    assert plan.pages_per_chunk == 2**31 - 1 and plan.request_chunks.tolist() == [1, 1]


def test_fp8_plans_count_three_ctas_per_sm_and_their_own_constants():
    # the driver reports 3 resident fp8 tensor-core CTAs per SM (136-142 registers),
    # and fp8's per-CTA rate has its own constants: a one-long batch splits finer
    import cupaged
    from cupaged import plan as plan_mod, schedule

    assert plan_mod.ctas_per_sm(np.dtype(np.float16), plan_mod.FLOAT8_E4M3, 128, 4) == 3
    assert plan_mod.ctas_per_sm(np.dtype(np.float16), np.dtype(np.uint8), 128, 4) == 3  # fp8 bits
    assert plan_mod.ctas_per_sm(np.dtype(np.float16), np.dtype(np.float16), 128, 4) == 2
    # head_dim 192's fp8 instances take ~200 registers: 2 per SM (mma_traits); 16-bit 80: 2
    assert plan_mod.ctas_per_sm(np.dtype(np.float16), plan_mod.FLOAT8_E4M3, 192, 4) == 2
    assert plan_mod.ctas_per_sm(np.dtype(np.float16), np.dtype(np.float16), 80, 4) == 2
    table = cupaged.PageTable.from_seq_lens([131072] + [512] * 63, 16)
    fp8 = cupaged.plan_decode(table, 32, 8, 128, np.float16, kv_dtype="float8_e4m3fn", num_sms=132)
    fp16 = cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=132)
    pages = np.asarray(table.request_pages)
    want = schedule.choose_max_pages_per_chunk(pages, 8, 3 * 132, 16 * 2 * 128, 8, schedule.H200_COSTS_FP8)
    assert int(fp8.request_chunk_pages[0]) <= want and int(fp8.request_chunk_pages[0]) == int(
        schedule.split_pages(pages[:1], want)[0][0])
    assert fp8.request_chunks[0] > fp16.request_chunks[0]


# ----------------------------------------------------- CTAs per SM (fp8: 3 or 2)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("seed", range(6))
def test_default_plan_takes_the_residency_the_model_predicts_faster(seed, monkeypatch):
    """fp8's instances fit 3 CTAs per SM; the default plan weighs 3 against 2
    (each with its constants and slots) and takes the count whose best cap
    the model predicts faster, with that cap; 16-bit plans have one count."""
    monkeypatch.delenv("CUPAGED_CORE", raising=False)
    rng = np.random.default_rng(seed)
    lens = rng.lognormal(np.log(rng.choice([256, 2048, 16384])), 1.0, int(rng.choice([8, 32, 64, 128]))).astype(int) + 1
    table = PageTable.from_seq_lens(lens.tolist(), 16)
    pages = np.asarray(table.request_pages)
    predicted = {}
    for count in (3, 2):
        costs, slots = schedule.costs_for(1, count), count * 132
        cap = schedule.choose_max_pages_per_chunk(pages, 8, slots, 16 * 2 * 128, 8, costs)
        predicted[count] = (float(schedule.predict_step_us(pages, np.array([cap]), 8, slots, 16 * 2 * 128, costs)[0]),
                            cap)
    plan = plan_decode(table, 32, 8, 128, np.float16, kv_dtype=FP8, num_sms=132)
    want = 3 if predicted[3][0] <= predicted[2][0] else 2
    assert plan.ctas_per_sm == want
    assert plan_decode(table, 32, 8, 128, np.float16, kv_dtype=FP8, num_sms=132,
                       max_pages_per_chunk=predicted[want][1]).request_chunks.tolist() == plan.request_chunks.tolist()
    assert plan_decode(table, 32, 8, 128, np.float16, num_sms=132).ctas_per_sm == 2  # fp16: the kernel's 2


def test_ctas_per_sm_of_explicit_and_hand_built_plans():
    """Plans whose split the caller chose run at the kernel's count; a
    hand-built plan (or one from dataclasses.replace with 0) gets it too; a
    count below 1 is refused."""
    table = PageTable.from_seq_lens([4000, 300, 17], 16)
    fixed = plan_decode(table, 32, 8, 128, np.float16, kv_dtype=FP8, pages_per_chunk=8)
    assert fixed.ctas_per_sm == plan_mod.ctas_per_sm(np.dtype(np.float16), FP8, 128, fixed.heads_per_cta) == 3
    assert plan_decode(table, 32, 8, 128, np.float16, kv_dtype=FP8, deterministic=True).ctas_per_sm == 3
    assert dataclasses.replace(fixed, ctas_per_sm=0).ctas_per_sm == 3
    assert dataclasses.replace(fixed, ctas_per_sm=2).ctas_per_sm == 2
    with pytest.raises(InvalidArgumentError, match="ctas_per_sm"):
        dataclasses.replace(fixed, ctas_per_sm=-1)
