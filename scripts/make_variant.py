#!/usr/bin/env python3
"""Writes a copy of cuda_src/ with one named experimental change, for A/B runs
of kernel variants on the GPU (``AB_TREES="cuda_src OUT" scripts/gpu_run.sh
RESULTS variants ncu_sectors``).

The variants are the issue-20 experiments on the tensor-core core's K/V copy
(``mma_token_loop`` in attend_mma.cuh), kept here so that an experiment can
be rerun, and a lost one recorded, without hand-editing a tree:

* ``predicated``: a copy of a valid row has no source-size operand (the
  zero-fill form only for rows past the range), as FlashInfer's K/V copy;
* ``fi_lanes``: where pages hold whole tiles, 8 lanes copy one 128-byte half
  row and a warp instruction covers 4 rows (FlashInfer's lane map) instead of
  16 lanes per 256-byte row and 2 rows per instruction (rows of 8 or 16
  chunks: fp16 head_dim 64/128, fp8 head_dim 128);
* ``permuted``: rows unpadded, 16-byte chunk c of row r at c ^ (r % 8)
  (FlashInfer's shared-memory permutation; measured 2026-12-01: lost);
* ``nopad``: rows unpadded, no permutation (measured: lost);
* ``no_l2_hint``, ``no_evict_first``: without the L2::128B prefetch hint or
  the evict_first policy on 16-bit rows;
* ``bulk_rows``: where pages hold whole tiles, each K and V row copied by
  the bulk-copy engine (``cp.async.bulk``, one per row, lane r row r), each
  warp's ring stage completed on its own mbarrier; rows past the range
  zero-filled by stores (written 2026-12-01, not yet run on a GPU).

Variants combine with ``+`` (``predicated+fi_lanes``). Each edit is an exact
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

_PAGE_PATH_OLD = """          constexpr int ROWS_PER_PASS = 32 % CPR == 0 ? 32 / CPR : 1;
          const int col = (lane % CPR) * ELEMS_PER_CHUNK;
          const KV* kp = k_cache;
          const KV* vp = v_cache;
          if (base < s1) {  // (else the tile is all zero fill, and its page id may be out of the window)
            const int p = base / page_size;
            const long long page = sm.page_ids[p - win];
            const int slot = base - p * page_size + lane / CPR;
            kp = k_cache + page * ks.page + slot * ks.token + k_head + col;
            vp = v_cache + page * vs.page + slot * vs.token + v_head + col;
          }
#pragma unroll
          for (int pass = 0; pass < PASSES; ++pass) {
            const int r = lane / CPR + pass * ROWS_PER_PASS;
            const bool valid = base + r < s1;
            cp_async_16<L2_HINT, EVICT_FIRST>(&sm.kv[stage][warp][0][r][col * (int)sizeof(KV)],
                                              valid ? kp + pass * ROWS_PER_PASS * ks.token : k_cache, valid, policy);
            cp_async_16<L2_HINT, EVICT_FIRST>(&sm.kv[stage][warp][1][r][col * (int)sizeof(KV)],
                                              valid ? vp + pass * ROWS_PER_PASS * vs.token : v_cache, valid, policy);
          }
"""
_FI_LANES_NEW = """          // variant fi_lanes: 8 lanes per 128-byte half row, 4 rows per instruction
          constexpr int HALVES = CPR % 8 == 0 ? CPR / 8 : 1;
          const int col0 = (lane % 8) * ELEMS_PER_CHUNK;
          const KV* kp = k_cache;
          const KV* vp = v_cache;
          if (base < s1) {  // (else the tile is all zero fill, and its page id may be out of the window)
            const int p = base / page_size;
            const long long page = sm.page_ids[p - win];
            const int slot = base - p * page_size + lane / 8;
            kp = k_cache + page * ks.page + slot * ks.token + k_head + col0;
            vp = v_cache + page * vs.page + slot * vs.token + v_head + col0;
          }
#pragma unroll
          for (int pass = 0; pass < PASSES; ++pass) {
            const int dr = 4 * (pass / HALVES), dc = 8 * ELEMS_PER_CHUNK * (pass % HALVES);
            const int r = lane / 8 + dr, col = col0 + dc;
            const bool valid = base + r < s1;
            cp_async_16<L2_HINT, EVICT_FIRST>(&sm.kv[stage][warp][0][r][col * (int)sizeof(KV)],
                                              valid ? kp + dr * ks.token + dc : k_cache, valid, policy);
            cp_async_16<L2_HINT, EVICT_FIRST>(&sm.kv[stage][warp][1][r][col * (int)sizeof(KV)],
                                              valid ? vp + dr * vs.token + dc : v_cache, valid, policy);
          }
