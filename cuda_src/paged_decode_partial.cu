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
// Grid: x = unit * heads_groups + y (1-D), where y = kv_head * q_groups +
// q_group and heads_groups = num_kv_heads * q_groups: a unit's CTAs are
// adjacent, and units run in the plan's launch order (longest first, so short
// units fill the tail of long ones). The grid may be larger than the step's
// units (a CUDA graph captured once serves later plans up to the capacity its
// grid was captured with): CTAs past num_units exit at once.
// Block: AttendCore<CORE>::THREADS threads, AttendCore<CORE>::DYNAMIC_SMEM bytes
// of dynamic shared memory (0 for SIMT; MMA_SMEM_BYTES for MMA). One CTA reads each K/V element of its
// chunk once and uses it for the HEADS query heads
//   kv_head * group_size + q_group * HEADS + [0, HEADS).
//
// Parameters (PartialParams below; element strides are in elements of T, or
// of KV for the caches; head_dim is contiguous):
//   q                [batch, num_qo_heads, HEAD_DIM] T, strides (stride_q_batch, stride_q_head, 1)
//   k_cache, v_cache [num_pages, page_size, num_kv_heads, HEAD_DIM] KV, strides per CacheStrides
//                    (NHD, or HND passed as NHD strides)
//   k_head_scale, v_head_scale [num_kv_heads] float32 per-head dequantization scales, or null (1)
//   plan             the plan image, one int32 array written by one host-to-device copy
//                    (cupaged/_launch.py PlanImage):
//     [0:8)   header {num_units, o_indptr, indptr, last_page_len, first_page_offset, indices, batch, 0}:
//             the count of units, then each array's offset in int32 elements from the image's start
//     [8:8+4*num_units)  the units, int4 {request, chunk, page_lo, page_hi} in launch order:
//             chunk c (its partial row; chunk c - o_indptr[r] of request r) covers the request's
//             pages [page_lo, min(page_hi, pages_r)) (a request's last unit ends past its pages, so a
//             plan reused while the request grows still covers them)
//     o_indptr [batch + 1]: request r's chunks are partial rows [o_indptr[r], o_indptr[r + 1])
//     indptr [batch + 1], last_page_len [batch], first_page_offset [batch], indices [indptr[batch]]:
//             the page table (CSR of physical page ids)
//   partial_v        [chunks, num_qo_heads, HEAD_DIM] float32 contiguous (null if no request splits)
//   partial_lse      [chunks, num_qo_heads] float32 contiguous (null if no request splits)
//   merge_counters   [batch * heads_groups] int32, all 0 before the launch and after it (null if no split)
//   final_out        [batch, num_qo_heads, HEAD_DIM] T, strides (stride_o_batch, stride_o_head, 1)
//   final_lse        [batch, num_qo_heads] float32 contiguous, may be null
//   sinks            [num_qo_heads] float32 attention-sink logits (natural log, in the units of
//                    q.k * sm_scale, not soft-capped), or null: each adds exp(sink) to its head's
//                    softmax denominator in the final output (EmitStrided::finish), never in a partial
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

