// The CTA-level attention core shared by the split-KV partial kernel and the
// v1 baseline: HEADS query heads that share one kv head attend over a
// contiguous range of one request's visible slots, walking its page list.
//
// Thread mapping (per warp): TPR lanes cover one token's head_dim row with
// 16-byte vectors (VPT vectors per lane); the warp's 32/TPR lane groups take
// different tokens. Each (warp, group) keeps its own base-2 online softmax
// state in registers, so the token loop needs no barrier; the states are
// combined once at the end (shuffles across groups, shared memory across
// warps). Every K/V vector is loaded once and used for all HEADS query heads.
#pragma once
#include "common.cuh"

namespace cupaged {

constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = NUM_WARPS * 32;
// Page ids of the current window are staged in shared memory, so the token
// loop's address math never waits on a dependent global load.
constexpr int PAGE_WINDOW = 256;

// How one warp covers head_dim rows. With few query heads per CTA a lane
// takes two 16-byte vectors of a row (fewer lanes per row: fewer shuffle
// stages and less address math per token); with many heads one vector keeps
// q and the accumulators within the register budget. A row of ACTIVE lanes
// sits in a power-of-two group of TPR lanes (the xor reductions need one):
// head_dim 96 in fp16 is 12 vectors, 12 active lanes in groups of 16 (fp32:
// 24 in groups of 32); the idle lanes hold zeros.
template <typename T, int HEAD_DIM, int HEADS>
struct RowMap {
  static constexpr int VEC = Storage<T>::VEC;
  static constexpr int NVEC = HEAD_DIM / VEC;                 // 16-byte vectors per row
  // (two vectors only when NVEC is a power of two: 96's six-lane rows spill)
  static constexpr int WANT_VPT = HEADS <= 4 && NVEC >= 2 && (NVEC & (NVEC - 1)) == 0 ? 2 : 1;
  // lanes holding data: all of a short row's vectors, else 32 lanes, or 16
  // when 32 do not divide the row (float32 head_dim 192: 48 vectors, 3 a lane)
  static constexpr int ACTIVE = NVEC / WANT_VPT <= 32 ? NVEC / WANT_VPT : NVEC % 32 == 0 ? 32 : 16;
  static constexpr int TPR = ACTIVE <= 1 ? 1 : ACTIVE <= 2 ? 2 : ACTIVE <= 4 ? 4 : ACTIVE <= 8 ? 8
                             : ACTIVE <= 16 ? 16 : 32;          // lanes per token row (a power of two)
  static constexpr int VPT = NVEC / ACTIVE;                    // vectors per lane
  static constexpr int GPW = 32 / TPR;                         // token groups per warp
  static constexpr int EPT = VPT * VEC;                        // elements per lane
  // Tokens per lane per pipeline stage: two amortize the loop when a lane
  // holds one vector; the ring stays within RING_BYTES either way.
  static constexpr int UNROLL = VPT == 1 ? 2 : 1;
  static_assert(HEAD_DIM % VEC == 0, "head_dim must be a multiple of 16 bytes");
  static_assert(NVEC % ACTIVE == 0, "no lane mapping of this head_dim's 16-byte vectors (a multiple of 16 above 32)");
  // Lane li < ACTIVE of a group holds elements [v*ACTIVE*VEC + li*VEC, +VEC) for v < VPT.
  __device__ __forceinline__ static int dim(int li, int v) { return v * ACTIVE * VEC + li * VEC; }
};

// How raw scores q.k become base-2 logits: s = dot * scale, then with a
// soft cap s = soft_cap * tanh(s) (Gemma-2's cap * tanh(x / cap), with the
// 1/cap folded into scale and log2(e) into soft_cap); soft_cap == 0 turns it
// off. out_scale multiplies the output (the V dequantization scale).
struct ScoreMap {
  float scale, soft_cap, out_scale;
  __device__ __forceinline__ float cap(float s) const { return soft_cap * fast_tanh(s); }  // when soft_cap > 0
  // tanh(x) = (e - 1) / (e + 1) with e = 2^(2|x| log2 e): absolute error
  // ~2e-7 (ex2.approx and a fast divide), a few instructions instead of
  // tanhf's slow path, which cost the CUDA-core core its register budget.
  __device__ __forceinline__ static float fast_tanh(float x) {
    const float e = fast_exp2(2.8853900817779268f * fabsf(x));  // 2 log2(e) |x|
    return copysignf(1.f - __fdividef(2.f, e + 1.f), x);
  }
};

// Resident CTAs per SM the register allocation must allow: 3 for small
// groups (12 warps to hide latency); large groups need the registers.
template <int HEADS>
struct MinBlocks {
  static constexpr int value = HEADS <= 4 ? 3 : 1;
};

// Element strides of a [num_pages, page_size, num_kv_heads, head_dim] cache
// (head_dim itself is contiguous).
struct CacheStrides {
  long long page, token, head;
};

// K/V ring buffer budget per CTA: the stage count follows from it.
constexpr int RING_BYTES = 32 * 1024;

template <typename T, int HEAD_DIM, int HEADS>
struct Pipeline {
  using Map = RowMap<T, HEAD_DIM, HEADS>;
  static constexpr int STAGE_BYTES = Map::UNROLL * Map::VPT * 2 * 16 * NUM_THREADS;
  static constexpr int STAGES = RING_BYTES / STAGE_BYTES >= 4 ? 4 : RING_BYTES / STAGE_BYTES;
  static_assert(STAGES >= 2, "K/V ring needs at least two stages");
};

// Per-warp softmax states of a CTA, staged in shared memory to be combined:
// running max m and denominator l (base 2) and the unnormalized output, its
// rows PAD floats apart beyond HEAD_DIM (a multiple of 4: float4 reads).
template <int WARPS, int HEADS, int HEAD_DIM, int PAD = 0>
struct WarpStates {
  static_assert(PAD % 4 == 0, "rows stay 16-byte aligned");
  float m[WARPS][HEADS];
  float l[WARPS][HEADS];
  float acc[WARPS][HEADS][HEAD_DIM + PAD];
};

// Combines the warps' states (thread per head and 4 dims) and emits the
// normalized output (times out_scale) and its log2 LSE. Call after a barrier that publishes st.
template <int WARPS, int THREADS, int HEADS, int HEAD_DIM, int PAD, typename Emit>
__device__ __forceinline__ void emit_combined(const WarpStates<WARPS, HEADS, HEAD_DIM, PAD>& st, float out_scale,
                                              Emit& emit) {
  constexpr int D4 = HEAD_DIM / 4;
  for (int item = threadIdx.x; item < HEADS * D4; item += THREADS) {
    const int h = item / D4, d = (item % D4) * 4;
    float m_max = neg_inf();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m_max = fmaxf(m_max, st.m[w][h]);
    const float m_safe = m_max == neg_inf() ? 0.f : m_max;
    float denom = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wgt = fast_exp2(st.m[w][h] - m_safe);
      denom += st.l[w][h] * wgt;
      const float4 a = *reinterpret_cast<const float4*>(&st.acc[w][h][d]);
      o.x += a.x * wgt; o.y += a.y * wgt; o.z += a.z * wgt; o.w += a.w * wgt;
    }
    const float inv = denom > 0.f ? out_scale / denom : 0.f;
    o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
    emit.finish(h, d, o, denom > 0.f ? m_safe + fast_log2(denom) : neg_inf());
  }
}

