// Tensor-core attention core for 16-bit KV (fp16, bf16) and fp8 (e4m3) KV:
// the same contract as cta_attend (attend.cuh), computed with
// mma.sync.m16n8k16 (f32 accumulate). fp8 K/V are widened to f16 in
// registers (cvt.rn.f16x2.e4m3x2, exact) right before their MMA, so the ring
// carries half the bytes of fp16.
//
// Why: on CUDA cores every K/V element costs a multiply-add per query head
// plus shuffle reductions, and the SM issue rate, not memory, bounds decode
// well below the HBM roofline. With tensor cores a warp does 16 tokens x
// head_dim of Q.K^T and P.V in a few dozen instructions.
//
// Mapping: MMA_WARPS warps; each owns 16 consecutive tokens per stage and
// keeps its own online softmax (mma_token_loop). K/V tiles go global ->
// shared with cp.async (a ring of STAGES per warp; MmaLayout places the rows
// so ldmatrix is conflict-free and the L2 serves each sector once). Two tile
// computations share that loop:
// RowsTile (16-bit KV: query heads as the M rows of S = Q.K^T, rows 8..15
// zero, P straight from the S accumulators into P.V) and ColsTile (fp8 KV,
// and 16-bit head dims above 128: transposed, S^T = K.Q^T and
// O^T += V^T.P^T with heads as the N columns).
// P is rounded to the MMA dtype for the second MMA (as in FlashAttention);
// the denominator keeps the f32 P, so the LSE stays f32-accurate and an
// output can exceed its inputs by ~1 ulp (fp16 stores saturate it).
#pragma once
#include "attend.cuh"

