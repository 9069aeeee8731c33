"""The command line: ``python -m cupaged demo | info | --version``.

``demo`` decodes a small random paged batch: with a GPU it runs
``cupaged.decode`` (every method) and compares each against the float64
reference; without one it says so and runs the reference and its
split-then-merge emulation instead. Exit status 0 when every check passes.

``info`` prints what cupaged sees on this machine: the GPU, driver and CUDA
versions, CuPy, whether one kernel module of each family compiles (NVRTC; for
sm_90 when there is no GPU) and the cache folders. Exit status 0 unless a
kernel family failed to compile.
"""

from __future__ import annotations

import argparse
import sys
import time


import numpy as np

from . import _env, reference
from ._device import has_gpu, no_gpu_message
from ._version import __version__
from .plan import plan_decode
from .pool import BlockPool

MAX_DEMO_BATCH = 64
#: The architecture ``info`` compiles for when there is no GPU (CI's compile check uses it too).
NO_GPU_ARCH = "sm_90"


def _random_batch(rng, batch: int, page_size: int):
    """A pool-built batch of ``batch`` requests with ragged lengths: with two or
    more, the last one is a fork of request 0 (it shares request 0's full
    pages), and the last new request keeps a sliding window."""
    new = batch - 1 if batch >= 2 else 1
    pool = BlockPool(41 * batch + 8, page_size)  # each new request takes at most 40 pages
    seqs = []
    for _ in range(new):
        s = pool.add_sequence()
        pool.append(s, int(rng.integers(1, 40 * page_size)))
        seqs.append(s)
    if batch >= 2:
        child, _copies = pool.fork(seqs[0])
        pool.append(child, 3)
        seqs.append(child)
    pool.apply_window(seqs[new - 1], max(1, pool.sequence(seqs[new - 1]).length // 2))
    table, rope_offsets = pool.page_table(seqs)
    return pool, table, rope_offsets, new


def demo(args) -> int:
    rng = np.random.default_rng(args.seed)
    num_qo_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16
    pool, table, rope_offsets, new = _random_batch(rng, args.batch, page_size)
    # Shared pages hold copied data in a real cache; here fork's partial-page
    # copy is irrelevant because the caches are random anyway.
    fork = ", the last a fork of request 0" if args.batch >= 2 else ""
    requests = "1 request" if table.batch_size == 1 else f"{table.batch_size} requests"
    print(f"batch of {requests}{fork}; request {new - 1} keeps a sliding window")
    print(f"seq_lens {table.seq_lens.tolist()}, rope offsets (written lengths) {rope_offsets.tolist()}")
    plan = plan_decode(table, num_qo_heads, num_kv_heads, head_dim, np.float16, num_sms=None)
    print(f"plan: pages_per_chunk={plan.pages_per_chunk} chunks={plan.num_chunks} "
          f"ctas={plan.num_ctas} merge={plan.needs_merge}")
    shape = (pool.num_pages, page_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    v = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    q = rng.standard_normal((table.batch_size, num_qo_heads, head_dim), dtype=np.float32).astype(np.float16)
    ref_out, ref_lse = reference.decode(q, k, v, table)

    if not has_gpu():
        print(no_gpu_message("cupaged.decode"))
        print("running the NumPy float64 reference and its split/merge emulation instead")
        out, lse = reference.decode_split(q, k, v, table, plan)[:2]
        err = np.abs(out - ref_out).max() / np.abs(ref_out).max()
        print(f"reference split/merge vs unsplit: max_rel={err:.2e}")
        return 0 if err < 1e-10 else 1

    import cupy

    from .decode import decode

    dq, dk, dv = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)
    ok = True
    for method in ("v2", "v1", "gather"):
        out = decode(dq, dk, dv, table, plan if method == "v2" else None, method=method).get().astype(np.float64)
        err = np.abs(out - ref_out).max() / np.abs(ref_out).max()
        good = bool(np.isfinite(out).all()) and err < 2e-2
        ok &= good
        print(f"{method:>6}: max_rel={err:.2e} {'ok' if good else 'FAILED'}")
    return 0 if ok else 1


# -------------------------------------------------------------------- info


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _gpu_lines() -> tuple[list[str], str | None]:
    """Lines about CuPy, the driver and the GPU, and the arch to compile for
    (``None`` without a GPU)."""
    try:
        import cupy
    except Exception:  # noqa: BLE001  missing or broken: gpu_status says which
        return ["CuPy: not importable", no_gpu_message("cupaged.decode")], None
    lines = [f"CuPy: {cupy.__version__} (CUDA {_cuda_version(cupy.cuda.runtime.runtimeGetVersion())} runtime)"]
    try:
        driver = cupy.cuda.runtime.driverGetVersion()
        lines.append(f"NVIDIA driver: supports CUDA {_cuda_version(driver)}" if driver else "NVIDIA driver: none loaded")
    except Exception as e:  # noqa: BLE001
        lines.append(f"NVIDIA driver: unknown ({e})")
    if not has_gpu():
        return [*lines, no_gpu_message("cupaged.decode")], None
    runtime = cupy.cuda.runtime
    dev = runtime.getDevice()
    props = runtime.getDeviceProperties(dev)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    cc = int(cupy.cuda.Device(dev).compute_capability)
    note = ("below 8.0: the kernels need cp.async (sm_80+)" if cc < 80
            else "fp8 KV needs 8.9+" if cc < 89 else "fp8 KV supported")
    lines.append(f"GPU {dev} of {runtime.getDeviceCount()}: {name}, compute capability {cc // 10}.{cc % 10} "
                 f"({note}), {props['multiProcessorCount']} SMs, {props['totalGlobalMem'] / 2**30:.0f} GiB")
    return lines, f"sm_{cc}"


def _compile_lines(arch: str) -> tuple[list[str], bool]:
    """One line per kernel family: whether one module of it compiles for ``arch``."""
    from . import _configs, _loader

    try:
        from cupy.cuda import nvrtc

        major, minor = nvrtc.getVersion()
        lines = [f"NVRTC: {major}.{minor}; compiling one module per kernel family for {arch}"]
    except Exception as e:  # noqa: BLE001  no CuPy, or no NVRTC library
        return [f"NVRTC: not available ({type(e).__name__}: {e}); kernels not compiled"], True
    ok = True
    for family in _configs.SOURCES:
        modules = [m for m in _configs.all_modules() if m[0] == family]
        _, dtype, head_dim = next((m for m in modules if m[1:] in (("float16", 128), ("float16", 0))), modules[0])
        t = time.perf_counter()
        try:
            n = len(_loader.compile_for_arch(family, dtype, head_dim, arch=arch))
            lines.append(f"  {family:<8} ok ({dtype}, head_dim {head_dim or 'any'}, {n} instances, "
                         f"{time.perf_counter() - t:.1f} s)")
        except Exception as e:  # noqa: BLE001  report and go on with the next family
            ok = False
            lines.append(f"  {family:<8} FAILED: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return lines, ok


def _cache_lines() -> list[str]:
    from . import _loader, autotune

    try:
        import cupy.cuda.compiler as compiler

        cupy_dir = getattr(compiler._kernel_cache_backend, "_cache_dir", None) or _env.cupy_cache_dir()
    except Exception:  # noqa: BLE001  no CuPy
        cupy_dir = _env.cupy_cache_dir()
    return [f"CUDA sources: {_loader.SRC_DIR}",
            f"CuPy kernel cache: {cupy_dir} (env CUPY_CACHE_DIR)",
            f"cupaged autotune cache: {autotune.cache_path()} (env {autotune.ENV_CACHE_DIR})"]


def info(args) -> int:
    print(f"cupaged {__version__} (Python {sys.version.split()[0]}, NumPy {np.__version__})")
    lines, arch = _gpu_lines()
    for line in lines:
        print(line)
    ok = True
    if args.no_compile:
        print("kernels: not compiled (--no-compile)")
    else:
        compiled, ok = _compile_lines(arch or NO_GPU_ARCH)
        for line in compiled:
            print(line)
    for line in _cache_lines():
        print(line)
    return 0 if ok else 1


# --------------------------------------------------------------------- CLI


def _demo_batch(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= n <= MAX_DEMO_BATCH:
        raise argparse.ArgumentTypeError(f"{n} is not in 1..{MAX_DEMO_BATCH}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cupaged",
        description="cupaged: paged-attention decode kernels for CuPy.",
        epilog="Run 'python -m cupaged COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"cupaged {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="demo or info")
    p = sub.add_parser(
        "demo", help="decode a small random paged batch and check it against the float64 reference",
        description="Decode a small random paged batch (ragged lengths, a forked request, a sliding "
        "window) with every method and check each against the NumPy float64 reference. Without a GPU, "
        "runs the reference and its split/merge emulation instead. Exit status 0 when every check passes.")
    p.add_argument("--batch", type=_demo_batch, default=6, metavar="N",
                   help=f"number of requests, 1 to {MAX_DEMO_BATCH} (default 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random lengths and data (default 0)")
    p.set_defaults(run=demo)
    p = sub.add_parser(
        "info", help="print the GPU, driver, CUDA and CuPy versions, which kernels compile, and cache folders",
        description="Print what cupaged sees on this machine: GPU name and compute capability, driver and "
        "CUDA runtime versions, CuPy version, whether one kernel module of each family compiles with NVRTC "
        f"(for the GPU's architecture; for {NO_GPU_ARCH} without a GPU) and the cache folders. Exit status 1 "
        "when a kernel family fails to compile.")
    p.add_argument("--no-compile", action="store_true", help="skip the NVRTC compile of each kernel family")
    p.set_defaults(run=info)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
