// merge_states<OUT_T, HEAD_DIM>: variable-length merge of attention states.
// Knows nothing of paging (cascade attention reuses it with any grouping).
//
// For output row r and head h, merges partials n in [o_indptr[r], o_indptr[r+1]):
//   M = max_n lse[n,h];  w_n = exp2(lse[n,h] - M);  W = sum_n w_n
//   v_out[r,h,:] = sum_n w_n * v[n,h,:] / W;      lse_out[r,h] = M + log2(W)
// Each partial must already be normalized by its own softmax denominator and
// its LSE must be in log2 units; lse_out is log2 too, so merges chain and the
// result is associative under regrouping (up to rounding).
// Edge behaviour: a partial with lse = -inf contributes nothing (its v is
// ignored); a row with no finite partial (or none at all) gets zeros and -inf.
//
// Grid: x = output row (M rows), y = ceil(num_heads / HEADS_PER_CTA).
// Block: 128 threads; HEAD_DIM / 4 threads per head, each owning 4 dims;
// HEADS_PER_CTA = 128 / (HEAD_DIM / 4) heads per block (leftover threads idle).
// Pointers:
//   v        [N, num_heads, HEAD_DIM] float32 contiguous
//   lse      [N, num_heads] float32 contiguous, log2 units
//   o_indptr [M + 1] int32, non-decreasing, o_indptr[M] <= N
//   v_out    [M, num_heads, HEAD_DIM] OUT_T, strides (stride_o_row, stride_o_head, 1)
//   lse_out  [M, num_heads] float32 contiguous, may be null
#include "merge.cuh"

namespace cupaged {

constexpr int MERGE_THREADS = 128;

template <typename OUT_T, int HEAD_DIM>
__global__ void __launch_bounds__(MERGE_THREADS) merge_states(
    const float* __restrict__ v, const float* __restrict__ lse, const int* __restrict__ o_indptr,
    int num_heads, OUT_T* __restrict__ v_out, long long stride_o_row, long long stride_o_head,
    float* __restrict__ lse_out) {
  constexpr int THREADS_PER_HEAD = HEAD_DIM / 4;
  constexpr int HEADS_PER_CTA = MERGE_THREADS / THREADS_PER_HEAD;
  static_assert(HEAD_DIM % 4 == 0 && HEADS_PER_CTA >= 1, "unsupported HEAD_DIM");
  const int row = blockIdx.x;
  const int h = blockIdx.y * HEADS_PER_CTA + threadIdx.x / THREADS_PER_HEAD;
  const int d = (threadIdx.x % THREADS_PER_HEAD) * 4;
  // (head_dim 96: 5 heads of 24 threads, the last 8 threads idle)
  if (h >= num_heads || threadIdx.x >= HEADS_PER_CTA * THREADS_PER_HEAD) return;
  const int n0 = o_indptr[row];
  const Merged r = merge_partials<1>(v, lse, {{n0}, {h}, {d}}, o_indptr[row + 1] - n0, num_heads, HEAD_DIM).m[0];
  OUT_T* out = v_out + row * stride_o_row + h * stride_o_head + d;
  Storage<OUT_T>::store(out, r.o.x); Storage<OUT_T>::store(out + 1, r.o.y);
  Storage<OUT_T>::store(out + 2, r.o.z); Storage<OUT_T>::store(out + 3, r.o.w);
  if (lse_out != nullptr && d == 0) lse_out[(long long)row * num_heads + h] = r.lse;
}

}  // namespace cupaged
