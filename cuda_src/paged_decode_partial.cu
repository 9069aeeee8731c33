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
// merge_counters, acquire-release at GPU scope) merges them into final_out with
// the closed-form exp2/log2 rescale (merge.cuh) and resets its counter to 0.
// Where the plan image's header says so (the waiting merge: plans without row
// groups whose grid fits the GPU at once), the CTA of the request's first
// chunk merges them as their values arrive, with no ticket (merge_waiting
// below).
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
//     [0:8)   header {num_units, o_indptr, indptr, last_page_len, first_page_offset, indices, batch,
//             group_rows}: the count of units, then each array's offset in int32 elements from the
//             image's start (group_rows: when the plan has no row groups, the merge: 0 the ticket,
//             -1 the waiting merge)
//     [8:8+4*num_units)  the units, int4 {request, chunk, page_lo, page_hi} in launch order:
//             chunk c (its partial row; chunk c - o_indptr[r] of request r) covers the request's
//             pages [page_lo, min(page_hi, pages_r)) (a request's last unit ends past its pages, so a
//             plan reused while the request grows still covers them)
//     o_indptr [batch + 1]: request r's chunks are partial rows [o_indptr[r], o_indptr[r + 1])
//     indptr [batch + 1], last_page_len [batch], first_page_offset [batch], indices [indptr[batch]]:
//             the page table (CSR of physical page ids)
//     group_rows [batch] (paged_decode_rows): the rows of a table of several query tokens per
//             request (PageTable.query_rows) form row groups, each a request's consecutive tokens;
//             row r starts a group of group_rows[r] rows (>= 1), every row of which has the same
//             chunk count and split; units name only a group's first row, and its CTAs serve all
//             of the group's rows (AttendCore::TOKENS tokens per pass over the chunk's K/V,
//             PAIR_TOKENS on warp pairs)
//   partial_v        [chunks, num_qo_heads, HEAD_DIM] float32 contiguous (null if no request splits)
//   partial_lse      [chunks, num_qo_heads] float32 contiguous (null if no request splits)
//   merge_counters   [batch * heads_groups] int32, all 0 before the launch and after it (null if no split)
//                    (the waiting merge: partial_v and partial_lse hold PARTIAL_EMPTY, merge.cuh, in every
//                    float before the launch and after it)
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

// GROUPS: the core serves row groups (RowGroup), TOKENS tokens per pass, or
// up to PAIR_TOKENS with run<true> (the tensor cores' warp pairs).
template <Core CORE, typename T, typename KV, int HEAD_DIM, int HEADS, bool GROUPS>
struct AttendCore;

template <typename T, int HEAD_DIM, int HEADS, bool GROUPS>
struct AttendCore<Core::SIMT, T, T, HEAD_DIM, HEADS, GROUPS> {
  static constexpr int THREADS = NUM_THREADS;
  static constexpr int MIN_BLOCKS = MinBlocks<HEADS>::value;
  static constexpr int TOKENS = 1;  // one token's heads per pass
  static constexpr int PAIR_TOKENS = 1;
  using Scratch = AttendScratch<T, HEAD_DIM, HEADS>;
  static constexpr int DYNAMIC_SMEM = 0;  // static shared memory (< 48 KB)
  __device__ __forceinline__ static Scratch& scratch() {
    __shared__ Scratch sm;
    return sm;
  }
  template <bool PAIRED, typename Emit, typename... Args>
  __device__ __forceinline__ static void run(Scratch& sm, Emit& emit, RowGroup, Args... args) {
    cta_attend<T, HEAD_DIM, HEADS>(args..., sm, emit);
  }
};