// Shared memory of one CTA. The K/V ring (used by the token loop) and the
// cross-warp combine buffers (used after it) are never live together.
template <typename T, int HEAD_DIM, int HEADS>
struct AttendScratch {
  using Map = RowMap<T, HEAD_DIM, HEADS>;
  static constexpr int STAGES = Pipeline<T, HEAD_DIM, HEADS>::STAGES;
  int page_ids[PAGE_WINDOW];
  union {
    // [stage][u][vector][K or V][thread]: each lane reads back only what it
    // copied, and a warp's 32 lanes touch 512 contiguous bytes (no conflicts).
    uint4 ring[STAGES][Map::UNROLL][Map::VPT][2][NUM_THREADS];
    WarpStates<NUM_WARPS, HEADS, HEAD_DIM> combine;
  };
};

// Walks the visible slots [slot_begin, slot_end) of one request in windows of
// PAGE_WINDOW pages, shared by both attention cores: stages each window's
// page ids in shared memory (page_ids[p - win] is page p's id) and calls
// body(win, s0, s1) with the window's first page and its slot range. All
// THREADS threads of the CTA call it.
template <int THREADS, typename Body>
__device__ __forceinline__ void for_each_page_window(const int* __restrict__ req_pages, int page_size,
                                                     int slot_begin, int slot_end, int* page_ids, Body&& body) {
  const int first_page = slot_begin / page_size;
  const int end_page = slot_end > slot_begin ? (slot_end + page_size - 1) / page_size : first_page;
  for (int win = first_page; win < end_page; win += PAGE_WINDOW) {
    const int win_end = min(win + PAGE_WINDOW, end_page);
    __syncthreads();  // the previous window's ids are no longer read
    for (int i = threadIdx.x; i < win_end - win; i += THREADS) page_ids[i] = req_pages[win + i];
    __syncthreads();
    body(win, max(slot_begin, win * page_size), min(slot_end, win_end * page_size));
  }
}

