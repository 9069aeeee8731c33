"""Public wrapper of the variable-length merge kernel (cuda_src/merge_states.cu)."""

from __future__ import annotations

import numpy as np

from . import _configs
from ._device import require_gpu
from . import _loader
from ._typing import DeviceArray, IndexArray
from ._arrays import as_cupy as _as_cupy, check_float32, is_device_array
from ._launch import NULL_PTR, THREADS, elem_strides
from .errors import (DeviceMismatchError, DTypeError, InvalidArgumentError, LayoutError, ShapeError,
                     UnsupportedConfigError)


def merge_states(v: DeviceArray, lse: DeviceArray, o_indptr: IndexArray, *, out_dtype=np.float32,
                 validate: bool = True):
    """Merges attention states that share their heads, in variable-length groups.

    Output row ``r`` merges partial rows ``o_indptr[r]:o_indptr[r+1]``:
    ``v_out[r] = sum_n exp2(lse[n] - M) v[n] / W`` and ``lse_out[r] = M + log2(W)``
    with ``M`` the max LSE and ``W`` the sum of the weights, per head.

    Args:
        v: ``[N, num_heads, head_dim]`` float32 CuPy array (or any CUDA
            array via ``__cuda_array_interface__`` / DLPack, e.g. a torch
            tensor: read in place, never copied), C-contiguous; each partial
            already normalized by its own softmax denominator.
        lse: ``[N, num_heads]`` float32, C-contiguous, **log2 units**; ``-inf``
            marks an empty partial (contributes nothing).
        o_indptr: ``[M + 1]`` int32 (NumPy, CuPy, or another host or CUDA
            array such as a torch tensor), non-decreasing, from 0 to at most
            N.
        out_dtype: float32 (default), float16 or ``ml_dtypes.bfloat16``.
        validate: check ``o_indptr``'s values on the host (starts at 0,
            never decreases, ends at most at N; a CuPy ``o_indptr`` is copied
            there, which synchronizes); pass False on a hot path with a
            trusted, device-resident ``o_indptr``. Its dtype, rank, length,
            contiguity and device are checked either way (O(1)). ``lse`` is
            not checked for NaN or ``+inf`` (garbage in, garbage out; the
            float64 :func:`cupaged.reference.merge_states` rejects them).

    Returns:
        ``(v_out [M, num_heads, head_dim] out_dtype, lse_out [M, num_heads]
        float32 log2)``. A row with no finite partial gets zeros and -inf.
        Merges chain (lse_out is log2) and regroup associatively.

    Raises:
        Each a :class:`~cupaged.errors.CupagedError` and the builtin in
        brackets. ArgumentTypeError [TypeError] (``v`` or ``lse`` not a
        CuPy/CUDA array), ShapeError [ValueError] (``v`` not 3-D, ``lse`` not
        ``[N, num_heads]``, ``o_indptr`` not 1-D or empty), DTypeError
        [ValueError] (``v``/``lse`` not float32, ``o_indptr`` not int32
        (int64 included: never cast), an unsupported ``out_dtype``),
        LayoutError [ValueError] (``v``/``lse`` not C-contiguous, a strided
        CuPy ``o_indptr``), DeviceMismatchError [ValueError] (``lse`` or a
        CuPy ``o_indptr`` on another device than ``v``; ``v`` not on the
        current device),
        UnsupportedConfigError [ValueError] (head_dim other than 64/80/96/128/192/256),
        InvalidArgumentError [ValueError] (with ``validate``: an
        ``o_indptr`` that does not start at 0, decreases or ends beyond N),
        NoGPUError [RuntimeError] (no CUDA device; checked first).

    Example (needs a GPU)::

        import cupy, numpy, cupaged

        v = cupy.random.standard_normal((5, 8, 128), dtype=cupy.float32)
        lse = cupy.random.standard_normal((5, 8), dtype=cupy.float32)       # log2 units
        o_indptr = numpy.array([0, 2, 5], dtype=numpy.int32)               # rows 0..1 -> 0, 2..4 -> 1
        v_out, lse_out = cupaged.merge_states(v, lse, o_indptr)            # [2, 8, 128], [2, 8]
        ref_v, ref_lse = cupaged.reference.merge_states(v, lse, o_indptr)  # float64 check
    """
    require_gpu("cupaged.merge_states")
    import cupy

    v, lse = _as_cupy(v, "v"), _as_cupy(lse, "lse")
    o_indptr = _host_or_device(o_indptr)
    out_name = _check_merge_inputs(v, lse, o_indptr, out_dtype, validate)
    current = cupy.cuda.runtime.getDevice()
    if v.data.device_id != current:
        raise DeviceMismatchError(
            f"v and lse are on device {v.data.device_id} but the current device is {current}; "
            f"call merge_states inside `with cupy.cuda.Device({v.data.device_id}):`"
        )
    d_indptr = o_indptr if isinstance(o_indptr, cupy.ndarray) else cupy.asarray(np.ascontiguousarray(o_indptr))
    rows = d_indptr.shape[0] - 1
    v_out = cupy.empty((rows, v.shape[1], v.shape[2]), dtype=np.dtype(out_dtype) if out_name != "bfloat16" else out_dtype)
    lse_out = cupy.empty((rows, v.shape[1]), dtype=cupy.float32)
    if rows > 0 and v.shape[1] > 0:
        launch_merge(v, lse, d_indptr, rows, v_out, lse_out)
    return v_out, lse_out