namespace cupaged {

// Warps per CTA and the resident CTAs per SM the register budget must allow
// (defaults below; cupaged/_configs.py passes the same values to NVRTC).
#ifndef CUPAGED_MMA_WARPS
#define CUPAGED_MMA_WARPS 4
#endif
#ifndef CUPAGED_MMA_MIN_BLOCKS
#define CUPAGED_MMA_MIN_BLOCKS 2
#endif
constexpr int MMA_WARPS = CUPAGED_MMA_WARPS;
constexpr int MMA_THREADS = MMA_WARPS * 32;
constexpr int MMA_MIN_BLOCKS = CUPAGED_MMA_MIN_BLOCKS;
constexpr int MMA_TILE = 16;  // tokens per warp per stage

template <typename T> struct Mma;
template <> struct Mma<f16> {
  __device__ __forceinline__ static void mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                             unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float lo, float hi) { return float2_to_f16x2(lo, hi); }
};
template <> struct Mma<bf16> {
  __device__ __forceinline__ static void mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                             unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

// Transposes an 8x8 matrix of 16-bit values held one row pair per lane
// (lane g*4+t holds row g, columns 2t, 2t+1) in registers.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
  unsigned r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned* r, const void* smem) {  // (lanes 0-15's addresses)
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// Dynamic shared memory of one CTA (opt-in above 48 KB): the page-id window
// plus a ring of STAGES tiles per warp. 72 KB gives 4 warps 2 stages at
// head_dim 128 (more stages measured no faster: the per-warp instruction
// chain, not the bytes in flight, sets the pace).
// cupaged/_configs.py passes the same size at launch (MMA_SMEM_KB); a
// developer can override both with env CUPAGED_MMA_SMEM_KB for experiments.
#ifndef CUPAGED_MMA_SMEM_KB
#define CUPAGED_MMA_SMEM_KB 72
#endif
constexpr int MMA_SMEM_BYTES = CUPAGED_MMA_SMEM_KB * 1024;
constexpr int MMA_MAX_STAGES = 8;

// Shared-memory rows hold one token's head_dim of K or V in the cache's
// storage type. Rows of whole 128-byte lines (16-bit head_dim 64 and 128, fp8
// 128) are unpadded, 16-byte chunk c of row r at c ^ (r % 8), so ldmatrix's
// 8 rows hit distinct banks and every row starts 128-byte aligned. Why the
// alignment: a cp.async quarter-warp whose 128-byte line lands across a 32-byte
// boundary of shared memory has the L2 serve its sectors twice. Rows padded by
// 16 bytes (the layout before 2026-12-01, kept for other row sizes) put every
// second row there: 1.5x the K/V sectors through the L2 and 4.18 TB/s at
// 128 x 16k fp16; unpadded, permuted and aligned: 1.00x and 4.49 TB/s (H200,
// docs/architecture.md).
template <typename KV, int HEAD_DIM>
struct MmaLayout {
  static constexpr int DATA_BYTES = HEAD_DIM * (int)sizeof(KV);
  static constexpr bool SWIZZLE = DATA_BYTES % 128 == 0;
  static constexpr int ROW_BYTES = SWIZZLE ? DATA_BYTES : DATA_BYTES + 16;
  // Byte offset in its row of a row's 16-byte chunk at `byte` (r: the row, or
  // any number equal to it mod 8).
  __device__ __forceinline__ static int at(int r, int byte) { return SWIZZLE ? byte ^ ((r & 7) << 4) : byte; }
  static constexpr int CPR = HEAD_DIM * (int)sizeof(KV) / 16;  // 16-byte chunks per token row
  static constexpr int STAGE_BYTES = MMA_WARPS * 2 * MMA_TILE * ROW_BYTES;
  static constexpr int BUDGET = MMA_SMEM_BYTES - PAGE_WINDOW * 4;
  static constexpr int STAGES = BUDGET / STAGE_BYTES < MMA_MAX_STAGES ? BUDGET / STAGE_BYTES : MMA_MAX_STAGES;
  static_assert(STAGES >= 2, "the K/V ring needs two stages: raise CUPAGED_MMA_SMEM_KB");
  // (16-bit rows: whole 16-dim k-steps; fp8 rows: the transposed tile's 32-dim blocks)
  static_assert(HEAD_DIM % (sizeof(KV) == 1 ? 32 : 16) == 0 && (MMA_TILE * CPR) % 32 == 0, "unsupported HEAD_DIM");
};

// The warp states' row padding (floats). The tiles' stores put 8 rows (RowsTile:
// lanes g, float2) or 4 (ColsTile: lanes t) in one instruction; unpadded rows
// (head_dim 64-256: multiples of 32 floats) all start at bank 0: a RowsTile
// store took 8 shared-memory wavefronts instead of 2 (by count, ~2K cycles an
// SM at the end of every CTA of 16-row groups), a ColsTile store was 4-way
// conflicted. 8 floats more a row start row r at bank 8r: the rows tile's
// stores are conflict-free, the cols tile's 2-way (H200: q_len 2-8 cells 2-5 %
// faster, docs/architecture.md "Warp states padded").
constexpr int MMA_STATE_PAD = 8;

// ROWS: the query rows a CTA combines (its heads, or a row group's rows).
template <typename T, typename KV, int HEAD_DIM, int ROWS>
struct MmaScratch {
  using L = MmaLayout<KV, HEAD_DIM>;
  int page_ids[PAGE_WINDOW];
  union __align__(128) {  // (with the 128-byte aligned dynamic shared memory: every row 128-byte aligned)
    unsigned char kv[L::STAGES][MMA_WARPS][2][MMA_TILE][L::ROW_BYTES];  // [stage][warp][K or V][token][bytes]
    WarpStates<MMA_WARPS, ROWS, HEAD_DIM, MMA_STATE_PAD> combine;
    WarpStates<MMA_WARPS / 2, 2 * ROWS, HEAD_DIM, MMA_STATE_PAD> paired;  // (warp pairs: a pair's rows side by side)
  };
};


// Two e4m3 (low byte first) as the f16x2 B operand; prmt 0x3120 first splits
// a register of ldmatrix.trans into its even and odd bytes.
__device__ __forceinline__ unsigned fp8_lo(unsigned x) { return e4m3x2_to_f16x2((unsigned short)(x & 0xffffu)); }
__device__ __forceinline__ unsigned fp8_hi(unsigned x) { return e4m3x2_to_f16x2((unsigned short)(x >> 16)); }
__device__ __forceinline__ unsigned byte_deinterleave(unsigned x) {
  unsigned r;
  asm("prmt.b32 %0, %1, 0, 0x3120;" : "=r"(r) : "r"(x));
  return r;
}

// Loads query row g's A fragments (KSTEPS k-steps of 16 dims). 16-bit KV:
// natural order, a0 = Q[16k + 2t, +1], a2 = Q[16k + 2t + 8, +1]. fp8 KV: the
// reduction runs over a permuted dim order that matches what ldmatrix hands
// out for 16 one-byte dims (a lane gets dims 4t..4t+3 of a 16-dim block), so
// a0 = Q[16k + 4t, +1], a2 = Q[16k + 4t + 2, +1], converted to f16 (the MMA
// type for fp8; a bf16 q is first scaled by a power of two into f16 range,
// returned as q_unscale so the scores can be scaled back exactly).
template <typename T, bool FP8, int KSTEPS>
__device__ __forceinline__ float load_q_fragments(const T* __restrict__ q, bool row_valid, int t,
                                                  unsigned (&qa)[KSTEPS][2]) {
  if constexpr (!FP8 || IsSame<T, f16>::value) {
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      if (row_valid) {
        const unsigned* qr = reinterpret_cast<const unsigned*>(q + k * 16 + (FP8 ? 4 : 2) * t);
        qa[k][0] = __ldg(qr);
        qa[k][1] = __ldg(qr + (FP8 ? 1 : 4));
      } else {
        qa[k][0] = qa[k][1] = 0u;
      }
    }
    return 1.f;
  } else {  // bf16 q over fp8 KV
    float f[KSTEPS][4];
    float mx = 0.f;
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      const uint2 u = row_valid ? __ldg(reinterpret_cast<const uint2*>(q + k * 16 + 4 * t)) : make_uint2(0u, 0u);
      f[k][0] = __uint_as_float(u.x << 16); f[k][1] = __uint_as_float(u.x & 0xffff0000u);
      f[k][2] = __uint_as_float(u.y << 16); f[k][3] = __uint_as_float(u.y & 0xffff0000u);
#pragma unroll
      for (int e = 0; e < 4; ++e) mx = fmaxf(mx, fabsf(f[k][e]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    // Largest |q| at most 2^14 after scaling: products with e4m3 (<= 448)
    // stay finite in the f32 accumulator and q keeps f16's 11-bit mantissa.
    const float unscale = mx > 16384.f ? exp2f(ceilf(log2f(mx / 16384.f))) : 1.f;
    const float mult = 1.f / unscale;  // an exact power of two
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      qa[k][0] = float2_to_f16x2(f[k][0] * mult, f[k][1] * mult);
      qa[k][1] = float2_to_f16x2(f[k][2] * mult, f[k][3] * mult);
    }
    return unscale;
  }
}

// The per-warp token loop both tensor-core tiles share: walks the visible
// slots in page windows; each warp copies its 16-token tiles of K and V
// global -> shared with cp.async (STAGES - 1 tiles ahead) and hands each
// landed tile to tile.step<LO>(kt, vt, base, lo, s1) (base: the tile's first
// slot; slots past s1 are masked, and with LO those before lo).
// PAIRED (a row group of more tokens than one tile holds rows): warps 2p and
// 2p + 1 share each tile, copy alternate rows of it and step their own rows
// over all of it, so the K/V is read once for twice the rows; the ring is
// then 2 x STAGES stages of MMA_WARPS / 2 tiles (the same bytes in flight).
template <typename KV, int HEAD_DIM, bool PAIRED, bool LO, typename Scratch, typename Tile>
__device__ __forceinline__ void mma_token_loop(const KV* __restrict__ k_cache, CacheStrides ks,
                                               const KV* __restrict__ v_cache, CacheStrides vs, int kv_head,
                                               const int* __restrict__ req_pages, int page_size, int slot_begin,
                                               int slot_end, Scratch& sm, Tile& tile) {
  using L = MmaLayout<KV, HEAD_DIM>;
  constexpr int STAGES = L::STAGES;
  constexpr int CPR = L::CPR;                            // 16-byte chunks per token row
  constexpr int ELEMS_PER_CHUNK = 16 / (int)sizeof(KV);
  constexpr int PASSES = MMA_TILE * CPR / 32;            // chunks each lane copies per tile
  constexpr int SLOTS = PAIRED ? MMA_WARPS / 2 : MMA_WARPS;  // tiles per CTA step
  constexpr int CTA_TILE = SLOTS * MMA_TILE;
  // The L2::128B prefetch hint for 16-bit rows of whole lines: +2 % at
  // 128 x 32k fp16 on the H200; for fp8 it cost 12 % at 8 x 32k and 32 x 4k.
  constexpr bool L2_HINT = sizeof(KV) == 2 && HEAD_DIM * 2 % 128 == 0;
  // evict_first on the 16-bit K/V stream: 2-8 % faster below ~600 MB, neutral
  // above; for fp8 neutral to 5 % slower (H200, docs/architecture.md).
  constexpr bool EVICT_FIRST = sizeof(KV) == 2;
  const unsigned long long policy = EVICT_FIRST ? evict_first_policy() : 0ull;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tix = PAIRED ? warp / 2 : warp, half = PAIRED ? warp % 2 : 0;  // its tile; the passes it copies
  // Stage `stage`'s tile `tix`: [K or V][token][bytes] (paired: stage s of
  // the 2 x STAGES ring is half s % 2 of the unpaired ring's stage s / 2).
  auto tile_at = [&](int stage) {
    return PAIRED ? sm.kv[stage / 2][(stage % 2) * SLOTS + tix] : sm.kv[stage][warp];
  };
  const long long k_head = (long long)kv_head * ks.head;
  const long long v_head = (long long)kv_head * vs.head;
  // Whole-tile pages (below): what a lane's copies share is computed once,
  // not per tile and pass: its rows r0 + i * ROW_STEP (a pair's warp only its
  // own passes, no per-pass branch), the ring's shared-space address and its
  // K/V pointers; the tile's page and slot advance with each copy instead of
  // a division: a warp pair's copy of a tile went from ~170 to ~100 of the
  // ~435 instructions a warp-tile takes, and q_len 8 ran 11-15 % faster
  // (H200, docs/architecture.md "The copy's addresses, once").
  // 16-bit KV only: with it the fp8 rows instances took 190-197 registers
  // (were 168), past the 3 CTAs per SM their plans count; fp8 keeps the
  // per-tile form below (MMA_FP8_RESIDENT_CTAS in cupaged/_configs.py).
  constexpr bool LEAN = sizeof(KV) == 2;
  constexpr int RPP = 32 % CPR == 0 ? 32 / CPR : 1;           // rows per pass
  constexpr int MY_PASSES = PAIRED ? PASSES / 2 : PASSES;      // (a pair: alternate passes each)
  constexpr int ROW_STEP = (PAIRED ? 2 : 1) * RPP;
  constexpr int TILE_BYTES = 2 * MMA_TILE * L::ROW_BYTES;
  static_assert(!PAIRED || 32 % CPR != 0 || PASSES % 2 == 0, "a pair splits a tile's passes evenly");
  const int r0 = lane / CPR + half * RPP;
  const int col_bytes = (lane % CPR) * 16;
  const unsigned ring = static_cast<unsigned>(__cvta_generic_to_shared(&sm.kv[0][0][0][0][0]));
  const char* k_lane =
      reinterpret_cast<const char*>(k_cache + k_head) + col_bytes + (long long)r0 * ks.token * (int)sizeof(KV);
  const char* v_lane =
      reinterpret_cast<const char*>(v_cache + v_head) + col_bytes + (long long)r0 * vs.token * (int)sizeof(KV);

  // LO: a range that starts inside a tile (a window's start, a
  // first_page_offset) takes whole tiles too when pages hold whole tiles: it
  // starts at its tile boundary, the copy zero-fills the slots before
  // slot_begin and the tile masks them (only the first tile has any), where
  // it took the (page, slot) walk for its first page window before (H200:
  // windowed decode 2-16 % faster, the smallest plain cells ~2 % slower).
  // One query token per request and 16-bit KV only: in the row-group
  // instances (255 registers) it cost 1.5-2 % at q_len 8, and fp8 was not
  // timed with it (docs/architecture.md "Windows start on a tile").
  const bool whole_tiles = 32 % CPR == 0 && page_size % MMA_TILE == 0;
  const int lo = slot_begin;
  for_each_page_window<MMA_THREADS>(req_pages, page_size, LO && whole_tiles ? lo - lo % MMA_TILE : lo, slot_end,
                                    sm.page_ids, [&](int win, int s0, int s1) {
    const int n_iter = (s1 - s0 + CTA_TILE - 1) / CTA_TILE;
    // Every 16-token tile lies in one page when pages hold whole tiles and
    // the range starts on a tile boundary (a page-16 table's chunks; with LO
    // every range): one page-id read and one address per tile, each pass a
    // fixed step from it, instead of a (page, slot) walk per pass.
    const bool page_tiles = whole_tiles && (LO || s0 % MMA_TILE == 0);
    // (page_tiles: the page and slot of this warp's next tile, one division a window)
    int next_p = 0, next_slot = 0;
    if (LEAN && page_tiles) {
      next_p = (s0 + tix * MMA_TILE) / page_size;
      next_slot = s0 + tix * MMA_TILE - next_p * page_size;
    }

    auto copy = [&](int stage, int it) {
      const int base = s0 + it * CTA_TILE + tix * MMA_TILE;
      // (fp8's whole tiles and the (page, slot) walk below: unpaired, each
      // copy's address as before pairs; paired, the tile's address computed once)
      auto* kv = tile_at(stage);
      auto dst = [&](int kv_i, int r, int at) { return PAIRED ? &kv[kv_i][r][at] : &sm.kv[stage][warp][kv_i][r][at]; };
      if (LEAN && page_tiles) {
        // (the ring's stage index as tile_at's)
        const int slot_index = PAIRED ? (stage / 2) * MMA_WARPS + (stage % 2) * SLOTS + tix : stage * MMA_WARPS + warp;
        const unsigned dst0 = ring + slot_index * TILE_BYTES;
        const int p = next_p, slot = next_slot;
        next_slot += CTA_TILE;  // (copies come in tile order: the ring issues it = 0, 1, 2, ...)
        while (next_slot >= page_size) {
          next_slot -= page_size;
          ++next_p;
        }
        if (base < s1) {  // (else the tile is all zero fill, and its page id may be out of the window)
          const long long page = sm.page_ids[p - win];
          const char* kp = k_lane + (page * ks.page + slot * ks.token) * (int)sizeof(KV);
          const char* vp = v_lane + (page * vs.page + slot * vs.token) * (int)sizeof(KV);
#pragma unroll
          for (int i = 0; i < MY_PASSES; ++i) {
            const int r = r0 + i * ROW_STEP;
            // (rows in [lo, s1); an invalid row's address still lies in the tile's page)
            const bool valid =
                LO ? static_cast<unsigned>(base + r - lo) < static_cast<unsigned>(s1 - lo) : base + r < s1;
            const unsigned at = dst0 + r * L::ROW_BYTES + L::at(r, col_bytes);
            cp_async_16s<L2_HINT, EVICT_FIRST>(at, kp + (long long)i * ROW_STEP * ks.token * (int)sizeof(KV), valid,
                                               policy);
            cp_async_16s<L2_HINT, EVICT_FIRST>(at + MMA_TILE * L::ROW_BYTES,
                                               vp + (long long)i * ROW_STEP * vs.token * (int)sizeof(KV), valid,
                                               policy);
          }
        } else {
#pragma unroll
          for (int i = 0; i < MY_PASSES; ++i) {
            const int r = r0 + i * ROW_STEP;
            const unsigned at = dst0 + r * L::ROW_BYTES + L::at(r, col_bytes);
            cp_async_16s<L2_HINT, EVICT_FIRST>(at, k_cache, false, policy);
            cp_async_16s<L2_HINT, EVICT_FIRST>(at + MMA_TILE * L::ROW_BYTES, v_cache, false, policy);
          }
        }
      } else if (page_tiles) {
        static_assert(LEAN || !LO, "LO takes the 16-bit copy above");
        constexpr int ROWS_PER_PASS = 32 % CPR == 0 ? 32 / CPR : 1;
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
          if (PAIRED && pass % 2 != half) continue;  // (the partner's pass)
          const int r = lane / CPR + pass * ROWS_PER_PASS;
          const bool valid = base + r < s1;  // (fp8: no LO instance)
          const int at = L::at(r, col * (int)sizeof(KV));
          cp_async_16<L2_HINT, EVICT_FIRST>(dst(0, r, at),
                                            valid ? kp + pass * ROWS_PER_PASS * ks.token : k_cache, valid, policy);
          cp_async_16<L2_HINT, EVICT_FIRST>(dst(1, r, at),
                                            valid ? vp + pass * ROWS_PER_PASS * vs.token : v_cache, valid, policy);
        }
      } else {
        // Chunk c = lane + 32 * pass is row c / CPR, 16 bytes at (c % CPR).
        // One division per tile; later rows advance the (page, slot) pair
        // (at most one page step unless page_size is tiny).
        int row = lane / CPR;
        int p = (base + row) / page_size;
        int slot = base + row - p * page_size;
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
          const int c = lane + 32 * pass;
          // (32 % CPR == 0: every lane's rows advance 32 / CPR per pass)
          const int r = 32 % CPR == 0 ? lane / CPR + pass * (32 / CPR) : c / CPR;
          const int col = (32 % CPR == 0 ? lane % CPR : c % CPR) * ELEMS_PER_CHUNK;
          if (pass > 0) {
            slot += 32 % CPR == 0 ? 32 / CPR : r - row;
            row = r;
            while (slot >= page_size) {
              slot -= page_size;
              ++p;
            }
          }
          const bool valid = base + r < s1;
          const KV* kp = k_cache;
          const KV* vp = v_cache;
          if (valid) {
            const long long page = sm.page_ids[p - win];
            kp = k_cache + page * ks.page + slot * ks.token + k_head + col;
            vp = v_cache + page * vs.page + slot * vs.token + v_head + col;
          }
          const int at = L::at(r, col * (int)sizeof(KV));
          if (PAIRED && pass % 2 != half) continue;  // (the partner's pass; the walk above still advanced)
          cp_async_16<L2_HINT, EVICT_FIRST>(dst(0, r, at), kp, valid, policy);
          cp_async_16<L2_HINT, EVICT_FIRST>(dst(1, r, at), vp, valid, policy);
        }
      }
    };
    auto consume = [&](int stage, int it) {
      auto* kv = tile_at(stage);
      tile.template step<LO>(kv[0], kv[1], s0 + it * CTA_TILE + tix * MMA_TILE, lo, s1);
    };
    // (lanes read each other's copies; a pair's two warps each other's, past the pair's barrier)
    if constexpr (PAIRED)
      cp_async_ring<2 * STAGES, false, true>(n_iter, copy, consume, 1 + tix);
    else
      cp_async_ring<STAGES, true>(n_iter, copy, consume);
  });
}