"""
_FI_LANES_GATE_OLD = "const bool page_tiles = 32 % CPR == 0 && "
_FI_LANES_GATE_NEW = "const bool page_tiles = CPR % 8 == 0 && "

_PAD_OLD = "  static constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(KV) + 16;\n"
_PAD_NEW = "  static constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(KV);  // variant: unpadded\n"
_PERMUTED_ROWS_NEW = _PAD_NEW + (
    "  static_assert(HEAD_DIM * (int)sizeof(KV) % 128 == 0,\n"
    "                \"variant permuted: rows of a multiple of 8 chunks only (fp16 head_dim 64/128, fp8 128)\");\n")

# every shared-memory address of a K/V row's bytes, and its permuted form
_PERMUTED = [
    ("attend_mma.cuh", "&sm.kv[stage][warp][0][r][col * (int)sizeof(KV)]",
     "&sm.kv[stage][warp][0][r][((col * (int)sizeof(KV)) ^ ((r & 7) << 4))]"),
    ("attend_mma.cuh", "&sm.kv[stage][warp][1][r][col * (int)sizeof(KV)]",
     "&sm.kv[stage][warp][1][r][((col * (int)sizeof(KV)) ^ ((r & 7) << 4))]"),
    ("attend_mma.cuh", "&kt[n * 8 + (lane % 8)][(k * 16 + (lane / 8) * 8) * 2]",
     "&kt[n * 8 + (lane % 8)][((k * 16 + (lane / 8) * 8) * 2) ^ ((lane & 7) << 4)]"),
    ("attend_mma.cuh", "&vt[((lane / 8) % 2) * 8 + (lane % 8)][(n * 8 + (lane / 16) * 8) * 2]",
     "&vt[((lane / 8) % 2) * 8 + (lane % 8)][((n * 8 + (lane / 16) * 8) * 2) ^ ((lane & 7) << 4)]"),
    ("attend_mma.cuh", "&kt[((lane / 8) % 2) * 8 + (lane % 8)][kb * 32 + (lane / 16) * 16]",
     "&kt[((lane / 8) % 2) * 8 + (lane % 8)][(kb * 32 + (lane / 16) * 16) ^ ((lane & 7) << 4)]"),
    ("attend_mma.cuh", "&vt[((lane / 8) % 2) * 8 + (lane % 8)][db * 32 + (lane / 16) * 16]",
     "&vt[((lane / 8) % 2) * 8 + (lane % 8)][(db * 32 + (lane / 16) * 16) ^ ((lane & 7) << 4)]"),
]

# bulk_rows: the page path's copies as one cp.async.bulk per K or V row (the
# Hopper bulk-copy engine; no L1TEX request shape), each warp's stage completed
# on its own mbarrier; the other path keeps cp.async.
_BULK_BUDGET_OLD = "  static constexpr int BUDGET = MMA_SMEM_BYTES - PAGE_WINDOW * 4;\n"
_BULK_BUDGET_NEW = ("  static constexpr int BUDGET = MMA_SMEM_BYTES - PAGE_WINDOW * 4 - MMA_MAX_STAGES * MMA_WARPS * 8;"
                    "  // variant bulk_rows: + mbarriers\n")
_BULK_SCRATCH_OLD = """template <typename T, typename KV, int HEAD_DIM, int ROWS>
struct MmaScratch {
  using L = MmaLayout<KV, HEAD_DIM>;
  int page_ids[PAGE_WINDOW];
"""
_BULK_SCRATCH_NEW = """// variant bulk_rows: one row global -> shared by the bulk-copy engine,
// completing `bytes` of the mbarrier at shared address `bar`.
template <bool POLICY>
__device__ __forceinline__ void bulk_row(void* smem, const void* gmem, int bytes, unsigned bar,
                                         unsigned long long policy) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (POLICY)
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(dst), "l"(gmem), "r"(bytes), "r"(bar), "l"(policy) : "memory");
  else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(gmem), "r"(bytes), "r"(bar) : "memory");
}

template <typename T, typename KV, int HEAD_DIM, int ROWS>
struct MmaScratch {
  using L = MmaLayout<KV, HEAD_DIM>;
  int page_ids[PAGE_WINDOW];
  unsigned long long bars[MMA_MAX_STAGES][MMA_WARPS];  // variant bulk_rows: [stage][warp]
"""
_BULK_INIT_OLD = """  const long long v_head = (long long)kv_head * vs.head;