def _check_merge_inputs(v, lse, o_indptr, out_dtype, validate: bool) -> str:
    """merge_states' checks; returns the output dtype's name. O(1) unless
    ``validate`` (which reads ``o_indptr`` on the host)."""
    if v.ndim != 3:
        raise ShapeError(f"v must be 3-D [N, num_heads, head_dim], got shape {v.shape}")
    if v.dtype != np.float32:
        raise DTypeError(f"v must be float32 (the partial kernel's workspace dtype), got {v.dtype}")
    if not v.flags.c_contiguous:
        raise LayoutError(f"v must be C-contiguous (the kernel reads it as one block), got strides {v.strides}")
    lse = check_float32(lse, "lse", v.shape[:2], v.data.device_id, "v", " ([N, num_heads] of v)", " (log2 units)")
    try:
        _configs.check_head_dim(v.shape[2])
    except ValueError as e:
        raise UnsupportedConfigError(f"v's head_dim: {e}") from None
    try:
        out_name = _configs.dtype_name(out_dtype)
    except ValueError:
        raise DTypeError(
            f"out_dtype must be one of {', '.join(_configs.DTYPES)}, got {out_dtype!r}"
        ) from None
    dtype = getattr(o_indptr, "dtype", None)
    ndim = getattr(o_indptr, "ndim", None)
    if dtype is None or ndim is None:  # a list, say: a ValueError, as before these classes existed
        raise DTypeError(f"o_indptr must be a 1-D int32 NumPy or CuPy array, got {type(o_indptr).__name__}")
    if ndim != 1 or o_indptr.shape[0] < 1:
        raise ShapeError(f"o_indptr must be 1-D [M+1] with M+1 >= 1 entries, got shape {o_indptr.shape}")
    if dtype != np.int32:
        raise DTypeError(f"o_indptr must be int32 (the kernel reads int32), got {dtype}; it is never cast")
    device_id = _device_id(o_indptr)
    if device_id is not None:
        if device_id != v.data.device_id:
            raise DeviceMismatchError(f"o_indptr must be on v's device {v.data.device_id}, got device {device_id}")
        if o_indptr.shape[0] > 1 and o_indptr.strides[0] != 4:
            raise LayoutError(
                f"a CuPy o_indptr must be contiguous (the kernel reads it as one), got strides {o_indptr.strides}"
            )
    if validate:
        host = o_indptr.get() if device_id is not None else np.asarray(o_indptr)
        n = v.shape[0]
        if host[0] != 0:
            raise InvalidArgumentError(f"o_indptr must start at 0, got o_indptr[0]={int(host[0])}")
        bad = np.flatnonzero(np.diff(host) < 0)
        if bad.size:
            r = int(bad[0])
            raise InvalidArgumentError(
                f"o_indptr must never decrease, but o_indptr[{r}]={int(host[r])} > o_indptr[{r + 1}]={int(host[r + 1])}"
            )
        if host[-1] > n:
            raise InvalidArgumentError(
                f"o_indptr must end at most at N={n} (rows of v), got o_indptr[-1]={int(host[-1])}"
            )
    return out_name


def _host_or_device(o_indptr):
    """``o_indptr`` as NumPy or CuPy: a CUDA array of another library (a
    torch CUDA tensor, say) as a zero-copy CuPy view, a host array object
    with ``__array__`` (a CPU torch tensor) as a NumPy view; NumPy, CuPy and
    everything else unchanged (the checks then name what is wrong)."""
    if isinstance(o_indptr, np.ndarray) or not hasattr(o_indptr, "dtype") or hasattr(o_indptr, "get"):
        return o_indptr
    if is_device_array(o_indptr):
        return _as_cupy(o_indptr, "o_indptr")
    return np.asarray(o_indptr) if hasattr(o_indptr, "__array__") else o_indptr


def _device_id(a) -> int | None:
    """The CUDA device of a CuPy array; None for a host (NumPy) array."""
    data = getattr(a, "data", None)
    return getattr(data, "device_id", None)


def launch_merge(v, v_lse, o_indptr, rows: int, out, lse):
    heads, head_dim = v.shape[1], v.shape[2]
    heads_per_cta = THREADS // (head_dim // 4)
    kernel = _loader.get_kernel("merge", _configs.dtype_name(out.dtype), head_dim)
    grid = (rows, -(-heads // heads_per_cta), 1)
    kernel(grid, (THREADS,), (v, v_lse, o_indptr, np.int32(heads), out, *elem_strides(out, 2),
                               NULL_PTR if lse is None else lse))
