#!/usr/bin/env python3
"""The HBM read roofline of this GPU, measured two ways (issue 20: "Measure the
true one again: a >= 8 GB read with int4 loads, and a cp.async.bulk (TMA)
read, cold L2"):

* ``int4``: a grid-stride kernel of 16-byte streaming loads (``ld.global.cs``),
  ``--unroll`` independent loads per thread per step;
* ``bulk``: one thread per CTA issues ``cp.async.bulk`` copies of
  ``--chunk-kb`` KB into a ring of ``STAGES`` shared-memory stages, each
  completed on its own mbarrier (the Hopper bulk-copy path, no tensor map);
  the CTA's threads read one word of each landed chunk (so nothing is
  optimized away) and the stage is refilled.

The buffer (``--gb`` GB, default 8, far beyond the 60 MB L2) is read once per
launch; a configuration's figure is the median of ``--reps`` launches timed
with CUDA events, in TB/s of buffer bytes, for each CTAs-per-SM count of
``--ctas``. ``--compile-only`` compiles both kernels for sm_90 with NVRTC and
prints ptxas's report (no GPU needed; the CPU test does this).

``--small MB ...`` measures instead what a small launch costs beyond its
bytes (issue 20's "<= bytes / roofline + 4 us" target): a CUDA graph of
``--layers`` back-to-back reads (int4, then bulk per ``--chunk-kb``), each of its own buffer of that size
(cold L2, like a model's layers, while ``--layers`` x MB is well beyond the
60 MB L2), and the same graph of empty kernels; per
launch: GPU time, and time minus bytes / ``--roofline-tbps``. A plain read
has no page table, no dependent loads and no merge, so its excess is a floor
under any decode kernel's.

Exit status: 0 ran, 3 no CUDA GPU (unless ``--compile-only``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402

STAGES = 4
SOURCE = r"""
#define STAGES %(stages)d
#define UNROLL %(unroll)d

// int4 streaming read: each thread loads UNROLL independent 16-byte words per step.
extern "C" __global__ void __launch_bounds__(256) read_int4(const int4* __restrict__ src, long long n,
                                                            unsigned* sink) {
  unsigned acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
    int4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = __ldcs(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const int4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // never true in practice: keeps the loads
}

// Chunk k of this CTA (global chunk blockIdx.x + k * gridDim.x) into stage k %% STAGES.
__device__ __forceinline__ void issue_chunk(const unsigned char* src, long long chunks, int chunk_bytes,
                                            unsigned ring, unsigned bars, long long k) {
  const long long c = blockIdx.x + k * gridDim.x;
  if (c >= chunks) return;
  const int s = (int)(k %% STAGES);
  const unsigned bar = bars + 8u * s;
  asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%%0], %%1; }"
               :: "r"(bar), "r"(chunk_bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%%0], [%%1], %%2, [%%3];"
               :: "r"(ring + (unsigned)(s * chunk_bytes)), "l"(src + c * (long long)chunk_bytes),
                  "r"(chunk_bytes), "r"(bar) : "memory");
}

// Bulk-copy read: thread 0 keeps STAGES chunks in flight; each stage's
// mbarrier completes when its bytes land (expect_tx + complete_tx).
extern "C" __global__ void __launch_bounds__(128) read_bulk(const unsigned char* __restrict__ src,
                                                            long long chunks, int chunk_bytes, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) unsigned long long bar[STAGES];
  const unsigned ring_addr = (unsigned)__cvta_generic_to_shared(ring);
  const unsigned bar_addr = (unsigned)__cvta_generic_to_shared(bar);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%%0], 1;" :: "r"(bar_addr + 8u * s));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int k = 0; k < STAGES; ++k) issue_chunk(src, chunks, chunk_bytes, ring_addr, bar_addr, k);
  }
  __syncthreads();
  unsigned acc = 0;
  for (long long k = 0; blockIdx.x + k * gridDim.x < chunks; ++k) {
    const int s = (int)(k %% STAGES);
    const unsigned parity = (unsigned)((k / STAGES) & 1);
    unsigned done = 0;
    while (!done) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%%1], %%2; selp.u32 %%0, 1, 0, p; }"
                   : "=r"(done) : "r"(bar_addr + 8u * s), "r"(parity) : "memory");
    }
    acc ^= reinterpret_cast<const unsigned*>(ring + s * chunk_bytes)[threadIdx.x];
    __syncthreads();  // every thread is done with stage s before it is refilled
    if (threadIdx.x == 0) issue_chunk(src, chunks, chunk_bytes, ring_addr, bar_addr, k + STAGES);
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

