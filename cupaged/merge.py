"""Public wrapper of the variable-length merge kernel (cuda_src/merge_states.cu)."""

from __future__ import annotations

import numpy as np

from . import _configs
from ._device import require_gpu
from . import _loader
from .decode import _NULL, _THREADS, _as_cupy, _elem_strides


def merge_states(v, lse, o_indptr, *, out_dtype=np.float32, validate: bool = True):
    """Merges attention states that share their heads, in variable-length groups.

    Output row ``r`` merges partial rows ``o_indptr[r]:o_indptr[r+1]``:
    ``v_out[r] = sum_n exp2(lse[n] - M) v[n] / W`` and ``lse_out[r] = M + log2(W)``
    with ``M`` the max LSE and ``W`` the sum of the weights, per head.

    Args:
        v: ``[N, num_heads, head_dim]`` float32 CuPy array, C-contiguous; each
            partial already normalized by its own softmax denominator.
        lse: ``[N, num_heads]`` float32, C-contiguous, **log2 units**; ``-inf``
            marks an empty partial (contributes nothing).
        o_indptr: ``[M + 1]`` int32 (NumPy or CuPy), non-decreasing, from 0 to
            at most N.
        out_dtype: float32 (default), float16 or ``ml_dtypes.bfloat16``.
        validate: check ``o_indptr`` on the host (copies it there if it is a
            CuPy array, which synchronizes); pass False on a hot path with a
            trusted, device-resident ``o_indptr``.

    Returns:
        ``(v_out [M, num_heads, head_dim] out_dtype, lse_out [M, num_heads]
        float32 log2)``. A row with no finite partial gets zeros and -inf.
        Merges chain (lse_out is log2) and regroup associatively.

    Raises:
        TypeError (``v`` or ``lse`` not a CuPy/CUDA array), ValueError
        (shapes, dtypes, non-contiguous ``v``/``lse``, head_dim other than
        64/128/256, an unsupported ``out_dtype``, ``o_indptr`` not a 1-D int32
        array, or with ``validate`` one that is empty, does not start at 0,
        decreases or ends beyond N), NoGPUError (no CUDA device; checked
        first).

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
    if v.ndim != 3 or v.dtype != np.float32 or not v.flags.c_contiguous:
        raise ValueError(f"v must be a C-contiguous float32 [N, num_heads, head_dim] array, got {v.shape} {v.dtype}")
    if lse.shape != v.shape[:2] or lse.dtype != np.float32 or not lse.flags.c_contiguous:
        raise ValueError(f"lse must be a C-contiguous float32 array of shape {v.shape[:2]}, got {lse.shape} {lse.dtype}")
    _configs.check_head_dim(v.shape[2])
    out_name = _configs.dtype_name(out_dtype)
    if getattr(o_indptr, "dtype", None) != np.int32 or getattr(o_indptr, "ndim", 0) != 1:
        raise ValueError("o_indptr must be a 1-D int32 array")
    if validate:
        host = o_indptr.get() if isinstance(o_indptr, cupy.ndarray) else np.asarray(o_indptr)
        if host.size == 0 or host[0] != 0 or np.any(np.diff(host) < 0) or host[-1] > v.shape[0]:
            raise ValueError(f"o_indptr must start at 0, never decrease and end at most at N={v.shape[0]}")
    d_indptr = cupy.asarray(o_indptr)
    rows = d_indptr.shape[0] - 1
    v_out = cupy.empty((rows, v.shape[1], v.shape[2]), dtype=np.dtype(out_dtype) if out_name != "bfloat16" else out_dtype)
    lse_out = cupy.empty((rows, v.shape[1]), dtype=cupy.float32)
    if rows > 0 and v.shape[1] > 0:
        _launch_merge(v, lse, d_indptr, rows, v_out, lse_out)
    return v_out, lse_out


def _launch_merge(v, v_lse, o_indptr, rows: int, out, lse):
    heads, head_dim = v.shape[1], v.shape[2]
    heads_per_cta = _THREADS // (head_dim // 4)
    kernel = _loader.get_kernel("merge", _configs.dtype_name(out.dtype), head_dim)
    grid = (rows, -(-heads // heads_per_cta), 1)
    kernel(grid, (_THREADS,), (v, v_lse, o_indptr, np.int32(heads), out, *_elem_strides(out, 2),
                               _NULL if lse is None else lse))
