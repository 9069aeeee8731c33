"""The planner's fast paths against a plain copy of the algorithm they replace.

``plan_decode`` and the step model in ``cupaged.schedule`` were reworked for
host time (issue 15, item 5: fewer NumPy passes and temporaries). The rework
must not change a single plan. This file keeps the algorithm as it stood
before (commit 239ba71), written plainly: one expression per formula of the
model, one pass per plan array. Every test compares the library with it,
bit for bit, over a seeded random corpus; the last test checks that the
comparison does notice a perturbed fast path.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import plan as plan_mod
from cupaged import schedule
from cupaged.plan import (
    MIN_CHUNK_TOKENS,
    DecodePlan,
    canonical_kv_dtype,
    choose_pages_per_chunk,
    ctas_per_sm,
    deterministic_pages_per_chunk,
    heads_per_cta,
    plan_decode,
    resolve_num_sms,
    resolve_target_ctas,
)
from cupaged.schedule import H200_COSTS, StepCosts


# --------------------------------------------------------------------------
# the reference: the step model and plan_decode as they were (commit 239ba71)
# --------------------------------------------------------------------------
REF_SPLITS, REF_EXACT_REQUESTS, REF_GROUPS = 32, 8, 24


def ref_candidate_caps(longest, min_pages):
    longest, min_pages = max(1, int(longest)), max(1, int(min_pages))
    floor = min(min_pages, longest)
    counts = list(range(1, REF_SPLITS + 1))
    n = float(REF_SPLITS)
    while longest / n >= floor:
        n *= 2 ** 0.25
        counts.append(int(round(n)))
    caps = -(-longest // np.array(counts, dtype=np.int64))
    return np.unique(np.clip(caps, floor, longest))[::-1].copy()


def ref_groups(pages):
    p = np.sort(np.asarray(pages, dtype=np.float64))[::-1]
    if p.size <= REF_EXACT_REQUESTS + REF_GROUPS:
        return p, np.ones_like(p)
    cuts = np.unique(np.concatenate([np.arange(REF_EXACT_REQUESTS),
                                     np.linspace(REF_EXACT_REQUESTS, p.size, REF_GROUPS + 1)[:-1].astype(np.int64)]))
    weight = np.diff(np.append(cuts, p.size)).astype(np.float64)
    return np.add.reduceat(p, cuts) / weight, weight


def ref_predict_step_us(pages, caps, ctas_per_chunk, slots, page_bytes, costs=H200_COSTS):
    length, weight = ref_groups(pages)
    length = length[:, None]
    chunks = np.ceil(length / np.asarray(caps, dtype=np.float64))
    per_request = np.maximum(chunks, 1.0)
    unit_bytes = np.ceil(length / per_request)
    unit_bytes *= float(page_bytes)
    ctas = per_request * (weight * ctas_per_chunk)[:, None]
    n_prefix = np.cumsum(ctas, axis=0)
    rate = np.minimum(costs.cta_gbps, costs.hbm_gbps / slots) * 1e3
    unit_full = unit_bytes * (1.0 / rate)
    unit_full += costs.cta_us
    work = (ctas * unit_full).sum(axis=0) / slots
    waves = np.floor(n_prefix * (1.0 / slots))
    rest = n_prefix - waves * slots
    partial = unit_bytes * np.maximum(1e-3 / costs.cta_gbps, rest * (1e-3 / costs.hbm_gbps))
    partial += costs.cta_us
    partial *= rest > 0
    bound = np.maximum((waves * unit_full + partial).max(axis=0), work)
    most = chunks[0]
    return bound + (most > 1) * (costs.merge_us + costs.merge_us_per_chunk * most)


def ref_choose_max_pages_per_chunk(pages, ctas_per_chunk, slots, page_bytes, min_pages, costs=H200_COSTS):
    pages = np.asarray(pages, dtype=np.int64)
    caps = ref_candidate_caps(int(pages.max(initial=1)), min_pages)
    t = ref_predict_step_us(pages, caps, ctas_per_chunk, slots, page_bytes, costs)
    return int(caps[int(np.argmin(t))])


def ref_split_pages(pages, cap):
    pages = np.asarray(pages, dtype=np.int64)
    chunks = np.maximum(1, -(-pages // cap))
    return np.maximum(1, -(-pages // chunks)), chunks


def ref_fill_waves(pages, req_chunks, chunk_pages, grid_y, slots, page_bytes, cap):
    """schedule.fill_waves and plan._split_into, plainly: a one-wave split
    whose CTAs read >= 4 MB goes to two waves' worth of chunks (>= 2 MB, one
    request: one wave's), handed out in proportion to the pages."""
    per_wave = slots // grid_y
    if req_chunks.sum() * grid_y > slots or slots % grid_y:
        return req_chunks, chunk_pages
    most = max(min(int(c), int(p)) for c, p in zip(chunk_pages, pages)) * page_bytes
    if most >= 4 * 2**20:
        target = 2 * per_wave
    elif most >= 2 * 2**20 and len(pages) == 1:
        target = per_wave
    else:
        return req_chunks, chunk_pages
    if target <= req_chunks.sum() or len(pages) > target:
        return req_chunks, chunk_pages
    share = [p * target / pages.sum() for p in pages]
    n = [max(1, int(np.floor(x))) for x in share]
    for i in sorted(range(len(n)), key=lambda i: -(share[i] - n[i]))[:max(0, target - sum(n))]:
        n[i] += 1
    size = [max(1, -(-int(p) // k)) for p, k in zip(pages, n)]
    n = [max(1, -(-int(p) // z)) for p, z in zip(pages, size)]
    size = [max(int(p), int(cap)) if k == 1 else z for p, k, z in zip(pages, n, size)]
    return np.array(n, dtype=np.int64), np.array(size, dtype=np.int64)


def ref_plan_fields(table, hq, hkv, d, dtype, *, kv_dtype=None, deterministic=False, pages_per_chunk=None,
                    max_pages_per_chunk=None, target_ctas=None, num_sms=None):
    """Every DecodePlan field of ``plan_decode`` (valid arguments only)."""
    dt = np.dtype(dtype)
    kv_dt = dt if kv_dtype is None else canonical_kv_dtype(kv_dtype)
    batch, page_size = int(table.batch_size), int(table.page_size)
    pages = np.asarray(table.request_pages, dtype=np.int64)
    group = hq // hkv
    hpc = heads_per_cta(group)
    q_groups = group // hpc
    grid_y = hkv * q_groups
    target = resolve_target_ctas(target_ctas, num_sms)
    c = None
    best = None
    if pages_per_chunk is not None:
        c = pages_per_chunk
    elif max_pages_per_chunk is not None:
        pass
    elif deterministic:
        c = deterministic_pages_per_chunk(page_size)
    elif target_ctas is not None or cupaged._env.target_ctas() is not None:
        c = choose_pages_per_chunk(pages, grid_y, target)
    held = ctas_per_sm(dt, kv_dt, d, hpc)
    if c is None and max_pages_per_chunk is None:  # the step model's plan
        sms = resolve_num_sms(num_sms)
        page_bytes = page_size * 2 * d * kv_dt.itemsize
        best = None
        # fp8 instances that fit 3 CTAs per SM weigh 2 as well, 16-bit ones of head_dim 128 that fit 2
        # weigh 1, each count with its constants (1 per SM's only below the kernel's count)
        counts = {(1, 3): (3, 2), (2, 2): (2, 1)}.get((kv_dt.itemsize, held), (held,))
        if kv_dt.itemsize == 2 and d != 128:
            counts = (held,)
        for count in counts:
            if kv_dt.itemsize == 1:
                costs = schedule.H200_COSTS_FP8_2 if count == 2 else schedule.H200_COSTS_FP8
            else:
                costs = schedule.H200_COSTS_1 if count == 1 < held else H200_COSTS
            cap = ref_choose_max_pages_per_chunk(pages, grid_y, count * sms, page_bytes,
                                                 -(-MIN_CHUNK_TOKENS // page_size), costs)
            t = ref_predict_step_us(pages, np.array([cap]), grid_y, count * sms, page_bytes, costs)[0]
            if best is None or t < best[0]:
                best = (t, count, cap)
        resident = held
        _, held, max_pages_per_chunk = best
    if c is None:
        chunk_pages, req_chunks = ref_split_pages(pages, max_pages_per_chunk)
        chunk_pages = np.where(req_chunks == 1, max_pages_per_chunk, chunk_pages)  # unsplit: the cap
        if (pages_per_chunk is None and max_pages_per_chunk is not None and best is not None and held == resident
                and kv_dt.itemsize == 2 and d == 128):
            req_chunks, chunk_pages = ref_fill_waves(pages, req_chunks, chunk_pages, grid_y, held * sms,
                                                     page_bytes, max_pages_per_chunk)
    else:
        req_chunks = np.maximum(1, -((-pages) // c))
        chunk_pages = np.full(batch, c, dtype=np.int64)
    n = int(req_chunks.sum())
    o_indptr = np.concatenate([[0], np.cumsum(req_chunks)])
    chunk_request = np.repeat(np.arange(batch), req_chunks)
    chunk_index = np.arange(n) - o_indptr[chunk_request]
    chunk_size = chunk_pages[chunk_request]
    key = np.maximum(chunk_index * chunk_size - pages[chunk_request], -chunk_size)
    launch_order = np.argsort(key, kind="stable")
    needs_merge = bool(req_chunks.max() > 1)

    def frozen(a):
        a = a.astype(np.int32)
        a.flags.writeable = False
        return a

    return dict(
        batch_size=batch, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size, dtype=dt,
        group_size=group, heads_per_cta=hpc, q_groups=q_groups, pages_per_chunk=int(chunk_pages.max()),
        target_ctas=int(target), num_chunks=n, chunk_request=frozen(chunk_request),
        chunk_index=frozen(chunk_index), o_indptr=frozen(o_indptr), request_chunks=frozen(req_chunks),
        num_ctas=n * grid_y, grid=(n * grid_y, 1, 1), needs_merge=needs_merge,
        workspace_bytes=(n * hq * d + n * hq) * 4 if needs_merge else 0, kv_dtype=kv_dt,
        deterministic=bool(deterministic), request_chunk_pages=frozen(chunk_pages),
        launch_order=frozen(launch_order), heads_groups=grid_y, group_last=None, ctas_per_sm=held)


def plan_differences(plan, want) -> list[str]:
    """Fields where ``plan`` differs from the reference's: value, type, and
    for arrays dtype, shape, read-only and layout too."""
    out = []
    names = [f.name for f in dataclasses.fields(DecodePlan)]
    assert sorted(names) == sorted(want), "the reference lists every DecodePlan field"
    for name in names:
        got, exp = getattr(plan, name), want[name]
        if exp is None:
            same = got is None
        elif isinstance(exp, np.ndarray):
            same = (isinstance(got, np.ndarray) and got.dtype == exp.dtype and got.shape == exp.shape
                    and np.array_equal(got, exp) and not got.flags.writeable and got.flags.c_contiguous
                    and got.base is None)
        else:
            same = type(got) is type(exp) and got == exp
        if not same:
            out.append(f"{name}: {got!r} != {exp!r}")
    return out


# --------------------------------------------------------------------------
# the corpus
# --------------------------------------------------------------------------
SHAPES = ((32, 8, 128), (8, 8, 128), (64, 8, 128), (28, 4, 128), (32, 32, 64), (16, 1, 256), (14, 2, 96),
          (96, 8, 128), (40, 8, 72), (4, 4, 64))
DTYPES = (("float16", None), ("bfloat16", None), ("float32", None), ("float16", np.uint8),
          ("bfloat16", "float8_e4m3fn"), ("float16", ml_dtypes.float8_e4m3fn), ("float16", "float16"))
PAGE_SIZES = (1, 16, 64)
MAX_TOKENS = 200_000


def random_lengths(rng, batch):
    """Token counts in [0, 200k]: ragged, uniform, one long among short, or
    with many empty requests."""
    kind = rng.integers(6)
    if kind == 0:
        lens = rng.integers(0, MAX_TOKENS + 1, batch)
    elif kind == 1:
        lens = np.round(np.exp(rng.normal(rng.uniform(4, 10), rng.uniform(0.2, 2.0), batch)))
    elif kind == 2:
        lens = np.full(batch, rng.integers(0, MAX_TOKENS + 1))
    elif kind == 3:
        lens = rng.integers(1, 600, batch)
        lens[rng.integers(batch)] = rng.integers(MAX_TOKENS // 2, MAX_TOKENS + 1)
    elif kind == 4:
        lens = rng.choice([0, 1, 15, 16, 17, 1021, 4096, 32768], batch)
    else:
        lens = rng.integers(0, 3000, batch) * (rng.random(batch) < 0.3)
    return np.clip(lens, 0, MAX_TOKENS).astype(np.int64)


def random_table(rng):
    """A stand-in with a PageTable's planning attributes: 512 requests of
    200k tokens at page size 1 would need a 100M-entry CSR for nothing (real
    tables are used below). ``request_pages`` is read-only int32 like a
    PageTable's, else int64 or a list (plan_decode takes those too)."""
    batch = int(rng.choice([1, 2, 3, 7, 8, 9, 31, 32, 33, 40, 64, 100, 128, 255, 256, 257, 300, 511, 512]))
    page_size = int(rng.choice(PAGE_SIZES))
    pages = -(-random_lengths(rng, batch) // page_size)
    kind = rng.random()
    if kind < 0.8:
        pages = pages.astype(np.int32)
        pages.flags.writeable = False
    elif kind < 0.9:
        pages = pages.tolist()
    return types.SimpleNamespace(batch_size=batch, page_size=page_size, request_pages=pages)


def random_knobs(rng):
    """Keyword arguments of plan_decode: mostly the default plan, else one
    explicit knob (an explicit SM count most of the time)."""
    kind = rng.integers(10)
    knobs = {}
    if rng.random() < 0.8:
        knobs["num_sms"] = int(rng.choice([1, 7, 78, 108, 132, 144, 1000]))
    if kind == 6:
        knobs["pages_per_chunk"] = int(rng.choice([1, 3, 64, 1000, 2**31 - 1]))
    elif kind == 7:
        knobs["max_pages_per_chunk"] = int(rng.choice([1, 5, 64, 333, 2**31 - 1]))
    elif kind == 8:
        knobs["target_ctas"] = int(rng.integers(1, 5000))
    elif kind == 9:
        knobs["deterministic"] = True
        if rng.random() < 0.3:
            knobs["pages_per_chunk"] = int(rng.integers(1, 100))
    return knobs


CORPUS = 1500


@functools.lru_cache(maxsize=1)
def corpus():
    rng = np.random.default_rng(20261215)
    cases = []
    for _ in range(CORPUS):
        hq, hkv, d = SHAPES[rng.integers(len(SHAPES))]
        dtype, kv_dtype = DTYPES[rng.integers(len(DTYPES))]
        cases.append((random_table(rng), hq, hkv, d, dtype, dict(kv_dtype=kv_dtype, **random_knobs(rng))))
    return cases


def corpus_mismatches(limit=5):
    """(case, differences) of the first corpus cases whose plan differs."""
    bad = []
    for i, (table, hq, hkv, d, dtype, knobs) in enumerate(corpus()):
        diff = plan_differences(plan_decode(table, hq, hkv, d, dtype, **knobs),
                                ref_plan_fields(table, hq, hkv, d, dtype, **knobs))
        if diff:
            bad.append((i, diff))
            if len(bad) >= limit:
                break
    return bad


@pytest.fixture
def no_env(monkeypatch):
    """No device and no CTA-target or SM-count variables: the default plan
    plans for DEFAULT_NUM_SMS where no SM count is given."""
    monkeypatch.setattr(plan_mod, "device_num_sms", lambda: None)
    monkeypatch.delenv("CUPAGED_NUM_SMS", raising=False)
    monkeypatch.delenv("CUPAGED_TARGET_CTAS", raising=False)
    monkeypatch.delenv("CUPAGED_CORE", raising=False)


# --------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------
def test_corpus_covers_the_paths(no_env):
    """The corpus reaches every way of choosing the chunk size, splits and
    ties (so the comparisons below can fail)."""
    cases = corpus()
    assert len(cases) == CORPUS
    default = [c for c in cases if not {"pages_per_chunk", "max_pages_per_chunk", "target_ctas",
                                        "deterministic"} & set(c[5])]
    assert len(default) > 0.5 * CORPUS
    assert len(cases) - len(default) > 0.3 * CORPUS
    assert {int(c[0].batch_size) for c in cases} >= {1, 512}
    assert {int(c[0].page_size) for c in cases} == set(PAGE_SIZES)
    assert max(int(np.max(c[0].request_pages)) for c in cases) >= MAX_TOKENS - 1
    split = sum(plan_decode(*c[:5], **c[5]).needs_merge for c in default)
    assert 0.2 * len(default) < split < 0.9 * len(default)


def test_plan_decode_equals_the_reference(no_env):
    assert corpus_mismatches() == []


def test_plan_decode_equals_the_reference_on_page_tables(no_env):
    """Real PageTables (int32 request_pages, mid-page starts) through every
    knob, and the env CTA target."""
    rng = np.random.default_rng(7)
    for trial in range(150):
        batch = int(rng.integers(1, 80))
        page_size = int(rng.choice(PAGE_SIZES))
        lens = random_lengths(rng, batch) // int(rng.choice([1, 10]))
        offs = np.where(lens > 0, rng.integers(0, page_size, batch), 0)
        table = cupaged.PageTable.from_seq_lens(lens.tolist(), page_size, offs.tolist())
        hq, hkv, d = SHAPES[rng.integers(len(SHAPES))]
        dtype, kv_dtype = DTYPES[rng.integers(len(DTYPES))]
        knobs = dict(kv_dtype=kv_dtype, **random_knobs(rng))
        with pytest.MonkeyPatch.context() as mp:
            if trial % 10 == 0:
                mp.setenv("CUPAGED_TARGET_CTAS", str(int(rng.integers(1, 3000))))
            want = ref_plan_fields(table, hq, hkv, d, dtype, **knobs)
            assert plan_differences(plan_decode(table, hq, hkv, d, dtype, **knobs), want) == [], (trial, knobs)


def random_model_args(rng):
    """(pages, ctas_per_chunk, slots, page_bytes, min_pages, costs) of the step
    model, with fitted-looking and arbitrary cost constants."""
    batch = int(rng.integers(1, 520))
    pages = -(-random_lengths(rng, batch) // int(rng.choice(PAGE_SIZES)))
    costs = H200_COSTS if rng.random() < 0.5 else StepCosts(
        hbm_gbps=float(rng.uniform(500, 9000)), cta_gbps=float(rng.uniform(1, 60)),
        cta_us=float(rng.uniform(0, 10)), merge_us=float(rng.uniform(0, 30)),
        merge_us_per_chunk=float(rng.choice([0.0, rng.uniform(0, 2)])))
    return (pages, int(rng.choice([1, 2, 8, 32, 64])), int(rng.choice([1, 3, 132, 264, 396, 2000])),
            int(rng.choice([2, 1024, 8192, 16 * 512, 64 * 1024])), int(rng.choice([1, 2, 8, 128])), costs)


def test_predict_step_us_is_bitwise_the_reference():
    rng = np.random.default_rng(11)
    for trial in range(800):
        pages, cpc, slots, page_bytes, min_pages, costs = random_model_args(rng)
        if trial % 4 == 0:  # arbitrary caps, not the ladder: any order, repeats
            caps = rng.integers(1, max(2, int(pages.max()) * 2), int(rng.integers(1, 60)))
        else:
            caps = ref_candidate_caps(int(pages.max(initial=1)), min_pages)
        got = schedule.predict_step_us(pages, caps, cpc, slots, page_bytes, costs)
        want = ref_predict_step_us(pages, caps, cpc, slots, page_bytes, costs)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want), (trial, pages.tolist()[:20], caps.tolist())


def test_choose_max_pages_per_chunk_is_the_reference():
    rng = np.random.default_rng(12)
    for trial in range(1500):
        pages, cpc, slots, page_bytes, min_pages, costs = random_model_args(rng)
        if trial % 3 == 0:
            pages = pages.astype(np.int32)  # a table's request_pages
        elif trial % 10 == 1:
            pages = pages + 0.5  # floats are truncated, as before
        got = schedule.choose_max_pages_per_chunk(pages, cpc, slots, page_bytes, min_pages, costs)
        want = ref_choose_max_pages_per_chunk(pages, cpc, slots, page_bytes, min_pages, costs)
        assert type(got) is int and got == want, trial


#: Costs under which even splits of a power-of-two request tie: no fixed CTA
#: or merge cost, and a partial wave bound by the HBM share alone, so halving
#: the chunks and doubling their count changes no term of the model.
TIE_COSTS = StepCosts(hbm_gbps=4700.0, cta_gbps=1e9, cta_us=0.0, merge_us=0.0, merge_us_per_chunk=0.0)


def test_choose_max_pages_per_chunk_takes_the_largest_cap_among_ties():
    rng = np.random.default_rng(14)
    ties = 0
    for trial in range(100):
        pages = np.full(int(rng.integers(1, 40)), 2 ** int(rng.integers(4, 12)))
        pages[1:][rng.random(pages.size - 1) < 0.3] = 0
        args = (pages, int(rng.choice([1, 8])), int(rng.choice([10_000, 100_000])), 8192, 1, TIE_COSTS)
        caps = ref_candidate_caps(int(pages.max(initial=1)), 1)
        t = ref_predict_step_us(pages, caps, *args[1:4], TIE_COSTS)
        ties += int((t == t.min()).sum() > 1)  # (rounding breaks a few)
        assert schedule.choose_max_pages_per_chunk(*args) == ref_choose_max_pages_per_chunk(*args), trial
    assert ties > 80


def test_candidate_caps_and_split_pages_are_the_reference():
    rng = np.random.default_rng(13)
    for _ in range(300):
        longest, floor = int(rng.integers(0, 250_000)), int(rng.integers(0, 300))
        assert np.array_equal(schedule.candidate_caps(longest, floor), ref_candidate_caps(longest, floor))
        pages = rng.integers(0, 250_000, int(rng.integers(1, 600)))
        cap = int(rng.integers(1, 300_000))
        got, want = schedule.split_pages(pages, cap), ref_split_pages(pages, cap)
        assert all(g.dtype == w.dtype and np.array_equal(g, w) for g, w in zip(got, want))


def test_the_comparison_catches_a_perturbed_fast_path(no_env, monkeypatch):
    """The comparisons above can fail: each perturbation of a fast path
    (a merge 0.5 µs dearer, a launch-order key without its cap at the
    chunk size, the smaller cap among ties) changes plans of the corpus or
    the tie cases."""
    setup = schedule._ladder_setup

    def merge_off(*args):
        caps, caps_float, group_ctas, merge, constants = setup(*args)
        return caps, caps_float, group_ctas, np.where(merge > 0, merge + 0.5, 0.0), constants

    with monkeypatch.context() as mp:
        mp.setattr(schedule, "_ladder_setup", merge_off)
        assert corpus_mismatches(limit=1)
    split = plan_mod._split_chunks

    def uncapped_key(pages, chunk_pages, req_chunks, n):  # every chunk keyed as if it were the last
        o_indptr, chunk_request, chunk_index, _ = split(pages, chunk_pages, req_chunks, n)
        return o_indptr, chunk_request, chunk_index, chunk_index * chunk_pages[chunk_request] - pages[chunk_request]

    with monkeypatch.context() as mp:
        mp.setattr(plan_mod, "_split_chunks", uncapped_key)
        assert corpus_mismatches(limit=1)
    step_us = schedule._step_us

    def last_of_ties(*args, **kwargs):  # argmin then takes the last (smallest) cap among ties
        t = step_us(*args, **kwargs)
        t[np.flatnonzero(t == t.min())[-1]] -= 1e-9
        return t

    with monkeypatch.context() as mp:
        mp.setattr(schedule, "_step_us", last_of_ties)
        with pytest.raises(AssertionError):
            test_choose_max_pages_per_chunk_takes_the_largest_cap_among_ties()
