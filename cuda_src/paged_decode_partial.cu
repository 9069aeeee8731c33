// paged_decode_partial<T, KV, HEAD_DIM, HEADS, CORE>: split-KV paged-attention
// decode, merge fused in (one launch per decode step). T is the query/output
// storage type, KV the cache's (T itself, or e4m3 under a 16-bit T). CORE
// picks the attention core: Core::SIMT (CUDA cores, KV == T any dtype, 128
// threads, attend.cuh) or Core::MMA (tensor cores, fp16/bf16/fp8 KV,
// MMA_THREADS threads, attend_mma.cuh).
//
// For every chunk of the plan and every query head it attends the head's
// query over the chunk's visible tokens. Base-2 logits: s = (q.k) * scale_k
// with scale_k = scale * k_head_scale[kv_head]; when soft_cap > 0 then
// s = soft_cap * tanh(s) (the host passes scale = sm_scale * k_scale / cap
// and soft_cap = cap * log2(e); else scale = sm_scale * k_scale * log2(e)).
// exp2 softmax, so LSEs are in log2 units; the output is multiplied by
// v_scale * v_head_scale[kv_head] (dequantized V, linear in V).
// A request with one chunk writes its normalized result straight to final_out
// (and final_lse). A request with several chunks writes each chunk's partial
// (normalized by the chunk's own softmax denominator, float32) and its LSE to
// partial_v / partial_lse; the last of its CTAs to finish (an atomic ticket in
// merge_counters after a device-wide fence) merges them into final_out with
// the closed-form exp2/log2 rescale (merge.cuh) and resets its counter to 0.
// Every output element is written by exactly one CTA.
//
// Grid: x = work_unit * heads_groups + y (1-D, plan.num_ctas CTAs), where
// y = kv_head * q_groups + q_group and heads_groups = num_kv_heads * q_groups:
// a unit's CTAs are adjacent, and units run in the plan's launch order
// (longest first, so short units fill the tail of long ones).
// Block: AttendCore<CORE>::THREADS threads, AttendCore<CORE>::DYNAMIC_SMEM bytes
// of dynamic shared memory (0 for SIMT; MMA_SMEM_BYTES for MMA). One CTA reads each K/V element of its
// chunk once and uses it for the HEADS query heads
//   kv_head * group_size + q_group * HEADS + [0, HEADS).
// Work unit u = work_units[u] = {r, c, page_lo, page_hi}: chunk c (its partial
// row; chunk c - o_indptr[r] of request r) covers the request's pages
// [page_lo, min(page_hi, pages_r)) (the plan's last chunk of a request ends
// past its pages, so a plan reused while the request grows still covers them).
//
// Pointers (element strides are in elements of T; head_dim is contiguous):
//   q                [batch, num_qo_heads, HEAD_DIM] T, strides (stride_q_batch, stride_q_head, 1)
//   k_cache, v_cache [num_pages, page_size, num_kv_heads, HEAD_DIM] KV, strides per CacheStrides
//                    (elements of KV; NHD, or HND passed as NHD strides)
//   k_head_scale, v_head_scale [num_kv_heads] float32 per-head dequantization scales, or null (1)
//   indices          [indptr[batch]] int32 physical page ids
//   indptr           [batch + 1] int32;  last_page_len, first_page_offset [batch] int32
//   work_units       [num_chunks] int4 {request, chunk, page_lo, page_hi}, launch order
//   o_indptr         [batch + 1] int32: request r's chunks are rows [o_indptr[r], o_indptr[r + 1])
//   partial_v        [num_chunks, num_qo_heads, HEAD_DIM] float32 contiguous (null if no request splits)
//   partial_lse      [num_chunks, num_qo_heads] float32 contiguous (null if no request splits)
//   merge_counters   [batch * heads_groups] int32, all 0 before the launch and after it (null if no split)
//   final_out        [batch, num_qo_heads, HEAD_DIM] T, strides (stride_o_batch, stride_o_head, 1)
//   final_lse        [batch, num_qo_heads] float32 contiguous, may be null
//
// Preconditions: the page table passed PageTable.validate() and every page id
// is < num_pages (checked on the host); q, caches and strides are 16-byte
// aligned; HEAD_DIM % (16 / sizeof(T)) == 0. One launch per plan at a time
// (the workspace and counters belong to the plan).
// Edge behaviour: a chunk with no visible token (a zero-page request) yields
// zeros and LSE -inf.
#include "attend.cuh"
#include "attend_mma.cuh"
#include "merge.cuh"