// The pieces of cta_attend below (the CUDA-core core). A lane holds EPT
// elements of one head_dim row (Map) for each of the CTA's HEADS query
// heads; lane group `group` of a warp takes one token of each tile row.

// q's rows, scaled by the softmax scale (idle lanes hold zeros).
template <typename T, int HEAD_DIM, int HEADS>
__device__ __forceinline__ void simt_load_q(const T* __restrict__ q, long long stride_q_head, float scale, int li,
                                            bool active, float (&qf)[HEADS][RowMap<T, HEAD_DIM, HEADS>::EPT]) {
  using Map = RowMap<T, HEAD_DIM, HEADS>;
  constexpr int VEC = Map::VEC, VPT = Map::VPT;
#pragma unroll
  for (int h = 0; h < HEADS; ++h)
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      if (active) {
        Storage<T>::unpack(load_vec(q + h * stride_q_head + Map::dim(li, v)), &qf[h][v * VEC]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) qf[h][v * VEC + e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) qf[h][v * VEC + e] *= scale;
    }
}

// Copies one tile of K/V into its ring stage with cp.async (zero-filled past
// s1 and in idle lanes). `tile0`: the tile's first slot; the window's page
// ids are in page_ids (page p at p - win).
template <typename T, int HEAD_DIM, int HEADS, typename Stage>
__device__ __forceinline__ void simt_copy_tile(Stage& stage, int tid, int tile0, int lane_offset, int s1, bool active,
                                               const int* page_ids, int win, int page_size,
                                               const T* __restrict__ k_cache, CacheStrides ks, long long k_head,
                                               const T* __restrict__ v_cache, CacheStrides vs, long long v_head) {
  using Map = RowMap<T, HEAD_DIM, HEADS>;
  constexpr int VEC = Map::VEC, VPT = Map::VPT, GPW = Map::GPW, ACTIVE = Map::ACTIVE;
#pragma unroll
  for (int u = 0; u < Map::UNROLL; ++u) {
    const int pos = tile0 + u * NUM_WARPS * GPW + lane_offset;
    const bool valid = active && pos < s1;
    const T* kp = k_cache;
    const T* vp = v_cache;
    if (valid) {
      const int p = pos / page_size;
      const int slot = pos - p * page_size;
      const long long page = page_ids[p - win];
      kp = k_cache + page * ks.page + slot * ks.token + k_head;
      vp = v_cache + page * vs.page + slot * vs.token + v_head;
    }
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      cp_async_16(&stage[u][v][0][tid], kp + v * ACTIVE * VEC, valid);
      cp_async_16(&stage[u][v][1][tid], vp + v * ACTIVE * VEC, valid);
    }
  }
}

