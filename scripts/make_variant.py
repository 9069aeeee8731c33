#!/usr/bin/env python3
"""Writes a copy of cuda_src/ with one named experimental change, for A/B runs
of kernel variants on the GPU (``AB_TREES="cuda_src OUT" scripts/gpu_run.sh
RESULTS variants ncu_sectors``).

The variants are issue-20 experiments on the tensor-core core's K/V copy
(``mma_token_loop`` in attend_mma.cuh), kept here so that an experiment can
be rerun without hand-editing a tree:

* ``predicated``: a copy of a valid row has no source-size operand (the
  zero-fill form only for rows past the range), as FlashInfer's K/V copy;
* ``padded``: the ring's layout before 2026-12-01 (rows padded by 16 bytes,
  the dynamic shared memory 16-byte aligned): 1.5x the K/V sectors through
  the L2 and ~7 % slower on large fp16 cells than today's permuted, aligned rows;
* ``no_l2_hint``, ``no_evict_first``: without the L2::128B prefetch hint or
  the evict_first policy on 16-bit rows;
* ``no_prefetch``: without the partial kernel's L2 prefetch of the first
  tile's K/V rows and the q rows before ``griddepcontrol.wait``
  (``prefetch_first_tile``; adopted 2026-12-02 from the experiments
  ``pdl_prefetch`` and ``prefetch_q``, whose A/B is in
  docs/benchmarks/h200-prefetch-ab-2026-12-02.md).

* ``prefetch_256`` (issue 20, twenty-third session): ``prefetch_first_tile``
  warms up to 256 slots of the chunk instead of 64, so a small cell's whole
  chunk (128-256 tokens) is in the L2 when ``griddepcontrol.wait`` returns
  (1-10 % slower on the H200, docs/benchmarks/h200-merge-probes-2026-12-03.md);
* ``no_merge`` (a probe, wrong results): a split chunk returns after writing
  its partials (no fence, ticket or merge): the fused merge's cost ceiling.
* ``fenced_ticket``: the fused merge's ticket as before 2026-12-03 (a fence in
  every thread, a relaxed atomic, an acquire fence), for A/B against today's
  single ``atom.add.acq_rel.gpu`` of thread 0 (0.94-1.00x the time on the
  issue-5 small cells; thread 0 alone fencing, ``fence_once`` then, 0.99x).

* ``fp8_bitmove``, ``fp8_noconv``: the fp8 tensor-core core widening e4m3 by
  bit moves instead of ``cvt`` (1-3 % slower on the H200), and the same with no
  widening at all (wrong values: the conversions' cost ceiling, 1-2 % faster
  than ``cvt``); docs/benchmarks/fp8-core-experiments-h200-2026-12-02.log.

* ``last_mask`` (issue 18, prepared 2026-12-02, not yet timed): RowsTile (16-bit
  KV up to head_dim 128) masks a tile's scores only when the tile crosses a
  row's end (a warp vote), not on every tile, as the issue's "causal mask on
  the last tile(s) only"; the plain kernel and the row groups alike.

* ``fold_scale`` (issue 18, prepared 2026-12-02, not yet timed): RowsTile
  without a soft cap keeps its scores unscaled, scales the row max after the
  reduction and computes exp2(s * scale - max) as one FMA (8 multiplies a
  tile fewer at 16 rows).

* ``merge_items4`` (issue 18, prepared in the twenty-sixth session, timed in
  the twenty-seventh and not kept: -4 to -6 % at 4-8 x 1024 q_len 4, +10 % at
  1 x 1024 q_len 2, whose 8 chunks then take two batches;
  ``docs/benchmarks/merge-items4-ab-h200-2026-12-03.log``): a row group's
  last CTA merges four items a thread at a time in batches of 4 partials
  (the same 16 loads in flight as two items in batches of 8), so a q_len 4
  group at 4 heads per CTA and at most 4 chunks a row waits on one L2 round
  trip instead of two. Limited to 16-bit tensor-core rows at head_dim 128:
  applied to every rows instance it took fp8 at 128 from 168 to 170-174
  registers and 16-bit head_dim 64 at 3, 5-7 heads from 168 to 174, past the
  168 of 3 CTAs per SM (NVRTC sm_90); 16-bit head_dim 128 stays at 244-246 (2
  CTAs per SM either way).

* ``pair_step2`` (issue 18, prepared in the twenty-seventh session; timed in
  the twenty-eighth, not kept): warp pairs (q_len 8 row groups) step two
  16-token tiles at a time with one online-softmax update over their 32
  tokens: S of four n-tiles (four MMA chains), one max, vote and rescale, then
  P.V of both tiles (``RowsTile::step2``); the pairs' ring hands over two
  stages a step and refills the two read one step ago
  (``cp_async_ring_pairs2``; 4 stages at the default 72 KB, 6 with
  ``CUPAGED_MMA_SMEM_KB=104``). NVRTC sm_90, head_dim 128: 254-255 registers,
  no spills. H200 against f151d8f (``docs/benchmarks/pair-step2-ab-h200-2026-12-03.log``):
  q_len 8 1-4 % slower at 72 KB, 1-11 % at 104 KB; q_len 4 within 1.3 %. Its
  16-bit checks passed; its fp8 instances did not compile then (``consume2``
  was built for ColsTile too, which has no ``step2``; now defined inside the
  ``if constexpr`` branch). Over the trimmed copy of 5a61cb3 (which left the
  softmax a larger share of the step) it spills 8-12 bytes at 16-bit
  head_dim 128 (NVRTC sm_90): a rerun needs registers freed first (Q in
  shared memory).
* ``copy_u32`` (issue 18/20, prepared in the twenty-eighth session; timed in
  the twenty-ninth, not kept: every cell within 1.3 % of 8e7edc3,
  docs/benchmarks/copy-u32-ab-h200-2026-12-03.log): the 16-bit whole-tile
  copy of 5a61cb3 trimmed further: a page-16 table advances the next
  tile's page by a constant (no slot loop), and the page's K/V byte offsets
  are 32 x 32 -> 64-bit products (a page's stride
  below 4 GB, which a host check would have to guarantee if it lands)
  instead of 64 x 64. Why: after 5a61cb3 the copy is still ~100 of a warp
  tile's ~290 instructions (SASS), and instruction count is what held q_len 8
  behind FlashInfer (``docs/benchmarks/ncu-q8-64x8192-h200-2026-12-03.md``).
  NVRTC sm_90: registers as 5a61cb3's (rows 248-255, plain 194-197 at
  head_dim 128), no spills; a warp pair's copy of a page-16 tile ~83
  instructions on its executed path (was ~100); timed on the q_len 8 cells
  and the small one-token cells, above.

* ``vector_emit`` (issue 18, prepared in the thirty-second session, not yet
  timed): an emitted item (4 dims of one row: a partial's float32, a final
  output's 16-bit or float32) is one 16- or 8-byte store where its address
  is aligned (partials always are), not four scalar stores. Why: the end of
  a row-group CTA grows with its rows (1 x 8192 q_len 4 ran ~2 us longer than
  q_len 2 on the same plan); its partial writes are 4x the store requests
  the acq_rel ticket then waits on. NVRTC sm_90: rows8 fp16, rows bf16 and
  partial float32 at head_dim 128 compile without spills (other modules untried).

* ``eager_rescale`` (issues 18 and 20, thirty-fourth session): the inverse
  of the landed lazy rescale. The tensor-core rows tile moves a row's running
  max on every tile whose max passes it (the kernels before the thirty-fourth
  session), so the O rescale runs on nearly every tile of a multi-token cell.
  Timed as ``lazy_rescale`` against it (H200, 2 rounds,
  docs/benchmarks/lazy-rescale-ab-h200-2026-12-04.log): lazy 0.4-1.2 %
  faster on multi-token cells, one-token within 0.3 %.

* ``lazy_rescale_cols`` (issue 20, thirty-fourth session, prepared, not yet
  timed): the landed lazy rescale in ColsTile (fp8 KV) as well: a column's
  running max moves only when a tile's max passes it by more than 8 (log2
  units), so P <= 2^8 (f16 A fragments) and the O rescale runs only then.
  NVRTC sm_90: the fp8 partial instances at head_dim 128 keep their 152-156
  registers, no spills.

* ``early_ticket`` (issue 20, thirty-fifth session; timed, not kept): a split
  CTA arrives with an acquire atomic that does not wait for its own partials,
  and only a CTA that is not last then releases them (``red.release`` of
  1 << 16 on the same counter); the last to arrive waits for the others'
  marks. Meant to take the last CTA's path from three L2 round trips to two;
  on the H200 it was 1-10 % slower on every split small cell (1 x 1024 5.38 ->
  5.93 us; docs/benchmarks/waves-h200-2026-12-04.md).

* ``cta_stamps`` (issue 20, thirty-fifth session; a probe with right output):
  per-CTA ``%globaltimer`` stamps of the one-token kernel (entry, after
  ``griddepcontrol.wait``, attention done, exit) and SM ids in a
  ``__device__`` array that ``scripts/cta_timeline.py`` reads back: how a
  grid's CTAs end (a one-wave grid's equal CTAs end 15-20 % apart) and where
  a small call's time goes.

* The thirty-sixth session's probes of the fused merge's tail and the K/V
  stream (issue 20; timed on the H200, none kept;
  docs/benchmarks/merge-tail-probes-h200-2026-12-04.md):

  - ``ticket_only`` (a probe, the output is not written): the last CTA of a
    split request takes the ticket, resets its counter and exits; against
    ``no_merge`` it prices the ticket (0.7-0.8 us), against today the merge
    body (0.9-1.05 us a batch of 8 chunks);
  - ``merge_batch16``, ``merge_batch4``: the merge loads 16 or 4 partials a
    step for one item a thread (8 today): 16 costs 0.35-0.4 us at 8 chunks
    and does not halve 16 chunks' two steps; 4 is 2 % faster at 4 chunks a
    request, 2-4 % slower at 8-16;
  - ``warm_merge``: every split CTA runs ``merge_partials`` once on its own
    partial rows before ``griddepcontrol.wait`` (their values discarded), so
    the last CTA finds the merge's code in the instruction cache: 1-7 %
    slower (the SIMT 4-head instance spills with it);
  - ``page_window_1024``: 1024 page ids a window instead of 256 (fewer ring
    drains): within 0.5 % (the host's mirror, ``_configs.PAGE_WINDOW_BYTES``,
    stays 1 KB: fine where the ring leaves 4 KB of the 72 KB, as at 16-bit
    head_dim 128);
  - ``l2_ahead2``, ``l2_ahead4``: each warp of the one-token 16-bit core also
    prefetches (``cp.async.bulk.prefetch.L2``, a 256-byte row a lane) its tile
    2 or 4 CTA steps ahead: 13-25 % slower on every large cell.

  The release-free merge of the same session (the workspace marked, the
  partials waited on) touches the host too: it is
  docs/benchmarks/empty-partials-experiment-2026-12-04.patch.

Lost experiments whose edits no longer apply were removed after their runs
were recorded (``docs/benchmarks/kernel-variants-h200-2026-12-01.log``): the
lane map ``fi_lanes``, the unpadded ``nopad`` and ``permuted`` layouts, and
one ``cp.async.bulk`` per row (``bulk_rows``); their edits are in this
script at commit 4bed7ee.

Variants combine with ``+`` (``predicated+padded``). Each edit is an exact
text replacement; a variant whose text no longer matches the sources stops
with an error naming it (update the edit with the source).

Exit status: 0 written, 2 bad arguments or an edit that no longer applies.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "cuda_src"

_PREDICATED_OLD = "  const int n = valid ? 16 : 0;\n"
_PREDICATED_NEW = """  const int n = valid ? 16 : 0;
  if (valid) {  // variant predicated: no source-size operand
    if constexpr (L2_128B && POLICY)
      asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2;\\n" ::"r"(dst), "l"(gmem),
                   "l"(policy));
    else if constexpr (POLICY)
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\\n" ::"r"(dst), "l"(gmem),
                   "l"(policy));
    else if constexpr (L2_128B)
      asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\\n" ::"r"(dst), "l"(gmem));
    else
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(dst), "l"(gmem));
    return;
  }
