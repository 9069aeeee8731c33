#!/usr/bin/env python3
"""GPU time of CTAs that exit at once: what a capacity-sized grid (a CUDA
graph captured by a DecodeRunner, replayed for a smaller batch) costs beyond
the CTAs that work. A probe kernel shaped like the tensor-core partial kernel
(128 threads, 72 KB dynamic shared memory, 2 CTAs per SM) reads a count and
exits when its index is past it.

    python3 scripts/empty_grid.py

Needs a CUDA GPU. Exit status: 0 ran, 2 no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(128, 2) probe(const int* n, float* out) {
  extern __shared__ float smem[];
  if ((int)blockIdx.x >= *n) return;
  smem[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = smem[5];
}"""
GRIDS = (264, 528, 1056, 2112, 4224, 8448, 16896, 33792, 67584)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    _common.require_gpu()
    import cupy

    from cupaged import testing

    kernel = cupy.RawKernel(SOURCE, "probe")
    smem = 72 * 1024
    kernel.max_dynamic_shared_size_bytes = smem
    n = cupy.zeros(1, cupy.int32)
    out = cupy.zeros(max(GRIDS), cupy.float32)
    for active in (0, 264):
        n[0] = active
        for grid in GRIDS:
            us = testing.graph_time_us(lambda: kernel((grid,), (128,), (n, out), shared_mem=smem), launches=20, reps=5)
            print(f"active {active} grid {grid}: {us:.2f} us per launch", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
