"""Array interop: any CUDA array in, a CuPy view of the same memory out.

Every public function that takes device arrays runs its arguments through
:func:`as_cupy`: a CuPy array passes through; an object exposing DLPack
(``__dlpack__``) whose data lives on a CUDA device becomes a zero-copy CuPy
view of it through ``cupy.from_dlpack``; one exposing only
``__cuda_array_interface__`` (CAI) becomes one through ``cupy.asarray``.
DLPack goes first because it names every dtype: torch's CAI spells bfloat16
as two raw bytes (``"<V2"``). Either way cupaged reads and writes the
tensor's own memory: an ``out=`` tensor is written in place (a torch ``float8_e4m3fn``
tensor is viewed as the uint8 bits cupaged's fp8 caches are). Results
cupaged allocates are CuPy arrays; ``torch.from_dlpack`` (or
``torch.as_tensor``) views them back without a copy.

Host arrays (NumPy, a CPU torch tensor) are refused with
:class:`~cupaged.errors.ArgumentTypeError` and a hint, never copied to the
GPU behind the caller's back. CuPy is imported lazily, on the first call.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .errors import ArgumentTypeError, DeviceMismatchError, DTypeError, LayoutError, ShapeError

__all__ = ["as_cupy", "dlpack_on_gpu", "is_device_array"]

_DL_CUDA = (2, 13)  # DLPack device types: kDLCUDA, kDLCUDAManaged


def dlpack_on_gpu(x: Any) -> bool:
    """True when a DLPack producer says its data lives on a CUDA device
    (``__dlpack_device__()[0]`` is kDLCUDA or kDLCUDAManaged). A producer
    without a working ``__dlpack_device__`` gets the benefit of the doubt:
    ``cupy.from_dlpack`` then decides."""
    try:
        device_type = int(x.__dlpack_device__()[0])
    except Exception:  # noqa: BLE001  no or a broken __dlpack_device__: let CuPy decide
        return True
    return device_type in _DL_CUDA


def _has_cai(x: Any) -> bool:
    """``hasattr(x, "__cuda_array_interface__")`` that survives producers whose
    property raises something other than AttributeError (torch raises for a
    dtype CAI cannot spell, such as bfloat16, and for a tensor that requires
    grad): those fall through to DLPack."""
    try:
        return getattr(x, "__cuda_array_interface__", None) is not None
    except Exception:  # noqa: BLE001  torch raises KeyError, RuntimeError ...
        return False


def _fp8_as_uint8(x: Any) -> Any:
    """A torch ``float8_e4m3fn`` tensor as a uint8 view of its bits (CuPy
    has no float8 dtype; an fp8 cache is uint8 bit patterns to cupaged);
    anything else unchanged."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.dtype == getattr(torch, "float8_e4m3fn", None):
        return x.view(torch.uint8)
    return x


def _torch_bf16(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16


def _torch_bf16_view(x: Any):
    """A CUDA torch bfloat16 tensor through an int16 DLPack view, for a CuPy
    whose DLPack import refuses bfloat16; None when that does not apply or
    fails too."""
    if not _torch_bf16(x) or x.requires_grad:
        return None
    torch = sys.modules["torch"]
    try:
        import cupy
        import ml_dtypes

        return cupy.from_dlpack(x.view(torch.int16)).view(ml_dtypes.bfloat16)
    except Exception:  # noqa: BLE001  the caller reports the original error
        return None


def _type_name(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__name__}"


def _hint(x: Any, name: str) -> str:
    """How to fix a host (or unusable) array, for the error message."""
    module = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return f"; copy it to the GPU first, e.g. cupy.asarray({name})"
    if module == "torch":
        if getattr(x, "requires_grad", False):
            return f"; pass {name}.detach() (a tensor that requires grad cannot be shared)"
        if not getattr(x, "is_cuda", True):
            return f"; it is on the CPU: move it to the GPU first, e.g. {name}.cuda()"
    if hasattr(x, "__dlpack__") and not dlpack_on_gpu(x):
        return "; its DLPack device is not CUDA: copy it to the GPU first"
    return ""


def is_device_array(x: Any) -> bool:
    """True for a CuPy array or anything :func:`as_cupy` would view on the
    GPU (CAI, or DLPack on a CUDA device). Never raises."""
    try:
        import cupy
    except ImportError:  # pragma: no cover - cupy is a dependency
        return False
    if isinstance(x, cupy.ndarray) or _has_cai(x):
        return True
    return hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__") and dlpack_on_gpu(x)


def as_cupy(x: Any, name: str):
    """``x`` as a CuPy array sharing its memory (never a copy).

    Args:
        x: a CuPy array; or a DLPack producer on a CUDA device
            (``__dlpack__`` / ``__dlpack_device__``), e.g. a torch CUDA
            tensor of any dtype CuPy knows (bfloat16 included); or an object
            with ``__cuda_array_interface__`` (Numba ...).
        name: the argument's name, for the error message.

    Returns:
        ``x`` itself for a CuPy array, else a CuPy view of the same device
        memory (same pointer, shape, strides and dtype): writes through it
        land in ``x``.

    Raises:
        ArgumentTypeError [TypeError]: ``x`` is not a CUDA array: a NumPy
            array (hint: ``cupy.asarray``), a CPU torch tensor (hint:
            ``.cuda()``), a tensor that requires grad (hint: ``.detach()``),
            a DLPack producer on another device, or anything else; also when
            CuPy cannot import the producer's DLPack capsule (an
            unsupported dtype, say).

    A torch ``float8_e4m3fn`` tensor (an fp8 KV cache) comes back as a uint8
    view of its bits, the form cupaged's fp8 caches take.
    """
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    x = _fp8_as_uint8(x)
    if hasattr(x, "__dlpack__") and dlpack_on_gpu(x):
        try:
            return cupy.from_dlpack(x)
        except Exception as e:  # e.g. a dtype CuPy cannot describe, a grad-tracking tensor
            bf16 = _torch_bf16_view(x)
            if bf16 is not None:
                return bf16
            if _has_cai(x) and not _torch_bf16(x):  # a producer whose DLPack export alone is broken
                return cupy.asarray(x)
            raise ArgumentTypeError(
                f"{name} ({_type_name(x)}) could not be viewed through DLPack: "
                f"{type(e).__name__}: {e}{_hint(x, name)}"
            ) from e
    if _has_cai(x):
        return cupy.asarray(x)
    raise ArgumentTypeError(
        f"{name} must be a CuPy array (or a CUDA array via __cuda_array_interface__ / DLPack), "
        f"got {_type_name(x)}{_hint(x, name)}"
    )


def check_float32(x: Any, name: str, shape: tuple, device_id: int, device_of: str, shape_note: str = "",
                  dtype_note: str = ""):
    """``x`` (a CuPy array) if it is C-contiguous float32 of ``shape`` on
    device ``device_id`` (``device_of``'s); else the error naming ``name``
    (an LSE buffer, sinks, merge inputs)."""
    if x.shape != shape:
        raise ShapeError(f"{name} must have shape {shape}{shape_note}, got {x.shape}")
    if x.dtype != np.float32:
        raise DTypeError(f"{name} must be float32{dtype_note}, got {x.dtype}")
    if not x.flags.c_contiguous:
        raise LayoutError(f"{name} must be C-contiguous, got strides {x.strides}")
    if x.data.device_id != device_id:
        raise DeviceMismatchError(f"{name} must be on {device_of}'s device {device_id}, got device {x.data.device_id}")
    return x