extern "C" __global__ void empty_kernel() {}
"""


def source(unroll: int) -> str:
    return SOURCE % {"stages": STAGES, "unroll": unroll}


def compile_report(unroll: int = 4, arch: str = "sm_90") -> str:
    """NVRTC compiles both kernels for ``arch`` (no GPU); returns ptxas's log."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source(unroll), "roofline.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", f"-arch={arch}", "-Xptxas=-v"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{exc}\n{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def launch_bulk(read_bulk, buf, nbytes: int, kb: int, grid: int, sink) -> int:
    """One launch of the bulk reader over the first whole ``kb``-KB chunks of
    ``nbytes`` at ``buf`` (at most ``grid`` CTAs); returns the bytes it reads."""
    import cupy

    chunk = kb * 1024
    chunks, smem = nbytes // chunk, STAGES * chunk
    read_bulk.max_dynamic_shared_size_bytes = smem
    read_bulk((min(grid, chunks),), (128,), (buf, cupy.int64(chunks), cupy.int32(chunk), sink), shared_mem=smem)
    return chunks * chunk


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG)
    p.add_argument("--gb", type=float, default=8.0, help="buffer size in GB (default 8)")
    p.add_argument("--reps", type=int, default=7, help="timed launches per configuration (default 7)")
    p.add_argument("--ctas", type=int, nargs="+", default=[1, 2, 4, 8], help="CTAs per SM to try")
    p.add_argument("--unroll", type=int, default=4, help="int4 loads in flight per thread (default 4)")
    p.add_argument("--chunk-kb", type=int, nargs="+", default=[8, 16], help="bulk-copy chunk sizes in KB")
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90 and print ptxas's report")
    p.add_argument("--small", type=float, nargs="+", metavar="MB",
                   help="instead: per-launch cost of back-to-back reads of these sizes in a graph (cold L2)")
    p.add_argument("--layers", type=int, default=64, help="launches (distinct buffers) per graph with --small")
    p.add_argument("--roofline-tbps", type=float, default=4.59, help="the floor's rate with --small (default 4.59)")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    args = p.parse_args(argv)
    if args.compile_only:
        print(compile_report(args.unroll))
        return 0
    _common.require_gpu()
    import cupy

    if args.small:
        return small_launches(args)
    nbytes = int(args.gb * 1e9) // (64 * 1024) * (64 * 1024)  # whole chunks of any size tried
    buf = cupy.empty(nbytes, dtype=cupy.uint8)
    buf.view(cupy.uint32)[:] = 1  # touched once, so no page is read for the first time while timed
    sink = cupy.zeros(1, cupy.uint32)
    module = cupy.RawModule(code=source(args.unroll), options=("-std=c++17",))
    read_int4, read_bulk = module.get_function("read_int4"), module.get_function("read_bulk")
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def tbps(launch) -> tuple[float, float]:
        launch()  # warm-up
        times = []
        for _ in range(args.reps):
            start.record()
            launch()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e-3)
        med = statistics.median(times)
        return nbytes / med / 1e12, (max(times) - min(times)) / med * 100

    rows = []
    print(f"buffer {nbytes / 1e9:.2f} GB, {sms} SMs")
    for per_sm in args.ctas:
        grid = sms * per_sm
        n4 = nbytes // 16
        rate, spread = tbps(lambda: read_int4((grid,), (256,), (buf, cupy.int64(n4), sink)))
        rows.append(("int4", per_sm, 0, rate, spread))
        print(f"int4 unroll {args.unroll}, {per_sm} CTAs/SM x 256 threads: {rate:.3f} TB/s (spread {spread:.1f} %)")
        for kb in args.chunk_kb:  # (whole chunks: nbytes is a multiple of 64 KB)
            rate, spread = tbps(lambda: launch_bulk(read_bulk, buf, nbytes, kb, grid, sink))
            rows.append(("bulk", per_sm, kb, rate, spread))
            print(f"bulk {kb} KB x {STAGES} stages, {per_sm} CTAs/SM: {rate:.3f} TB/s (spread {spread:.1f} %)")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("kernel,ctas_per_sm,chunk_kb,tbps,spread_pct\n")
            f.writelines(f"{k},{c},{kb},{r:.4f},{s:.2f}\n" for k, c, kb, r, s in rows)
    return 0