// 16-bit KV: the query heads are the M rows of S = Q K^T (rows 8..15 and
// rows >= HEADS are zero), tokens are N; O += P V with P straight from the S
// accumulators (their layout is the A layout). Measured faster than the
// transposed tile below for 16-bit KV on the largest cells (4-6 % at batch
// 128, H200, 2026-11-29): one shuffle pair per tile instead of three.
// GROUPS (a row group, RowGroup): all 16 rows are query rows, row r token
// r / HEADS's head r % HEADS with its own causal end; a lane keeps rows g and
// g + 8 (HALVES), so the K/V tile is read once for up to 16 / HEADS tokens.
template <typename T, int HEAD_DIM, int HEADS, bool GROUPS>
struct RowsTile {
  static_assert(HEADS <= 8, "query heads are MMA rows 0..7");
  using M = Mma<T>;
  using L = MmaLayout<T, HEAD_DIM>;
  using Row = unsigned char[L::ROW_BYTES];
  static constexpr int KSTEPS = HEAD_DIM / 16, NT = HEAD_DIM / 8;  // k-steps; output n-tiles of 8 dims
  static constexpr int HALVES = GROUPS ? 2 : 1;  // MMA rows g (and g + 8) this lane keeps
  unsigned qa[HALVES][KSTEPS][2];  // Q A fragments: rows g (+8), columns 16k + 2t (+8)
  float o[NT][4];          // O rows g and g + 8 (zero without GROUPS), dims 8n + 2t, +1
  float m[HALVES], l[HALVES];  // each row's running max and this lane's share of its sum
  int lim[HALVES];         // GROUPS: each row's causal end (slot)
  int rows;                // query rows in use
  float score_scale;
  ScoreMap sc;
  int g, t, lane;