// One landed tile of the ring (UNROLL tokens per lane group): scores, one
// online-softmax rescale per tile and head, and P.V into acc. `tile0`: the
// tile's first slot; `lane_offset`: this lane group's token in a tile row.
template <typename T, int HEAD_DIM, int HEADS, typename Stage>
__device__ __forceinline__ void simt_attend_tile(const Stage& stage, int tid, int tile0, int lane_offset, int s1,
                                                 ScoreMap sc,
                                                 const float (&qf)[HEADS][RowMap<T, HEAD_DIM, HEADS>::EPT],
                                                 float (&m)[HEADS], float (&l)[HEADS],
                                                 float (&acc)[HEADS][RowMap<T, HEAD_DIM, HEADS>::EPT]) {
  using Map = RowMap<T, HEAD_DIM, HEADS>;
  using S = Storage<T>;
  constexpr int VEC = Map::VEC, TPR = Map::TPR, VPT = Map::VPT, GPW = Map::GPW, EPT = Map::EPT;
  constexpr int UNROLL = Map::UNROLL;
  float s[UNROLL][HEADS];
  bool valid[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    valid[u] = tile0 + u * NUM_WARPS * GPW + lane_offset < s1;
    float kf[EPT];
#pragma unroll
    for (int v = 0; v < VPT; ++v) S::unpack(stage[u][v][0][tid], &kf[v * VEC]);
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < EPT; ++e) dot = fmaf(qf[h][e], kf[e], dot);
      s[u][h] = group_sum<TPR>(dot);
    }
  }
  if (sc.soft_cap > 0.f) {  // uniform: one branch per tile, not per score
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int h = 0; h < HEADS; ++h) s[u][h] = sc.cap(s[u][h]);
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
#pragma unroll
    for (int h = 0; h < HEADS; ++h) s[u][h] = valid[u] ? s[u][h] : neg_inf();

  // One rescale per tile and head, not per token.
  float p[UNROLL][HEADS];
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    float m_new = m[h];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) m_new = fmaxf(m_new, s[u][h]);
    const float m_safe = m_new == neg_inf() ? 0.f : m_new;  // avoids -inf - -inf
    // The running max grows O(log n) times over n random tokens: rescale
    // only when some lane of the warp saw it grow (a warp-uniform branch).
    if (__any_sync(0xffffffffu, m_new > m[h])) {
      const float alpha = fast_exp2(m[h] - m_safe);
      l[h] *= alpha;
#pragma unroll
      for (int e = 0; e < EPT; ++e) acc[h][e] *= alpha;
    }
    m[h] = m_new;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      p[u][h] = fast_exp2(s[u][h] - m_safe);
      l[h] += p[u][h];
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    float vf[EPT];
#pragma unroll
    for (int v = 0; v < VPT; ++v) S::unpack(stage[u][v][1][tid], &vf[v * VEC]);
#pragma unroll
    for (int h = 0; h < HEADS; ++h)
#pragma unroll
      for (int e = 0; e < EPT; ++e) acc[h][e] = fmaf(p[u][h], vf[e], acc[h][e]);
  }
}

// Combines the lane groups of a warp (same dims, different tokens) into
// every group's registers.
template <int TPR, int HEADS, int EPT>
__device__ __forceinline__ void simt_merge_lane_groups(float (&m)[HEADS], float (&l)[HEADS], float (&acc)[HEADS][EPT]) {
#pragma unroll
  for (int off = TPR; off < 32; off <<= 1) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      const float m_o = __shfl_xor_sync(0xffffffffu, m[h], off);
      const float l_o = __shfl_xor_sync(0xffffffffu, l[h], off);
      const float m_new = fmaxf(m[h], m_o);
      const float m_safe = m_new == neg_inf() ? 0.f : m_new;
      const float a = fast_exp2(m[h] - m_safe), b = fast_exp2(m_o - m_safe);
      m[h] = m_new;
      l[h] = l[h] * a + l_o * b;
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        const float acc_o = __shfl_xor_sync(0xffffffffu, acc[h][e], off);
        acc[h][e] = acc[h][e] * a + acc_o * b;
      }
    }
  }
}

