"""The one table of supported kernel configurations.

It generates every ``name_expressions`` entry the loader compiles, drives the
dispatch checks (an unsupported combination raises ``ValueError`` listing what
is supported) and is what the CI compile check walks.
"""

from __future__ import annotations

import numpy as np
import ml_dtypes

# numpy dtype name -> C++ storage type in cuda_src/common.cuh
DTYPES: dict[str, str] = {
    "float16": "cupaged::f16",
    "bfloat16": "cupaged::bf16",
    "float32": "float",
}
HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
# Query heads one CTA of the partial kernel serves (plan.heads_per_cta picks
# the largest divisor of the GQA group size in this range).
HEADS_PER_CTA: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)

# kernel family -> source file in cuda_src/
SOURCES: dict[str, str] = {
    "partial": "paged_decode_partial.cu",
    "v1": "paged_decode_v1.cu",
    "merge": "merge_states.cu",
}


def dtype_name(dtype) -> str:
    """Canonical name of a KV/query dtype; ``ValueError`` when unsupported."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None and dt == np.dtype(ml_dtypes.bfloat16):
        return "bfloat16"
    if dt is None or dt.name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return dt.name


def check_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"unsupported head_dim {head_dim}; the kernels support {', '.join(map(str, HEAD_DIMS))}"
        )


def name_expressions(family: str, dtype: str, head_dim: int) -> list[str]:
    """Template instances of one compiled module: (family, dtype, head_dim)."""
    t = DTYPES[dtype]
    if family == "partial":
        return [f"cupaged::paged_decode_partial<{t}, {head_dim}, {h}>" for h in HEADS_PER_CTA]
    if family == "v1":
        return [f"cupaged::paged_decode_v1<{t}, {head_dim}>"]
    if family == "merge":  # dtype is the output dtype
        return [f"cupaged::merge_states<{t}, {head_dim}>"]
    raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(SOURCES)}")


def all_modules() -> list[tuple[str, str, int]]:
    """Every (family, dtype, head_dim) module the library can compile."""
    return [(f, d, h) for f in SOURCES for d in DTYPES for h in HEAD_DIMS]