"""

# padded: the K/V ring's layout before 2026-12-01 (rows padded by 16 bytes, the
# dynamic shared memory at its default 16-byte alignment, 16 mod 32 here)
_PADDED = [
    ("attend_mma.cuh", "  static constexpr bool SWIZZLE = DATA_BYTES % 128 == 0;\n",
     "  static constexpr bool SWIZZLE = false;  // variant padded\n"),
    ("attend_mma.cuh", "  union __align__(128) {", "  union __align__(16) {  // variant padded"),
    ("paged_decode_partial.cu", "    extern __shared__ __align__(128) uint4 dynamic_smem[];",
     "    extern __shared__ uint4 dynamic_smem[];  // variant padded"),
]


_PREFETCH_CALL = ("  prefetch_first_tile<T, KV, HEAD_DIM, HEADS>(p, indices, slot_begin, slot_end, page_size, kv_head, "
                  "req, head0);\n")


# fp8_bitmove (eighteenth session, 2026-12-02; not kept: 1-3 % slower on the H200,
# docs/benchmarks/fp8-core-experiments-h200-2026-12-02.log): e4m3 widened to f16 by bit
# moves (FlashInfer's fast_dequant_f8f16x4 idea): the 7 exponent-and-mantissa bits one
# place right of f16's make value * 2^-8 exactly; scores and output scaled back by 2^8; Q
# fragments in the even/odd dim order the moves produce; fp8 instances (head_dim <= 128)
# bounded to 3 CTAs per SM (unbounded: 194 registers, 2 per SM).
_FP8_DEINTERLEAVE = "__device__ __forceinline__ unsigned byte_deinterleave(unsigned x) {\n"
_FP8_EVEN = "__device__ __forceinline__ unsigned fp8_even(unsigned x) { return fp8_odd(x << 8); }\n"
_FP8_LOADS = "// Loads query row g's A fragments (KSTEPS k-steps of 16 dims)."
_FP8_BITMOVE = [
    ("attend_mma.cuh", _FP8_DEINTERLEAVE,
     "constexpr float FP8_UNSCALE = 256.f;  // variant fp8_bitmove\n"
     "__device__ __forceinline__ unsigned fp8_odd(unsigned x) {\n"
     "  return (x & 0x80008000u) | ((x & 0x7f007f00u) >> 1);\n}\n" + _FP8_EVEN + _FP8_DEINTERLEAVE),
    ("attend_mma.cuh",
     "      if (row_valid) {\n"
     "        const unsigned* qr = reinterpret_cast<const unsigned*>(q + k * 16 + (FP8 ? 4 : 2) * t);\n"
     "        qa[k][0] = __ldg(qr);\n"
     "        qa[k][1] = __ldg(qr + (FP8 ? 1 : 4));\n",
     "      if (row_valid && FP8) {  // variant fp8_bitmove\n"
     "        const uint2 u = __ldg(reinterpret_cast<const uint2*>(q + k * 16 + 4 * t));\n"
     "        asm(\"prmt.b32 %0, %1, %2, 0x5410;\" : \"=r\"(qa[k][0]) : \"r\"(u.x), \"r\"(u.y));\n"
     "        asm(\"prmt.b32 %0, %1, %2, 0x7632;\" : \"=r\"(qa[k][1]) : \"r\"(u.x), \"r\"(u.y));\n"
     "      } else if (row_valid) {\n"
     "        const unsigned* qr = reinterpret_cast<const unsigned*>(q + k * 16 + 2 * t);\n"
     "        qa[k][0] = __ldg(qr);\n"
     "        qa[k][1] = __ldg(qr + 4);\n"),
    ("attend_mma.cuh",
     "      qa[k][0] = float2_to_f16x2(f[k][0] * mult, f[k][1] * mult);\n"
     "      qa[k][1] = float2_to_f16x2(f[k][2] * mult, f[k][3] * mult);\n",
     "      qa[k][0] = float2_to_f16x2(f[k][0] * mult, f[k][2] * mult);  // variant fp8_bitmove\n"
     "      qa[k][1] = float2_to_f16x2(f[k][1] * mult, f[k][3] * mult);\n"),
    ("attend_mma.cuh", "      score_scale = sc.scale * load_q_fragments<T, FP8, KSTEPS>(qg, g < rows, t, qb);\n",
     "      score_scale = sc.scale * FP8_UNSCALE * load_q_fragments<T, FP8, KSTEPS>(qg, g < rows, t, qb);\n"),
    ("attend_mma.cuh",
     "        M::mma(sa, fp8_lo(a[0]), fp8_lo(a[1]), fp8_hi(a[0]), fp8_hi(a[1]), qb[2 * kb][0], qb[2 * kb][1]);\n"
     "        M::mma(sb, fp8_lo(a[2]), fp8_lo(a[3]), fp8_hi(a[2]), fp8_hi(a[3]), qb[2 * kb + 1][0], qb[2 * kb + 1][1]);\n",
     "        M::mma(sa, fp8_even(a[0]), fp8_even(a[1]), fp8_odd(a[0]), fp8_odd(a[1]), qb[2 * kb][0], qb[2 * kb][1]);\n"
     "        M::mma(sb, fp8_even(a[2]), fp8_even(a[3]), fp8_odd(a[2]), fp8_odd(a[3]), qb[2 * kb + 1][0],\n"
     "               qb[2 * kb + 1][1]);\n"),
    ("attend_mma.cuh",
     "          const unsigned x = byte_deinterleave(v[2 * h]), y = byte_deinterleave(v[2 * h + 1]);\n"
     "          M::mma(o[2 * db + h], fp8_lo(x), fp8_hi(x), fp8_lo(y), fp8_hi(y), pb0, pb1);\n",
     "          const unsigned x = v[2 * h], y = v[2 * h + 1];  // variant fp8_bitmove\n"
     "          M::mma(o[2 * db + h], fp8_even(x), fp8_odd(x), fp8_even(y), fp8_odd(y), pb0, pb1);\n"),
    ("attend_mma.cuh",
     "        if (h0 < rows)\n"
     "          *reinterpret_cast<float2*>(&st.acc[warp][roff + h0][dim_of(i, 0)]) = make_float2(o[i][0], o[i][2]);\n"
     "        if (h1 < rows)\n"
     "          *reinterpret_cast<float2*>(&st.acc[warp][roff + h1][dim_of(i, 0)]) = make_float2(o[i][1], o[i][3]);\n",
     "        const float u = FP8_UNSCALE;  // variant fp8_bitmove\n"
     "        if (h0 < rows)\n"
     "          *reinterpret_cast<float2*>(&st.acc[warp][roff + h0][dim_of(i, 0)]) = {o[i][0] * u, o[i][2] * u};\n"
     "        if (h1 < rows)\n"
     "          *reinterpret_cast<float2*>(&st.acc[warp][roff + h1][dim_of(i, 0)]) = {o[i][1] * u, o[i][3] * u};\n"),
    ("paged_decode_partial.cu", "  static constexpr int MIN_BLOCKS = MMA_MIN_BLOCKS;\n",
     "  static constexpr int MIN_BLOCKS = IsSame<KV, e4m3>::value && HEAD_DIM <= 128 ? 3 : MMA_MIN_BLOCKS;  "
     "// variant fp8_bitmove\n"),
]
# fp8_noconv: fp8_bitmove with the widening removed (wrong values: the conversions'
# cost ceiling, 1-2 % faster than cvt on the H200)
_FP8_NOCONV = _FP8_BITMOVE + [
    ("attend_mma.cuh", _FP8_LOADS, "#define fp8_odd(x) (x)  // variant fp8_noconv\n"
                                   "#define fp8_even(x) ((x) << 8)\n" + _FP8_LOADS),
]


# last_mask: RowsTile's per-element end mask only on a tile that crosses an end
_LAST_MASK = [
    ("attend_mma.cuh",
     "    float m_new[HALVES], m_safe[HALVES];\n"
     "    bool grew = false;\n",
     "    float m_new[HALVES], m_safe[HALVES];\n"
     "    bool grew = false;\n"
     "    // variant last_mask: row g's end is its lane's first (row g + 8 ends later)\n"
     "    const bool edge = __any_sync(0xffffffffu, base + MMA_TILE > (GROUPS ? min(s1, lim[0]) : s1));\n"),
    ("attend_mma.cuh",
     "#pragma unroll\n"
     "      for (int n = 0; n < 2; ++n)\n"
     "#pragma unroll\n"
     "        for (int e = 0; e < 2; ++e) {\n"
     "          if (base + n * 8 + 2 * t + e >= end) s[n][2 * h + e] = neg_inf();\n"
     "          mx = fmaxf(mx, s[n][2 * h + e]);\n"
     "        }\n",
     "      if (edge) {  // variant last_mask\n"
     "#pragma unroll\n"
     "        for (int n = 0; n < 2; ++n)\n"
     "#pragma unroll\n"
     "          for (int e = 0; e < 2; ++e)\n"
     "            if (base + n * 8 + 2 * t + e >= end) s[n][2 * h + e] = neg_inf();\n"
     "      }\n"
     "#pragma unroll\n"
     "      for (int n = 0; n < 2; ++n)\n"
     "#pragma unroll\n"
     "        for (int e = 0; e < 2; ++e) mx = fmaxf(mx, s[n][2 * h + e]);\n"),
]


# fold_scale: RowsTile's score scale folded into the max and the exp2 argument
_FOLD_SCALE = [
    ("attend_mma.cuh",
     "#pragma unroll\n"
     "    for (int n = 0; n < 2; ++n)\n"
     "#pragma unroll\n"
     "      for (int e = 0; e < 2 * HALVES; ++e) s[n][e] = (s[n][e] + s_odd[n][e]) * score_scale;\n"
     "    if (sc.soft_cap > 0.f) {  // uniform branch\n"
     "#pragma unroll\n"
     "      for (int n = 0; n < 2; ++n)\n"
     "#pragma unroll\n"
     "        for (int e = 0; e < 2 * HALVES; ++e) s[n][e] = sc.cap(s[n][e]);\n"
     "    }\n",
     "    // variant fold_scale: no soft cap and a positive scale (uniform): scores stay unscaled\n"
     "    const bool fold = sc.soft_cap <= 0.f && score_scale > 0.f;\n"
     "    const float k = fold ? score_scale : 1.f;\n"
     "#pragma unroll\n"
     "    for (int n = 0; n < 2; ++n)\n"
     "#pragma unroll\n"
     "      for (int e = 0; e < 2 * HALVES; ++e) s[n][e] += s_odd[n][e];\n"
     "    if (!fold) {\n"
     "#pragma unroll\n"
     "      for (int n = 0; n < 2; ++n)\n"
     "#pragma unroll\n"
     "        for (int e = 0; e < 2 * HALVES; ++e) s[n][e] *= score_scale;\n"
     "      if (sc.soft_cap > 0.f) {\n"
     "#pragma unroll\n"
     "        for (int n = 0; n < 2; ++n)\n"
     "#pragma unroll\n"
     "          for (int e = 0; e < 2 * HALVES; ++e) s[n][e] = sc.cap(s[n][e]);\n"
     "      }\n"
     "    }\n"),
    ("attend_mma.cuh", "      m_new[h] = mx > m[h] + 8.f ? mx : m[h];\n",
     "      m_new[h] = mx * k > m[h] + 8.f ? mx * k : m[h];  // variant fold_scale (k > 0: the max of the scaled)\n"),
    ("attend_mma.cuh", "fast_exp2(s[n][2 * h + e] - m_safe[h])",
     "fast_exp2(fmaf(s[n][2 * h + e], k, -m_safe[h]))"),
]


# merge_items4 (issue 18, twenty-sixth session; timed, not kept): row groups merge four items a thread at a
# time, 4 partials a batch (16 loads in flight, as two items at 8)
_MERGE_ITEMS4 = [
    ("paged_decode_partial.cu", "MI = GROUPS ? 2 : 1;",
     "MI = GROUPS ? (CORE == Core::MMA && sizeof(KV) == 2 && HEAD_DIM == 128 ? 4 : 2) : 1;  // variant merge_items4"),
    ("merge.cuh", "  constexpr int BATCH = 8;\n",
     "  constexpr int BATCH = ITEMS > 2 ? 4 : 8;  // variant merge_items4\n"),
]

# pair_step2 (issue 18, twenty-seventh session; timed in the twenty-eighth, not kept): warp pairs step two
# 16-token tiles at a time, one online-softmax update over 32 tokens (RowsTile::step2, cp_async_ring_pairs2)
_PAIR_STEP2 = [
    ('common.cuh',
     '''// Programmatic dependent launch (sm_90;''',
     '''// The warp pairs' ring two tiles a step (variant pair_step2): the pair
// consumes tiles it and it + 1 together (one softmax over both); after each
// wait it meets its partner and refills the two stages read one step ago.
// Tiles 0 .. STAGES - 3 go out first; a step waits for its two tiles with
// STAGES - 4 groups left in flight.
template <int STAGES, typename Copy, typename Consume2>
__device__ __forceinline__ void cp_async_ring_pairs2(int n_iter, Copy& copy, Consume2& consume2, int pair_id) {
  static_assert(STAGES >= 4 && STAGES % 2 == 0, "two tiles a step: an even ring of four stages or more");
  auto issue = [&](int it) {
    if (it < n_iter) copy(it % STAGES, it);
    cp_async_commit();
  };
#pragma unroll
  for (int it = 0; it < STAGES - 2; ++it) issue(it);
  for (int it = 0; it < n_iter; it += 2) {
    cp_async_wait<STAGES - 4>();
    named_barrier<64>(pair_id);
    issue(it + STAGES - 2);  // (the stages of tiles it - 2 and it - 1, read one step ago)
    issue(it + STAGES - 1);
    consume2(it % STAGES, (it + 1) % STAGES, it, it + 1 < n_iter);
  }
  cp_async_wait<0>();
}

// Programmatic dependent launch (sm_90;'''),
    ('attend_mma.cuh',
     '''    // (lanes read each other's copies; a pair's two warps each other's, past the pair's barrier)
    if constexpr (PAIRED)
      cp_async_ring<2 * STAGES, false, true>(n_iter, copy, consume, 1 + tix);''',
     '''    // (lanes read each other's copies; a pair's two warps each other's, past the pair's barrier)
    if constexpr (PAIRED && Tile::STEP2) {
      auto consume2 = [&](int st0, int st1, int it, bool two) {  // (only RowsTile has step2)
        auto* a = tile_at(st0);
        auto* b = tile_at(st1);
        tile.step2(a[0], a[1], b[0], b[1], s0 + it * CTA_TILE + tix * MMA_TILE, two, s1);
      };
      cp_async_ring_pairs2<2 * STAGES>(n_iter, copy, consume2, 1 + tix);
    } else if constexpr (PAIRED)
      cp_async_ring<2 * STAGES, false, true>(n_iter, copy, consume, 1 + tix);'''),
    ('attend_mma.cuh',
     '''  static constexpr int HALVES = GROUPS ? 2 : 1;  // MMA rows g (and g + 8) this lane keeps''',
     '''  static constexpr int HALVES = GROUPS ? 2 : 1;  // MMA rows g (and g + 8) this lane keeps
  static constexpr bool STEP2 = GROUPS;  // warp pairs step two tiles at a time (variant pair_step2)'''),
    ('attend_mma.cuh',
     '''  // This warp's states as entry `warp` of st, rows from roff (a pair's second warp: after the first's).''',
     '''  // Two tiles, base and base + ct (ct: the tiles' distance, CTA_TILE), one
  // online-softmax update over their 32 tokens (variant pair_step2): S of
  // four n-tiles (four MMA chains), one max, vote and rescale, then P.V of
  // both. !two: only the first tile (the second's stage holds stale data).
  __device__ __forceinline__ void step2(const Row* kt0, const Row* vt0, const Row* kt1, const Row* vt1, int base,
                                        bool two, int s1) {
    constexpr int CT = 2 * MMA_TILE;  // (PAIRED: CTA_TILE = MMA_WARPS / 2 tiles; 2 with 4 warps)
    static_assert(MMA_WARPS == 4, "pair_step2 assumes two pairs per CTA");
    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      if (n >= 2 && !two) continue;
      const Row* kt = n < 2 ? kt0 : kt1;
      const int nn = n % 2;
#pragma unroll
      for (int k = 0; k < KSTEPS; k += 2) {
        unsigned b[4];
        if (k + 1 < KSTEPS) {
          ldmatrix_x4(b, &kt[nn * 8 + (lane % 8)][L::at(lane, (k * 16 + (lane / 8) * 8) * 2)]);
        } else {
          ldmatrix_x2(b, &kt[nn * 8 + (lane % 8)][L::at(lane, (k * 16 + (lane / 8 % 2) * 8) * 2)]);
        }
        M::mma(s[n], qa[0][k][0], qa[HALVES - 1][k][0], qa[0][k][1], qa[HALVES - 1][k][1], b[0], b[1]);
        if (k + 1 < KSTEPS)
          M::mma(s[n], qa[0][k + 1][0], qa[HALVES - 1][k + 1][0], qa[0][k + 1][1], qa[HALVES - 1][k + 1][1], b[2],
                 b[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 2 * HALVES; ++e) s[n][e] *= score_scale;
    if (sc.soft_cap > 0.f) {  // uniform branch
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 2 * HALVES; ++e) s[n][e] = sc.cap(s[n][e]);
    }
    float m_new[HALVES], m_safe[HALVES];
    bool grew = false;
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      const int end = min(s1, lim[h]);
      float mx = neg_inf();
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int slot = base + (n / 2) * CT + (n % 2) * 8 + 2 * t + e;
          if (slot >= end || (n >= 2 && !two)) s[n][2 * h + e] = neg_inf();
          mx = fmaxf(mx, s[n][2 * h + e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      m_new[h] = fmaxf(m[h], mx);
      m_safe[h] = m_new[h] == neg_inf() ? 0.f : m_new[h];
      grew = grew || m_new[h] > m[h];
    }
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int h = 0; h < HALVES; ++h) {
        const float alpha = fast_exp2(m[h] - m_safe[h]);
        l[h] *= alpha;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          o[n][2 * h] *= alpha;
          o[n][2 * h + 1] *= alpha;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      m[h] = m_new[h];
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[n][2 * h + e] = fast_exp2(s[n][2 * h + e] - m_safe[h]);
          l[h] += s[n][2 * h + e];
        }
    }
    unsigned pa[2][4];  // per tile: P's A fragment (tokens 2t, 2t+1 | 2t+8, 2t+9 of rows g | g + 8)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      pa[j][0] = M::pack(s[2 * j][0], s[2 * j][1]);
      pa[j][1] = M::pack(s[2 * j][2], s[2 * j][3]);
      pa[j][2] = M::pack(s[2 * j + 1][0], s[2 * j + 1][1]);
      pa[j][3] = M::pack(s[2 * j + 1][2], s[2 * j + 1][3]);
    }
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
      unsigned b[4];
      ldmatrix_x4_trans(b, &vt0[((lane / 8) % 2) * 8 + (lane % 8)][L::at(lane, (n * 8 + (lane / 16) * 8) * 2)]);
      M::mma(o[n], pa[0][0], pa[0][1], pa[0][2], pa[0][3], b[0], b[1]);
      M::mma(o[n + 1], pa[0][0], pa[0][1], pa[0][2], pa[0][3], b[2], b[3]);
      if (two) {
        ldmatrix_x4_trans(b, &vt1[((lane / 8) % 2) * 8 + (lane % 8)][L::at(lane, (n * 8 + (lane / 16) * 8) * 2)]);
        M::mma(o[n], pa[1][0], pa[1][1], pa[1][2], pa[1][3], b[0], b[1]);
        M::mma(o[n + 1], pa[1][0], pa[1][1], pa[1][2], pa[1][3], b[2], b[3]);
      }
    }
  }

  // This warp's states as entry `warp` of st, rows from roff (a pair's second warp: after the first's).'''),
    ('attend_mma.cuh',
     '''  static constexpr bool FP8 = IsSame<KV, e4m3>::value;
  using M = Mma<typename Select<FP8, f16, KV>::type>;  // e4m3 widens exactly to f16''',
     '''  static constexpr bool FP8 = IsSame<KV, e4m3>::value;
  static constexpr bool STEP2 = false;
  using M = Mma<typename Select<FP8, f16, KV>::type>;  // e4m3 widens exactly to f16'''),
]

# fenced_ticket: the fused merge's ticket as it was before 2026-12-03 (fences around a relaxed atomic)
_TICKET_ASM = '    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(ticket) : "l"(counter) : "memory");\n'
_FENCED_TICKET = [
    ("paged_decode_partial.cu", "  __syncthreads();\n  int* counter = p.merge_counters",
     "  __threadfence();  // variant fenced_ticket\n  __syncthreads();\n  int* counter = p.merge_counters"),
    ("paged_decode_partial.cu", _TICKET_ASM, "    ticket = atomicAdd(counter, 1);\n"),
    ("paged_decode_partial.cu", "  if (!is_last) return;  // from here on the other CTAs' partials are visible\n",
     "  if (!is_last) return;\n  __threadfence();  // acquire\n"),
]

# early_ticket (issue 20, thirty-fifth session): a split CTA arrives with an acquire atomic that does not wait for
# its own partials (the last to arrive never needs them), and only a CTA that is not last then releases them (a
# red.release of 1 << 16 on the same counter); the last waits for n - 1 such marks (usually already there), so its
# path is two L2 round trips (arrive, loads) instead of three (store acks, ticket, loads). Requests of 2**15
# chunks or more keep the acq_rel ticket.
_EARLY_TICKET = [
    ("paged_decode_partial.cu",
     "  if (threadIdx.x == 0) {\n    int ticket;\n" + _TICKET_ASM + "    is_last = ticket == num_chunks - 1;\n  }\n",
     "  if (threadIdx.x == 0) {  // variant early_ticket\n"
     "    if (num_chunks < (1 << 15)) {\n"
     "      unsigned v;\n"
     '      asm volatile("atom.add.acquire.gpu.u32 %0, [%1], 1;" : "=r"(v) : "l"(counter) : "memory");\n'
     "      if ((v & 0xffffu) + 1 < (unsigned)num_chunks) {\n"
     '        asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(1u << 16) : "memory");\n'
     "        is_last = 0;\n"
     "      } else {\n"
     "        while ((v >> 16) < (unsigned)num_chunks - 1)\n"
     '          asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");\n'
     "        is_last = 1;\n"
     "      }\n"
     "    } else {\n"
     "      int ticket;\n"
     "  " + _TICKET_ASM +
     "      is_last = ticket == num_chunks - 1;\n"
     "    }\n"
     "  }\n"),
]

# cta_stamps (issue 20, thirty-fifth session; a probe, the output is right): per-CTA %globaltimer stamps of the
# one-token kernel in a __device__ array cupaged_probe[5][16384] (row 0 entry, 1 attention done, 2 exit, 3 the SM
# id, 4 after griddepcontrol.wait), read back by scripts/cta_timeline.py
_CTA_STAMPS = [
    ("paged_decode_partial.cu", '#include "merge.cuh"\n',
     '#include "merge.cuh"\n\n'
     "// variant cta_stamps: per-CTA stamps, [0] entry, [1] attention done, [2] exit, [3] SM id, [4] after the wait\n"
     "__device__ unsigned long long cupaged_probe[5][16384];\n"
     "__device__ __forceinline__ void probe_mark(int k) {\n"
     "  if (threadIdx.x == 0 && blockIdx.x < 16384) {\n"
     "    unsigned long long t;\n"
     '    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));\n'
     "    cupaged_probe[k][blockIdx.x] = t;\n"
     "    if (k == 0) {\n"
     "      unsigned sm;\n"
     '      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));\n'
     "      cupaged_probe[3][blockIdx.x] = sm;\n"
     "    }\n"
     "  }\n"
     "}\n"),
    ("paged_decode_partial.cu", "  typename Attn::Scratch& sm = Attn::scratch();\n",
     "  typename Attn::Scratch& sm = Attn::scratch();\n  probe_mark(0);\n"),
    ("paged_decode_partial.cu", "  pdl_wait();\n", "  pdl_wait();\n  probe_mark(4);\n"),
    ("paged_decode_partial.cu", "                                indices, page_size, slot_begin, slot_end);\n      return;\n",
     "                                indices, page_size, slot_begin, slot_end);\n"
     "      probe_mark(1);\n      probe_mark(2);\n      return;\n"),
    ("paged_decode_partial.cu", "                              indices, page_size, slot_begin, slot_end);\n    if (p.plan[7] < 0) {",
     "                              indices, page_size, slot_begin, slot_end);\n    probe_mark(1);\n    if (p.plan[7] < 0) {"),
    ("paged_decode_partial.cu", "      merge_waiting<T, HEAD_DIM, HEADS, Attn::THREADS>(p);\n      return;\n",
     "      merge_waiting<T, HEAD_DIM, HEADS, Attn::THREADS>(p);\n      probe_mark(2);\n      return;\n"),
    ("paged_decode_partial.cu", "  if (!is_last) return;  // from here on",
     "  if (!is_last) {\n    probe_mark(2);\n    return;\n  }  // from here on"),
    ("paged_decode_partial.cu",
     "  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)\n",
     "  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)\n  probe_mark(2);\n"),
]

#: name -> its edits: (file, old text, new text), every occurrence of old replaced
# copy_u32 (issues 18/20, twenty-eighth session; timed in the twenty-ninth: within 1.3 %, not kept): the 16-bit
# whole-tile copy with a page-16 advance and 32-bit page-offset products
_COPY_U32 = [
    ('attend_mma.cuh',
     '''        next_slot += CTA_TILE;  // (copies come in tile order: the ring issues it = 0, 1, 2, ...)
        while (next_slot >= page_size) {
          next_slot -= page_size;
          ++next_p;
        }''',
     '''        if (page_size == MMA_TILE) {  // (variant copy_u32: page 16, each tile its own page)
          next_p += CTA_TILE / MMA_TILE;
        } else {
          next_slot += CTA_TILE;  // (copies come in tile order: the ring issues it = 0, 1, 2, ...)
          while (next_slot >= page_size) {
            next_slot -= page_size;
            ++next_p;
          }
        }'''),
    ('attend_mma.cuh',
     '''          const long long page = sm.page_ids[p - win];
          const char* kp = k_lane + (page * ks.page + slot * ks.token) * (int)sizeof(KV);
          const char* vp = v_lane + (page * vs.page + slot * vs.token) * (int)sizeof(KV);''',
     '''          // (variant copy_u32: a page's stride below 4 GB, so 32 x 32 -> 64-bit products)
          const unsigned page = static_cast<unsigned>(sm.page_ids[p - win]);
          const char* kp = k_lane + ((unsigned long long)page * (unsigned)(ks.page * (int)sizeof(KV)) +
                                     (unsigned)(slot * ks.token * (int)sizeof(KV)));
          const char* vp = v_lane + ((unsigned long long)page * (unsigned)(vs.page * (int)sizeof(KV)) +
                                     (unsigned)(slot * vs.token * (int)sizeof(KV)));'''),
]

# vector_emit (issue 18, thirty-second session; not yet timed): one store per emitted item where aligned
_VECTOR_EMIT = [
    ("attend.cuh",
     """    T* p = out + h * stride_head + d;
    Storage<T>::store(p, o.x); Storage<T>::store(p + 1, o.y);
    Storage<T>::store(p + 2, o.z); Storage<T>::store(p + 3, o.w);
