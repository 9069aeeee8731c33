#!/usr/bin/env python3
"""Compiles cupaged's kernel modules for the current GPU into CuPy's kernel
cache, several at a time, so that first calls (a notebook's, a server's
warm-up, a test session's) load them instead of waiting on NVRTC.

    python3 scripts/precompile.py                  # every module
    python3 scripts/precompile.py --families partial rows --jobs 8

Prints one line per module (seconds, or the error) and the total. Exit
status: 0 all compiled, 1 a module failed, 3 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402


def main(argv=None) -> int:
    from cupaged import _configs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG)
    p.add_argument("--families", nargs="+", choices=sorted(_configs.SOURCES), help="kernel families (default all)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="modules compiled at once (default: CPUs)")
    args = p.parse_args(argv)
    _common.require_gpu()
    from cupaged import _loader

    modules = [m for m in _configs.all_modules() if args.families is None or m[0] in args.families]

    def compile_one(module):
        start = time.perf_counter()
        _loader._module(*module).compile()  # NVRTC releases the GIL: threads compile in parallel
        return time.perf_counter() - start

    start, failed = time.perf_counter(), False
    # the first alone: NVRTC loads its builtins library on first use (threads racing it failed once)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {modules[0]: pool.submit(compile_one, modules[0])} if modules else {}
        if futures:
            futures[modules[0]].exception()
        futures.update({m: pool.submit(compile_one, m) for m in modules[1:]})
        for module, future in futures.items():
            err = future.exception()
            failed |= err is not None
            print(f"{'/'.join(map(str, module)):<40} " + (f"{future.result():6.1f} s" if err is None
                                                         else f"failed: {type(err).__name__}: {err}"), flush=True)
    print(f"{len(modules)} modules in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
