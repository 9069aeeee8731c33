"""Adversarial paged batches for the GPU tests (host side is NumPy only).

Physical pages are a shuffled draw from a pool with 2x slack, and every cache
entry that no request can see (slack pages, slots before first_page_offset,
slots after last_page_len) holds NaN: a kernel that reads one fails loudly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from cupaged import PageTable

ROOT = Path(__file__).resolve().parents[1]


def run_python(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python *argv`` in the repository root with it on PYTHONPATH (the
    scripts' command-line tests), output captured as text."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ragged lengths around a page of 16: 1, page-1, page, page+1, primes
RAGGED_LENS = (1, 15, 16, 17, 31, 97, 257, 1021)


def make_table(rng, seq_lens, page_size, first_page_offset=None, slack=2.0):
    """(table, num_pages): shuffled physical pages out of a pool with slack."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    off = np.zeros_like(seq_lens) if first_page_offset is None else np.asarray(first_page_offset, np.int64)
    pages = np.where(seq_lens > 0, -(-(seq_lens + off) // page_size), 0)
    num_pages = max(1, int(pages.sum() * slack) + 1)
    ids = rng.permutation(num_pages).astype(np.int32)
    table = PageTable.from_seq_lens(seq_lens.astype(np.int32), page_size, off.astype(np.int32), page_ids=ids)
    return table, num_pages


def visible_mask(table: PageTable, num_pages: int) -> np.ndarray:
    """[num_pages, page_size] bool: True where some request can see the slot."""
    mask = np.zeros((num_pages, table.page_size), dtype=bool)
    P = table.page_size
    for i in range(table.batch_size):
        a, b = table.indptr[i], table.indptr[i + 1]
        for k, page in enumerate(table.indices[a:b]):
            lo = table.first_page_offset[i] if k == 0 else 0
            hi = table.last_page_len[i] if k == b - a - 1 else P
            mask[page, lo:hi] = True
    return mask


def make_caches(rng, table, num_pages, num_kv_heads, head_dim, dtype):
    """Host K and V [num_pages, P, Hkv, D] in ``dtype``, NaN where invisible."""
    shape = (num_pages, table.page_size, num_kv_heads, head_dim)
    mask = visible_mask(table, num_pages)[:, :, None, None]
    k = np.where(mask, rng.standard_normal(shape, dtype=np.float32), np.nan).astype(dtype)
    v = np.where(mask, rng.standard_normal(shape, dtype=np.float32), np.nan).astype(dtype)
    return k, v


def make_query(rng, batch, num_qo_heads, head_dim, dtype):
    return rng.standard_normal((batch, num_qo_heads, head_dim), dtype=np.float32).astype(dtype)


def rel_errors(out, ref):
    """(max_rel, rel_rms) of ``out`` against the float64 ``ref``."""
    out = np.asarray(out, dtype=np.float64)
    diff = out - ref
    scale = max(np.abs(ref).max(initial=0.0), 1e-30)
    return float(np.abs(diff).max(initial=0.0) / scale), float(
        np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30))


def tolerance(dtype) -> float:
    return 1e-5 if np.dtype(dtype) == np.float32 else 2e-2


def check_close(out, lse, ref_out, ref_lse, dtype):
    """Asserts out/lse match the float64 reference within q's dtype tolerance
    (LSE: the same -inf pattern, 1e-3 or 1e-5 elsewhere); returns (max_rel, rel_rms)."""
    max_rel, rel_rms = rel_errors(out, ref_out)
    tol = tolerance(dtype)
    assert max_rel <= tol and rel_rms <= tol, (max_rel, rel_rms)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse)), "LSE -inf pattern differs"
    lse_tol = 1e-3 if tol > 1e-5 else 1e-5
    assert np.allclose(lse[finite], ref_lse[finite], rtol=lse_tol, atol=lse_tol)
    return max_rel, rel_rms


# ------------------------------------------------------- serving features (issue 6)

#: Per-head magnitudes of the real K/V values of a per-head-scaled fp8 cache
#: (cycled over the KV heads): a kernel that used one head's scale for another
#: is off by up to 8x.
HEAD_MAGNITUDES = (0.5, 1.0, 2.0, 4.0)
#: e4m3fn NaN bits: the sentinel in every slot no request can see.
E4M3_NAN = 0x7F


def to_hnd(cache):
    """An NHD cache [num_pages, P, Hkv, D] as a contiguous HND copy [num_pages, Hkv, P, D]."""
    return np.ascontiguousarray(np.asarray(cache).transpose(0, 2, 1, 3))


def make_fp8_caches(rng, table, num_pages, num_kv_heads, head_dim, scale_mode="none"):
    """Host fp8 K and V: uint8 e4m3 bits [num_pages, P, Hkv, D] (NHD) of random
    real values, :data:`E4M3_NAN` where no request can see, and their scales.

    ``scale_mode``: ``"none"`` (real values N(0, 1), scales None),
    ``"tensor"`` (3 * N(0, 1); scale = max|real| / 448, a float) or
    ``"head"`` (N(0, 1) * HEAD_MAGNITUDES[h % 4]; float32 ``[Hkv]`` scales
    = per-head max|real| / 448), the max over the visible slots. Returns ``(k_bits, v_bits, k_scale,
    v_scale)``; the real K is ``from_e4m3(k_bits) * k_scale``.
    """
    from cupaged import fp8

    shape = (num_pages, table.page_size, num_kv_heads, head_dim)
    mask = visible_mask(table, num_pages)[:, :, None, None]
    out = []
    for _ in range(2):
        real = np.where(mask, rng.standard_normal(shape, dtype=np.float32), np.float32(0))  # scales: visible max
        if scale_mode == "head":
            real *= np.resize(np.array(HEAD_MAGNITUDES, np.float32), num_kv_heads)[None, None, :, None]
            scale = (np.abs(real).max(axis=(0, 1, 3)) / fp8.E4M3_MAX).astype(np.float32)
            bits = fp8.to_e4m3(real, scale, head_axis=2)
        elif scale_mode == "tensor":
            real *= 3
            scale = float(np.abs(real).max()) / fp8.E4M3_MAX
            bits = fp8.to_e4m3(real, scale)
        elif scale_mode == "none":
            scale, bits = None, fp8.to_e4m3(real)
        else:
            raise ValueError(f"scale_mode must be none, tensor or head, got {scale_mode!r}")
        out.append((np.where(mask, bits, np.uint8(E4M3_NAN)).astype(np.uint8), scale))
    (k, ks), (v, vs) = out
    return k, v, ks, vs