""",
     """    T* p = out + h * stride_head + d;
    if (reinterpret_cast<unsigned long long>(p) % (4 * sizeof(T)) == 0) {  // variant vector_emit: one store
      if constexpr (sizeof(T) == 4) {
        *reinterpret_cast<float4*>(p) = o;
      } else {
        *reinterpret_cast<uint2*>(p) = make_uint2(Storage<T>::bits(o.x) | Storage<T>::bits(o.y) << 16,
                                                  Storage<T>::bits(o.z) | Storage<T>::bits(o.w) << 16);
      }
    } else {
      Storage<T>::store(p, o.x); Storage<T>::store(p + 1, o.y);
      Storage<T>::store(p + 2, o.z); Storage<T>::store(p + 3, o.w);
    }
"""),
]

# eager_rescale (issues 18 and 20, thirty-fourth session): the running max moves on every larger tile
_EAGER_RESCALE = [
    ("attend_mma.cuh",
     """      m_new[h] = mx > m[h] + 8.f ? mx : m[h];""",
     """      m_new[h] = fmaxf(m[h], mx);  // variant eager_rescale"""),
]

# lazy_rescale_cols (issue 20, thirty-fourth session): the lazy rescale in ColsTile (fp8 KV)
_LAZY_RESCALE_COLS = [
    ("attend_mma.cuh",
     """    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);""",
     """    const float mn0 = mx0 > m0 + 8.f ? mx0 : m0, mn1 = mx1 > m1 + 8.f ? mx1 : m1;  // variant lazy_rescale_cols"""),
]

