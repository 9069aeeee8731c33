"""float8 e4m3 (``ml_dtypes.float8_e4m3fn``) encoding helpers for fp8 KV caches.

CuPy has no float8 dtype, so an fp8 KV cache on the GPU is a **uint8** array
holding float8_e4m3fn bit patterns: sign bit, 4 exponent bits (bias 7), 3
mantissa bits; no infinities; ``0x7f`` / ``0xff`` are NaN; the largest finite
value is :data:`E4M3_MAX` = 448 (``0x7e``).  The real value of a cache element
is ``from_e4m3(bits) * scale`` with ``scale`` per tensor (a float) or per KV
head (a 1-D array broadcast along the head axis).

These are host-side set-up and test helpers: the rounding is done by
``ml_dtypes`` on the host (round to nearest even, saturating to ``+-448``);
CuPy inputs are copied to the host and the result copied back.

Example:

>>> import numpy as np
>>> from cupaged import fp8
>>> bits = fp8.to_e4m3(np.array([1.0, 448.0, -2.0, 1000.0, 0.3]))
>>> [hex(b) for b in bits.tolist()]
['0x38', '0x7e', '0xc0', '0x7e', '0x2a']
>>> fp8.from_e4m3(bits).tolist()   # 1000 saturates to 448; 0.3 rounds to 0.3125
[1.0, 448.0, -2.0, 448.0, 0.3125]
"""

from __future__ import annotations

import numbers
from typing import Any

import ml_dtypes
import numpy as np

from ._typing import DeviceArray, HostArray, Scale
from .errors import DTypeError, InvalidArgumentError, ShapeError

__all__ = ["E4M3_MAX", "from_e4m3", "to_e4m3"]

#: Largest finite float8_e4m3fn value (bits ``0x7e``); ``to_e4m3`` saturates to it.
E4M3_MAX = 448.0

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _is_cupy(x: Any) -> bool:
    return hasattr(x, "__cuda_array_interface__") and hasattr(x, "get")


def _to_host(x: Any) -> np.ndarray:
    return x.get() if _is_cupy(x) else np.asarray(x)


def _like_input(result: np.ndarray, was_cupy: bool):
    if not was_cupy:
        return result
    import cupy

    return cupy.asarray(result)


def _broadcast_scale(scale: Any, ndim: int, shape: tuple, head_axis: int | None,
                     name: str = "scale") -> np.ndarray | float:
    """``scale`` as a float (per tensor) or a float64 array shaped to broadcast
    against an array of ``shape`` (per head along ``head_axis``)."""
    if scale is None:
        return 1.0
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        value = float(scale)
        if not np.isfinite(value) or value == 0.0:
            raise InvalidArgumentError(f"{name} must be finite and nonzero, got {value}")
        return value
    s = _to_host(scale)
    if s.dtype.kind not in "fiu" and s.dtype not in (np.dtype(ml_dtypes.bfloat16),):
        raise DTypeError(f"{name} must be a real number or a float array, got dtype {s.dtype}")
    s = s.astype(np.float64)
    if s.ndim == 0:
        return _broadcast_scale(float(s), ndim, shape, head_axis, name)
    if s.ndim != 1:
        raise ShapeError(f"{name} must be a float or a 1-D per-head array, got shape {s.shape}")
    if head_axis is None:
        raise InvalidArgumentError(
            f"a per-head {name} (shape {s.shape}) needs head_axis, the axis of the heads")
    if not isinstance(head_axis, numbers.Integral) or not -ndim <= int(head_axis) < ndim:
        raise InvalidArgumentError(f"head_axis {head_axis!r} out of range for a {ndim}-D array")
    axis = int(head_axis) % ndim
    if s.shape[0] != shape[axis]:
        raise ShapeError(
            f"{name} has {s.shape[0]} entries, the array has {shape[axis]} heads along axis {axis}")
    if not np.isfinite(s).all() or (s == 0).any():
        raise InvalidArgumentError(f"{name} entries must be finite and nonzero")
    view = [1] * ndim
    view[axis] = s.shape[0]
    return s.reshape(view)