template <typename T, typename KV, int HEAD_DIM, int HEADS, bool GROUPS>
struct AttendCore<Core::MMA, T, KV, HEAD_DIM, HEADS, GROUPS> {
  static constexpr int THREADS = MMA_THREADS;
  static constexpr int MIN_BLOCKS = MMA_MIN_BLOCKS;
  static constexpr int ROWS = MmaRows<KV, HEAD_DIM, HEADS, GROUPS>::value;
  static constexpr int TOKENS = ROWS / HEADS;
  // Warp pairs for RowsTile at power-of-two heads only: at 3, 5, 6 and 7
  // heads (row -> token by a division) ptxas spills 8 bytes at 16-bit
  // head_dim 128, and ColsTile's (fp8) registers pass the 3 CTAs per SM
  // its plans count on (docs/architecture.md "Warp pairs for q_len 8").
  static constexpr bool PAIRS = !MmaCols<KV, HEAD_DIM>::value && (HEADS & (HEADS - 1)) == 0;
  static constexpr int PAIR_TOKENS = PAIRS ? 2 * TOKENS : TOKENS;
  using Scratch = MmaScratch<T, KV, HEAD_DIM, ROWS>;
  static constexpr int DYNAMIC_SMEM = MMA_SMEM_BYTES;  // the launch must pass exactly this
  static_assert(sizeof(Scratch) <= MMA_SMEM_BYTES, "MMA scratch exceeds its shared memory budget");
  __device__ __forceinline__ static Scratch& scratch() {
    // 128-byte aligned: the static is_last flag would otherwise put it at 16
    // mod 32, and the K/V ring's rows must start on 128 bytes (MmaLayout).
    extern __shared__ __align__(128) uint4 dynamic_smem[];
    return *reinterpret_cast<Scratch*>(dynamic_smem);
  }
  template <bool PAIRED, typename Emit, typename... Args>
  __device__ __forceinline__ static void run(Scratch& sm, Emit& emit, RowGroup rg, Args... args) {
    cta_attend_mma<T, KV, HEAD_DIM, HEADS, GROUPS, PAIRED>(args..., rg, sm, emit);
  }
};

// Under PDL, before the wait: the K/V rows of the first 64 visible slots
// and the CTA's q rows into the L2 (prefetch.global.L2), so the first
// tile's DRAM latency overlaps the previous kernel's tail instead of
// following it (issue-5 cells <= 64 MB 3-6 % faster, A/B in
// docs/benchmarks/h200-prefetch-ab-2026-12-02.md). The page ids come from
// the plan image. Safe while the previous kernel still writes those lines:
// a prefetch only warms the L2, the point of coherence, and every load
// after the wait reads through it.
template <typename T, typename KV, int HEAD_DIM, int HEADS>
__device__ __forceinline__ void prefetch_first_tile(const PartialParams& p, const int* indices, int slot_begin,
                                                    int slot_end, int page_size, int kv_head, int req, int head0) {
#if defined(CUPAGED_PDL) && __CUDA_ARCH__ >= 900
  {
    constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(KV), LINES = (ROW_BYTES + 127) / 128;
    const int n = min(slot_end - slot_begin, 64) * LINES;
    for (int i = threadIdx.x; i < 2 * n; i += blockDim.x) {
      const int is_v = i >= n, j = is_v ? i - n : i;
      const int s = slot_begin + j / LINES, off = min((j % LINES) * 128, ROW_BYTES - 16);
      const long long page = indices[s / page_size], tok = s % page_size;
      const char* row = is_v ? reinterpret_cast<const char*>(static_cast<const KV*>(p.v_cache) + page * p.stride_v_page
                                                             + tok * p.stride_v_token + kv_head * p.stride_v_head)
                             : reinterpret_cast<const char*>(static_cast<const KV*>(p.k_cache) + page * p.stride_k_page
                                                             + tok * p.stride_k_token + kv_head * p.stride_k_head);
      asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
    }
  }
  {
    constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(T), LINES = (ROW_BYTES + 127) / 128;
    const char* q0 = reinterpret_cast<const char*>(static_cast<const T*>(p.q) + req * p.stride_q_batch
                                                   + head0 * p.stride_q_head);
    for (int i = threadIdx.x; i < HEADS * LINES; i += blockDim.x)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(q0 + (i / LINES) * p.stride_q_head * (long long)sizeof(T)
                                                    + min((i % LINES) * 128, ROW_BYTES - 16)));
  }
#endif
}

// One pass of a row group's n tokens on a core with warp pairs: on pairs
// when they are more than one warp's tile holds.
template <typename Attn, typename Emit, typename... Args>
__device__ __forceinline__ void attend_rows(int n, typename Attn::Scratch& sm, Emit& emit, RowGroup rg,
                                            Args... args) {
  if (n > Attn::TOKENS)
    Attn::template run<true>(sm, emit, rg, args...);
  else
    Attn::template run<false>(sm, emit, rg, args...);
}