  __device__ __forceinline__ RowsTile(const T* __restrict__ q, long long stride_q_head, ScoreMap sc_, RowGroup rg)
      : sc(sc_), g(threadIdx.x % 32 / 4), t(threadIdx.x % 4), lane(threadIdx.x % 32) {
    rows = GROUPS ? rg.rows : HEADS;
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      const int r = g + 8 * h;
      const T* qr = GROUPS ? q + (r / HEADS) * rg.stride_q_row + (r % HEADS) * stride_q_head : q + g * stride_q_head;
      score_scale = sc.scale * load_q_fragments<T, false, KSTEPS>(qr, r < rows, t, qa[h]);  // (1 for 16-bit q)
      m[h] = neg_inf();
      l[h] = 0.f;
      lim[h] = GROUPS ? rg.lim0 + r / HEADS : 0;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  }

  template <bool LO>
  __device__ __forceinline__ void step(const Row* kt, const Row* vt, int base, int lo, int s1) {
    // S = Q K^T: two n-tiles of 8 tokens; one ldmatrix.x4 covers 32 dims of one n-tile
    // (an odd last k-step, head_dim 80: one ldmatrix.x2 of 16 dims). Even and odd
    // k-steps accumulate apart (s, s_odd), summed after: four MMA chains of half
    // the length, since the step waits on MMA latency (2 warps per scheduler):
    // 1-4 % less time at q_len 8 on the H200 (docs/architecture.md).
    float s[2][4], s_odd[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      s_odd[n][0] = s_odd[n][1] = s_odd[n][2] = s_odd[n][3] = 0.f;
#pragma unroll
      for (int k = 0; k < KSTEPS; k += 2) {
        unsigned b[4];
        if (k + 1 < KSTEPS) {
          ldmatrix_x4(b, &kt[n * 8 + (lane % 8)][L::at(lane, (k * 16 + (lane / 8) * 8) * 2)]);
        } else {
          ldmatrix_x2(b, &kt[n * 8 + (lane % 8)][L::at(lane, (k * 16 + (lane / 8 % 2) * 8) * 2)]);
        }
        M::mma(s[n], qa[0][k][0], GROUPS ? qa[HALVES - 1][k][0] : 0u, qa[0][k][1],
               GROUPS ? qa[HALVES - 1][k][1] : 0u, b[0], b[1]);
        if (k + 1 < KSTEPS)
          M::mma(s_odd[n], qa[0][k + 1][0], GROUPS ? qa[HALVES - 1][k + 1][0] : 0u, qa[0][k + 1][1],
                 GROUPS ? qa[HALVES - 1][k + 1][1] : 0u, b[2], b[3]);
      }
    }
    // Online softmax of rows g (s[n][0..1]) and g + 8 (s[n][2..3]) over this
    // tile's 16 tokens (4 lanes per row).
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2 * HALVES; ++e) s[n][e] = (s[n][e] + s_odd[n][e]) * score_scale;
    if (sc.soft_cap > 0.f) {  // uniform branch
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2 * HALVES; ++e) s[n][e] = sc.cap(s[n][e]);
    }
    if (LO && base < lo) {  // (uniform: a range's first tile only, its slots before lo)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2 * HALVES; ++e)
          if (base + n * 8 + 2 * t + e % 2 < lo) s[n][e] = neg_inf();
    }
    float m_new[HALVES], m_safe[HALVES];
    bool grew = false;
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      const int end = GROUPS ? min(s1, lim[h]) : s1;
      float mx = neg_inf();
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (base + n * 8 + 2 * t + e >= end) s[n][2 * h + e] = neg_inf();
          mx = fmaxf(mx, s[n][2 * h + e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // The running max moves only when the tile passes it by more than 8 (log2
      // units): P stays <= 2^8 (f16/bf16 keep its relative precision, l is f32)
      // and the O rescale below runs only then (FlashAttention-4's lazy rescale).
      m_new[h] = mx > m[h] + 8.f ? mx : m[h];
      m_safe[h] = m_new[h] == neg_inf() ? 0.f : m_new[h];
      grew = grew || m_new[h] > m[h];
    }
    if (__any_sync(0xffffffffu, grew)) {  // rarely after the first tiles
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
    float p[2][4];
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      m[h] = m_new[h];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          p[n][2 * h + e] = fast_exp2(s[n][2 * h + e] - m_safe[h]);
          l[h] += p[n][2 * h + e];
        }
    }
    // P as the A fragment of P.V: tokens 2t, 2t+1 (n-tile 0) and 2t+8, 2t+9
    // (n-tile 1) of rows g (a0, a2) and g + 8 (a1, a3).
    const unsigned pa0 = M::pack(p[0][0], p[0][1]);
    const unsigned pa2 = M::pack(p[1][0], p[1][1]);
    const unsigned pa1 = GROUPS ? M::pack(p[0][2], p[0][3]) : 0u;
    const unsigned pa3 = GROUPS ? M::pack(p[1][2], p[1][3]) : 0u;
    // O += P V: one ldmatrix.x4.trans gives the B fragments of 16 dims.
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
      unsigned b[4];
      ldmatrix_x4_trans(b, &vt[((lane / 8) % 2) * 8 + (lane % 8)][L::at(lane, (n * 8 + (lane / 16) * 8) * 2)]);
      M::mma(o[n], pa0, pa1, pa2, pa3, b[0], b[1]);
      M::mma(o[n + 1], pa0, pa1, pa2, pa3, b[2], b[3]);
    }
  }

  // This warp's states as entry `warp` of st, rows from roff (a pair's second warp: after the first's).
  template <typename States>
  __device__ __forceinline__ void store(States& st, int warp, int roff) {
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      float lh = l[h];
      lh += __shfl_xor_sync(0xffffffffu, lh, 1);
      lh += __shfl_xor_sync(0xffffffffu, lh, 2);
      const int r = g + 8 * h;
      if (r < rows) {
        if (t == 0) {
          st.m[warp][roff + r] = m[h];
          st.l[warp][roff + r] = lh;
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
          *reinterpret_cast<float2*>(&st.acc[warp][roff + r][n * 8 + 2 * t]) =
              make_float2(o[n][2 * h], o[n][2 * h + 1]);
      }
    }
  }
};

