"""GPU: deterministic plans are batch-invariant (issue #6, item 8).

A request decoded alone and decoded inside batches of other requests
(different lengths, batch sizes and positions, with and without a merge
elsewhere in the batch) gives BITWISE identical ``out`` and ``lse`` when the
plans come from ``plan_decode(..., deterministic=True)``: its chunk
boundaries, chunk count, kernel instance and merge order depend on the
request alone. Covered: float16, bfloat16 and float32; a request split into
three merged chunks (starting mid-page) and a single-chunk one. A control
shows that the default plan's chunking does change with the batch, so the
invariance checked here is not automatic. The request's result alone is also
checked against the float64 reference, so two equal garbage outputs cannot
pass.

The other requests read random pages of the same pool (shared pages are
allowed in a page table); the target request owns its own pages, the same in
every table.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import PageTable, reference
from cupaged.plan import deterministic_pages_per_chunk
from helpers import rel_errors, tolerance

pytestmark = pytest.mark.gpu

P = 16
HQ, HKV, D = 16, 4, 128  # GQA group 4
NUM_PAGES = 1024
DTYPES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)]
# target request -> (visible tokens, first_page_offset): 3000 tokens from entry 5
# are 188 pages = 3 deterministic chunks (64 pages each at P 16), merged; 700 are
# 44 pages = one chunk, written straight to out.
TARGETS = {"merged": (3000, 5), "single_chunk": (700, 0)}
# other requests of each batch (visible lengths); the target goes at position pos.
# Lengths 1, page +-1, a prime, exactly one deterministic chunk (1024) and one more,
# several chunks; batch sizes 2 to 24.
BATCHES = [
    ([1], 1),
    ([5000], 0),                                    # a merge elsewhere in the batch
    ([17, 1024, 1025, 15, 9000], 3),
    ([997] * 7 + [1] * 8 + [4096] * 8, 11),        # 24 requests, many CTAs
]


def _cp():
    import cupy

    return cupy


def request(rng, seq_len, offset, page_ids=None):
    """``(page_ids, last_page_len, first_page_offset)`` of one request; page ids
    drawn from the pool unless given."""
    pages = -(-(offset + seq_len) // P)
    if page_ids is None:
        page_ids = rng.integers(0, NUM_PAGES, size=pages)
    return np.asarray(page_ids, np.int32), offset + seq_len - (pages - 1) * P, offset


def csr(requests):
    indptr = np.cumsum([0] + [len(r[0]) for r in requests]).astype(np.int32)
    indices = np.concatenate([r[0] for r in requests]).astype(np.int32)
    return PageTable(indices, indptr, np.array([r[1] for r in requests], np.int32),
                     np.array([r[2] for r in requests], np.int32), page_size=P, num_pages=NUM_PAGES)


@pytest.fixture(scope="module")
def pool():
    """Host float32 K, V ``[NUM_PAGES, P, HKV, D]``; the target's page ids; q rows."""
    rng = np.random.default_rng(2026)
    k = rng.standard_normal((NUM_PAGES, P, HKV, D), dtype=np.float32)
    v = rng.standard_normal((NUM_PAGES, P, HKV, D), dtype=np.float32)
    target_ids = {name: rng.choice(NUM_PAGES, size=-(-(n + off) // P), replace=False)
                  for name, (n, off) in TARGETS.items()}
    q_rows = rng.standard_normal((64, HQ, D), dtype=np.float32)  # row 0: the target's
    return k, v, target_ids, q_rows


def bits(a) -> np.ndarray:
    """The raw bytes of a host array, for a bitwise comparison (NaN-safe)."""
    return np.ascontiguousarray(a).view(np.uint8)


def decode(table, q, k, v, dtype, **plan_kw):
    cp = _cp()
    plan = cupaged.plan_decode(table, HQ, HKV, D, dtype, **plan_kw)
    out = cp.full(q.shape, np.nan, dtype=dtype)
    out, lse = cupaged.decode(q, k, v, table, plan, method="v2", out=out, return_lse=True)
    cp.cuda.runtime.deviceSynchronize()
    return plan, out.get(), lse.get()


def batch_of(rng, target, others, pos, q_rows):
    """The table and q of ``others`` with ``target`` inserted at ``pos``."""
    reqs = [request(rng, n, 0) for n in others]
    reqs.insert(pos, target)
    q = q_rows[1:len(reqs) + 1].copy()
    q[pos] = q_rows[0]
    return csr(reqs), q


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("which", list(TARGETS))
def test_deterministic_decode_is_batch_invariant(pool, dtype, which):
    cp = _cp()
    k_h, v_h, target_ids, q_rows = pool
    k, v = cp.asarray(k_h.astype(dtype)), cp.asarray(v_h.astype(dtype))
    rng = np.random.default_rng(7)
    n, off = TARGETS[which]
    target = request(rng, n, off, target_ids[which])
    alone_t = csr([target])
    q0 = q_rows[:1].astype(dtype)
    alone, out0, lse0 = decode(alone_t, cp.asarray(q0), k, v, dtype, deterministic=True)
    assert alone.deterministic and alone.needs_merge == (which == "merged")
    assert alone.request_chunks.tolist() == [3 if which == "merged" else 1]
    # the answer alone is right (so equal bits below are not two equal wrongs)
    ref_out, ref_lse = reference.decode(q0, k_h.astype(dtype), v_h.astype(dtype), alone_t)
    max_rel, rel_rms = rel_errors(out0.astype(np.float64), ref_out)
    assert max_rel <= tolerance(dtype) and rel_rms <= tolerance(dtype), (max_rel, rel_rms)
    assert np.allclose(lse0, ref_lse, rtol=1e-3, atol=1e-3)

    merges = set()
    for others, pos in BATCHES:
        table, q = batch_of(rng, target, others, pos, q_rows)
        plan, out, lse = decode(table, cp.asarray(q.astype(dtype)), k, v, dtype, deterministic=True)
        assert plan.pages_per_chunk == alone.pages_per_chunk
        assert plan.request_chunks[pos] == alone.request_chunks[0]
        assert np.isfinite(out.astype(np.float32)).all()
        merges.add(plan.needs_merge)
        where = f"{which} {dtype} at {pos} of a batch of {table.batch_size}"
        assert np.array_equal(bits(out[pos]), bits(out0[0])), f"out differs: {where}"
        assert np.array_equal(bits(lse[pos]), bits(lse0[0])), f"lse differs: {where}"
    assert merges == ({True} if which == "merged" else {False, True})


def test_default_plan_depends_on_the_batch(pool):
    """Control: without ``deterministic`` the chunk size follows the batch, so
    the target's chunk boundaries (hence its rounding) change with it."""
    _, _, target_ids, q_rows = pool
    rng = np.random.default_rng(7)
    n, off = TARGETS["merged"]
    target = request(rng, n, off, target_ids["merged"])
    alone = cupaged.plan_decode(csr([target]), HQ, HKV, D, np.float16)
    sizes = set()
    for others, pos in BATCHES:
        table, _ = batch_of(rng, target, others, pos, q_rows)
        plan = cupaged.plan_decode(table, HQ, HKV, D, np.float16)
        sizes.add(plan.pages_per_chunk)
        det = cupaged.plan_decode(table, HQ, HKV, D, np.float16, deterministic=True)
        assert det.pages_per_chunk == deterministic_pages_per_chunk(P)
    assert sizes - {alone.pages_per_chunk}, (alone.pages_per_chunk, sizes)
