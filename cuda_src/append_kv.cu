// append_kv<IN_T, CACHE_T>: one launch writes the new tokens' K and V of a
// whole batch into their KV-cache pages, through the CSR page table. The
// table already includes the new tokens (the pool grew the sequences first):
// the n_i new tokens of request i are its LAST n_i visible slots.
//
// For new token t and kv head h:
//   request i: append_indptr[i] <= t < append_indptr[i + 1], found by a binary
//              search over append_indptr (no host round trip); with
//              append_indptr null, one token per request and i = t
//   n_i = append_indptr[i + 1] - append_indptr[i],  j = t - append_indptr[i]
//   seq_len_i = (pages_i - 1) * page_size + last_page_len[i] - first_page_offset[i]
//               (0 when request i has no pages), pages_i = indptr[i + 1] - indptr[i]
//   slot s = seq_len_i - n_i + j,  pos = first_page_offset[i] + s
//   page = indices[indptr[i] + pos / page_size],  entry = pos % page_size
//   k_cache[page, entry, h, :] = convert(k_new[t, h, :] / k_scale_h)   (V alike)
// with k_scale_h = k_scale_per_head[h] when that pointer is given, else
// k_scale. x / scale is computed in float32 as x * rcp(scale), both rounded
// to nearest even (rcp correctly rounded; exactly x / scale when scale is a
// power of two), then convert:
//   CACHE_T == IN_T: round to nearest even into IN_T (float16 saturates a
//     finite value beyond +-65504 to +-65504; inf and NaN pass through). With
//     no scale (k_scale_per_head null and k_scale == 1) the bytes are copied
//     unchanged.
//   CACHE_T == e4m3: float8 e4m3fn bits (bias 7, max 448, no inf),
//     round to nearest even, saturating to +-448 (infinities included); NaN
//     stays NaN (cvt.rn.satfinite.e4m3x2.f32, sm_89+; older archs trap).
// Other bytes of both caches are never written.
//
// Grid: 1-D, ceil(num_tokens * num_kv_heads * (head_dim / ELEMS) / APPEND_THREADS)
// CTAs. Block: APPEND_THREADS threads, one per (token, kv head, chunk of ELEMS
// consecutive head_dim elements), chunk fastest, then head, then token; each
// thread writes its chunk of K and of V. ELEMS = 16 bytes of the narrower of
// IN_T and CACHE_T: one 16-byte store per tensor and 1 (same dtype), 2 (16-bit
// -> fp8) or 4 (float32 -> fp8) 16-byte loads.
// Pointers (strides in elements of the pointer's own type):
//   k_new, v_new  [num_tokens, num_kv_heads, head_dim] IN_T, strides
//                 (stride_k_new_token, stride_k_new_head, 1) / (stride_v_new_token, ...)
//   k_cache, v_cache  [num_pages, ...] CACHE_T; element (page, entry, h, d) at
//                 page * stride_k_page + entry * stride_k_slot + h * stride_k_head + d
//                 (NHD and HND differ only in these strides) / (stride_v_page, ...)
//   indices [indptr[batch]], indptr [batch + 1], last_page_len [batch],
//   first_page_offset [batch]: int32, the page table (PageTable.device())
//   append_indptr [batch + 1] int32, non-decreasing, from 0 to num_tokens; or null
//   device_batch  [1] int32: the batch size, read on the device (it overrides
//                 batch; with append_indptr null, tokens t >= batch write
//                 nothing), or null (batch as passed). A DecodeRunner passes
//                 its plan image's batch entry, so that a graph launching
//                 max_batch tokens serves every later step.
//   k_scale_per_head, v_scale_per_head  [num_kv_heads] float32, or null
// Preconditions: head_dim % ELEMS == 0; every pointer and every byte stride
// (stride * sizeof) a multiple of 16; a valid table whose page ids index the
// caches; with append_indptr null, num_tokens == batch.
// Edge behaviour: a token whose slot is not visible (n_i > seq_len_i, a
// malformed append_indptr, t >= append_indptr[batch], or batch == 0) writes
// nothing, so no input can write out of bounds; num_tokens == 0 is not launched.
#include "common.cuh"

namespace cupaged {

constexpr int APPEND_THREADS = 128;

// Two floats -> float8 e4m3fn bits, lo in the low byte (the lower address).
__device__ __forceinline__ unsigned append_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  unsigned short r;
  // The first source lands in the upper byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  __trap();  // the host refuses fp8 caches below sm_89
  return 0;
#endif
}

// Floats -> one 16-byte vector of T (round to nearest even): 16-bit T as
// Storage<T>::bits (f16 saturating as every output store does), float as is.
template <typename T> struct AppendPack {
  __device__ __forceinline__ static uint4 pack(const float* f) {
    using S = Storage<T>;
    return make_uint4(S::bits(f[0]) | S::bits(f[1]) << 16, S::bits(f[2]) | S::bits(f[3]) << 16,
                      S::bits(f[4]) | S::bits(f[5]) << 16, S::bits(f[6]) | S::bits(f[7]) << 16);
  }
};

template <> struct AppendPack<float> {
  __device__ __forceinline__ static uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};

// Reads ELEMS inputs at src and returns the 16 bytes of CACHE_T to store.
template <typename IN_T, typename CACHE_T>
struct AppendChunk {
  static constexpr bool SAME = IsSame<IN_T, CACHE_T>::value;
  static constexpr int IN_VEC = Storage<IN_T>::VEC;
  static constexpr int ELEMS = SAME ? IN_VEC : 16;  // CACHE_T is e4m3 (1 byte) otherwise
  static constexpr int LOADS = ELEMS / IN_VEC;