// Attends query heads [0, HEADS) at q (head stride stride_q_head) over the
// visible slots [slot_begin, slot_end) of one request; a slot s lives in page
// req_pages[s / page_size] at entry s % page_size. Calls
// emit.finish(h, d, float4 o, lse) for every 4 output elements of head h (o
// normalized by the softmax denominator, lse its log2).
// An empty range emits zeros and -inf. Must be called by all NUM_THREADS threads.
//
// K/V move global -> shared with cp.async, STAGES - 1 tiles ahead of the
// compute, so each lane keeps several 16-byte loads in flight without
// holding them in registers.
template <typename T, int HEAD_DIM, int HEADS, typename Emit>
__device__ __forceinline__ void cta_attend(
    const T* __restrict__ q, long long stride_q_head, ScoreMap sc,
    const T* __restrict__ k_cache, CacheStrides ks,
    const T* __restrict__ v_cache, CacheStrides vs, int kv_head,
    const int* __restrict__ req_pages, int page_size, int slot_begin, int slot_end,
    AttendScratch<T, HEAD_DIM, HEADS>& sm, Emit& emit) {
  using Map = RowMap<T, HEAD_DIM, HEADS>;
  constexpr int VEC = Map::VEC, TPR = Map::TPR, VPT = Map::VPT, GPW = Map::GPW, EPT = Map::EPT;
  constexpr int ACTIVE = Map::ACTIVE;
  constexpr int UNROLL = Map::UNROLL;
  constexpr int STAGES = Pipeline<T, HEAD_DIM, HEADS>::STAGES;
  constexpr int TILE = NUM_WARPS * GPW * UNROLL;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = lane / TPR, li = lane % TPR;
  const bool active = ACTIVE == TPR || li < ACTIVE;  // idle lanes (li >= ACTIVE) hold zeros

  float qf[HEADS][EPT];
  simt_load_q<T, HEAD_DIM, HEADS>(q, stride_q_head, sc.scale, li, active, qf);
  float m[HEADS], l[HEADS], acc[HEADS][EPT];
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    m[h] = neg_inf();
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < EPT; ++e) acc[h][e] = 0.f;
  }

  const long long k_head = (long long)kv_head * ks.head + (active ? Map::dim(li, 0) : 0);
  const long long v_head = (long long)kv_head * vs.head + (active ? Map::dim(li, 0) : 0);
  const int lane_offset = warp * GPW + group;  // this lane's token within a tile row

  for_each_page_window<NUM_THREADS>(req_pages, page_size, slot_begin, slot_end, sm.page_ids,
                                    [&](int win, int s0, int s1) {
    const int n_iter = (s1 - s0 + TILE - 1) / TILE;
    auto copy = [&](int stage, int it) {
      simt_copy_tile<T, HEAD_DIM, HEADS>(sm.ring[stage], tid, s0 + it * TILE, lane_offset, s1, active,
                                         sm.page_ids, win, page_size, k_cache, ks, k_head, v_cache, vs, v_head);
    };
    auto consume = [&](int stage, int it) {
      simt_attend_tile<T, HEAD_DIM, HEADS>(sm.ring[stage], tid, s0 + it * TILE, lane_offset, s1, sc, qf, m, l, acc);
    };
    cp_async_ring<STAGES, false>(n_iter, copy, consume);
  });

  simt_merge_lane_groups<TPR, HEADS, EPT>(m, l, acc);
  __syncthreads();  // every lane is done with the ring before it becomes the combine buffer
  // (inline: as a function of its own, this store compiled the rows family's
  // 2-head instances to other machine code, scripts/sass_hash.py)
  if (group == 0 && active) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      if (li == 0) {
        sm.combine.m[warp][h] = m[h];
        sm.combine.l[warp][h] = l[h];
      }
#pragma unroll
      for (int v = 0; v < VPT; ++v)
#pragma unroll
        for (int e = 0; e < VEC; e += 4)
          *reinterpret_cast<float4*>(&sm.combine.acc[warp][h][Map::dim(li, v) + e]) =
              make_float4(acc[h][v * VEC + e], acc[h][v * VEC + e + 1], acc[h][v * VEC + e + 2],
                          acc[h][v * VEC + e + 3]);
    }
  }
  __syncthreads();
  emit_combined<NUM_WARPS, NUM_THREADS>(sm.combine, sc.out_scale, emit);
}

