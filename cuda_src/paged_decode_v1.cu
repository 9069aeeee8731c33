// paged_decode_v1<T, HEAD_DIM>: the pre-split baseline, kept for the
// three-way comparison (gather vs v1 vs v2).
//
// Computes the attention of one query head over all visible tokens of one
// request and writes the final output (and optionally its LSE, log2 units).
// Scores and soft cap as paged_decode_partial (scale, soft_cap; per-tensor
// scales only: the host folds k_scale into scale), output times v_scale.
// Grid: x = request, y = query head. Block: NUM_THREADS (128) threads that
// split the request's tokens among themselves (the KV split happens inside
// the CTA, so parallelism does not grow with context). Query head h reads
// kv head h / group_size; each K/V element is read once per query head.
//
// Pointers (element strides in elements of T; head_dim contiguous):
//   q                [batch, num_qo_heads, HEAD_DIM] T, strides (stride_q_batch, stride_q_head, 1)
//   k_cache, v_cache [num_pages, page_size, num_kv_heads, HEAD_DIM] T, NHD, strides per CacheStrides
//   indices [indptr[batch]], indptr [batch + 1], last_page_len, first_page_offset [batch]: int32
//   out              [batch, num_qo_heads, HEAD_DIM] T, strides (stride_o_batch, stride_o_head, 1)
//   lse              [batch, num_qo_heads] float32 contiguous, may be null
// Preconditions: as paged_decode_partial (validated table, ids < num_pages,
// 16-byte alignment). Edge behaviour: an empty request writes zeros and -inf.
#include "attend.cuh"

namespace cupaged {

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(NUM_THREADS, 1) paged_decode_v1(
    const T* __restrict__ q, long long stride_q_batch, long long stride_q_head,
    const T* __restrict__ k_cache, long long stride_k_page, long long stride_k_token, long long stride_k_head,
    const T* __restrict__ v_cache, long long stride_v_page, long long stride_v_token, long long stride_v_head,
    const int* __restrict__ indices, const int* __restrict__ indptr,
    const int* __restrict__ last_page_len, const int* __restrict__ first_page_offset,
    int page_size, int num_qo_heads, int group_size, float scale, float soft_cap, float v_scale,
    T* __restrict__ out, long long stride_o_batch, long long stride_o_head, float* __restrict__ lse) {
  __shared__ AttendScratch<T, HEAD_DIM, 1> sm;
  const int req = blockIdx.x, head = blockIdx.y;
  const int page0 = indptr[req];
  const int pages = indptr[req + 1] - page0;
  int slot_begin, slot_end;
  visible_slots(pages, first_page_offset[req], last_page_len[req], page_size, 0, pages, slot_begin, slot_end);
  EmitStrided<T> emit{out + req * stride_o_batch + head * stride_o_head, stride_o_head,
                      lse == nullptr ? nullptr : lse + (long long)req * num_qo_heads + head};
  cta_attend<T, HEAD_DIM, 1>(q + req * stride_q_batch + head * stride_q_head, stride_q_head,
                             ScoreMap{scale, soft_cap, v_scale},
                             k_cache, CacheStrides{stride_k_page, stride_k_token, stride_k_head},
                             v_cache, CacheStrides{stride_v_page, stride_v_token, stride_v_head},
                             head / group_size, indices + page0, page_size, slot_begin, slot_end, sm, emit);
}

}  // namespace cupaged
