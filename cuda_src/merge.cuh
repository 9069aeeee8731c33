// Merging normalized attention states, shared by the standalone merge kernel
// and the partial kernel's fused merge (the last CTA of a request).
#pragma once
#include "common.cuh"

namespace cupaged {

// Merges partials n in [n0, n1) of head h, dims [d, d + 4):
//   M = max_n lse[n,h];  w_n = exp2(lse[n,h] - M);  W = sum_n w_n
//   o = sum_n w_n * v[n,h,d:d+4] / W;  lse_out = M + log2(W)
// v is [N, num_heads, head_dim] float32 and lse [N, num_heads] float32 (log2),
// both contiguous. Loads go through L2 (ld.global.cg), so partials written by
// other CTAs of the same launch are seen once they fenced. Partials with
// lse = -inf contribute nothing and their v is not read; no finite partial
// gives zeros and -inf.
__device__ __forceinline__ void merge_partials(const float* __restrict__ v, const float* __restrict__ lse,
                                               int n0, int n1, int num_heads, int head_dim, int h, int d,
                                               float4& o, float& lse_out) {
  constexpr int BATCH = 8;  // independent loads in flight per pass
  float m = neg_inf();
  for (int n = n0; n < n1; n += BATCH) {
    float x[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      x[b] = n + b < n1 ? __ldcg(lse + (long long)(n + b) * num_heads + h) : neg_inf();
#pragma unroll
    for (int b = 0; b < BATCH; ++b) m = fmaxf(m, x[b]);
  }
  const float m_safe = m == neg_inf() ? 0.f : m;
  float denom = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int n = n0; n < n1; n += BATCH) {
    float w[BATCH];
    float4 x[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const long long nh = (long long)(n + b) * num_heads + h;
      w[b] = n + b < n1 ? fast_exp2(__ldcg(lse + nh) - m_safe) : 0.f;
      x[b] = w[b] > 0.f ? __ldcg(reinterpret_cast<const float4*>(v + nh * head_dim + d))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      acc.x = fmaf(w[b], x[b].x, acc.x); acc.y = fmaf(w[b], x[b].y, acc.y);
      acc.z = fmaf(w[b], x[b].z, acc.z); acc.w = fmaf(w[b], x[b].w, acc.w);
      denom += w[b];
    }
  }
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
  o = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  lse_out = denom > 0.f ? m_safe + fast_log2(denom) : neg_inf();
}

}  // namespace cupaged