// Emits into a [rows, heads, HEAD_DIM] output of storage T with strides, and
// an optional float32 [rows, heads] LSE (contiguous). With sinks (a final
// output, never a partial), head h's sink logit z (natural log) is one more
// softmax denominator term: lse' = log2(2^lse + 2^(z log2 e)), o' = o 2^(lse - lse').
template <typename T>
struct EmitStrided {
  T* out;              // points at (row, first head of the CTA)
  long long stride_head;
  float* lse_out;      // points at (row, first head) or nullptr
  const float* sinks = nullptr;  // points at the first head's sink, or nullptr
  // dims [d, d + 4) of head h: o normalized by its softmax denominator, lse its log2
  __device__ __forceinline__ void finish(int h, int d, float4 o, float lse) {
    if (sinks != nullptr) {
      const float z = sinks[h] * 1.4426950408889634f;  // base 2
      const float mx = fmaxf(lse, z);                 // z is finite: so is mx
      const float total = mx + fast_log2(fast_exp2(lse - mx) + fast_exp2(z - mx));
      const float f = fast_exp2(lse - total);         // lse = -inf: 0
      o.x *= f; o.y *= f; o.z *= f; o.w *= f;
      lse = total;
    }
    T* p = out + h * stride_head + d;
    Storage<T>::store(p, o.x); Storage<T>::store(p + 1, o.y);
    Storage<T>::store(p + 2, o.z); Storage<T>::store(p + 3, o.w);
    if (d == 0 && lse_out != nullptr) lse_out[h] = lse;
  }
};

// Several query tokens of one request in one CTA (row groups: a plan of a
// PageTable.query_rows table). The CTA's query rows are r = tt * HEADS + h
// for r < rows: token tt's head h, its query at q + tt * stride_q_row + h *
// stride_q_head; token tt sees the slots below lim0 + tt (causal among the
// new tokens). The CUDA-core core serves one token at a time (rows == HEADS).
struct RowGroup {
  long long stride_q_row;
  int rows, lim0;
};

// Emits the rows of a row group (RowGroup): row r = tt * HEADS + h is
// EmitStrided's head h of output row tt (out + tt * stride_row, its LSE at
// lse_out + tt * lse_stride_row); rows >= rows are padding and emit nothing.
template <typename T, int HEADS>
struct EmitRows {
  EmitStrided<T> first;  // output row 0
  long long stride_row, lse_stride_row;
  int rows;
  __device__ __forceinline__ void finish(int r, int d, float4 o, float lse) {
    if (r >= rows) return;
    const int tt = r / HEADS, h = r - tt * HEADS;
    EmitStrided<T>{first.out + tt * stride_row, first.stride_head,
                   first.lse_out == nullptr ? nullptr : first.lse_out + tt * lse_stride_row, first.sinks}
        .finish(h, d, o, lse);
  }
};

// Emit a when `first`, else b (one inlined attention core serves either).
template <typename A, typename B>
struct EmitEither {
  A a;
  B b;
  bool first;
  __device__ __forceinline__ void finish(int r, int d, float4 o, float lse) {
    if (first)
      a.finish(r, d, o, lse);
    else
      b.finish(r, d, o, lse);
  }
};

// Visible slot range of pages [page_lo, page_hi) of a request: slots are
// counted from entry 0 of its first page, and the visible ones are
// [first_page_offset, (pages - 1) * page_size + last_page_len).
__device__ __forceinline__ void visible_slots(int pages, int first_page_offset, int last_page_len,
                                              int page_size, int page_lo, int page_hi,
                                              int& slot_begin, int& slot_end) {
  if (pages <= 0 || page_lo >= page_hi) {
    slot_begin = slot_end = 0;
    return;
  }
  const int total = (pages - 1) * page_size + last_page_len;
  slot_begin = max(page_lo * page_size, first_page_offset);
  slot_end = min(page_hi * page_size, total);
  if (slot_end < slot_begin) slot_end = slot_begin;
}

}  // namespace cupaged
