"""Facts about the CUDA device, read lazily so the package imports without one."""

from __future__ import annotations

import functools

#: What to install for CuPy, per CUDA major of the driver (README, "Requirements").
INSTALL_HINT = 'pip install "cupaged[cuda13]" for a CUDA 13 driver, "cupaged[cuda12]" for CUDA 12'


def _cuda_version(v: int) -> str:
    """``13020`` -> ``"13.2"`` (CUDA's encoding: 1000 * major + 10 * minor)."""
    return f"{v // 1000}.{v % 1000 // 10}"


@functools.lru_cache(maxsize=None)
def gpu_status() -> tuple[bool, str]:
    """``(True, "")`` when CuPy imports and CUDA reports a device, else
    ``(False, why)``: CuPy missing, no NVIDIA driver, a driver older than
    CuPy's CUDA runtime, or no device. Never raises; cached for the life of
    the process."""
    try:
        import cupy
    except ImportError:
        return False, f"CuPy is not installed ({INSTALL_HINT})"
    except Exception as e:  # noqa: BLE001  a broken CuPy (e.g. two CuPy packages installed)
        return False, f"CuPy does not import ({type(e).__name__}: {e})"
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001  CUDARuntimeError, or a missing library
        try:
            driver, rt = runtime.driverGetVersion(), runtime.runtimeGetVersion()
        except Exception:  # noqa: BLE001
            driver = rt = None
        if driver == 0:
            return False, "no NVIDIA driver is loaded"
        if driver is not None and rt is not None and driver < rt:
            return False, (f"the NVIDIA driver supports CUDA {_cuda_version(driver)}, older than the "
                           f"CUDA {_cuda_version(rt)} of this CuPy ({INSTALL_HINT})")
        return False, f"CUDA reports {e}"
    if count <= 0:
        return False, "CUDA reports no device"
    return True, ""


def has_gpu() -> bool:
    """True when CuPy imports and the CUDA driver reports at least one device.

    Never raises: no CuPy, no driver, a driver too old for CuPy's runtime, or
    no device all give ``False``. The answer is computed on the first call and
    cached for the life of the process: a later change of the machine's
    devices is not seen. :func:`cupaged.decode` and
    :func:`cupaged.merge_states` raise :class:`~cupaged.errors.NoGPUError`
    exactly when this is ``False``.

    Returns:
        ``bool``.

    Example:

    >>> import cupaged
    >>> cupaged.has_gpu() in (True, False)
    True
    """
    return gpu_status()[0]


def no_gpu_message(what: str) -> str:
    """The one wording of "no GPU" (:class:`~cupaged.errors.NoGPUError`, the
    demo, ``python -m cupaged info``): ``"no CUDA GPU: <what> needs one;
    <why>"``."""
    return f"no CUDA GPU: {what} needs one; {gpu_status()[1] or 'CUDA reports no device'}"


def require_gpu(what: str = "this code") -> None:
    """Raise :class:`~cupaged.errors.NoGPUError` unless :func:`has_gpu`.

    Call it before the first CuPy allocation of a program to get cupaged's
    error, which says why there is no GPU (CuPy missing, no driver, a driver
    older than CuPy's CUDA), instead of a CUDA error from CuPy.

    Args:
        what: what needs the GPU, for the message (default ``"this code"``).

    Raises:
        NoGPUError [RuntimeError]: ``"no CUDA GPU: <what> needs one; <why>"``.

    Example:

    >>> import cupaged
    >>> try:
    ...     cupaged.require_gpu("this example")
    ... except cupaged.NoGPUError as e:
    ...     assert str(e).startswith("no CUDA GPU: this example needs one; ")
    """
    from .errors import NoGPUError

    if not has_gpu():
        raise NoGPUError(no_gpu_message(what))
