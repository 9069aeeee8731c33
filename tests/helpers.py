"""Adversarial paged batches for the GPU tests (host side is NumPy only).

Physical pages are a shuffled draw from a pool with 2x slack, and every cache
entry that no request can see (slack pages, slots before first_page_offset,
slots after last_page_len) holds NaN: a kernel that reads one fails loudly.
"""

from __future__ import annotations

import numpy as np

from cupaged import PageTable

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