_MERGE_IS_LAST = "  if (!is_last) return;  // from here on the other CTAs' partials are visible\n"
_TICKET_ONLY = [("paged_decode_partial.cu", _MERGE_IS_LAST,
                 _MERGE_IS_LAST + "  if (threadIdx.x == 0) *counter = 0;\n"
                 "  return;  // variant ticket_only (a probe: the output is not written)\n")]
_MERGE_BATCH = "  constexpr int BATCH = 8;\n"


def _merge_batch(n: int) -> list[tuple[str, str, str]]:
    return [("merge.cuh", _MERGE_BATCH, f"  constexpr int BATCH = ITEMS == 1 ? {n} : 8;  // variant merge_batch{n}\n")]


_PDL_WAIT = ("  prefetch_first_tile<T, KV, HEAD_DIM, HEADS>(p, indices, slot_begin, slot_end, page_size, kv_head, req, head0);\n"
             "  pdl_wait();\n")
_WARM_MERGE = [("paged_decode_partial.cu", _PDL_WAIT, _PDL_WAIT.replace("  pdl_wait();\n", (
    "  if (!GROUPS && num_chunks > 1) {  // variant warm_merge: the merge's code once, for the icache\n"
    "    __shared__ int warm_sink;\n"
    "    MergeItems<1> wit;\n"
    "    wit.n0[0] = chunk0;\n"
    "    wit.h[0] = head0;\n"
    "    wit.d[0] = 0;\n"
    "    const MergedItems<1> wm = merge_partials<1>(p.partial_v, p.partial_lse, wit, num_chunks, num_qo_heads, HEAD_DIM);\n"
    "    if (wm.m[0].lse == p.scale && wm.m[0].o.x == p.soft_cap) warm_sink = 1;\n"
    "  }\n"
    "  pdl_wait();\n")))]