def to_e4m3(x: HostArray | DeviceArray, scale: Scale | HostArray = None, *, head_axis: int | None = None):
    """Quantize ``x / scale`` to float8_e4m3fn bit patterns.

    Args:
        x: NumPy or CuPy array of any shape, a real dtype (float16, bfloat16,
            float32, float64 or an integer dtype).
        scale: ``None`` (1.0), a finite nonzero float (per tensor), or a 1-D
            array (NumPy or CuPy) of ``x.shape[head_axis]`` finite nonzero
            entries (per head).
        head_axis: keyword-only; the axis of ``x`` a per-head ``scale`` runs
            along (negative counts from the end), e.g. 2 for an NHD cache
            ``[num_pages, page_size, Hkv, D]``, 1 for HND.

    Returns:
        uint8 array of ``x.shape`` (NumPy for NumPy input, CuPy for CuPy
        input): ``x / scale`` computed in float64, clipped to ``[-448, 448]``
        (saturating), then rounded to nearest even by ``ml_dtypes``. NaN
        stays NaN (``0x7f`` or ``0xff``).

    Raises:
        DTypeError: ``x`` or ``scale`` not of a real dtype.
        ShapeError: a ``scale`` that is not 0-D or 1-D, or whose length differs
            from ``x.shape[head_axis]``.
        InvalidArgumentError: a zero or non-finite scale; a per-head ``scale``
            without ``head_axis``; ``head_axis`` out of range.

    Example: per-head scales along the last axis:

    >>> import numpy as np
    >>> from cupaged import fp8
    >>> x = np.array([[1.0, 1.0], [3.0, -8.0]])
    >>> bits = fp8.to_e4m3(x, np.array([0.5, 2.0]), head_axis=1)
    >>> fp8.from_e4m3(bits).tolist()
    [[2.0, 0.5], [6.0, -4.0]]
    >>> fp8.from_e4m3(bits, np.array([0.5, 2.0]), head_axis=1).tolist()
    [[1.0, 1.0], [3.0, -8.0]]
    >>> fp8.to_e4m3(x, np.ones(3), head_axis=1)
    Traceback (most recent call last):
        ...
    cupaged.errors.ShapeError: scale has 3 entries, the array has 2 heads along axis 1
    """
    was_cupy = _is_cupy(x)
    a = _to_host(x)
    if a.dtype.kind not in "fiu" and a.dtype != np.dtype(ml_dtypes.bfloat16):
        raise DTypeError(f"x must have a real dtype, got {a.dtype}")
    s = _broadcast_scale(scale, a.ndim, a.shape, head_axis)
    with np.errstate(invalid="ignore"):
        y = np.clip(a.astype(np.float64) / s, -E4M3_MAX, E4M3_MAX)
    bits = np.ascontiguousarray(y.astype(_E4M3)).view(np.uint8)
    return _like_input(bits, was_cupy)


def from_e4m3(bits: HostArray | DeviceArray, scale: Scale | HostArray = None, *, head_axis: int | None = None):
    """Dequantize float8_e4m3fn bit patterns: ``value(bits) * scale``.

    Args:
        bits: uint8 array (NumPy or CuPy) of e4m3 bit patterns, or a NumPy
            ``ml_dtypes.float8_e4m3fn`` array.
        scale: ``None`` (1.0), a finite nonzero float, or a 1-D per-head array
            along ``head_axis`` (as for :func:`to_e4m3`).
        head_axis: keyword-only; the axis a per-head ``scale`` runs along.

    Returns:
        float32 array of ``bits.shape`` (NumPy or CuPy, like the input): the
        exact e4m3 value (NaN for ``0x7f`` / ``0xff``) times ``scale``, the
        product rounded to float32.

    Raises:
        DTypeError: ``bits`` neither uint8 nor float8_e4m3fn.
        ShapeError, InvalidArgumentError: a bad ``scale`` / ``head_axis`` (as
            for :func:`to_e4m3`).

    Example:

    >>> import numpy as np
    >>> from cupaged import fp8
    >>> fp8.from_e4m3(np.array([0x38, 0x7e, 0xc0, 0x01, 0x7f], np.uint8)).tolist()
    [1.0, 448.0, -2.0, 0.001953125, nan]
    """
    was_cupy = _is_cupy(bits)
    b = _to_host(bits)
    if b.dtype == np.uint8:
        b = b.view(_E4M3)
    elif b.dtype != _E4M3:
        raise DTypeError(f"bits must be uint8 (e4m3 bit patterns) or float8_e4m3fn, got dtype {b.dtype}")
    s = _broadcast_scale(scale, b.ndim, b.shape, head_axis)
    out = (b.astype(np.float32) * np.asarray(s, dtype=np.float32)).astype(np.float32)
    return _like_input(out, was_cupy)