// The transposed tile: tokens and head dims as the M rows and the (at most
// 8) query heads as the N columns: S^T = K Q^T (one m16n8k16 per 16 dims of a
// 16-token tile) and O^T += V^T P^T (one per 16 output dims). P^T comes out
// of the S^T accumulators in the A/C layout; movmatrix turns it into the B
// layout. A lane keeps O^T as head_dim / 16 m-tiles of 4 floats, half of
// RowsTile's O, so it serves what RowsTile cannot hold in registers:
// - fp8 KV: every A fragment is widened from e4m3 in registers, and this
//   layout widens each K/V byte once (the rows layout would need the
//   byte-split V twice as B fragments);
// - 16-bit KV at head_dim > 128 (MmaCols): K as A straight from ldmatrix, V^T
//   from ldmatrix.trans.
// GROUPS (a row group, RowGroup): the 8 columns are query rows, column c
// token c / HEADS's head c % HEADS with its own causal end.
template <typename T, typename KV, int HEAD_DIM, int HEADS, bool GROUPS>
struct ColsTile {
  static_assert(HEADS <= 8, "query heads are the MMA's 8 N columns");
  static constexpr bool FP8 = IsSame<KV, e4m3>::value;
  using M = Mma<typename Select<FP8, f16, KV>::type>;  // e4m3 widens exactly to f16
  using L = MmaLayout<KV, HEAD_DIM>;
  using Row = unsigned char[L::ROW_BYTES];
  static constexpr int KSTEPS = HEAD_DIM / 16, MT = HEAD_DIM / 16;  // k-steps; O^T m-tiles of 16 dims
  // Q^T B fragments (column g = query head g). fp8: held in registers
  // (permuted k order). 16-bit: re-read (L1) each tile from column g's q row
  // + 2t (null: a column not in use), which keeps 24 registers at head_dim
  // 192 out of the loop (else the rows family spills). (QRow's unused pair
  // keeps the member layout of the build measured on the H200: the layout
  // changes the register allocation, docs/architecture.md.)
  struct QRow {
    unsigned unused[1][2];
    const T* row;
  };
  typename Select<FP8, unsigned[KSTEPS][2], QRow>::type qb;
  float o[MT][4];          // O^T rows (dims: dim_of(i, 0), dim_of(i, 1)), columns (heads 2t, 2t + 1)
  float m0, m1, l0, l1;    // heads 2t and 2t + 1 (l: this lane's share of the sum)
  int rows;               // query columns in use
  int lim0, lim1;         // GROUPS: the causal ends (slot) of columns 2t and 2t + 1
  float score_scale;
  ScoreMap sc;
  int g, t, lane;