_PAGE_WINDOW_1024 = [("attend.cuh", "constexpr int PAGE_WINDOW = 256;\n",
                      "constexpr int PAGE_WINDOW = 1024;  // variant page_window_1024\n")]
_LEAN_TILE = ("        if (base < s1) {  // (else the tile is all zero fill, and its page id may be out of the window)\n"
              "          const long long page = sm.page_ids[p - win];\n"
              "          const char* kp = k_lane + (page * ks.page + slot * ks.token) * (int)sizeof(KV);\n")


def _l2_ahead(steps: int) -> list[tuple[str, str, str]]:
    return [("attend_mma.cuh", _LEAN_TILE, (
        "#if __CUDA_ARCH__ >= 900\n"
        f"        if constexpr (!PAIRED) {{  // variant l2_ahead{steps}: this warp's tile {steps} steps on, a row a lane\n"
        f"          const int base_f = base + {steps} * CTA_TILE;\n"
        "          if (base_f < s1) {\n"
        "            const int pf = base_f / page_size, slot_f = base_f - pf * page_size + (lane & 15);\n"
        "            const long long page_f = sm.page_ids[pf - win];\n"
        "            const KV* row = lane < 16 ? k_cache + k_head + page_f * ks.page + slot_f * ks.token\n"
        "                                      : v_cache + v_head + page_f * vs.page + slot_f * vs.token;\n"
        '            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "n"(HEAD_DIM * (int)sizeof(KV))\n'
        '                         : "memory");\n'
        "          }\n"
        "        }\n"
        "#endif\n") + _LEAN_TILE)]


