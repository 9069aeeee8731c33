// Tensor-core attention core for 16-bit KV (fp16, bf16): the same contract
// as cta_attend (attend.cuh), computed with mma.sync.m16n8k16 (f32 accumulate).
//
// Why: on CUDA cores every K/V element costs a multiply-add per query head
// plus shuffle reductions, and the SM issue rate, not memory, bounds decode
// well below the HBM roofline. With tensor cores a warp does 16 tokens x
// head_dim of Q.K^T and P.V in a few dozen instructions.
//
// Mapping: MMA_WARPS warps; each owns 16 consecutive tokens per stage and
// keeps its own online softmax. The query heads are the M rows of the MMA
// (rows >= HEADS, and rows 8..15, are zero), tokens are N for S = Q.K^T and
// K for O += P.V. K/V tiles go global -> shared with cp.async (a ring of
// STAGES per warp, rows padded by 16 bytes so ldmatrix is conflict-free);
// K is read with ldmatrix (B operand of S), V with ldmatrix.trans (B of P.V),
// and P stays in registers (the S accumulator layout is the A layout).
// P is rounded to the KV dtype for the second MMA (as in FlashAttention); the
// denominator keeps the f32 P, so the LSE stays f32-accurate and an output
// can exceed its inputs by ~1 ulp of the KV dtype (fp16 stores saturate it).
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
  __device__ __forceinline__ static void mma(float* c, unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};
