#!/usr/bin/env python3
"""Hash the machine code of every kernel instance, to show that a source change leaves the kernels unchanged.

Compiles each kernel module with NVRTC for sm_90 (no GPU needed) and prints,
per kernel instance, a SHA-256 of its ``.text`` section in the cubin: the
SASS that runs. Two trees whose hashes all agree run the same instructions
(register allocation and scheduling included), so a refactor of cuda_src/
that keeps every hash needs no new GPU measurement. With --against, compares
this tree's cuda_src/ (or --src) with another one and lists the instances
that differ.

    python3 scripts/sass_hash.py --families partial rows
    python3 scripts/sass_hash.py --against /tmp/old/cuda_src      # exit 1 if any instance differs
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def sections(cubin: bytes) -> list[tuple[str, bytes, int]]:
    """``(name, bytes, alignment)`` of every section of an ELF64 cubin (a
    ``.nv.shared.*`` section is NOBITS: its bytes are the file's at its
    offset, meaningless; its size is ``sh_size``, read with
    :func:`section_sizes`)."""
    return [(name, cubin[offset:offset + size], align) for name, offset, size, align in _headers(cubin)]


def section_sizes(cubin: bytes) -> dict[str, tuple[int, int]]:
    """``{name: (size, alignment)}`` of every section of an ELF64 cubin."""
    return {name: (size, align) for name, _, size, align in _headers(cubin)}


def _headers(cubin: bytes) -> list[tuple[str, int, int, int]]:
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    out = []
    for name, _, _, _, offset, size, _, _, align, _ in headers:
        out.append((cubin[names + name:cubin.index(b"\0", names + name)].decode(), offset, size, align))
    return out


def text_sections(cubin: bytes) -> dict[str, bytes]:
    """``{kernel: bytes}`` of the ``.text.*`` sections (the SASS) of an ELF64 cubin."""
    return {name[len(".text."):]: data for name, data, _ in sections(cubin) if name.startswith(".text.")}


def compile_cubin(family: str, dtype: str, head_dim: int) -> tuple[bytes, dict[str, str]]:
    """One module compiled with NVRTC for sm_90 (this process's cuda_src):
    ``(cubin, {lowered name: name expression})``."""
    from cupy.cuda import nvrtc

    from cupaged import _configs, _loader

    names = _configs.name_expressions(family, dtype, head_dim)
    prog = nvrtc.createProgram(_loader.module_source(family), _configs.SOURCES[family], [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        nvrtc.compileProgram(prog, [*_loader.module_options(family, dtype, head_dim), "-arch=sm_90"])
        lowered = {nvrtc.getLoweredName(prog, n): n for n in names}
        return nvrtc.getCUBIN(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)


def module_hashes(family: str, dtype: str, head_dim: int) -> dict[str, str]:
    """``{kernel instance: sha256 of its SASS}`` of one module (this process's
    cuda_src, i.e. env CUPAGED_CUDA_SRC or the tree's)."""
    cubin, lowered = compile_cubin(family, dtype, head_dim)
    return {lowered.get(k, k): hashlib.sha256(v).hexdigest()[:16] for k, v in sorted(text_sections(cubin).items())}


def _module_entry(module: tuple[str, str, int]) -> dict[str, str]:
    family, dtype, head_dim = module
    return {f"{family}/{dtype}/{head_dim}: {name}": digest
            for name, digest in module_hashes(family, dtype, head_dim).items()}


def all_hashes(families: list[str] | None, jobs: int = 1) -> dict[str, str]:
    """Every selected module's hashes, ``jobs`` modules compiling at once."""
    from concurrent.futures import ProcessPoolExecutor

    from cupaged import _configs

    modules = [m for m in _configs.all_modules() if not families or m[0] in families]
    out = {}
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            for entry in pool.map(_module_entry, modules):
                out.update(entry)
    else:
        for m in modules:
            out.update(_module_entry(m))
    return out


def _hashes_of(src: Path | None, families: list[str] | None, jobs: int) -> dict[str, str]:
    """Hashes computed in a child process whose CUPAGED_CUDA_SRC is ``src``
    (the loader reads it at import)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if src is not None:
        env["CUPAGED_CUDA_SRC"] = str(src)
    cmd = [sys.executable, __file__, "--raw", "--jobs", str(jobs), *(["--families", *families] if families else [])]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return dict(line.rsplit("\t", 1) for line in res.stdout.splitlines() if "\t" in line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="exit status: 0 printed (or every instance the same), 1 some instance "
                                       "differs or exists in one tree only, 2 bad arguments")
    p.add_argument("--families", nargs="+", help="kernel families (default: all; e.g. partial rows merge append v1)")
    p.add_argument("--src", type=Path, help="the cuda_src/ to hash (default: this tree's)")
    p.add_argument("--against", type=Path, help="another cuda_src/ to compare with")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="modules compiled at once (default: CPUs)")
    p.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for path in (args.src, args.against):
        if path is not None and not path.is_dir():
            p.error(f"{path} is not a folder")
    if args.raw:
        for key, digest in all_hashes(args.families, args.jobs).items():
            print(f"{key}\t{digest}")
        return 0
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    mine = _hashes_of(args.src, args.families, args.jobs)
    if args.against is None:
        for key, digest in mine.items():
            print(f"{digest}  {key}")
        return 0
    other = _hashes_of(args.against, args.families, args.jobs)
    differ = sorted(k for k in mine.keys() | other.keys() if mine.get(k) != other.get(k))
    for key in differ:
        print(f"differs: {key} ({other.get(key, 'absent')} -> {mine.get(key, 'absent')})")
    print(f"{len(mine.keys() & other.keys()) - len(set(differ) & mine.keys() & other.keys())} of "
          f"{len(mine.keys() | other.keys())} kernel instances identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