VARIANTS: dict[str, list[tuple[str, str, str]]] = {
    "predicated": [("common.cuh", _PREDICATED_OLD, _PREDICATED_NEW)],
    "padded": _PADDED,
    "no_l2_hint": [("attend_mma.cuh", "constexpr bool L2_HINT = sizeof(KV) == 2 && HEAD_DIM * 2 % 128 == 0;",
                    "constexpr bool L2_HINT = false;  // variant no_l2_hint")],
    "no_evict_first": [("attend_mma.cuh", "constexpr bool EVICT_FIRST = sizeof(KV) == 2;",
                        "constexpr bool EVICT_FIRST = false;  // variant no_evict_first")],
    "no_prefetch": [("paged_decode_partial.cu", _PREFETCH_CALL, "  // variant no_prefetch\n")],
    "prefetch_256": [("paged_decode_partial.cu", "const int n = min(slot_end - slot_begin, 64) * LINES;",
                      "const int n = min(slot_end - slot_begin, 256) * LINES;  // variant prefetch_256")],
    "no_merge": [("paged_decode_partial.cu",
                  "  // Release this CTA's partials, then take a ticket; the last one merges. One\n",
                  "  return;  // variant no_merge (a probe: the output is wrong)\n")],
    "fenced_ticket": _FENCED_TICKET,
    "early_ticket": _EARLY_TICKET,
    "cta_stamps": _CTA_STAMPS,
    "ticket_only": _TICKET_ONLY,
    "merge_batch16": _merge_batch(16),
    "merge_batch4": _merge_batch(4),
    "warm_merge": _WARM_MERGE,
    "page_window_1024": _PAGE_WINDOW_1024,
    "l2_ahead2": _l2_ahead(2),
    "l2_ahead4": _l2_ahead(4),
    "fp8_bitmove": _FP8_BITMOVE,
    "fp8_noconv": _FP8_NOCONV,
    "last_mask": _LAST_MASK,
    "fold_scale": _FOLD_SCALE,
    "merge_items4": _MERGE_ITEMS4,
    "pair_step2": _PAIR_STEP2,
    "eager_rescale": _EAGER_RESCALE,
    "lazy_rescale_cols": _LAZY_RESCALE_COLS,
    "copy_u32": _COPY_U32,
    "vector_emit": _VECTOR_EMIT,
}


