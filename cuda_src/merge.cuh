// Merging normalized attention states, shared by the standalone merge kernel
// and the partial kernel's fused merge (the last CTA of a request).
#pragma once
#include "common.cuh"

namespace cupaged {

// Merges partials n in [n0, n1) of head h, dims [d, d + 4) (returns o and lse_out):
//   M = max_n lse[n,h];  w_n = exp2(lse[n,h] - M);  W = sum_n w_n
//   o = sum_n w_n * v[n,h,d:d+4] / W;  lse_out = M + log2(W)
// v is [N, num_heads, head_dim] float32 and lse [N, num_heads] float32 (log2),
// both contiguous. Loads go through L2 (ld.global.cg), so partials written by
// other CTAs of the same launch are seen once they fenced. Partials with
// lse = -inf contribute nothing (their v is ignored, whatever it holds); no
// finite partial gives zeros and -inf.
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
__device__ __noinline__ Merged merge_partials(const float* __restrict__ v, const float* __restrict__ lse,
                                              int n0, int n1, int num_heads, int head_dim, int h, int d) {
  constexpr int BATCH = 8;
  float m = neg_inf();
  float denom = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int n = n0; n < n1; n += BATCH) {
    float x[BATCH];
    float4 y[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const long long nh = (long long)(n + b) * num_heads + h;
      const bool in = n + b < n1;
      x[b] = in ? __ldcg(lse + nh) : neg_inf();
      y[b] = in ? __ldcg(reinterpret_cast<const float4*>(v + nh * head_dim + d)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float m_new = m;
#pragma unroll
    for (int b = 0; b < BATCH; ++b) m_new = fmaxf(m_new, x[b]);
    if (m_new == neg_inf()) continue;  // nothing finite yet
    const float r = fast_exp2(m - m_new);  // m = -inf -> 0; m == m_new -> 1
    acc.x *= r; acc.y *= r; acc.z *= r; acc.w *= r;
    denom *= r;
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const bool live = x[b] != neg_inf();
      const float w = live ? fast_exp2(x[b] - m_new) : 0.f;
      if (live) {  // a dead partial's v may be anything (NaN, inf): never multiply it
        acc.x = fmaf(w, y[b].x, acc.x); acc.y = fmaf(w, y[b].y, acc.y);
        acc.z = fmaf(w, y[b].z, acc.z); acc.w = fmaf(w, y[b].w, acc.w);
      }
      denom += w;
    }
    m = m_new;
  }
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
  return Merged{make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv),
                denom > 0.f ? m + fast_log2(denom) : neg_inf()};
}

}  // namespace cupaged
