"""The gather baseline ("strategy A") and universal fallback, CuPy only.

Gathers each request's visible tokens into a padded contiguous
``[batch, max_len, num_kv_heads, head_dim]`` K and V, then runs dense attention
with batched cuBLAS matmuls (scores and softmax in float32). It serves any
head_dim and any strides, which is why it is the fallback for shapes the CUDA
kernels decline.
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from . import _configs
from .page_table import PageTable

LOG2E = 1.0 / math.log(2.0)

# table -> {device id: (page, slot, valid)}: one copy per device (issue 17: a
# table used on two GPUs must not hand GPU 0's arrays to GPU 1)
_index_cache: "weakref.WeakKeyDictionary[PageTable, dict]" = weakref.WeakKeyDictionary()


def token_index(table: PageTable):
    """``(page [B, L], slot [B, L], valid [B, L])`` device arrays locating each
    request's visible tokens (L = longest request; padding points at physical
    page 0, slot 0, and is masked and zeroed before use). Computed once per
    table and device, on the current device."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    per_device = _index_cache.setdefault(table, {})
    cached = per_device.get(device)
    if cached is not None:
        return cached

    seq_lens = table.seq_lens
    batch = table.batch_size
    max_len = int(seq_lens.max(initial=0))
    pos = np.arange(max_len, dtype=np.int64)[None, :] + table.first_page_offset[:, None].astype(np.int64)
    valid = np.arange(max_len)[None, :] < seq_lens[:, None]
    page_in_req = pos // table.page_size
    flat = table.indptr[:-1, None].astype(np.int64) + page_in_req
    flat = np.where(valid, flat, 0)
    page = table.indices[np.minimum(flat, max(len(table.indices) - 1, 0))] if len(table.indices) else np.zeros_like(flat)
    page = np.where(valid, page, 0)
    slot = np.where(valid, pos % table.page_size, 0)
    cached = (cupy.asarray(page.reshape(batch, max_len)), cupy.asarray(slot.reshape(batch, max_len)),
              cupy.asarray(valid.reshape(batch, max_len)))
    return per_device.setdefault(device, cached)  # a racing thread's copy wins or loses whole


_E4M3_LUT = {}  # device id -> float32 [256]: the value of every e4m3 bit pattern


def _e4m3_values(device_id: int):
    lut = _E4M3_LUT.get(device_id)
    if lut is None:
        import cupy
        import ml_dtypes

        lut = _E4M3_LUT[device_id] = cupy.asarray(
            np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    return lut


def gather_decode(q, k_cache, v_cache, table: PageTable, scale_log2: float, out, lse=None, *,
                  soft_cap: float = 0.0, v_scale: float = 1.0, k_head_scale=None, v_head_scale=None,
                  sinks=None) -> None:
    """Writes the decode of ``q`` into ``out`` (and the log2 LSE into ``lse``).

    Score arguments as the kernels' (cupaged._checks.ScoreArgs): base-2 logits
    ``s = (q.k) * scale_log2 * k_head_scale[h]``, then ``soft_cap * tanh(s)``
    when ``soft_cap > 0``; output times ``v_scale * v_head_scale[h]``. Caches
    NHD views (HND is passed transposed); uint8 caches are fp8 e4m3 bits.
    ``sinks`` (float32 ``[Hq]``, natural log, or None): one more softmax
    denominator term ``exp(sinks[h])`` per head. Shapes as :func:`cupaged.decode`.
    """
    import cupy

    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_qo_heads // num_kv_heads
    page, slot, valid = token_index(table)
    max_len = page.shape[1]
    if batch == 0:
        return
    sink2 = None if sinks is None else sinks.astype(cupy.float32) * np.float32(LOG2E)  # base 2
    if max_len == 0:
        out[...] = 0
        if lse is not None:
            lse[...] = -np.inf if sink2 is None else sink2[None, :]
        return
    # bfloat16 matmuls are not universally available in cuBLAS through CuPy:
    # compute in float32 for it, natively for float16/float32.
    compute = cupy.float32 if q.dtype not in (np.float16, np.float32) else q.dtype
    # Padding slots point at an arbitrary cache entry: zero them, since a
    # masked score still multiplies that entry's V (0 * NaN = NaN).
    pad = ~valid[:, :, None, None]
    k, v = k_cache[page, slot], v_cache[page, slot]  # [B, L, Hkv, D]
    if _configs.stored_format(k.dtype) is not None:  # fp8 e4m3 bits: exact float32 values, matmuls in float32
        lut = _e4m3_values(q.data.device_id)
        k, v, compute = lut[k], lut[v], cupy.float32
    k = cupy.where(pad, 0, k).astype(compute, copy=False)
    v = cupy.where(pad, 0, v).astype(compute, copy=False)
    qg = q.astype(compute, copy=False).reshape(batch, num_kv_heads, group, head_dim)
    scores = cupy.matmul(qg, k.transpose(0, 2, 3, 1)).astype(cupy.float32)  # [B, Hkv, g, L]
    scores *= np.float32(scale_log2)
    if k_head_scale is not None:
        scores *= k_head_scale[None, :, None, None]
    if soft_cap > 0:
        scores = np.float32(soft_cap) * cupy.tanh(scores)
    scores = cupy.where(valid[:, None, None, :], scores, cupy.float32(-np.inf))
    m = scores.max(axis=-1, keepdims=True)
    m_safe = cupy.where(cupy.isfinite(m), m, cupy.float32(0))
    p = cupy.exp2(scores - m_safe)
    denom = p.sum(axis=-1, keepdims=True)
    o = cupy.matmul(p.astype(compute), v.transpose(0, 2, 1, 3))  # [B, Hkv, g, D]
    o = o.astype(cupy.float32) / cupy.where(denom > 0, denom, cupy.float32(1))
    if v_scale != 1.0:
        o *= np.float32(v_scale)
    if v_head_scale is not None:
        o *= v_head_scale[None, :, None, None]
    lse_v = None
    if lse is not None or sink2 is not None:
        lse_v = cupy.where(denom > 0, m_safe + cupy.log2(cupy.where(denom > 0, denom, 1)), -np.inf)
    if sink2 is not None:  # as the kernels' EmitStrided::finish
        total = cupy.logaddexp2(lse_v, sink2.reshape(1, num_kv_heads, group, 1))
        o *= cupy.exp2(lse_v - total)
        lse_v = total
    out[...] = o.reshape(batch, num_qo_heads, head_dim).astype(out.dtype)
    if lse is not None:
        lse[...] = lse_v.reshape(batch, num_qo_heads)