def apply(names: list[str], out: Path, src: Path = SRC) -> None:
    """Copies ``src`` to ``out`` and applies the named variants' edits in order;
    raises ValueError naming the first edit that does not apply."""
    if out.exists():
        raise ValueError(f"{out} exists; choose a new folder")
    texts = {p.name: p.read_text() for p in src.iterdir() if p.is_file()}
    for name in names:
        for fname, old, new in VARIANTS[name]:
            text = texts[fname]
            if old not in text:
                raise ValueError(f"variant {name}: its edit of {fname} no longer matches the source "
                                 f"(looked for {old.strip().splitlines()[0]!r})")
            texts[fname] = text.replace(old, new)
    shutil.copytree(src, out)
    for fname, text in texts.items():
        (out / fname).write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="make_variant.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a copy of cuda_src/ with named experimental kernel changes applied, for A/B "
                    "runs of kernel variants (scripts/gpu_run.sh steps variants and ncu_sectors).",
        epilog="variants: " + ", ".join(VARIANTS) + "\n\nexamples:\n"
               "  python3 scripts/make_variant.py predicated .variants/predicated\n"
               "  python3 scripts/make_variant.py predicated+padded .variants/both\n"
               "  AB_TREES='cuda_src .variants/predicated' scripts/gpu_run.sh OUT variants ncu_sectors\n\n"
               "exit status: 0 written, 2 bad arguments or an edit that no longer applies",
    )
    p.add_argument("variant", help="a variant name, or several joined with '+'")
    p.add_argument("out", type=Path, help="the new folder to write (must not exist)")
    args = p.parse_args(argv)
    names = args.variant.split("+")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    try:
        apply(names, args.out)
    except ValueError as exc:
        print(f"make_variant.py: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.variant})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
