"""Facts about the CUDA device, read lazily so the package imports without one."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def has_gpu() -> bool:
    """True when CuPy imports and the CUDA driver reports at least one device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, or a driver too old: all mean "no GPU"
        return False


def require_gpu(what: str) -> None:
    from .errors import NoGPUError

    if not has_gpu():
        raise NoGPUError(f"{what} needs a CUDA GPU, and CuPy found none on this machine")