  __device__ __forceinline__ ColsTile(const T* __restrict__ q, long long stride_q_head, ScoreMap sc_, RowGroup rg)
      : m0(neg_inf()), m1(neg_inf()), l0(0.f), l1(0.f), sc(sc_), g(threadIdx.x % 32 / 4), t(threadIdx.x % 4),
        lane(threadIdx.x % 32) {
    rows = GROUPS ? rg.rows : HEADS;
    lim0 = GROUPS ? rg.lim0 + 2 * t / HEADS : 0;
    lim1 = GROUPS ? rg.lim0 + (2 * t + 1) / HEADS : 0;
    const T* qg = GROUPS ? q + (g / HEADS) * rg.stride_q_row + (g % HEADS) * stride_q_head : q + g * stride_q_head;
    if constexpr (FP8) {
      score_scale = sc.scale * load_q_fragments<T, FP8, KSTEPS>(qg, g < rows, t, qb);
    } else {
      qb.row = g < rows ? qg + 2 * t : nullptr;
      score_scale = sc.scale;
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  }

  // The head dim of O^T row g (h = 0) or g + 8 (h = 1) of m-tile i.
  __device__ __forceinline__ int dim_of(int i, int h) const { return FP8 ? 16 * i + 2 * g + h : 16 * i + g + 8 * h; }

  template <bool LO>
  __device__ __forceinline__ void step(const Row* kt, const Row* vt, int base, int lo, int s1) {
    static_assert(!LO, "LO (16-bit KV, 32 % CPR == 0) has RowsTile instances only");
    // S^T = K Q^T: rows tokens g, g + 8; columns heads 2t, 2t + 1. One
    // ldmatrix.x4 covers 32 bytes of the tile's 16 rows: matrix j is tokens
    // (j % 2) * 8.. and bytes 16 * (j / 2).. of the block. 16-bit: that is
    // one k-step's A fragment. fp8: 32 dims, two k-steps; a lane's 4 bytes
    // are dims 4t..4t+3, the permuted k order of load_q_fragments. Two
    // accumulators (even and odd k-steps) halve the dependent MMA chain.
    float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kb = 0; kb < HEAD_DIM * (int)sizeof(KV) / 32; ++kb) {
      unsigned a[4];
      ldmatrix_x4(a, &kt[((lane / 8) % 2) * 8 + (lane % 8)][L::at(lane, kb * 32 + (lane / 16) * 16)]);
      if constexpr (FP8) {
        M::mma(sa, fp8_lo(a[0]), fp8_lo(a[1]), fp8_hi(a[0]), fp8_hi(a[1]), qb[2 * kb][0], qb[2 * kb][1]);
        M::mma(sb, fp8_lo(a[2]), fp8_lo(a[3]), fp8_hi(a[2]), fp8_hi(a[3]), qb[2 * kb + 1][0], qb[2 * kb + 1][1]);
      } else {
        // (B = Q^T's fragments are Q's A fragments: natural order)
        const unsigned* qr = reinterpret_cast<const unsigned*>(qb.row + kb * 16);
        const unsigned b0 = qb.row ? __ldg(qr) : 0u, b1 = qb.row ? __ldg(qr + 4) : 0u;
        M::mma(kb % 2 ? sb : sa, a[0], a[1], a[2], a[3], b0, b1);
      }
    }
    float s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = (sa[i] + sb[i]) * score_scale;
    if (sc.soft_cap > 0.f) {  // uniform branch
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] = sc.cap(s[i]);
    }
    if constexpr (GROUPS) {  // columns 2t and 2t + 1 end where their tokens do
      const int e0 = min(s1, lim0), e1 = min(s1, lim1);
      if (base + g >= e0) s[0] = neg_inf();
      if (base + g >= e1) s[1] = neg_inf();
      if (base + g + 8 >= e0) s[2] = neg_inf();
      if (base + g + 8 >= e1) s[3] = neg_inf();
    } else {
      if (base + g >= s1) s[0] = s[1] = neg_inf();
      if (base + g + 8 >= s1) s[2] = s[3] = neg_inf();
    }

