"""Compiles cuda_src/ with cupy.RawModule and looks kernels up by name.

One module per (kernel family, dtype, head_dim), built on first use. CuPy's
on-disk kernel cache keys on the source text and options only, so a changed
header would be missed: the source handed to NVRTC starts with a hash of every
file in cuda_src/, headers included.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from . import _configs, _env


def find_src_dir() -> Path:
    """The folder of the CUDA sources: env ``CUPAGED_CUDA_SRC`` if set, else
    ``cupaged/cuda_src/`` of an installed wheel (the repository's top-level
    ``cuda_src/``, shipped as package data), else ``cuda_src/`` beside the
    package (a source checkout or an editable install). Raises only for a
    bad ``CUPAGED_CUDA_SRC`` (not a directory); otherwise when
    neither holds the sources it returns the wheel's place, and
    :func:`module_source` says what is missing."""
    places = _src_places()
    env = _env.cuda_src(places[0])
    if env is not places[0]:
        return env
    return next((p for p in places if (p / _configs.SOURCES["partial"]).is_file()), places[0])


def _src_places() -> tuple[Path, Path]:
    here = Path(__file__).resolve().parent
    return here / "cuda_src", here.parent / "cuda_src"


SRC_DIR = find_src_dir()
OPTIONS = ("-std=c++17", f"-I{SRC_DIR}", *_configs.nvrtc_defines())  # (a module of the default traits)


def module_options(family: str, dtype: str, head_dim: int) -> tuple[str, ...]:
    """NVRTC options of one module: ``OPTIONS`` with its MMA shared memory
    (:func:`cupaged._configs.module_smem_kb`, what its launches pass), its
    CTA shape (:func:`cupaged._configs.cta_shape`) and programmatic
    dependent launch where :func:`cupaged._configs.module_pdl`."""
    return (*OPTIONS[:2], *_configs.nvrtc_defines(_configs.module_smem_kb(family, dtype, head_dim),
                                                  _configs.module_pdl(family, dtype, head_dim),
                                                  _configs.cta_shape(family)))


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(SRC_DIR.glob("*.cu*")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def module_source(family: str) -> str:
    path = SRC_DIR / _configs.SOURCES[family]
    if not path.is_file():
        where = ("looked in " + " and ".join(map(str, _src_places())) if SRC_DIR in _src_places()
                 else "env CUPAGED_CUDA_SRC")
        raise FileNotFoundError(f"cupaged's CUDA source {path.name} is missing from {SRC_DIR} ({where}); "
                                "reinstall cupaged, or set CUPAGED_CUDA_SRC to a cuda_src/ folder")
    code = path.read_text()
    return f"// cupaged cuda_src hash {source_hash()}\n{code}"


@functools.lru_cache(maxsize=None)
def _module(family: str, dtype: str, head_dim: int):
    import cupy

    return cupy.RawModule(
        code=module_source(family),
        options=module_options(family, dtype, head_dim),
        name_expressions=_configs.name_expressions(family, dtype, head_dim),
    )


@functools.lru_cache(maxsize=None)
def get_kernel(family: str, dtype: str, head_dim: int, index: int = 0):
    """The ``index``-th instance of the module (family, dtype, head_dim)."""
    names = _configs.name_expressions(family, dtype, head_dim)
    return _module(family, dtype, head_dim).get_function(names[index])


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def compile_for_arch(family: str, dtype: str, head_dim: int, arch: str = "sm_90") -> dict[str, KernelResources]:
    """Compiles one module with NVRTC for ``arch`` (no GPU needed) and returns
    ptxas's resource report per template instance; raises on a compile error."""
    from cupy.cuda import nvrtc

    names = _configs.name_expressions(family, dtype, head_dim)
    prog = nvrtc.createProgram(module_source(family), _configs.SOURCES[family], [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, [*module_options(family, dtype, head_dim), f"-arch={arch}", "-Xptxas=-v"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{family}/{dtype}/{head_dim}: {exc}\n{nvrtc.getProgramLog(prog)}") from exc
        log = nvrtc.getProgramLog(prog)
        lowered = {nvrtc.getLoweredName(prog, n): n for n in names}
    finally:
        nvrtc.destroyProgram(prog)
    return _parse_ptxas(log, lowered)


def _parse_ptxas(log: str, lowered: dict[str, str]) -> dict[str, KernelResources]:
    out: dict[str, KernelResources] = {}
    current = None
    frame = (0, 0, 0)
    for line in log.splitlines():
        if m := _PTXAS_FUNC.search(line):
            current = m.group(1)
        elif (m := _PTXAS_FRAME.search(line)) and current:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _PTXAS_REGS.search(line)) and current in lowered:
            name = lowered[current]
            out[name] = KernelResources(name, int(m.group(1)), *frame, int(m.group(2) or 0))
            current = None
    missing = set(lowered.values()) - set(out)
    if missing:
        raise RuntimeError(f"no ptxas report for {sorted(missing)}:\n{log}")
    return out