// The kernel's parameters, passed as one __grid_constant__ struct; mirrored
// field for field by cupaged/_launch.py PartialParams (a CPU test compares
// the offsets with NVRTC's layout). Pointers are untyped so that one struct
// serves every instance.
struct PartialParams {
  const void* q;
  long long stride_q_batch, stride_q_head;
  const void* k_cache;
  long long stride_k_page, stride_k_token, stride_k_head;
  const void* v_cache;
  long long stride_v_page, stride_v_token, stride_v_head;
  const int* plan;  // the plan image (layout above)
  const float* k_head_scale;
  const float* v_head_scale;
  float* partial_v;
  float* partial_lse;
  int* merge_counters;
  void* final_out;
  long long stride_o_batch, stride_o_head;
  float* final_lse;
  const float* sinks;  // [num_qo_heads] float32 natural-log sink logits, or null
  int heads_groups, page_size, num_qo_heads, group_size, q_groups;
  float scale, soft_cap, v_scale;
};

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
                                  AttendCore<CORE, T, KV, HEAD_DIM, HEADS>::MIN_BLOCKS)
    paged_decode_partial(const __grid_constant__ PartialParams p) {
  using Attn = AttendCore<CORE, T, KV, HEAD_DIM, HEADS>;
  typename Attn::Scratch& sm = Attn::scratch();
  __shared__ int is_last;
  // A launch with less dynamic shared memory than the core needs would write
  // past it: fail loudly instead (the host passes _configs.dynamic_smem()).
  if (Attn::DYNAMIC_SMEM > 0 && dynamic_smem_size() < (unsigned)Attn::DYNAMIC_SMEM) __trap();
  const int heads_groups = p.heads_groups, q_groups = p.q_groups, num_qo_heads = p.num_qo_heads;
  const int unit = blockIdx.x / heads_groups, y = blockIdx.x - unit * heads_groups;
  // The header and this CTA's unit load side by side (the unit slot is inside
  // the image even past num_units: the grid never exceeds its capacity).
  const int4* image = reinterpret_cast<const int4*>(p.plan);
  const int4 h0 = image[0], h1 = image[1], w = image[2 + unit];
  if (unit >= h0.x) return;  // a capacity-sized grid (captured graph): no unit here this step
  const int* o_indptr = p.plan + h0.y;
  const int* indptr = p.plan + h0.z;
  const int kv_head = y / q_groups;
  const int head0 = kv_head * p.group_size + (y % q_groups) * HEADS;
  const int req = w.x, chunk = w.y;
  const int chunk0 = o_indptr[req], num_chunks = o_indptr[req + 1] - chunk0;
  const int page0 = indptr[req];
  const int pages = indptr[req + 1] - page0;
  const int page_size = p.page_size;

  int slot_begin, slot_end;
  visible_slots(pages, p.plan[h1.x + req], p.plan[h0.w + req], page_size, w.z, min(w.w, pages), slot_begin,
                slot_end);
  const int* indices = p.plan + h1.y + page0;

  const T* q_cta = static_cast<const T*>(p.q) + req * p.stride_q_batch + head0 * p.stride_q_head;
  const ScoreMap sc{p.k_head_scale == nullptr ? p.scale : p.scale * p.k_head_scale[kv_head], p.soft_cap,
                    p.v_head_scale == nullptr ? p.v_scale : p.v_scale * p.v_head_scale[kv_head]};
  const KV* k_cache = static_cast<const KV*>(p.k_cache);
  const KV* v_cache = static_cast<const KV*>(p.v_cache);
  const CacheStrides ks{p.stride_k_page, p.stride_k_token, p.stride_k_head};
  const CacheStrides vs{p.stride_v_page, p.stride_v_token, p.stride_v_head};
  const long long stride_o_head = p.stride_o_head;
  T* out = static_cast<T*>(p.final_out) + req * p.stride_o_batch + head0 * stride_o_head;
  float* lse_out = p.final_lse == nullptr ? nullptr : p.final_lse + (long long)req * num_qo_heads + head0;
  const float* sinks = p.sinks == nullptr ? nullptr : p.sinks + head0;
  if (num_chunks == 1) {
    EmitStrided<T> emit{out, stride_o_head, lse_out, sinks};
    Attn::run(sm, emit, q_cta, p.stride_q_head, sc, k_cache, ks, v_cache, vs, kv_head, indices, page_size,
              slot_begin, slot_end);
    return;
  }
  const long long row = (long long)chunk * num_qo_heads + head0;
  EmitStrided<float> emit{p.partial_v + row * HEAD_DIM, HEAD_DIM, p.partial_lse + row};
  Attn::run(sm, emit, q_cta, p.stride_q_head, sc, k_cache, ks, v_cache, vs, kv_head, indices, page_size,
            slot_begin, slot_end);

  // Release this CTA's partial, then take a ticket; the last one merges.
  __threadfence();
  __syncthreads();
  int* counter = p.merge_counters + (long long)req * heads_groups + y;
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == num_chunks - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();  // acquire: the other CTAs' partials are visible from here on
  constexpr int D4 = HEAD_DIM / 4;
  for (int item = threadIdx.x; item < HEADS * D4; item += Attn::THREADS) {
    const int h = item / D4, d = (item % D4) * 4;
    const Merged r =
        merge_partials(p.partial_v, p.partial_lse, chunk0, chunk0 + num_chunks, num_qo_heads, HEAD_DIM, head0 + h, d);
    EmitStrided<T>{out, stride_o_head, lse_out, sinks}.finish(h, d, r.o, r.lse);
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)
}

}  // namespace cupaged
