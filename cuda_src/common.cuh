// Shared device helpers for every cupaged kernel: storage types, 16-byte
// vector loads and conversions, fast base-2 math, warp reductions.
// Kernels include no CUDA header so NVRTC compiles them with no include path
// beyond cuda_src/ (the CI compile check runs on a machine without a toolkit).
#pragma once

namespace cupaged {

// 16-bit storage types. Plain structs (not __half/__nv_bfloat16) so no CUDA
// header is needed; the conversions below are one PTX instruction each.
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };
// fp8 KV storage (float8_e4m3fn bits); only the tensor-core core reads it.
struct e4m3 { unsigned char bits; };

// Two e4m3 values (low byte first) -> f16x2, exactly (sm_89+).
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned short v) {
  unsigned r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
}
// f32 pair -> f16x2 (lo in the low half).
__device__ __forceinline__ unsigned float2_to_f16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Type traits (no <type_traits>: NVRTC gets no include path beyond cuda_src/).
template <typename A, typename B> struct IsSame { static constexpr bool value = false; };
template <typename A> struct IsSame<A, A> { static constexpr bool value = true; };
template <bool C, typename A, typename B> struct Select { using type = A; };
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ex2.approx / lg2.approx: 2 ulp, what the online softmax needs; exp2(-inf) = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Storage traits: VEC elements per 16-byte vector, unpacking a vector into
// floats and packing floats into one element.
template <typename T> struct Storage;

template <> struct Storage<float> {
  static constexpr int VEC = 4;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static void store(float* p, float x) { *p = x; }
};

__device__ __forceinline__ void half2_to_float2(unsigned int u, float& lo, float& hi) {
  unsigned short l = (unsigned short)(u & 0xffffu), h = (unsigned short)(u >> 16);
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(l));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(h));
}

template <> struct Storage<f16> {
  static constexpr int VEC = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    half2_to_float2(v.x, f[0], f[1]); half2_to_float2(v.y, f[2], f[3]);
    half2_to_float2(v.z, f[4], f[5]); half2_to_float2(v.w, f[6], f[7]);
  }
  // The f16 bits of x (round to nearest even, zero-extended). Outputs are
  // convex combinations of f16 values, so a finite x beyond 65504 is
  // rounding (P rounded for the tensor cores): saturate it rather than store
  // inf. inf and NaN pass through.
  __device__ __forceinline__ static unsigned bits(float x) {
    if (fabsf(x) > 65504.f && fabsf(x) != __int_as_float(0x7f800000)) x = copysignf(65504.f, x);
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
  }
  __device__ __forceinline__ static void store(f16* p, float x) { p->bits = (unsigned short)bits(x); }
};

template <> struct Storage<bf16> {
  static constexpr int VEC = 8;
  // bf16 is the top half of an fp32: widening is a shift or a mask.
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
  }
  // The bf16 bits of x (round to nearest even, zero-extended).
  __device__ __forceinline__ static unsigned bits(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
  }
  __device__ __forceinline__ static void store(bf16* p, float x) { p->bits = (unsigned short)bits(x); }
};

// Read-only 16-byte load through the non-coherent path.
template <typename T>
__device__ __forceinline__ uint4 load_vec(const T* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 16-byte global->shared copy that bypasses registers and L1 (cp.async.cg);
// when !valid it reads nothing and zero-fills the destination. L2_128B adds
// the L2::128B prefetch hint (L2 fills the whole 128-byte line on the first
// miss); POLICY adds an L2 cache-eviction policy from createpolicy (see
// evict_first_policy). Where each pays is measured: see the tensor-core token loop.
template <bool L2_128B = false, bool POLICY = false>
__device__ __forceinline__ void cp_async_16s(unsigned dst, const void* gmem, bool valid,
                                             unsigned long long policy = 0) {  // (dst: a shared-space address)
  const int n = valid ? 16 : 0;
  if constexpr (L2_128B && POLICY)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
                 "l"(gmem), "r"(n), "l"(policy));
  else if constexpr (POLICY)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(gmem),
                 "r"(n), "l"(policy));
  else if constexpr (L2_128B)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
}
template <bool L2_128B = false, bool POLICY = false>
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid,
                                            unsigned long long policy = 0) {
  cp_async_16s<L2_128B, POLICY>(static_cast<unsigned>(__cvta_generic_to_shared(smem)), gmem, valid, policy);
}
// An L2 policy that marks the lines it loads for eviction first: the K/V
// stream is read once, so it should not push out what is read again.
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Barrier of the THREADS threads (whole warps) that name barrier `id` (1..15;
// 0 is __syncthreads'): orders their shared-memory accesses, cp.async copies
// included once each thread has waited for its own.
template <int THREADS>
__device__ __forceinline__ void named_barrier(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}

// The cp.async ring both attention cores run over a page window's n_iter
// tiles: copy(stage, it) issues tile it's copies into its stage (STAGES - 1
// tiles ahead; every step commits a group, empty past the end, so the wait
// count stays uniform), consume(stage, it) reads it once landed. WARP_SYNC:
// the tile's lanes read each other's copies (a __syncwarp on each side).
// PAIR: a warp pair shares each tile (each warp copies part of it, both
// consume all of it): after each wait the pair meets at named barrier
// `pair_id`, which publishes the partner's copies, and the refill is issued
// after it, once both warps are done with the stage it overwrites (read one
// iteration ago); STAGES - 2 tiles stay in flight during a wait.
template <int STAGES, bool WARP_SYNC, bool PAIR = false, typename Copy, typename Consume>
__device__ __forceinline__ void cp_async_ring(int n_iter, Copy& copy, Consume& consume, int pair_id = 0) {
  static_assert(!PAIR || STAGES >= 3, "a shared ring refills after its barrier: three stages or more");
  auto issue = [&](int it) {
    if (it < n_iter) copy(it % STAGES, it);
    cp_async_commit();
  };
#pragma unroll
  for (int it = 0; it < STAGES - 1; ++it) issue(it);
  for (int it = 0; it < n_iter; ++it) {
    if constexpr (PAIR) {
      cp_async_wait<STAGES - 2>();
      named_barrier<64>(pair_id);
      issue(it + STAGES - 1);
    } else {
      issue(it + STAGES - 1);  // refills the stage read one iteration ago
      cp_async_wait<STAGES - 1>();
    }
    if (WARP_SYNC) __syncwarp();  // other lanes' copies of this stage are visible
    consume(it % STAGES, it);
    if (WARP_SYNC) __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();  // only empty groups remain; keeps the ring idle at window end
}

// Programmatic dependent launch (sm_90; compiled in with CUPAGED_PDL, which
// is defined unless env CUPAGED_PDL=0, and whose launches allow the overlap): once every
// CTA of this kernel has called pdl_trigger, the next kernel in the stream
// may start; pdl_wait returns once the previous kernel has finished and its
// writes are visible. Without CUPAGED_PDL both are empty.
__device__ __forceinline__ void pdl_trigger() {
#if defined(CUPAGED_PDL) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(CUPAGED_PDL) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Bytes of dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned dynamic_smem_size() {
  unsigned r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

// Sum over aligned groups of WIDTH lanes (WIDTH a power of two <= 32).
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

}  // namespace cupaged