  for_each_page_window<MMA_THREADS>("""
_BULK_INIT_NEW = """  const long long v_head = (long long)kv_head * vs.head;
  // variant bulk_rows: this warp's mbarrier per stage; bit s of `phases` is
  // the parity of stage s's next completion
  const unsigned bar0 = static_cast<unsigned>(__cvta_generic_to_shared(&sm.bars[0][warp]));
  if (lane == 0) {
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar0 + 8u * MMA_WARPS * s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  unsigned phases = 0;

  for_each_page_window<MMA_THREADS>("""
_BULK_COPY_NEW = """          // variant bulk_rows: lane r copies row r of K and of V with the bulk
          // engine; lane 0 tells the stage's mbarrier how many bytes to expect
          constexpr int ROW_DATA = HEAD_DIM * (int)sizeof(KV);
          const unsigned bar = bar0 + 8u * MMA_WARPS * stage;
          const int rows = min(max(s1 - base, 0), MMA_TILE);
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // earlier zero fills, then async writes
          if (lane == 0) {
            if (rows > 0)
              asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
                           :: "r"(bar), "r"(2 * rows * ROW_DATA) : "memory");
            else
              asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" :: "r"(bar) : "memory");
          }
          __syncwarp();
          if (lane < rows) {
            const int p = base / page_size;
            const long long page = sm.page_ids[p - win];
            const int slot = base - p * page_size + lane;
            bulk_row<EVICT_FIRST>(&sm.kv[stage][warp][0][lane][0], k_cache + page * ks.page + slot * ks.token + k_head,
                                  ROW_DATA, bar, policy);
            bulk_row<EVICT_FIRST>(&sm.kv[stage][warp][1][lane][0], v_cache + page * vs.page + slot * vs.token + v_head,
                                  ROW_DATA, bar, policy);
          }
          // rows past the range: zeros (V's must be finite: P is 0 there, and 0 x NaN is NaN)
          for (int c = lane; c < (MMA_TILE - rows) * CPR; c += 32) {
            const int r = rows + c / CPR, col = (c % CPR) * 16;
            *reinterpret_cast<uint4*>(&sm.kv[stage][warp][0][r][col]) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4*>(&sm.kv[stage][warp][1][r][col]) = make_uint4(0u, 0u, 0u, 0u);
          }
"""
_BULK_WAIT_OLD = """      issue(it + STAGES - 1);  // refills the stage every lane finished reading last iteration
      cp_async_wait<STAGES - 1>();
      __syncwarp();  // other lanes' copies of this stage are visible
      const int stage = it % STAGES;
"""
_BULK_WAIT_NEW = """      issue(it + STAGES - 1);  // refills the stage every lane finished reading last iteration
      const int stage = it % STAGES;
      if (page_tiles) {  // variant bulk_rows: the stage's mbarrier
        const unsigned bar = bar0 + 8u * MMA_WARPS * stage, parity = (phases >> stage) & 1u;
        unsigned done = 0;
        while (!done)
          asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                       : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        phases ^= 1u << stage;
      } else {
        cp_async_wait<STAGES - 1>();
      }
      __syncwarp();  // other lanes' copies of this stage are visible
"""


#: name -> its edits: (file, old text, new text), every occurrence of old replaced
VARIANTS: dict[str, list[tuple[str, str, str]]] = {
    "predicated": [("common.cuh", _PREDICATED_OLD, _PREDICATED_NEW)],
    "fi_lanes": [("attend_mma.cuh", _PAGE_PATH_OLD, _FI_LANES_NEW),
                 ("attend_mma.cuh", _FI_LANES_GATE_OLD, _FI_LANES_GATE_NEW)],
    "nopad": [("attend_mma.cuh", _PAD_OLD, _PAD_NEW)],
    "permuted": [("attend_mma.cuh", _PAD_OLD, _PERMUTED_ROWS_NEW), *_PERMUTED],
    "no_l2_hint": [("attend_mma.cuh", "constexpr bool L2_HINT = sizeof(KV) == 2 && HEAD_DIM * 2 % 128 == 0;",
                    "constexpr bool L2_HINT = false;  // variant no_l2_hint")],
    "bulk_rows": [("attend_mma.cuh", _BULK_BUDGET_OLD, _BULK_BUDGET_NEW),
                  ("attend_mma.cuh", _BULK_SCRATCH_OLD, _BULK_SCRATCH_NEW),
                  ("attend_mma.cuh", _BULK_INIT_OLD, _BULK_INIT_NEW),
                  ("attend_mma.cuh", _PAGE_PATH_OLD, _BULK_COPY_NEW),
                  ("attend_mma.cuh", _BULK_WAIT_OLD, _BULK_WAIT_NEW)],
    "no_evict_first": [("attend_mma.cuh", "constexpr bool EVICT_FIRST = sizeof(KV) == 2;",
                        "constexpr bool EVICT_FIRST = false;  // variant no_evict_first")],
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
               "  python3 scripts/make_variant.py predicated+fi_lanes .variants/both\n"
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
