"""Facts about the CUDA device, read lazily so the package imports without one."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def has_gpu() -> bool:
    """True when CuPy imports and the CUDA driver reports at least one device.

    Never raises: no CuPy, no driver, a driver too old for CuPy's runtime, or
    no device all give ``False``. The answer is computed on the first call and
    cached for the life of the process (``functools.lru_cache``): a later
    change of the machine's devices is not seen. :func:`cupaged.decode` and
    :func:`cupaged.merge_states` raise :class:`~cupaged.errors.NoGPUError`
    exactly when this is ``False``.

    Returns:
        ``bool``.

    Example:

    >>> import cupaged
    >>> cupaged.has_gpu() in (True, False)
    True
    """
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, or a driver too old: all mean "no GPU"
        return False


def require_gpu(what: str) -> None:
    from .errors import NoGPUError

    if not has_gpu():
        raise NoGPUError(f"{what} needs a CUDA GPU, and CuPy found none on this machine")