// The waiting merge (the header's group_rows entry -1: a plan without row
// groups whose CTAs, and its requests' first chunks with room to spare, fit
// the GPU at once; cupaged/_launch.py PartialLaunch.waits): the CTA of the
// request's first chunk merges its head group's partials as their values
// arrive (merge_partials<1, true>), writes the output and puts PARTIAL_EMPTY
// back; the other chunks' CTAs only write theirs. No ticket: 0.4-0.7 us less
// per split small call than the ticket's merge, which waits on the ticket's
// L2 round trip and then on the partials' (H200, docs/architecture.md "The
// first chunk merges, waiting on the values"). The first chunk's CTA is on
// the GPU while it waits, so it must not hold a slot a chunk it waits for
// needs: the host takes this path only where those CTAs fit at once.
template <typename T, int HEAD_DIM, int HEADS, int THREADS>
__device__ __noinline__ void merge_waiting(const PartialParams& p) {
  // (the CTA's request and heads found again from blockIdx and the image, as partial_body finds them,
  // so that nothing of the merge stays live through the attention loop: passed in, they took 6 more
  // registers in the tensor-core instances)
  const int heads_groups = p.heads_groups, q_groups = p.q_groups;
  const int unit = blockIdx.x / heads_groups, y = blockIdx.x - unit * heads_groups;
  const int4* image = reinterpret_cast<const int4*>(p.plan);
  const int4 h0 = image[0], w = image[2 + unit];
  const int req = w.x, chunk0 = p.plan[h0.y + req], num_chunks = p.plan[h0.y + req + 1] - chunk0;
  if (w.y != chunk0) return;  // (another chunk: its partial is written)
  const int head0 = (y / q_groups) * p.group_size + (y % q_groups) * HEADS;
  const long long stride_o_head = p.stride_o_head;
  T* out = static_cast<T*>(p.final_out) + req * p.stride_o_batch + head0 * stride_o_head;
  float* lse_out = p.final_lse == nullptr ? nullptr : p.final_lse + (long long)req * p.num_qo_heads + head0;
  const float* sinks = p.sinks == nullptr ? nullptr : p.sinks + head0;
  constexpr int D4 = HEAD_DIM / 4;
  const int num_qo_heads = p.num_qo_heads;
  const float empty = __uint_as_float(PARTIAL_EMPTY);
  __syncthreads();  // (this CTA's own partial: written by its other threads)
  for (int item = threadIdx.x; item < HEADS * D4; item += THREADS) {
    MergeItems<1> it;
    it.n0[0] = chunk0;
    it.h[0] = head0 + item / D4;
    it.d[0] = (item % D4) * 4;
    const MergedItems<1> m = merge_partials<1, true>(p.partial_v, p.partial_lse, it, num_chunks, num_qo_heads, HEAD_DIM);
    EmitStrided<T>{out, stride_o_head, lse_out, sinks}.finish(it.h[0] - head0, it.d[0], m.m[0].o, m.m[0].lse);
    for (int c = 0; c < num_chunks; ++c)  // (these values are read by this thread only)
      *reinterpret_cast<float4*>(p.partial_v + ((long long)(chunk0 + c) * num_qo_heads + it.h[0]) * HEAD_DIM +
                                 it.d[0]) = make_float4(empty, empty, empty, empty);
  }
  __syncthreads();  // (every thread has read the LSEs it shares with its head's other dims)
  for (int i = threadIdx.x; i < HEADS * num_chunks; i += THREADS)
    p.partial_lse[(long long)(chunk0 + i / HEADS) * num_qo_heads + head0 + i % HEADS] = empty;
}