    // Online softmax per head (column) over the tile's 16 tokens: the 8
    // lanes of one t hold a column's rows.
    float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float ms0 = mn0 == neg_inf() ? 0.f : mn0, ms1 = mn1 == neg_inf() ? 0.f : mn1;
    if (__any_sync(0xffffffffu, mn0 > m0 || mn1 > m1)) {  // the max grows O(log n) times
      const float a0 = fast_exp2(m0 - ms0), a1 = fast_exp2(m1 - ms1);
      l0 *= a0;
      l1 *= a1;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        o[i][0] *= a0;
        o[i][1] *= a1;
        o[i][2] *= a0;
        o[i][3] *= a1;
      }
    }
    m0 = mn0;
    m1 = mn1;
    const float p0 = fast_exp2(s[0] - ms0), p1 = fast_exp2(s[1] - ms1);
    const float p2 = fast_exp2(s[2] - ms0), p3 = fast_exp2(s[3] - ms1);
    l0 += p0 + p2;
    l1 += p1 + p3;
    // P^T (tokens x heads, C layout) -> B fragments of O^T = V^T P^T:
    // b0 = P[head g][tokens 2t, 2t+1], b1 = P[head g][tokens 2t+8, 2t+9].
    const unsigned pb0 = movmatrix_trans(M::pack(p0, p1));
    const unsigned pb1 = movmatrix_trans(M::pack(p2, p3));
    // O^T += V^T P^T, one m-tile of 16 dims per MMA.