template <> struct Mma<bf16> {
  __device__ __forceinline__ static void mma(float* c, unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
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

template <int HEAD_DIM>
struct MmaLayout {
  static constexpr int ROW = HEAD_DIM + 8;  // elements per smem row: +16 bytes, conflict-free ldmatrix
  static constexpr int STAGE_BYTES = MMA_WARPS * 2 * MMA_TILE * ROW * 2;
  static constexpr int BUDGET = MMA_SMEM_BYTES - PAGE_WINDOW * 4;
  static constexpr int STAGES = BUDGET / STAGE_BYTES < MMA_MAX_STAGES ? BUDGET / STAGE_BYTES : MMA_MAX_STAGES;
  static_assert(STAGES >= 2, "the K/V ring needs two stages: raise CUPAGED_MMA_SMEM_KB");
};

template <typename T, int HEAD_DIM, int HEADS>
struct MmaScratch {
  using L = MmaLayout<HEAD_DIM>;
  int page_ids[PAGE_WINDOW];
  union __align__(16) {
    unsigned short kv[L::STAGES][MMA_WARPS][2][MMA_TILE][L::ROW];  // [stage][warp][K or V][token][dim]
    WarpStates<MMA_WARPS, HEADS, HEAD_DIM> combine;
  };
};

// Same contract as cta_attend (attend.cuh); all MMA_THREADS threads call it.
template <typename T, int HEAD_DIM, int HEADS, typename Emit>
__device__ __forceinline__ void cta_attend_mma(
    const T* __restrict__ q, long long stride_q_head, float scale_log2,
    const T* __restrict__ k_cache, CacheStrides ks,
    const T* __restrict__ v_cache, CacheStrides vs, int kv_head,
    const int* __restrict__ req_pages, int page_size, int slot_begin, int slot_end,
    MmaScratch<T, HEAD_DIM, HEADS>& sm, Emit& emit) {
  static_assert(HEADS <= 8, "query heads are MMA rows 0..7");
  using L = MmaLayout<HEAD_DIM>;
  using M = Mma<T>;
  constexpr int STAGES = L::STAGES;
  constexpr int KSTEPS = HEAD_DIM / 16;
  constexpr int NT = HEAD_DIM / 8;                       // output n-tiles
  constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;           // 16-byte chunks per token row
  constexpr int ROWS_PER_PASS = 32 / CHUNKS_PER_ROW;
  constexpr int PASSES = MMA_TILE / ROWS_PER_PASS;
  constexpr int CTA_TILE = MMA_WARPS * MMA_TILE;
  static_assert(32 % CHUNKS_PER_ROW == 0 && MMA_TILE % ROWS_PER_PASS == 0, "unsupported HEAD_DIM");

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // MMA fragment row (query head) and column pair

  // Q as A fragments: a0 = Q[g][16k + 2t, +1], a2 = Q[g][16k + 2t + 8, +1].
  unsigned qa[KSTEPS][2];
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k) {
    if (g < HEADS) {
      const unsigned* qr = reinterpret_cast<const unsigned*>(q + g * stride_q_head + k * 16 + 2 * t);
      qa[k][0] = __ldg(qr);
      qa[k][1] = __ldg(qr + 4);
    } else {
      qa[k][0] = qa[k][1] = 0u;
    }
  }

  float o[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m = neg_inf(), l = 0.f;  // row g; l is this lane's share of the row sum

  const long long k_head = (long long)kv_head * ks.head;
  const long long v_head = (long long)kv_head * vs.head;
  const int my_col = (lane % CHUNKS_PER_ROW) * 8;
  const int my_row = lane / CHUNKS_PER_ROW;

  for_each_page_window<MMA_THREADS>(req_pages, page_size, slot_begin, slot_end, sm.page_ids,
                                    [&](int win, int s0, int s1) {
    const int n_iter = (s1 - s0 + CTA_TILE - 1) / CTA_TILE;

    auto issue = [&](int it) {
      if (it < n_iter) {
        const int stage = it % STAGES;
        const int base = s0 + it * CTA_TILE + warp * MMA_TILE;
        // One division per tile; the lane's rows then advance ROWS_PER_PASS
        // slots per pass (at most one page step unless page_size is tiny).
        int p = (base + my_row) / page_size;
        int slot = base + my_row - p * page_size;
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
          const int row = my_row + pass * ROWS_PER_PASS;
          const bool valid = base + row < s1;
          if (pass > 0) {
            slot += ROWS_PER_PASS;
            while (slot >= page_size) {
              slot -= page_size;
              ++p;
            }
          }
          const T* kp = k_cache;
          const T* vp = v_cache;
          if (valid) {
            const long long page = sm.page_ids[p - win];
            kp = k_cache + page * ks.page + slot * ks.token + k_head + my_col;
            vp = v_cache + page * vs.page + slot * vs.token + v_head + my_col;
          }
          cp_async_16(&sm.kv[stage][warp][0][row][my_col], kp, valid);
          cp_async_16(&sm.kv[stage][warp][1][row][my_col], vp, valid);
        }
      }
      cp_async_commit();
    };

#pragma unroll
    for (int it = 0; it < STAGES - 1; ++it) issue(it);

    for (int it = 0; it < n_iter; ++it) {
      issue(it + STAGES - 1);  // refills the stage every lane finished reading last iteration
      cp_async_wait<STAGES - 1>();
      __syncwarp();  // other lanes' copies of this stage are visible
      const int stage = it % STAGES;
      const unsigned short(*kt)[L::ROW] = sm.kv[stage][warp][0];
      const unsigned short(*vt)[L::ROW] = sm.kv[stage][warp][1];
      const int base = s0 + it * CTA_TILE + warp * MMA_TILE;

      // S = Q K^T: two n-tiles of 8 tokens; one ldmatrix.x4 covers 32 dims.
      float s[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int k = 0; k < KSTEPS; k += 2) {
          unsigned b[4];
          ldmatrix_x4(b, &kt[n * 8 + (lane % 8)][k * 16 + (lane / 8) * 8]);
          M::mma(s[n], qa[k][0], qa[k][1], b[0], b[1]);
          M::mma(s[n], qa[k + 1][0], qa[k + 1][1], b[2], b[3]);
        }
      }

      // Online softmax of row g over this tile's 16 tokens (4 lanes per row).
      float mx = neg_inf();
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool valid = base + n * 8 + 2 * t + e < s1;
          s[n][e] = valid ? s[n][e] * scale_log2 : neg_inf();
          mx = fmaxf(mx, s[n][e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m, mx);
      const float m_safe = m_new == neg_inf() ? 0.f : m_new;
      if (__any_sync(0xffffffffu, m_new > m)) {  // the max grows O(log n) times
        const float alpha = fast_exp2(m - m_safe);
        l *= alpha;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          o[n][0] *= alpha;
          o[n][1] *= alpha;
        }
      }
      m = m_new;
      float p[2][2];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          p[n][e] = fast_exp2(s[n][e] - m_safe);
          l += p[n][e];
        }
      // P as the A fragment of P.V: tokens 2t, 2t+1 (n-tile 0) and 2t+8, 2t+9 (n-tile 1).
      const unsigned pa0 = M::pack(p[0][0], p[0][1]);
      const unsigned pa2 = M::pack(p[1][0], p[1][1]);

      // O += P V: one ldmatrix.x4.trans gives the B fragments of 16 dims.
#pragma unroll
      for (int n = 0; n < NT; n += 2) {
        unsigned b[4];
        ldmatrix_x4_trans(b, &vt[((lane / 8) % 2) * 8 + (lane % 8)][n * 8 + (lane / 16) * 8]);
        M::mma(o[n], pa0, pa2, b[0], b[1]);
        M::mma(o[n + 1], pa0, pa2, b[2], b[3]);
      }
      __syncwarp();  // every lane is done with this stage before it is refilled
    }
    cp_async_wait<0>();
  });

  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // the ring becomes the combine buffer
  if (g < HEADS) {
    if (t == 0) {
      sm.combine.m[warp][g] = m;
      sm.combine.l[warp][g] = l;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
      *reinterpret_cast<float2*>(&sm.combine.acc[warp][g][n * 8 + 2 * t]) = make_float2(o[n][0], o[n][1]);
  }
  __syncthreads();
  emit_combined<MMA_WARPS, MMA_THREADS>(sm.combine, emit);
}

}  // namespace cupaged