// The kernels' body. Without GROUPS a unit is one request's chunk; with
// GROUPS (paged_decode_rows) its request is the first row of a row group.
template <typename T, typename KV, int HEAD_DIM, int HEADS, Core CORE, bool GROUPS>
__device__ __forceinline__ void partial_body(const PartialParams& p) {
  using Attn = AttendCore<CORE, T, KV, HEAD_DIM, HEADS, GROUPS>;
  typename Attn::Scratch& sm = Attn::scratch();
  __shared__ int is_last;
  // A launch with less dynamic shared memory than the core needs would write
  // past it: fail loudly instead (the host passes _configs.dynamic_smem()).
  if (Attn::DYNAMIC_SMEM > 0 && dynamic_smem_size() < (unsigned)Attn::DYNAMIC_SMEM) __trap();
  pdl_trigger();  // (the next kernel's CTAs then take SMs this grid's last wave frees)
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
  // A row group's rows are one request's consecutive tokens: its last row's
  // pages hold every row's, and row t ends (n - 1 - t) slots before it.
  const int rows = GROUPS && h1.w != 0 ? p.plan[h1.w + req] : 1;
  const int last = req + rows - 1;
  const int chunk0 = o_indptr[req], num_chunks = o_indptr[req + 1] - chunk0;
  const int page0 = indptr[last];
  const int pages = indptr[last + 1] - page0;
  const int page_size = p.page_size;
  const int last_len = p.plan[h0.w + last];

  int slot_begin, slot_end;
  visible_slots(pages, p.plan[h1.x + last], last_len, page_size, w.z, min(w.w, pages), slot_begin, slot_end);
  const int* indices = p.plan + h1.y + page0;
  // Up to here only the plan image was read (host-written, before the
  // previous kernel in stream order); q, the scales, the caches, the
  // workspace and out may be the previous kernel's.
  prefetch_first_tile<T, KV, HEAD_DIM, HEADS>(p, indices, slot_begin, slot_end, page_size, kv_head, req, head0);
  pdl_wait();

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
  const long long row = (long long)chunk * num_qo_heads + head0;
  if constexpr (!GROUPS) {
    const RowGroup none{0, HEADS, 0};
    if (num_chunks == 1) {
      EmitStrided<T> emit{out, stride_o_head, lse_out, sinks};
      Attn::template run<false>(sm, emit, none, q_cta, p.stride_q_head, sc, k_cache, ks, v_cache, vs, kv_head,
                                indices, page_size, slot_begin, slot_end);
      return;
    }
    EmitStrided<float> emit{p.partial_v + row * HEAD_DIM, HEAD_DIM, p.partial_lse + row};
    Attn::template run<false>(sm, emit, none, q_cta, p.stride_q_head, sc, k_cache, ks, v_cache, vs, kv_head,
                              indices, page_size, slot_begin, slot_end);
    if (p.plan[7] < 0) {  // (the header's merge for a plan without row groups; read again: no register held)
      merge_waiting<T, HEAD_DIM, HEADS, Attn::THREADS>(p);
      return;
    }
  } else {
    // Every row of the group has num_chunks chunks (the plan gives them the
    // last row's split): row t's partial of this chunk is chunk + t * num_chunks.
    const int end = pages > 0 ? (pages - 1) * page_size + last_len : 0;  // the last row's visible end
    // A group of more tokens than a tile's rows hold runs on warp pairs (up
    // to PAIR_TOKENS per pass over the chunk's K/V, in one pass for a plan's
    // groups: cupaged/_configs.py tokens_per_cta).
    const int per_pass = rows > Attn::TOKENS ? Attn::PAIR_TOKENS : Attn::TOKENS;
    for (int t0 = 0; t0 < rows; t0 += per_pass) {
      const int n = min(per_pass, rows - t0);
      const int lim0 = end - (rows - 1 - t0);  // token t0's end
      const int pass_end = max(slot_begin, min(slot_end, lim0 + n - 1));
      const RowGroup rg{p.stride_q_batch, n * HEADS, lim0};
      const T* q_pass = q_cta + t0 * p.stride_q_batch;
      if (t0 > 0) __syncthreads();  // the last pass's combine buffer is the ring
      if constexpr (Attn::PAIR_TOKENS > Attn::TOKENS) {
        // The final rows (T) of an unsplit group, else this chunk's partials
        // (float32), as one emit chosen at run time: the core is inlined twice
        // (on pairs or not), not four times (that spilled 8 bytes at head_dim 128).
        const long long prow = row + (long long)t0 * num_chunks * num_qo_heads;
        const long long stride_prow = (long long)num_chunks * num_qo_heads;
        EmitEither<EmitRows<T, HEADS>, EmitRows<float, HEADS>> emit{
            {{out + t0 * p.stride_o_batch, stride_o_head,
              lse_out == nullptr ? nullptr : lse_out + (long long)t0 * num_qo_heads, sinks},
             p.stride_o_batch, num_qo_heads, n * HEADS},
            {{num_chunks == 1 ? nullptr : p.partial_v + prow * HEAD_DIM, HEAD_DIM,
              num_chunks == 1 ? nullptr : p.partial_lse + prow},
             stride_prow * HEAD_DIM, stride_prow, n * HEADS},
            num_chunks == 1};
        attend_rows<Attn>(n, sm, emit, rg, q_pass, p.stride_q_head, sc, k_cache, ks, v_cache, vs, kv_head, indices,
                          page_size, slot_begin, pass_end);
      } else if (num_chunks == 1) {
        EmitRows<T, HEADS> emit{{out + t0 * p.stride_o_batch, stride_o_head,
                                 lse_out == nullptr ? nullptr : lse_out + (long long)t0 * num_qo_heads, sinks},
                                p.stride_o_batch, num_qo_heads, n * HEADS};
        Attn::template run<false>(sm, emit, rg, q_pass, p.stride_q_head, sc, k_cache, ks, v_cache, vs, kv_head,
                                  indices, page_size, slot_begin, pass_end);
      } else {
        const long long prow = row + (long long)t0 * num_chunks * num_qo_heads;
        const long long stride_prow = (long long)num_chunks * num_qo_heads;
        EmitRows<float, HEADS> emit{{p.partial_v + prow * HEAD_DIM, HEAD_DIM, p.partial_lse + prow},
                                    stride_prow * HEAD_DIM, stride_prow, n * HEADS};
        Attn::template run<false>(sm, emit, rg, q_pass, p.stride_q_head, sc, k_cache, ks, v_cache, vs, kv_head,
                                  indices, page_size, slot_begin, pass_end);
      }
    }
    if (num_chunks == 1) return;
  }

  // Release this CTA's partials, then take a ticket; the last one merges. One
  // acq_rel atomic of thread 0 after the barrier (the barrier orders every
  // thread's partials before its release; the second barrier its acquire
  // before every thread's loads, as cooperative groups' grid sync does):
  // 0.3 us less than a fence in every thread, the atomic and an acquire fence
  // (H200, docs/benchmarks/h200-merge-probes-2026-12-03.md).
  __syncthreads();
  int* counter = p.merge_counters + (long long)req * heads_groups + y;
  if (threadIdx.x == 0) {
    int ticket;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(ticket) : "l"(counter) : "memory");
    is_last = ticket == num_chunks - 1;
  }
  __syncthreads();
  if (!is_last) return;  // from here on the other CTAs' partials are visible
  // (row groups: a thread's items two at a time, their loads together; merge.cuh)
  constexpr int D4 = HEAD_DIM / 4, MI = GROUPS ? 2 : 1;
  const int items = rows * HEADS * D4;
  for (int i0 = threadIdx.x; i0 < items; i0 += MI * Attn::THREADS) {
    MergeItems<MI> it;
    int tt[MI];
#pragma unroll
    for (int i = 0; i < MI; ++i) {
      const int item = i0 + i * Attn::THREADS, r = item / D4;
      tt[i] = GROUPS ? r / HEADS : 0;
      it.n0[i] = chunk0 + tt[i] * num_chunks;
      it.h[i] = MI == 1 || item < items ? head0 + (GROUPS ? r - tt[i] * HEADS : r) : -1;
      it.d[i] = (item % D4) * 4;
    }
    const MergedItems<MI> m = merge_partials<MI>(p.partial_v, p.partial_lse, it, num_chunks, num_qo_heads, HEAD_DIM);
#pragma unroll
    for (int i = 0; i < MI; ++i)
      if (MI == 1 || it.h[i] >= 0)
        EmitStrided<T>{out + tt[i] * p.stride_o_batch, stride_o_head,
                       lse_out == nullptr ? nullptr : lse_out + (long long)tt[i] * num_qo_heads, sinks}
            .finish(it.h[i] - head0, it.d[i], m.m[i].o, m.m[i].lse);
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)
}

template <typename T, typename KV, int HEAD_DIM, int HEADS, Core CORE>
__global__ void __launch_bounds__(AttendCore<CORE, T, KV, HEAD_DIM, HEADS, false>::THREADS,
                                  AttendCore<CORE, T, KV, HEAD_DIM, HEADS, false>::MIN_BLOCKS)
    paged_decode_partial(const __grid_constant__ PartialParams p) {
  partial_body<T, KV, HEAD_DIM, HEADS, CORE, false>(p);
}

// The same over a plan with row groups (several query tokens per request):
// one CTA reads a chunk's K/V once for up to AttendCore::TOKENS tokens.
template <typename T, typename KV, int HEAD_DIM, int HEADS, Core CORE>
__global__ void __launch_bounds__(AttendCore<CORE, T, KV, HEAD_DIM, HEADS, true>::THREADS,
                                  AttendCore<CORE, T, KV, HEAD_DIM, HEADS, true>::MIN_BLOCKS)
    paged_decode_rows(const __grid_constant__ PartialParams p) {
  partial_body<T, KV, HEAD_DIM, HEADS, CORE, true>(p);
}

}  // namespace cupaged
