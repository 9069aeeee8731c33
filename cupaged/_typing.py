"""Type aliases of the public API's array arguments, in one place.

Annotations only: nothing here is checked at run time (the functions check
their arguments themselves and raise :mod:`cupaged.errors`).

* :data:`DeviceArray`: an array in GPU memory, used in place: a CuPy array,
  or any array exposing ``__cuda_array_interface__`` or DLPack (torch CUDA
  tensors included). Structurally a NumPy array matches the DLPack half too;
  the functions reject host arrays with ``ArgumentTypeError``.
* :data:`HostArray`: host data such as index arrays: NumPy arrays, sequences
  of numbers, or anything ``numpy.asarray`` takes.
* :data:`IndexArray`: host or device integers (page-table arrays, ``o_indptr``,
  ``group_indptr``, ``append_indptr``): a device array is copied to the host.
* :data:`Scale`: a dequantization scale: ``None`` (1), a float (per tensor) or
  a float32 device array (per KV head).
"""

from __future__ import annotations

from typing import Any, Protocol, Union

import numpy.typing as npt

__all__ = ["CudaArrayInterface", "DLPackArray", "DeviceArray", "HostArray", "IndexArray", "Scale"]


class CudaArrayInterface(Protocol):
    """An object exposing Numba's ``__cuda_array_interface__`` (CuPy, torch, Numba ...)."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...


class DLPackArray(Protocol):
    """An object exposing the DLPack protocol (``__dlpack__`` / ``__dlpack_device__``)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> tuple[int, int]: ...


DeviceArray = Union[CudaArrayInterface, DLPackArray]
HostArray = npt.ArrayLike
IndexArray = Union[npt.ArrayLike, DeviceArray]
Scale = Union[float, DeviceArray, None]
