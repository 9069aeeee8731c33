"""cupaged: paged-attention decode kernels for CuPy.

CUDA kernels (cuda_src/, compiled at run time with cupy.RawModule) for the
decode step of LLM serving when the KV cache lives in fixed-size pages: a CSR
page table, a split-KV partial kernel whose parallelism grows with context, a
variable-length merge kernel, a host-side plan and a dispatch layer, all
checked against a NumPy float64 reference (:mod:`cupaged.reference`).

LSE values are in **log2 units** everywhere (natural log = lse * ln 2).
"""

from . import reference
from ._device import has_gpu
from .decode import METHODS, Selection, decode, select_method
from .errors import (
    ArgumentTypeError,
    CupagedError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    LayoutError,
    NoGPUError,
    OutOfPagesError,
    PageTableError,
    PlanMismatchError,
    ShapeError,
    UnknownSequenceError,
    UnsupportedConfigError,
)
from .merge import merge_states
from .page_table import DeviceTable, PageTable, build_page_table
from .plan import DecodePlan, plan_decode
from .pool import BlockPool, PageCopy, SequenceState, apply_page_copies

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "BlockPool",
    "CupagedError",
    "DTypeError",
    "DecodePlan",
    "DeviceMismatchError",
    "DeviceTable",
    "InvalidArgumentError",
    "LayoutError",
    "METHODS",
    "NoGPUError",
    "OutOfPagesError",
    "PageCopy",
    "PageTable",
    "PageTableError",
    "PlanMismatchError",
    "Selection",
    "SequenceState",
    "ShapeError",
    "UnknownSequenceError",
    "UnsupportedConfigError",
    "apply_page_copies",
    "build_page_table",
    "decode",
    "has_gpu",
    "merge_states",
    "plan_decode",
    "reference",
    "select_method",
]
