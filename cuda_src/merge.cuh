// Merging normalized attention states, shared by the standalone merge kernel
// and the partial kernel's fused merges (the last CTA of a request after a
// ticket, or its first chunk's CTA waiting on the values).
#pragma once
#include "common.cuh"

namespace cupaged {

// Merges partials n in [n0, n0 + count) of head h, dims [d, d + 4) (returns o and lse_out):
//   M = max_n lse[n,h];  w_n = exp2(lse[n,h] - M);  W = sum_n w_n
//   o = sum_n w_n * v[n,h,d:d+4] / W;  lse_out = M + log2(W)
// v is [N, num_heads, head_dim] float32 and lse [N, num_heads] float32 (log2),
// both contiguous. Partials with lse = -inf contribute nothing (their v is
// ignored, whatever it holds); no finite partial gives zeros and -inf.
//
// WAIT_WRITTEN (the partial kernel's waiting merge, merge_waiting): the
// partials are being written by other CTAs of the same launch, with no
// release; every float not yet written still holds PARTIAL_EMPTY (the
// workspace is allocated so and the merge puts it back). The loads are
// relaxed at GPU scope (the L2), and a step re-reads what is still empty
// until all of it is there: a 32-bit store is seen whole or not at all, so
// each value is the one written. (The ticket's merge and the standalone
// merge kernel read finished arrays.)
//
// One pass with a running max (online softmax): each step issues BATCH lse
// and BATCH v loads that depend on nothing, so a request of n chunks costs
// ceil(n / BATCH) L2 round trips. (A max pass followed by lse-dependent v
// loads cost three per step: ~3 us at 33 chunks, the tail of every split
// decode.)
// Not inlined: inlined into the partial kernel, this loop changed how ptxas
// scheduled the attention loop, which ran 6-8 % slower on unsplit cells
// (batch 128, ctx 4k/16k; H200 A/B, 2026-11-29); as a call it leaves that
// loop as it was. The result comes back by value (a reference would put the
// caller's variables on the stack).
struct Merged {
  float4 o;
  float lse;
};

// A workspace float not written yet: a NaN whose bits float arithmetic never
// yields (its NaN results are the canonical 0x7fffffff), so no partial holds it.
constexpr unsigned PARTIAL_EMPTY = 0xffffffffu;
// A merge that waits this many re-reads of a step has lost a writer: trap
// (an error at the next synchronize) rather than hang or read garbage.
constexpr int MERGE_MAX_SPINS = 1 << 22;

__device__ __forceinline__ bool is_empty(float x) { return __float_as_uint(x) == PARTIAL_EMPTY; }
__device__ __forceinline__ bool is_empty(float4 x) {
  return is_empty(x.x) | is_empty(x.y) | is_empty(x.z) | is_empty(x.w);
}
template <bool RELAXED>
__device__ __forceinline__ float load_partial(const float* p) {
  if constexpr (!RELAXED) return __ldcg(p);
  float r;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}
template <bool RELAXED>
__device__ __forceinline__ float4 load_partial4(const float* p) {
  if constexpr (!RELAXED) return __ldcg(reinterpret_cast<const float4*>(p));
  float4 r;
  asm volatile("ld.relaxed.gpu.global.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
               : "l"(p));
  return r;
}
// ITEMS such merges of n partials each, their loads issued together: item i
// is head h[i], dims [d[i], d[i] + 4), partials n0[i] .. n0[i] + n; h[i] < 0
// marks no item (its result is unspecified). A row group's last CTA merges
// every row of its group, several items a thread: two at a time halve its
// serial L2 round trips (H200: 1 x 1024 q_len 4 9.86 -> 9.47 us,
// docs/architecture.md "The grouped merge, two items at a time").
template <int ITEMS>
struct MergeItems {
  int n0[ITEMS], h[ITEMS], d[ITEMS];
};
template <int ITEMS>
struct MergedItems {
  Merged m[ITEMS];
};
template <int ITEMS, bool WAIT_WRITTEN = false>
__device__ __noinline__ MergedItems<ITEMS> merge_partials(const float* __restrict__ v, const float* __restrict__ lse,
                                                          MergeItems<ITEMS> it, int n, int num_heads, int head_dim) {
  constexpr int BATCH = 8;
  float m[ITEMS], denom[ITEMS];
  float4 acc[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    m[i] = neg_inf();
    denom[i] = 0.f;
    acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int c = 0; c < n; c += BATCH) {
    float x[ITEMS][BATCH];
    float4 y[ITEMS][BATCH];
    // (WAIT_WRITTEN: the step's loads again while any value is still empty;
    // dead items and slots past n hold -inf and zeros, never empty. The test
    // follows all of the step's loads, so they stay in flight together.)
    for (int spins = 0;; ++spins) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
          const long long nh = (long long)(it.n0[i] + c + b) * num_heads + it.h[i];
          const bool in = c + b < n && (ITEMS == 1 || it.h[i] >= 0);
          x[i][b] = in ? load_partial<WAIT_WRITTEN>(lse + nh) : neg_inf();
          y[i][b] = in ? load_partial4<WAIT_WRITTEN>(v + nh * head_dim + it.d[i]) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      if constexpr (!WAIT_WRITTEN) break;
      bool empty = false;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int b = 0; b < BATCH; ++b) empty |= is_empty(x[i][b]) | is_empty(y[i][b]);
      if (!empty) break;
      if (spins == MERGE_MAX_SPINS) __trap();
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float m_new = m[i];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) m_new = fmaxf(m_new, x[i][b]);
      if (m_new == neg_inf()) continue;  // nothing finite yet
      const float r = fast_exp2(m[i] - m_new);  // m = -inf -> 0; m == m_new -> 1
      acc[i].x *= r; acc[i].y *= r; acc[i].z *= r; acc[i].w *= r;
      denom[i] *= r;
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        const bool live = x[i][b] != neg_inf();
        const float w = live ? fast_exp2(x[i][b] - m_new) : 0.f;
        if (live) {  // a dead partial's v may be anything (NaN, inf): never multiply it
          acc[i].x = fmaf(w, y[i][b].x, acc[i].x); acc[i].y = fmaf(w, y[i][b].y, acc[i].y);
          acc[i].z = fmaf(w, y[i][b].z, acc[i].z); acc[i].w = fmaf(w, y[i][b].w, acc[i].w);
        }
        denom[i] += w;
      }
      m[i] = m_new;
    }
  }
  MergedItems<ITEMS> out;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const float inv = denom[i] > 0.f ? 1.f / denom[i] : 0.f;
    out.m[i] = Merged{make_float4(acc[i].x * inv, acc[i].y * inv, acc[i].z * inv, acc[i].w * inv),
                      denom[i] > 0.f ? m[i] + fast_log2(denom[i]) : neg_inf()};
  }
  return out;
}

}  // namespace cupaged
