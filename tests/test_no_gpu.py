"""Without a usable GPU every GPU entry point raises cupaged's NoGPUError with
one wording, "no CUDA GPU: <what> needs one; <why>", and never lets CuPy's
CUDA error (cudaErrorInsufficientDriver on a machine without a driver) through.
The reasons are checked with a stand-in CuPy, so they run on any machine."""

from __future__ import annotations

import sys
import types

import pytest

import cupaged
from cupaged import _device
from cupaged.errors import NoGPUError

NO_GPU = pytest.mark.skipif(cupaged.has_gpu(), reason="checks the no-GPU behaviour")


@pytest.fixture
def fresh_status():
    """Forget the cached device probe before and after the test."""
    _device.gpu_status.cache_clear()
    yield
    _device.gpu_status.cache_clear()


def _fake_cupy(monkeypatch, *, count=None, error=None, driver=0, runtime=13000):
    def get_device_count():
        if error is not None:
            raise error
        return count

    rt = types.SimpleNamespace(getDeviceCount=get_device_count, driverGetVersion=lambda: driver,
                               runtimeGetVersion=lambda: runtime, getDevice=get_device_count,
                               CUDARuntimeError=RuntimeError)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)))


def _entry_points():
    table = cupaged.PageTable.from_seq_lens([5, 8], page_size=4)
    return {
        "cupaged.decode": lambda: cupaged.decode(None, None, None, table),
        "cupaged.merge_states": lambda: cupaged.merge_states(None, None, None),
        "cupaged.append_kv": lambda: cupaged.append_kv(None, None, None, None, None),
        "cupaged.cascade_decode": lambda: cupaged.cascade_decode(None, None, None, table, table, [0, 1, 2]),
        "PageTable.device()": table.device,
        "the README example": lambda: cupaged.require_gpu("the README example"),
    }


@NO_GPU
@pytest.mark.parametrize("what", list(_entry_points()))
def test_every_entry_point_says_no_cuda_gpu(what):
    with pytest.raises(NoGPUError) as info:
        _entry_points()[what]()
    assert str(info.value) == _device.no_gpu_message(what)
    assert str(info.value).startswith(f"no CUDA GPU: {what} needs one; ")
    assert info.value.__cause__ is None  # no CuPy traceback on top of it


def test_reason_cupy_missing(monkeypatch, fresh_status):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert not cupaged.has_gpu()
    msg = _device.no_gpu_message("cupaged.decode")
    assert msg == ('no CUDA GPU: cupaged.decode needs one; CuPy is not installed (pip install '
                   '"cupaged[cuda13]" for a CUDA 13 driver, "cupaged[cuda12]" for CUDA 12)')
    with pytest.raises(NoGPUError, match="CuPy is not installed"):
        cupaged.PageTable.from_seq_lens([3], 4).device()


def test_reason_no_driver(monkeypatch, fresh_status):
    _fake_cupy(monkeypatch, error=RuntimeError("cudaErrorInsufficientDriver: ..."), driver=0)
    assert _device.gpu_status() == (False, "no NVIDIA driver is loaded")
    with pytest.raises(NoGPUError, match="^no CUDA GPU: x needs one; no NVIDIA driver is loaded$"):
        cupaged.require_gpu("x")


def test_reason_old_driver(monkeypatch, fresh_status):
    _fake_cupy(monkeypatch, error=RuntimeError("cudaErrorInsufficientDriver: ..."), driver=12080, runtime=13000)
    ok, why = _device.gpu_status()
    assert not ok and why.startswith("the NVIDIA driver supports CUDA 12.8, older than the CUDA 13.0 of this CuPy")
    assert '"cupaged[cuda12]"' in why


def test_reason_no_device_and_a_gpu(monkeypatch, fresh_status):
    _fake_cupy(monkeypatch, count=0)
    assert _device.gpu_status() == (False, "CUDA reports no device")
    _device.gpu_status.cache_clear()
    _fake_cupy(monkeypatch, count=2)
    assert _device.gpu_status() == (True, "") and cupaged.has_gpu()
    cupaged.require_gpu()  # no error


def test_require_gpu_default_wording(monkeypatch, fresh_status):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(NoGPUError, match="^no CUDA GPU: this code needs one; "):
        cupaged.require_gpu()