  __device__ __forceinline__ static void load(const IN_T* src, uint4* raw) {
#pragma unroll
    for (int k = 0; k < LOADS; ++k) raw[k] = load_vec(src + k * IN_VEC);
  }

  // scale_is_one: no scale was given (copy the bytes when SAME).
  __device__ __forceinline__ static uint4 convert(const uint4* raw, float scale, bool scale_is_one) {
    if (SAME && scale_is_one) return raw[0];
    float f[ELEMS];
#pragma unroll
    for (int k = 0; k < LOADS; ++k) Storage<IN_T>::unpack(raw[k], f + k * IN_VEC);
    // x * (1 / scale): a correctly rounded reciprocal, then a rounded product
    // (IEEE division would call a slow-path subroutine with a stack frame).
    const float inv_scale = __frcp_rn(scale);
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) f[e] *= inv_scale;
    if constexpr (SAME) {
      return AppendPack<IN_T>::pack(f);
    } else {
      unsigned w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        w[q] = append_e4m3x2(f[4 * q], f[4 * q + 1]) | append_e4m3x2(f[4 * q + 2], f[4 * q + 3]) << 16;
      return make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
};

template <typename IN_T, typename CACHE_T>
__global__ void __launch_bounds__(APPEND_THREADS) append_kv(
    const IN_T* __restrict__ k_new, long long stride_k_new_token, long long stride_k_new_head,
    const IN_T* __restrict__ v_new, long long stride_v_new_token, long long stride_v_new_head,
    CACHE_T* __restrict__ k_cache, long long stride_k_page, long long stride_k_slot, long long stride_k_head,
    CACHE_T* __restrict__ v_cache, long long stride_v_page, long long stride_v_slot, long long stride_v_head,
    const int* __restrict__ indices, const int* __restrict__ indptr, const int* __restrict__ last_page_len,
    const int* __restrict__ first_page_offset, const int* __restrict__ append_indptr, int batch,
    const int* __restrict__ device_batch, int num_tokens, int num_kv_heads, int head_dim, int page_size,
    const float* __restrict__ k_scale_per_head, const float* __restrict__ v_scale_per_head, float k_scale,
    float v_scale) {
  using Chunk = AppendChunk<IN_T, CACHE_T>;
  static_assert(sizeof(CACHE_T) * Chunk::ELEMS == 16, "one 16-byte store per chunk");
  const int chunks = head_dim / Chunk::ELEMS;
  const long long item = (long long)blockIdx.x * APPEND_THREADS + threadIdx.x;
  const long long per_token = (long long)num_kv_heads * chunks;
  if (item >= (long long)num_tokens * per_token) return;
  const int t = (int)(item / per_token);
  const int rest = (int)(item - (long long)t * per_token);
  const int h = rest / chunks;
  const int d = (rest - h * chunks) * Chunk::ELEMS;

  // A graph replayed for several batches reads the batch from the device.
  if (device_batch != nullptr) {
    batch = __ldg(device_batch);
    if (append_indptr == nullptr && t >= batch) return;  // past this step's requests
  }
  // token -> (request i, its n_i new tokens, index j among them)
  int i = t, n = 1, j = 0;
  if (append_indptr != nullptr) {
    if (batch <= 0) return;  // no request to own any token
    int lo = 0, hi = batch;  // the largest i in [0, batch) with append_indptr[i] <= t
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (__ldg(append_indptr + mid) <= t) lo = mid; else hi = mid;
    }
    const int start = __ldg(append_indptr + lo), end = __ldg(append_indptr + lo + 1);
    if (t < start || t >= end) return;  // no request owns token t
    i = lo, n = end - start, j = t - start;
  }
  const int page_begin = __ldg(indptr + i);
  const int pages = __ldg(indptr + i + 1) - page_begin;
  const long long offset = __ldg(first_page_offset + i);
  const long long seq_len =
      pages > 0 ? (long long)(pages - 1) * page_size + __ldg(last_page_len + i) - offset : 0;
  const long long slot = seq_len - n + j;
  if (slot < 0 || slot >= seq_len) return;  // n_i > seq_len_i: not a visible slot
  const long long pos = offset + slot;
  const long long page = __ldg(indices + page_begin + (int)(pos / page_size));
  const long long entry = pos % page_size;

  uint4 k_raw[Chunk::LOADS], v_raw[Chunk::LOADS];
  Chunk::load(k_new + t * stride_k_new_token + h * stride_k_new_head + d, k_raw);
  Chunk::load(v_new + t * stride_v_new_token + h * stride_v_new_head + d, v_raw);
  const float ks = k_scale_per_head != nullptr ? __ldg(k_scale_per_head + h) : k_scale;
  const float vs = v_scale_per_head != nullptr ? __ldg(v_scale_per_head + h) : v_scale;
  const uint4 k_out = Chunk::convert(k_raw, ks, k_scale_per_head == nullptr && k_scale == 1.f);
  const uint4 v_out = Chunk::convert(v_raw, vs, v_scale_per_head == nullptr && v_scale == 1.f);
  *reinterpret_cast<uint4*>(k_cache + page * stride_k_page + entry * stride_k_slot + h * stride_k_head + d) = k_out;
  *reinterpret_cast<uint4*>(v_cache + page * stride_v_page + entry * stride_v_slot + h * stride_v_head + d) = v_out;
}

}  // namespace cupaged
