"""Numerics at the edges (issue 7 item 3) and determinism (item 4), on the GPU.

Every case runs on each decode path that serves it (:func:`paths`): v2 with a
single-chunk plan (no merge) and with a split plan (the fused merge), on each
attention core that serves the dtype (``CUPAGED_CORE=mma`` tensor cores for
float16/bfloat16, ``simt`` CUDA cores for all three), and the v1 baseline.
Outputs are poisoned with NaN before each launch and must come back finite.

Exact scores. The extreme-logit and float16-near-max cases use integer-valued
``q`` and ``k`` (exact in float16, bfloat16 and float32) and an ``sm_scale``
of ``2**-e * ln 2``, so the kernels' scale ``sm_scale * log2(e)`` rounds to the
float32 power of two ``2**-e`` and every score is computed exactly, whatever
the accumulation order. Any error left is the kernels' own (exp2/log2
approximations, float32 sums, the tensor-core path rounding P to the KV
dtype), not an artefact of ill-conditioned float32 scores at |s| ~ 1e4, where
one float32 ulp of a score (2**-10 at 16384) would already move a softmax
weight by 0.07%.

Tolerances (against the float64 reference on the same storage-dtype inputs):

- output: the project's (``helpers.tolerance``): max and rms error relative
  to ``max|ref|`` at most 1e-5 for float32, 2e-2 for float16/bfloat16;
- LSE: ``|lse - ref| <= 1e-5 * |ref| + 1e-4`` (``LSE_RTOL``, ``LSE_ATOL``).
  A float32 LSE is stored with relative spacing 2**-23 (1.2e-7); the error
  budget above that is ex2.approx/lg2.approx (about 2 ulp) and float32 sums of
  up to 2**18 weights, whose rounding walks to about 1e-5 relative at the
  longest context here. The absolute term covers LSEs near 0.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import _configs, reference
from helpers import make_table, rel_errors, tolerance, visible_mask

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
DTYPES = [F16, BF16, F32]
LSE_RTOL, LSE_ATOL = 1e-5, 1e-4
LN2 = math.log(2.0)


def _cp():
    import cupy

    return cupy


# ------------------------------------------------------------------------ paths
def paths(dtype, head_dim=128, split_pages=2):
    """``(id, method, core, plan kind)`` of every path serving (dtype, head_dim)."""
    name = _configs.dtype_name(dtype)
    out = []
    for core in ("mma", "simt"):
        if _configs.serves(core, name, head_dim):
            out += [(f"v2-single-{core}", "v2", core, "single"), (f"v2-split-{core}", "v2", core, split_pages)]
    return out + [("v1", "v1", None, None)]


def path_params(dtypes, head_dim=128):
    return [pytest.param(dt, p, id=f"{_configs.dtype_name(dt)}-{p[0]}") for dt in dtypes for p in paths(dt, head_dim)]


def make_plan(table, num_qo_heads, num_kv_heads, head_dim, dtype, kind):
    """A single-chunk plan (``kind == "single"``: no merge), a split one
    (``kind`` = pages per chunk; some request must split), or the default
    (``"auto"``)."""
    if kind == "single":
        plan = cupaged.plan_decode(table, num_qo_heads, num_kv_heads, head_dim, dtype, target_ctas=1)
        assert not plan.needs_merge
    elif kind == "auto":
        plan = cupaged.plan_decode(table, num_qo_heads, num_kv_heads, head_dim, dtype)
    else:
        plan = cupaged.plan_decode(table, num_qo_heads, num_kv_heads, head_dim, dtype, pages_per_chunk=kind)
        assert plan.needs_merge
    return plan


def run(path, q, k, v, table, monkeypatch, sm_scale=None, plan=None):
    """decode on ``path`` into a NaN-poisoned out; returns host (out, lse)."""
    cp = _cp()
    _, method, core, kind = path
    if core is None:
        monkeypatch.delenv("CUPAGED_CORE", raising=False)
    else:
        monkeypatch.setenv("CUPAGED_CORE", core)  # read when the (fresh) plan is first launched
    if method == "v2" and plan is None:
        plan = make_plan(table, q.shape[1], k.shape[2], q.shape[2], q.dtype, kind)
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupaged.decode(q, k, v, table, plan if method == "v2" else None, method=method,
                              sm_scale=sm_scale, out=out, return_lse=True)
    cp.cuda.runtime.deviceSynchronize()  # an asynchronous fault fails this test
    assert res is out
    return out.get(), lse.get()


def check(out, lse, ref_out, ref_lse, dtype, what="", tol=None):
    out = np.asarray(out, dtype=np.float64)
    assert np.isfinite(out).all(), f"{what}: inf or NaN in the output"
    assert not np.isnan(lse).any(), f"{what}: NaN in the LSE"
    max_rel, rel_rms = rel_errors(out, ref_out)
    tol = tolerance(dtype) if tol is None else tol
    assert max_rel <= tol and rel_rms <= tol, f"{what}: max_rel {max_rel:.3g}, rel_rms {rel_rms:.3g} > {tol}"
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), f"{what}: LSE -inf pattern differs"
    err = np.abs(lse[finite].astype(np.float64) - ref_lse[finite])
    bound = LSE_RTOL * np.abs(ref_lse[finite]) + LSE_ATOL
    assert (err <= bound).all(), f"{what}: LSE error {err.max():.3g} (bound {bound[err.argmax()]:.3g})"
    return max_rel, rel_rms


def exact_sm_scale(log2_scale: int) -> float:
    """An sm_scale whose kernel scale ``float32(sm_scale * log2(e))`` is exactly
    ``2**log2_scale``."""
    sm_scale = 2.0**log2_scale * LN2
    assert np.float32(sm_scale * reference.LOG2E) == np.float32(2.0**log2_scale)
    return sm_scale


def _fill_visible(table, num_pages, num_kv_heads, head_dim, dtype, k_rows, v_rows):
    """K and V caches with the given per-token rows in the visible slots (in
    table order) and NaN everywhere else. ``k_rows``/``v_rows`` are
    ``[total visible tokens, num_kv_heads, head_dim]`` float64."""
    P = table.page_size
    shape = (num_pages, P, num_kv_heads, head_dim)
    k = np.full(shape, np.nan)
    v = np.full(shape, np.nan)
    t = 0
    for i in range(table.batch_size):
        pages = table.indices[table.indptr[i] : table.indptr[i + 1]]
        slots = [(p, s) for p in pages for s in range(P)]
        slots = slots[table.first_page_offset[i] : table.first_page_offset[i] + table.seq_lens[i]]
        for p, s in slots:
            k[p, s], v[p, s] = k_rows[t], v_rows[t]
            t += 1
    assert t == len(k_rows)
    assert np.isnan(k[~visible_mask(table, num_pages)]).all()
    return k.astype(dtype), v.astype(dtype)


# ------------------------------------------------------------------ extreme logits
EXTREME_LENS = [300, 37, 1, 64]
EXTREME_OFF = [0, 5, 0, 9]


def extreme_logits_case(dtype, seed=0, num_qo_heads=8, num_kv_heads=2, head_dim=128):
    """Scores of about +-16384 in log2 units (+-1.1e4 natural), computed exactly.

    ``q`` is ``+8`` (even heads) or ``-8`` (odd heads) in every dim. A token's
    K row is ``beta`` in every dim except dim 0, which is ``beta + j``:
    ``beta`` in {+128 ("top"), 64 ("mid"), -128 ("bottom")}, ``j`` in
    [-12, 0]. With the kernel scale 2**-3 the log2 score is ``+-(16384 + j)``,
    ``+-(8192 + j)`` or ``-+(16384 - j)``: within each request a few tokens at
    the top share a rich softmax (weights 2**j), the rest sit 8192 or 32768
    below it. Request 1 holds only "bottom" tokens (every score about -16384
    for the even heads), request 2 a single token; requests 1 and 3 start
    mid-page. All values are integers below 256: exact in every dtype.
    """
    rng = np.random.default_rng(seed)
    table, num_pages = make_table(rng, EXTREME_LENS, 16, EXTREME_OFF)
    rows = []
    for i, n in enumerate(EXTREME_LENS):
        if i == 1:
            beta = np.full(n, -128)
        elif i == 2:
            beta = np.full(n, 128)
        else:
            beta = rng.choice([128, 64, -128], size=n, p=[0.15, 0.55, 0.30])
            beta[rng.integers(n)] = 128  # at least one top token
        rows.append(np.repeat(beta[:, None], num_kv_heads, axis=1))
    beta = np.concatenate(rows)  # [T, Hkv]
    j = rng.integers(-12, 1, size=beta.shape)
    k_rows = np.repeat(beta[:, :, None], head_dim, axis=2).astype(np.float64)
    k_rows[:, :, 0] += j
    v_rows = rng.standard_normal(k_rows.shape)
    k, v = _fill_visible(table, num_pages, num_kv_heads, head_dim, dtype, k_rows, v_rows)
    alpha = np.where(np.arange(num_qo_heads) % 2 == 0, 8.0, -8.0)
    q = np.broadcast_to(alpha[None, :, None], (len(EXTREME_LENS), num_qo_heads, head_dim)).astype(dtype)
    return q, k, v, table


# A split plan stores each chunk's LSE as float32 and merges with weights
# exp2(lse_c - max). At |lse| ~ 16396 a float32 has spacing 2**-9, so a stored
# partial LSE is off by up to 2**-10 and a merge weight by 2**(2**-10) - 1 =
# 6.8e-4 relative: the merged output can move by that much of the partials'
# spread. That is the float32 LSE format, not a kernel bug; a split plan's
# float32 output is held to 2e-3 here (3x the bound) instead of 1e-5. The
# 16-bit tolerance (2e-2) already covers it; single-chunk plans and v1 never
# store an LSE before normalizing and keep 1e-5.
SPLIT_EXTREME_TOL = 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, path", path_params(DTYPES))
def test_extreme_logits(dtype, path, monkeypatch):
    cp = _cp()
    q, k, v, table = extreme_logits_case(dtype)
    sm_scale = exact_sm_scale(-3)
    ref_out, ref_lse = reference.decode(q, k, v, table, sm_scale=sm_scale)
    assert np.abs(ref_lse).max() > 16000 and ref_lse.min() < -16000  # the regime under test
    out, lse = run(path, cp.asarray(q), cp.asarray(k), cp.asarray(v), table, monkeypatch, sm_scale=sm_scale)
    split = path[1] == "v2" and path[3] != "single"
    tol = max(tolerance(dtype), SPLIT_EXTREME_TOL) if split else None
    check(out, lse, ref_out, ref_lse, dtype, path[0], tol=tol)


# ------------------------------------------------------- float16 near its maximum
def fp16_near_max_case(seed=1, num_qo_heads=8, num_kv_heads=2, head_dim=128, lens=(700, 1, 129, 33)):
    """float16 q and k of +-240 (products 57600, raw q.k up to 7.4e6, far
    beyond float16's 65504, so any float16 accumulation overflows) and V of
    magnitude 3e4..6e4. With the kernel scale 2**-16 the log2 scores are
    exact multiples of 0.87890625 (spread about +-10)."""
    rng = np.random.default_rng(seed)
    table, num_pages = make_table(rng, list(lens), 16, [0, 0, 3, 15])
    T = int(table.seq_lens.sum())
    k_rows = 240.0 * rng.choice([-1.0, 1.0], size=(T, num_kv_heads, head_dim))
    v_rows = rng.uniform(3e4, 6e4, size=k_rows.shape) * rng.choice([-1.0, 1.0], size=k_rows.shape)
    k, v = _fill_visible(table, num_pages, num_kv_heads, head_dim, F16, k_rows, v_rows)
    q = (240.0 * rng.choice([-1.0, 1.0], size=(len(lens), num_qo_heads, head_dim))).astype(F16)
    return q, k, v, table


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, path", path_params([F16]))
def test_fp16_large_dot_products_and_values_near_max(dtype, path, monkeypatch):
    cp = _cp()
    q, k, v, table = fp16_near_max_case()
    sm_scale = exact_sm_scale(-16)
    ref_out, ref_lse = reference.decode(q, k, v, table, sm_scale=sm_scale)
    assert np.abs(ref_out).max() > 2e4
    out, lse = run(path, cp.asarray(q), cp.asarray(k), cp.asarray(v), table, monkeypatch, sm_scale=sm_scale)
    check(out, lse, ref_out, ref_lse, dtype, path[0])


def fp16_max_value_case(num_qo_heads=8, num_kv_heads=2, head_dim=128, n=96):
    """Every V entry is 65504 (float16's largest finite value), so the exact
    output is 65504 everywhere: any normalization error that pushes it up by
    2**-12 relative (to 65520) rounds to +inf on the float16 store.

    One request of ``n`` tokens on pages of 16; ``q`` is 1 in every dim. Every
    16th token (one per 16-token tile, so every warp and every chunk sees one)
    is a "top" token with K = 600 in every dim (dot 76800); the others' dots
    are 65489 lower (K = 88, with dim 0 = 135), so with the kernel scale
    2**-16 their log2 scores sit ``65489 / 65536`` below the top and their
    weights are ``2**(-65489/65536) = 0.5002486``: just above the float16
    midpoint between 0.5 and 0.50048828. That is the worst case for a core
    that rounds P to float16 for the P.V product but sums the unrounded P
    into the denominator: each such weight is rounded up by 4.8e-4 relative,
    the normalized output becomes 65504 * 1.00042 = 65531.7, and the store
    rounds it to +inf (emulated in NumPy when this test was written).
    """
    table = cupaged.PageTable.from_seq_lens([n], 16)
    num_pages = int(table.request_pages[0])
    k_rows = np.full((n, num_kv_heads, head_dim), 88.0)
    k_rows[:, :, 0] = 135.0
    k_rows[::16] = 600.0
    v_rows = np.full(k_rows.shape, 65504.0)
    k, v = _fill_visible(table, num_pages, num_kv_heads, head_dim, F16, k_rows, v_rows)
    q = np.ones((1, num_qo_heads, head_dim), dtype=F16)
    return q, k, v, table


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, path", path_params([F16]))
def test_fp16_output_at_max_stays_finite(dtype, path, monkeypatch):
    cp = _cp()
    q, k, v, table = fp16_max_value_case()
    sm_scale = exact_sm_scale(-16)
    ref_out, ref_lse = reference.decode(q, k, v, table, sm_scale=sm_scale)
    np.testing.assert_allclose(ref_out, 65504.0, rtol=1e-12)
    out, lse = run(path, cp.asarray(q), cp.asarray(k), cp.asarray(v), table, monkeypatch, sm_scale=sm_scale)
    assert np.isfinite(out.astype(np.float64)).all(), f"{path[0]}: float16 output overflowed to inf"
    check(out, lse, ref_out, ref_lse, dtype, path[0])


# ------------------------------------------------------------------ all-equal scores
EQUAL_LENS = [1, 17, 1000, 0, 4099]


def _equal_scores_case(dtype, seed, q_zero, num_qo_heads=8, num_kv_heads=2, head_dim=128):
    rng = np.random.default_rng(seed)
    table, num_pages = make_table(rng, EQUAL_LENS, 16, [0, 7, 0, 0, 15])
    T = int(table.seq_lens.sum())
    if q_zero:  # q = 0: every score is 0, whatever K holds
        k_rows = rng.standard_normal((T, num_kv_heads, head_dim))
        q = np.zeros((len(EQUAL_LENS), num_qo_heads, head_dim))
    else:  # one K row per KV head, repeated for every token; small integers: exact scores
        row = rng.integers(-3, 4, size=(num_kv_heads, head_dim)).astype(np.float64)
        k_rows = np.broadcast_to(row, (T, num_kv_heads, head_dim))
        q = rng.integers(-3, 4, size=(len(EQUAL_LENS), num_qo_heads, head_dim)).astype(np.float64)
    v_rows = rng.standard_normal((T, num_kv_heads, head_dim))
    k, v = _fill_visible(table, num_pages, num_kv_heads, head_dim, dtype, k_rows, v_rows)
    return q.astype(dtype), k, v, table


@pytest.mark.gpu
@pytest.mark.parametrize("q_zero", [True, False], ids=["q_zero", "identical_k_rows"])
@pytest.mark.parametrize("dtype, path", path_params(DTYPES))
def test_all_equal_scores_give_the_mean_of_v(dtype, path, q_zero, monkeypatch):
    """Output = mean of the visible V rows; LSE = score + log2(n) (score 0
    for q = 0), exact to float32 precision; the empty request stays 0/-inf."""
    cp = _cp()
    q, k, v, table = _equal_scores_case(dtype, 2, q_zero)
    sm_scale = exact_sm_scale(-3)
    ref_out, ref_lse = reference.decode(q, k, v, table, sm_scale=sm_scale)
    # the closed form, from the inputs alone
    g = q.shape[1] // k.shape[2]
    n = table.seq_lens
    for i in np.flatnonzero(n):
        vis_v = reference.gather_kv(v, table, i)  # [n, Hkv, D]
        vis_k = reference.gather_kv(k, table, i)
        mean = np.repeat(vis_v.mean(axis=0), g, axis=0)  # query head h reads KV head h // g
        np.testing.assert_allclose(ref_out[i], mean, rtol=1e-9, atol=1e-12)
        score = np.einsum("hd,hd->h", q[i].astype(np.float64), np.repeat(vis_k[0], g, axis=0)) * 0.125
        np.testing.assert_allclose(ref_lse[i], score + np.log2(n[i]), rtol=1e-12, atol=1e-12)
    out, lse = run(path, cp.asarray(q), cp.asarray(k), cp.asarray(v), table, monkeypatch, sm_scale=sm_scale)
    check(out, lse, ref_out, ref_lse, dtype, path[0])
    assert (out[3] == 0).all() and np.isneginf(lse[3]).all()
    if q_zero:  # LSE = log2(n) to float32 precision
        for i in np.flatnonzero(n):
            np.testing.assert_allclose(lse[i], np.log2(n[i]), rtol=0, atol=LSE_ATOL)


# -------------------------------------------------------------- a very long context
LONG_TOKENS = 262144  # 2**18 visible tokens, one request


def long_reference(q_row, k_vis, v_vis, sm_scale):
    """float64 decode of one request over its gathered ``[T, Hkv, D]`` K/V, one
    KV head at a time on contiguous float64 copies (the same math as
    :func:`cupaged.reference.attend`, at 2**18 tokens in seconds)."""
    hq, d = q_row.shape
    t, hkv, _ = k_vis.shape
    g = hq // hkv
    scale = sm_scale * reference.LOG2E
    out = np.empty((hq, d))
    lse = np.empty(hq)
    for h in range(hkv):
        kh = np.ascontiguousarray(k_vis[:, h, :], dtype=np.float64)
        vh = np.ascontiguousarray(v_vis[:, h, :], dtype=np.float64)
        qh = q_row[h * g : (h + 1) * g].astype(np.float64)
        s = (qh @ kh.T) * scale  # [g, T], log2 units
        m = s.max(axis=1, keepdims=True)
        p = np.exp2(s - m)
        denom = p.sum(axis=1)
        out[h * g : (h + 1) * g] = (p @ vh) / denom[:, None]
        lse[h * g : (h + 1) * g] = m[:, 0] + np.log2(denom)
    return out, lse


def test_long_reference_matches_reference_attend():
    """CPU: the fast float64 reference agrees with cupaged.reference.attend."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((8, 64)).astype(np.float16)
    k = rng.standard_normal((333, 2, 64)).astype(np.float16)
    v = rng.standard_normal((333, 2, 64)).astype(np.float16)
    out, lse = long_reference(q, k, v, 0.3)
    ref_out, ref_lse = reference.attend(q, k, v, 0.3)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def long_context():
    """One request of 2**18 tokens on 16384 shuffled pages of 16 (from a pool
    with 25% slack, NaN in the unused pages), float16, 8 query heads on one KV
    head, head_dim 128 (64 MiB each for K and V). References for a random q
    and for q = 0."""
    P, hkv, hq, d = 16, 1, 8, 128
    rng = np.random.default_rng(4)
    pages = LONG_TOKENS // P
    num_pages = pages + pages // 4
    ids = rng.permutation(num_pages)[:pages].astype(np.int32)
    table = cupaged.PageTable.from_seq_lens([LONG_TOKENS], P, page_ids=ids)
    shape = (num_pages, P, hkv, d)
    k = rng.standard_normal(shape, dtype=np.float32).astype(F16)
    v = rng.standard_normal(shape, dtype=np.float32).astype(F16)
    unused = np.setdiff1d(np.arange(num_pages), ids)
    k[unused] = np.nan
    v[unused] = np.nan
    k_vis = k[table.indices].reshape(-1, hkv, d)
    v_vis = v[table.indices].reshape(-1, hkv, d)
    assert k_vis.shape[0] == LONG_TOKENS and np.isfinite(k_vis).all()
    q = rng.standard_normal((1, hq, d), dtype=np.float32).astype(F16)
    sm_scale = 1.0 / math.sqrt(d)
    refs = {"random_q": (q, *long_reference(q[0], k_vis, v_vis, sm_scale)),
            "q_zero": (np.zeros_like(q), *long_reference(np.zeros_like(q[0]), k_vis, v_vis, sm_scale))}
    return table, k, v, refs


LONG_PATHS = [p for p in paths(F16, split_pages=64) if p[3] != 64] + [
    ("v2-split64-mma", "v2", "mma", 64), ("v2-default-simt", "v2", "simt", "auto")]


@pytest.mark.gpu
@pytest.mark.parametrize("path", LONG_PATHS, ids=[p[0] for p in LONG_PATHS])
def test_very_long_context(long_context, path, monkeypatch):
    """2**18 tokens at batch 1: the single-chunk plan is one CTA per KV head
    walking all 16384 pages (64 windows of page ids); the split plans merge
    256 (64 pages per chunk) or the default number of partials."""
    cp = _cp()
    table, k, v, refs = long_context
    dk, dv = cp.asarray(k), cp.asarray(v)
    # q = 0 only where the launch is short: a single-chunk or v1 launch streams
    # all 128 MiB of K and V through one CTA per (KV head or query head)
    names = ["random_q"] + (["q_zero"] if path[3] not in ("single", None) else [])
    for name in names:
        q, ref_out, ref_lse = refs[name]
        out, lse = run(path, cp.asarray(q), dk, dv, table, monkeypatch)
        check(out, lse, ref_out[None], ref_lse[None], F16, f"{path[0]} {name}")
        if name == "q_zero":  # every score 0: LSE = log2(2**18) = 18
            np.testing.assert_allclose(lse, 18.0, rtol=0, atol=LSE_ATOL)


# ---------------------------------------------------------------------- determinism
DET_LENS = [3000, 17, 1021, 0, 500, 1]
REPEATS = 5


def _bits(a) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, path", path_params(DTYPES))
def test_repeated_runs_are_bitwise_identical(dtype, path, monkeypatch):
    """Same inputs, same plan, five launches: identical bits (output and LSE),
    the fused merge's atomic ticket included."""
    cp = _cp()
    rng = np.random.default_rng(5)
    table, num_pages = make_table(rng, DET_LENS, 16, [0, 3, 0, 0, 9, 0])
    T = int(table.seq_lens.sum())
    k, v = _fill_visible(table, num_pages, 2, 128, dtype, rng.standard_normal((T, 2, 128)),
                         rng.standard_normal((T, 2, 128)))
    q = cp.asarray(rng.standard_normal((len(DET_LENS), 8, 128)).astype(dtype))
    dk, dv = cp.asarray(k), cp.asarray(v)
    plan = None
    if path[1] == "v2":
        monkeypatch.setenv("CUPAGED_CORE", path[2])
        plan = make_plan(table, 8, 2, 128, dtype, path[3])
    first = None
    for _ in range(REPEATS):
        out, lse = run(path, q, dk, dv, table, monkeypatch, plan=plan)
        if first is None:
            first = (_bits(out), _bits(lse))
        else:
            assert (_bits(out), _bits(lse)) == first, f"{path[0]}: a repeated run differs"


@pytest.mark.gpu
def test_merge_states_is_bitwise_repeatable():
    cp = _cp()
    rng = np.random.default_rng(6)
    v = cp.asarray(rng.standard_normal((40, 8, 128)).astype(np.float32))
    lse = cp.asarray((rng.standard_normal((40, 8)) * 8).astype(np.float32))
    lse[7] = -np.inf
    o_indptr = np.array([0, 1, 9, 9, 30, 40], np.int32)
    first = None
    for _ in range(REPEATS):
        v_out, lse_out = cupaged.merge_states(v, lse, o_indptr)
        got = (_bits(v_out.get()), _bits(lse_out.get()))
        first = first or got
        assert got == first


@pytest.mark.gpu
def test_cuda_graph_replays_are_bitwise_identical_to_eager():
    cp = _cp()
    rng = np.random.default_rng(7)
    table, num_pages = make_table(rng, DET_LENS, 16)
    T = int(table.seq_lens.sum())
    k, v = _fill_visible(table, num_pages, 2, 128, F16, rng.standard_normal((T, 2, 128)),
                         rng.standard_normal((T, 2, 128)))
    q = cp.asarray(rng.standard_normal((len(DET_LENS), 8, 128)).astype(F16))
    dk, dv = cp.asarray(k), cp.asarray(v)
    plan = cupaged.plan_decode(table, 8, 2, 128, F16, pages_per_chunk=4)
    assert plan.needs_merge
    out = cp.empty_like(q)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        eager = cupaged.decode(q, dk, dv, table, plan)  # also warms up: compile, upload, plan state
        stream.synchronize()
        want = _bits(eager.get())
        stream.begin_capture()  # (no return_lse: nothing is allocated while capturing)
        cupaged.decode(q, dk, dv, table, plan, out=out)
        graph = stream.end_capture()
        for _ in range(REPEATS):
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            assert _bits(out.get()) == want
