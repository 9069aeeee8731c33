"""cupaged: paged-attention decode kernels for CuPy.

CUDA kernels (cuda_src/, compiled at run time with cupy.RawModule) for the
decode step of LLM serving when the KV cache lives in fixed-size pages: a CSR
page table, a split-KV partial kernel whose parallelism grows with context, a
variable-length merge kernel, a host-side plan and a dispatch layer, all
checked against a NumPy float64 reference (:mod:`cupaged.reference`).

LSE values are in **log2 units** everywhere (natural log = lse * ln 2).
"""

from . import fp8, reference
from ._version import __version__
from ._device import has_gpu, require_gpu
from .cascade import CascadePlan, cascade_decode, plan_cascade
from .decode import decode
from .selection import METHODS, Selection, select_method
from .errors import (
    ArgumentTypeError,
    CapacityError,
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
from .append import append_kv
from .merge import merge_states
from .page_table import DeviceTable, PageTable, build_page_table
from .plan import DecodePlan, plan_decode
from .pool import BlockPool, PageCopy, SequenceState, apply_page_copies
from .runner import DecodeRunner


__all__ = [
    "ArgumentTypeError",
    "BlockPool",
    "CapacityError",
    "CascadePlan",
    "CupagedError",
    "DTypeError",
    "DecodePlan",
    "DecodeRunner",
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
    "append_kv",
    "apply_page_copies",
    "build_page_table",
    "cascade_decode",
    "decode",
    "fp8",
    "has_gpu",
    "merge_states",
    "plan_cascade",
    "plan_decode",
    "reference",
    "require_gpu",
    "select_method",
]