#pragma unroll
    for (int db = 0; db < HEAD_DIM * (int)sizeof(KV) / 32; ++db) {
      unsigned v[4];
      if constexpr (FP8) {
        // ldmatrix.trans of one-byte V gives a lane dims 2g, 2g+1 of tokens
        // 2t, 2t+1; split into even and odd dims they are the A rows g and
        // g + 8 of m-tile 2db + h: rows (g, g + 8) are dims 32db + 16h + 2g + (0, 1).
        ldmatrix_x4_trans(v, &vt[((lane / 8) % 2) * 8 + (lane % 8)][L::at(lane, db * 32 + (lane / 16) * 16)]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const unsigned x = byte_deinterleave(v[2 * h]), y = byte_deinterleave(v[2 * h + 1]);
          M::mma(o[2 * db + h], fp8_lo(x), fp8_hi(x), fp8_lo(y), fp8_hi(y), pb0, pb1);
        }
      } else {
        // 16 dims of 16 tokens: matrix j is tokens (j / 2) * 8.. and dims
        // 16db + (j % 2) * 8..; transposed, a lane holds V^T's A fragment
        // (rows dims g, g + 8; columns tokens 2t, 2t + 1 and 2t + 8, 2t + 9).
        ldmatrix_x4_trans(v, &vt[(lane / 16) * 8 + (lane % 8)][L::at(lane, db * 32 + ((lane / 8) % 2) * 16)]);
        M::mma(o[db], v[0], v[1], v[2], v[3], pb0, pb1);
      }
    }
  }

  template <typename States>  // (as RowsTile::store)
  __device__ __forceinline__ void store(States& st, int warp, int roff) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, off);
      l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    const int h0 = 2 * t, h1 = 2 * t + 1;
    if (g == 0) {
      if (h0 < rows) {
        st.m[warp][roff + h0] = m0;
        st.l[warp][roff + h0] = l0;
      }
      if (h1 < rows) {
        st.m[warp][roff + h1] = m1;
        st.l[warp][roff + h1] = l1;
      }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      if constexpr (FP8) {  // (adjacent dims: one float2 per head)
        if (h0 < rows)
          *reinterpret_cast<float2*>(&st.acc[warp][roff + h0][dim_of(i, 0)]) = make_float2(o[i][0], o[i][2]);
        if (h1 < rows)
          *reinterpret_cast<float2*>(&st.acc[warp][roff + h1][dim_of(i, 0)]) = make_float2(o[i][1], o[i][3]);
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h0 < rows) st.acc[warp][roff + h0][dim_of(i, h)] = o[i][2 * h];
          if (h1 < rows) st.acc[warp][roff + h1][dim_of(i, h)] = o[i][2 * h + 1];
        }
      }
    }
  }
};

// Which tile a (KV format, head_dim) runs: ColsTile for fp8, and for 16-bit
// head dims above 128 (RowsTile's O would need 96+ registers a lane at 192:
// 255 registers and spills); RowsTile otherwise. Mirrored by
// cupaged/_configs.py mma_cols.
template <typename KV, int HEAD_DIM>
struct MmaCols {
  static constexpr bool value = IsSame<KV, e4m3>::value || HEAD_DIM > 128;
};

// Query rows one tensor-core CTA holds: its HEADS heads, or with row groups
// the MMA's 16 M rows (RowsTile) or 8 N columns (ColsTile).
template <typename KV, int HEAD_DIM, int HEADS, bool GROUPS>
struct MmaRows {
  static constexpr int value = !GROUPS ? HEADS : MmaCols<KV, HEAD_DIM>::value ? 8 : 16;
};

// Same contract as cta_attend (attend.cuh); all MMA_THREADS threads call it.
// T is the query/output storage type, KV the cache's (T, or e4m3). With
// GROUPS, rg's rows (a row group) instead of the HEADS heads at q; PAIRED
// (with GROUPS): up to twice the tokens a tile's rows hold, the first
// TOKENS on even warps and the rest on odd ones, pairs sharing K/V tiles.
template <typename T, typename KV, int HEAD_DIM, int HEADS, bool GROUPS, bool PAIRED, typename Emit>
__device__ __forceinline__ void cta_attend_mma(
    const T* __restrict__ q, long long stride_q_head, ScoreMap sc,
    const KV* __restrict__ k_cache, CacheStrides ks,
    const KV* __restrict__ v_cache, CacheStrides vs, int kv_head,
    const int* __restrict__ req_pages, int page_size, int slot_begin, int slot_end, RowGroup rg,
    MmaScratch<T, KV, HEAD_DIM, MmaRows<KV, HEAD_DIM, HEADS, GROUPS>::value>& sm, Emit& emit) {
  using Tile = typename Select<MmaCols<KV, HEAD_DIM>::value, ColsTile<T, KV, HEAD_DIM, HEADS, GROUPS>,
                               RowsTile<T, HEAD_DIM, HEADS, GROUPS>>::type;
  static_assert(!PAIRED || (GROUPS && MMA_WARPS % 2 == 0), "warp pairs serve row groups");
  constexpr int TOKENS = MmaRows<KV, HEAD_DIM, HEADS, GROUPS>::value / HEADS;  // per warp
  const int half = PAIRED ? threadIdx.x / 32 % 2 : 0;
  // (a warp of a pair: its half of the rows, after the first TOKENS tokens for odd warps)
  const RowGroup mine = PAIRED ? RowGroup{rg.stride_q_row, min(max(rg.rows - half * TOKENS * HEADS, 0), TOKENS * HEADS),
                                          rg.lim0 + half * TOKENS}
                               : rg;
  Tile tile(PAIRED ? q + half * TOKENS * rg.stride_q_row : q, stride_q_head, sc, mine);
  // (LO where it was measured, and where it then takes whole tiles: mma_token_loop)
  constexpr bool LO = !GROUPS && sizeof(KV) == 2 && 32 % MmaLayout<KV, HEAD_DIM>::CPR == 0;
  mma_token_loop<KV, HEAD_DIM, PAIRED, LO>(k_cache, ks, v_cache, vs, kv_head, req_pages, page_size, slot_begin,
                                           slot_end, sm, tile);
  __syncthreads();  // the ring becomes the combine buffer
  if constexpr (PAIRED) {
    tile.store(sm.paired, threadIdx.x / 64, half * TOKENS * HEADS);
    __syncthreads();
    emit_combined<MMA_WARPS / 2, MMA_THREADS>(sm.paired, sc.out_scale, emit);
  } else {
    tile.store(sm.combine, threadIdx.x / 32, 0);
    __syncthreads();
    emit_combined<MMA_WARPS, MMA_THREADS>(sm.combine, sc.out_scale, emit);
  }
}

}  // namespace cupaged