def small_launches(args) -> int:
    """Per-launch GPU time of a graph of ``args.layers`` back-to-back reads,
    each over its own buffer (so every launch reads from HBM), against
    bytes / roofline; and of a graph of as many empty kernels."""
    import cupy

    module = cupy.RawModule(code=source(args.unroll), options=("-std=c++17",))
    read_int4, empty = module.get_function("read_int4"), module.get_function("empty_kernel")
    read_bulk = module.get_function("read_bulk")
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    sink = cupy.zeros(1, cupy.uint32)
    stream = cupy.cuda.Stream(non_blocking=True)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def per_launch_us(launch) -> tuple[float, float]:
        with stream:
            stream.begin_capture()
            for i in range(args.layers):
                launch(i)
            graph = stream.end_capture()
            graph.launch()
            times = []
            for _ in range(args.reps):
                start.record(stream)
                graph.launch()
                stop.record(stream)
                stop.synchronize()
                times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / args.layers)
        med = statistics.median(times)
        return med, (max(times) - min(times)) / med * 100

    rows = []
    us, spread = per_launch_us(lambda i: empty((1,), (32,), ()))
    rows.append(("empty", 0, 0, us, 0.0, spread))
    print(f"empty kernel: {us:.2f} us per launch (spread {spread:.1f} %)")
    for mb in args.small:
        nbytes = int(mb * 1e6) // 16 * 16
        bufs = [cupy.ones(nbytes // 4, dtype=cupy.uint32) for _ in range(args.layers)]
        n4 = nbytes // 16
        for per_sm in args.ctas:
            grid = min(sms * per_sm, -(-n4 // 256))
            us, spread = per_launch_us(lambda i: read_int4((grid,), (256,), (bufs[i], cupy.int64(n4), sink)))
            floor = nbytes / (args.roofline_tbps * 1e6)
            rows.append(("int4", per_sm, mb, us, us - floor, spread))
            print(f"read {mb:g} MB, {per_sm} CTAs/SM: {us:.2f} us per launch, floor {floor:.2f}, "
                  f"over {us - floor:.2f} us (spread {spread:.1f} %)")
            for kb in args.chunk_kb:  # the bulk reader over the same buffers (its whole chunks)
                us, spread = per_launch_us(lambda i: launch_bulk(read_bulk, bufs[i], nbytes, kb, sms * per_sm, sink))
                read = nbytes // (kb * 1024) * kb * 1024
                floor = read / (args.roofline_tbps * 1e6)
                rows.append((f"bulk{kb}", per_sm, mb, us, us - floor, spread))
                print(f"bulk {kb} KB read {mb:g} MB, {per_sm} CTAs/SM: {us:.2f} us per launch, floor {floor:.2f}, "
                      f"over {us - floor:.2f} us, {read / us / 1e6:.3f} TB/s (spread {spread:.1f} %)")
        bufs.clear()  # frees this size's buffers before the next
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("kernel,ctas_per_sm,mb,us_per_launch,us_over_floor,spread_pct\n")
            f.writelines(f"{k},{c},{mb},{u:.3f},{o:.3f},{sp:.2f}\n" for k, c, mb, u, o, sp in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