namespace cupaged {

// Attention core of the partial kernel; mirrored by cupaged/_configs.py CORES.
enum class Core { SIMT = 0, MMA = 1 };

template <Core CORE, typename T, typename KV, int HEAD_DIM, int HEADS>
struct AttendCore;

template <typename T, int HEAD_DIM, int HEADS>
struct AttendCore<Core::SIMT, T, T, HEAD_DIM, HEADS> {
  static constexpr int THREADS = NUM_THREADS;
  static constexpr int MIN_BLOCKS = MinBlocks<HEADS>::value;
  using Scratch = AttendScratch<T, HEAD_DIM, HEADS>;
  static constexpr int DYNAMIC_SMEM = 0;  // static shared memory (< 48 KB)
  __device__ __forceinline__ static Scratch& scratch() {
    __shared__ Scratch sm;
    return sm;
  }
  template <typename Emit, typename... Args>
  __device__ __forceinline__ static void run(Scratch& sm, Emit& emit, Args... args) {
    cta_attend<T, HEAD_DIM, HEADS>(args..., sm, emit);
  }
};

template <typename T, typename KV, int HEAD_DIM, int HEADS>
struct AttendCore<Core::MMA, T, KV, HEAD_DIM, HEADS> {
  static constexpr int THREADS = MMA_THREADS;
  static constexpr int MIN_BLOCKS = MMA_MIN_BLOCKS;
  using Scratch = MmaScratch<T, KV, HEAD_DIM, HEADS>;
  static constexpr int DYNAMIC_SMEM = MMA_SMEM_BYTES;  // the launch must pass exactly this
  static_assert(sizeof(Scratch) <= MMA_SMEM_BYTES, "MMA scratch exceeds its shared memory budget");
  __device__ __forceinline__ static Scratch& scratch() {
    extern __shared__ uint4 dynamic_smem[];
    return *reinterpret_cast<Scratch*>(dynamic_smem);
  }
  template <typename Emit, typename... Args>
  __device__ __forceinline__ static void run(Scratch& sm, Emit& emit, Args... args) {
    cta_attend_mma<T, KV, HEAD_DIM, HEADS>(args..., sm, emit);
  }
};

template <typename T, typename KV, int HEAD_DIM, int HEADS, Core CORE>
__global__ void __launch_bounds__(AttendCore<CORE, T, KV, HEAD_DIM, HEADS>::THREADS,
                                  AttendCore<CORE, T, KV, HEAD_DIM, HEADS>::MIN_BLOCKS) paged_decode_partial(
    const T* __restrict__ q, long long stride_q_batch, long long stride_q_head,
    const KV* __restrict__ k_cache, long long stride_k_page, long long stride_k_token, long long stride_k_head,
    const KV* __restrict__ v_cache, long long stride_v_page, long long stride_v_token, long long stride_v_head,
    const int* __restrict__ indices, const int* __restrict__ indptr,
    const int* __restrict__ last_page_len, const int* __restrict__ first_page_offset,
    const int4* __restrict__ work_units, const int* __restrict__ o_indptr,
    int heads_groups, int page_size, int num_qo_heads, int group_size, int q_groups,
    float scale, float soft_cap, float v_scale,
    const float* __restrict__ k_head_scale, const float* __restrict__ v_head_scale,
    float* __restrict__ partial_v, float* __restrict__ partial_lse, int* __restrict__ merge_counters,
    T* __restrict__ final_out, long long stride_o_batch, long long stride_o_head,
    float* __restrict__ final_lse) {
  using Attn = AttendCore<CORE, T, KV, HEAD_DIM, HEADS>;
  typename Attn::Scratch& sm = Attn::scratch();
  __shared__ int is_last;
  // A launch with less dynamic shared memory than the core needs would write
  // past it: fail loudly instead (the host passes _configs.dynamic_smem()).
  if (Attn::DYNAMIC_SMEM > 0 && dynamic_smem_size() < (unsigned)Attn::DYNAMIC_SMEM) __trap();
  const int unit = blockIdx.x / heads_groups, y = blockIdx.x - unit * heads_groups;
  const int kv_head = y / q_groups;
  const int head0 = kv_head * group_size + (y % q_groups) * HEADS;
  const int4 w = work_units[unit];
  const int req = w.x, chunk = w.y;
  const int chunk0 = o_indptr[req], num_chunks = o_indptr[req + 1] - chunk0;
  const int page0 = indptr[req];
  const int pages = indptr[req + 1] - page0;

  int slot_begin, slot_end;
  visible_slots(pages, first_page_offset[req], last_page_len[req], page_size, w.z, min(w.w, pages), slot_begin,
                slot_end);

  const T* q_cta = q + req * stride_q_batch + head0 * stride_q_head;
  const ScoreMap sc{k_head_scale == nullptr ? scale : scale * k_head_scale[kv_head], soft_cap,
                    v_head_scale == nullptr ? v_scale : v_scale * v_head_scale[kv_head]};
  const CacheStrides ks{stride_k_page, stride_k_token, stride_k_head};
  const CacheStrides vs{stride_v_page, stride_v_token, stride_v_head};
  T* out = final_out + req * stride_o_batch + head0 * stride_o_head;
  float* lse_out = final_lse == nullptr ? nullptr : final_lse + (long long)req * num_qo_heads + head0;
  if (num_chunks == 1) {
    EmitStrided<T> emit{out, stride_o_head, lse_out};
    Attn::run(sm, emit, q_cta, stride_q_head, sc, k_cache, ks, v_cache, vs, kv_head, indices + page0,
              page_size, slot_begin, slot_end);
    return;
  }
  const long long row = (long long)chunk * num_qo_heads + head0;
  EmitStrided<float> emit{partial_v + row * HEAD_DIM, HEAD_DIM, partial_lse + row};
  Attn::run(sm, emit, q_cta, stride_q_head, sc, k_cache, ks, v_cache, vs, kv_head, indices + page0,
            page_size, slot_begin, slot_end);

  // Release this CTA's partial, then take a ticket; the last one merges.
  __threadfence();
  __syncthreads();
  int* counter = merge_counters + (long long)req * heads_groups + y;
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == num_chunks - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();  // acquire: the other CTAs' partials are visible from here on
  constexpr int D4 = HEAD_DIM / 4;
  for (int item = threadIdx.x; item < HEADS * D4; item += Attn::THREADS) {
    const int h = item / D4, d = (item % D4) * 4;
    const Merged r =
        merge_partials(partial_v, partial_lse, chunk0, chunk0 + num_chunks, num_qo_heads, HEAD_DIM, head0 + h, d);
    EmitStrided<T>{out, stride_o_head, lse_out}.value(h, d, r.o);
    if (d == 0 && lse_out != nullptr) lse_out[h] = r.lse;
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)
}

}  // namespace cupaged
