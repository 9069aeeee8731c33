"""Interop (issue #6, item 7): every public function that takes arrays accepts
any array exposing DLPack or ``__cuda_array_interface__`` (torch tensors
included) without copying it; outputs are CuPy arrays.

GPU tests (marker ``gpu``, and torch with CUDA; skipped otherwise): torch
CUDA tensors in (float16, bfloat16), results bitwise equal to the call with
CuPy copies of the same values, the returned arrays are CuPy, an ``out=``
tensor is written in place (same ``data_ptr``) and inputs are viewed, not
copied (the CuPy view has the tensor's pointer). The CPU tests at the end
check the conversion rules with stand-in objects (CuPy importable, no device
needed).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import PageTable
from cupaged._arrays import as_cupy, dlpack_on_gpu, is_device_array
from cupaged.errors import ArgumentTypeError, PageTableError

HQ, HKV, D, P = 16, 4, 128, 16
LENS = [100, 1, 37, 2050]  # 7, 1, 3, 129 pages: one request splits under the default plan


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


def _cp():
    import cupy

    return cupy


TORCH_DTYPES = ["float16", "bfloat16"]


def _tdtype(torch, name):
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def bits(x) -> np.ndarray:
    """Host bytes of a CuPy array or a torch tensor (bitwise comparisons)."""
    if hasattr(x, "get"):
        h = x.get()
    else:  # torch: through a same-size integer view (numpy has no bfloat16)
        import torch

        h = x.view(torch.int16 if x.element_size() == 2 else torch.int32).cpu().numpy()
    return np.ascontiguousarray(h).view(np.uint8)


def torch_batch(torch, dtype_name, seed=0):
    """(table, q, k, v) as torch CUDA tensors; pages shuffled in a pool with slack."""
    rng = np.random.default_rng(seed)
    pages = sum(-(-n // P) for n in LENS)
    num_pages = 2 * pages + 3
    table = PageTable.from_seq_lens(LENS, P, page_ids=rng.permutation(num_pages).astype(np.int32))
    g = torch.Generator(device="cuda").manual_seed(seed)
    td = _tdtype(torch, dtype_name)
    k = torch.randn(num_pages, P, HKV, D, device="cuda", generator=g).to(td)
    v = torch.randn(num_pages, P, HKV, D, device="cuda", generator=g).to(td)
    q = torch.randn(len(LENS), HQ, D, device="cuda", generator=g).to(td)
    return table, q, k, v


def cupy_copy(t):
    """A CuPy array with a torch tensor's values in memory of its own."""
    cp = _cp()
    return cp.array(as_cupy(t, "t"), copy=True)


# ------------------------------------------------------------------ GPU: decode
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_inputs_are_viewed_not_copied(torch, dtype):
    cp = _cp()
    _, q, k, _ = torch_batch(torch, dtype)
    for t in (q, k, k[:, :, 1:3], q.transpose(0, 1)):  # contiguous, strided, transposed views
        view = as_cupy(t, "t")
        assert isinstance(view, cp.ndarray)
        assert view.data.ptr == t.data_ptr()
        assert view.shape == tuple(t.shape)
        assert view.strides == tuple(s * t.element_size() for s in t.stride())
        assert view.dtype == _np_dtype(dtype)
    view = as_cupy(q, "q")
    view[0, 0, 0] = 3.0  # a write through the view lands in the tensor
    torch.cuda.synchronize()
    assert float(q[0, 0, 0]) == 3.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("method", ["v2", "gather"])
def test_decode_torch_equals_cupy(torch, dtype, method):
    cp = _cp()
    table, q, k, v = torch_batch(torch, dtype)
    q_before, k_before = bits(q), bits(k)
    plan = cupaged.plan_decode(table, HQ, HKV, D, dtype)
    ref_out, ref_lse = cupaged.decode(cupy_copy(q), cupy_copy(k), cupy_copy(v), table, plan,
                                      method=method, return_lse=True)
    # out allocated by cupaged: a CuPy array
    out, lse = cupaged.decode(q, k, v, table, plan, method=method, return_lse=True)
    assert isinstance(out, cp.ndarray) and isinstance(lse, cp.ndarray)
    assert np.array_equal(bits(out), bits(ref_out)) and np.array_equal(bits(lse), bits(ref_lse))
    # out= a torch tensor: written in place, returned as a CuPy view of it
    out_t = torch.full_like(q, float("nan"))
    ptr = out_t.data_ptr()
    res = cupaged.decode(q, k, v, table, plan, method=method, out=out_t)
    torch.cuda.synchronize()
    assert isinstance(res, cp.ndarray) and res.data.ptr == ptr == out_t.data_ptr()
    assert np.array_equal(bits(out_t), bits(ref_out))
    # the inputs were not touched
    assert np.array_equal(bits(q), q_before) and np.array_equal(bits(k), k_before)


@pytest.mark.gpu
def test_select_method_takes_torch(torch):
    table, q, k, v = torch_batch(torch, "float16")
    assert cupaged.select_method(q, k, v, table).method in ("v2", "gather")


@pytest.mark.gpu
def test_fp8_torch_cache_is_a_uint8_view(torch):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    cp = _cp()
    _, q, k, v = torch_batch(torch, "float16")
    k8 = k.to(torch.float8_e4m3fn)
    view = as_cupy(k8, "k_cache")
    assert view.dtype == np.uint8 and view.data.ptr == k8.data_ptr() and view.shape == tuple(k8.shape)
    assert np.array_equal(bits(view), k8.view(torch.uint8).cpu().numpy().view(np.uint8))
    params = inspect.signature(cupaged.decode).parameters
    if "k_scale" not in params:
        pytest.skip("decode has no fp8 KV support yet")
    table = torch_batch(torch, "float16")[0]
    v8 = v.to(torch.float8_e4m3fn)
    plan = cupaged.plan_decode(table, HQ, HKV, D, "float16", kv_dtype="float8_e4m3fn")
    out_t = torch.empty_like(q)
    cupaged.decode(q, k8, v8, table, plan, out=out_t, k_scale=0.5, v_scale=2.0)
    ref = cupaged.decode(cupy_copy(q), cp.array(view), cp.array(as_cupy(v8, "v")), table, plan,
                         k_scale=0.5, v_scale=2.0)
    torch.cuda.synchronize()
    assert np.array_equal(bits(out_t), bits(ref))


# ------------------------------------------------------------ GPU: other entries
@pytest.mark.gpu
def test_merge_states_torch_equals_cupy(torch):
    cp = _cp()
    g = torch.Generator(device="cuda").manual_seed(3)
    v = torch.randn(7, HQ, D, device="cuda", generator=g)
    lse = torch.randn(7, HQ, device="cuda", generator=g)
    lse[2, :] = float("-inf")  # an empty partial
    indptr = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    want_v, want_lse = cupaged.merge_states(cupy_copy(v), cupy_copy(lse), indptr.numpy(), out_dtype=np.float16)
    for o_indptr in (indptr, indptr.cuda()):  # host and device o_indptr as torch tensors
        got_v, got_lse = cupaged.merge_states(v, lse, o_indptr, out_dtype=np.float16)
        assert isinstance(got_v, cp.ndarray) and isinstance(got_lse, cp.ndarray)
        assert np.array_equal(bits(got_v), bits(want_v)) and np.array_equal(bits(got_lse), bits(want_lse))


@pytest.mark.gpu
def test_page_table_from_torch(torch):
    want = PageTable([7, 3, 5, 1], [0, 3, 4], [2, 4], [2, 0], page_size=4)
    for device in ("cpu", "cuda"):
        def t(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=device)

        got = PageTable(t([7, 3, 5, 1]), t([0, 3, 4]), t([2, 4]), t([2, 0]), page_size=4)
        for name in ("indices", "indptr", "last_page_len", "first_page_offset"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), (device, name)
        with pytest.raises(PageTableError, match="indices must be int32, got int64"):
            PageTable(t([7, 3, 5, 1], torch.int64), t([0, 3, 4]), t([2, 4]), page_size=4)
        lens = PageTable.from_seq_lens(t([5, 8]), 4, page_ids=t([9, 2, 4, 6]))
        assert lens.indices.tolist() == [9, 2, 4, 6] and lens.seq_lens.tolist() == [5, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("copies", [[(1, 3)], [(0, 2), (1, 3)], [(0, 1), (1, 2)]],
                         ids=["one", "independent", "chained"])
def test_apply_page_copies_in_place_on_torch(torch, copies):
    k = torch.arange(4 * 2 * 8, dtype=torch.float16, device="cuda").reshape(4, 2, 8)
    v = k.clone().to(torch.bfloat16)
    want_k, want_v = k.cpu().clone(), v.cpu().clone()
    for s, d in copies:
        want_k[d] = want_k[s]
        want_v[d] = want_v[s]
    ptrs = (k.data_ptr(), v.data_ptr())
    cupaged.apply_page_copies([k, v], copies)
    torch.cuda.synchronize()
    assert (k.data_ptr(), v.data_ptr()) == ptrs
    assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)


@pytest.mark.gpu
def test_host_and_grad_tensors_are_refused_with_a_hint(torch):
    table, q, k, v = torch_batch(torch, "float16")
    with pytest.raises(ArgumentTypeError, match=r"q must be a CuPy array .*torch.Tensor; it is on the CPU.*q\.cuda\(\)"):
        cupaged.decode(q.cpu(), k, v, table)
    with pytest.raises(ArgumentTypeError, match=r"out .*\.cuda\(\)"):
        cupaged.decode(q, k, v, table, out=q.cpu())
    with pytest.raises(ArgumentTypeError, match=r"v .*\.cuda\(\)"):
        cupaged.merge_states(torch.zeros(2, HQ, D), torch.zeros(2, HQ, device="cuda"), np.array([0, 2], np.int32))
    grad = q.float().requires_grad_()
    with pytest.raises(ArgumentTypeError, match=r"detach\(\)"):
        as_cupy(grad, "q")


def _entry(name):
    fn = getattr(cupaged, name, None)
    if fn is None:
        pytest.skip(f"cupaged.{name} does not exist yet")
    return fn


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_append_kv_writes_torch_caches_in_place(torch, dtype):
    append_kv = _entry("append_kv")
    table, _, k, v = torch_batch(torch, dtype)
    k_c, v_c = cupy_copy(k), cupy_copy(v)
    g = torch.Generator(device="cuda").manual_seed(5)
    td = _tdtype(torch, dtype)
    k_new = torch.randn(len(LENS), HKV, D, device="cuda", generator=g).to(td)
    v_new = torch.randn(len(LENS), HKV, D, device="cuda", generator=g).to(td)
    before, ptrs = bits(k), (k.data_ptr(), v.data_ptr())
    assert append_kv(k_new, v_new, k, v, table) is None
    append_kv(cupy_copy(k_new), cupy_copy(v_new), k_c, v_c, table)
    torch.cuda.synchronize()
    assert (k.data_ptr(), v.data_ptr()) == ptrs
    assert not np.array_equal(bits(k), before)  # written ...
    assert np.array_equal(bits(k), bits(k_c)) and np.array_equal(bits(v), bits(v_c))  # ... as with CuPy
    # several tokens per request, append_indptr a torch CUDA tensor
    indptr = torch.tensor([0, 2, 3, 3, 5], dtype=torch.int32, device="cuda")
    k5, v5 = k_new[:1].repeat(5, 1, 1), v_new[:1].repeat(5, 1, 1)
    append_kv(k5, v5, k, v, table, append_indptr=indptr)
    append_kv(cupy_copy(k5), cupy_copy(v5), k_c, v_c, table, append_indptr=as_cupy(indptr, "i").copy())
    torch.cuda.synchronize()
    assert np.array_equal(bits(k), bits(k_c)) and np.array_equal(bits(v), bits(v_c))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_cascade_decode_torch_equals_cupy(torch, dtype):
    cascade_decode = _entry("cascade_decode")
    cp = _cp()
    shared = PageTable.from_seq_lens([1000], P)                                  # pages 0..62
    unique = PageTable.from_seq_lens([5, 20, 0], P, page_ids=np.arange(63, 66, dtype=np.int32))
    g = torch.Generator(device="cuda").manual_seed(9)
    td = _tdtype(torch, dtype)
    k = torch.randn(66, P, HKV, D, device="cuda", generator=g).to(td)
    v = torch.randn(66, P, HKV, D, device="cuda", generator=g).to(td)
    q = torch.randn(3, HQ, D, device="cuda", generator=g).to(td)
    want, want_lse = cascade_decode(cupy_copy(q), cupy_copy(k), cupy_copy(v), shared, unique, [0, 3],
                                    return_lse=True)
    out_t = torch.full_like(q, float("nan"))
    res, lse = cascade_decode(q, k, v, shared, unique, torch.tensor([0, 3]), out=out_t, return_lse=True)
    torch.cuda.synchronize()
    assert isinstance(res, cp.ndarray) and isinstance(lse, cp.ndarray) and res.data.ptr == out_t.data_ptr()
    assert np.array_equal(bits(out_t), bits(want)) and np.array_equal(bits(lse), bits(want_lse))


@pytest.mark.gpu
def test_readme_torch_example_runs(torch):
    """README's "Using torch tensors" example, verbatim."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text.split("## Using torch tensors", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 (our own docs)
    torch.cuda.synchronize()
    out, lse = scope["out"], scope["lse"]
    assert isinstance(lse, torch.Tensor) and lse.shape == (2, 32) and torch.isfinite(lse).all()
    assert torch.isfinite(out.float()).all()


# ------------------------------------------------------------ CPU: conversion rules
class _CpuDLPack:
    """A DLPack producer whose data is on the host (like a CPU tensor)."""

    dtype = np.dtype(np.float16)
    shape = (2,)

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be imported")

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


class _TorchLikeCpu(_CpuDLPack):
    __module__ = "torch"
    is_cuda = False
    requires_grad = False


class _BrokenCAI:
    """torch raises KeyError from __cuda_array_interface__ for bfloat16."""

    @property
    def __cuda_array_interface__(self):
        raise KeyError("bfloat16")


def test_as_cupy_refuses_host_arrays_with_hints():
    pytest.importorskip("cupy")
    with pytest.raises(ArgumentTypeError, match=r"got numpy.ndarray; copy it to the GPU first, e\.g\. cupy\.asarray\(q\)"):
        as_cupy(np.zeros(3), "q")
    with pytest.raises(ArgumentTypeError, match=r"its DLPack device is not CUDA"):
        as_cupy(_CpuDLPack(), "k_cache")
    with pytest.raises(ArgumentTypeError, match=r"it is on the CPU: move it to the GPU first, e\.g\. out\.cuda\(\)"):
        as_cupy(_TorchLikeCpu(), "out")
    grad = _TorchLikeCpu()
    grad.requires_grad = True
    with pytest.raises(ArgumentTypeError, match=r"pass q\.detach\(\)"):
        as_cupy(grad, "q")
    with pytest.raises(ArgumentTypeError, match="got builtins.list"):
        as_cupy([1.0, 2.0], "v")
    with pytest.raises(ArgumentTypeError, match="_BrokenCAI"):  # no KeyError escapes
        as_cupy(_BrokenCAI(), "q")


def test_is_device_array_and_dlpack_device():
    pytest.importorskip("cupy")
    for host in (np.zeros(2), [1, 2], _CpuDLPack(), _TorchLikeCpu(), _BrokenCAI(), None):
        assert not is_device_array(host)
    assert not dlpack_on_gpu(_CpuDLPack())

    class Cuda:
        def __dlpack__(self, stream=None):
            return None

        def __dlpack_device__(self):
            return (2, 0)

    assert dlpack_on_gpu(Cuda()) and is_device_array(Cuda())
    assert dlpack_on_gpu(object())  # no __dlpack_device__: CuPy decides


class _HostArray:
    """A host array object that is not NumPy (a CPU torch tensor, say)."""

    def __init__(self, values, dtype):
        self._a = np.asarray(values, dtype=dtype)
        self.dtype = self._a.dtype
        self.shape = self._a.shape

    def __array__(self, dtype=None, copy=None):
        return self._a


def test_page_table_reads_host_array_objects():
    pytest.importorskip("cupy")
    t = PageTable(_HostArray([7, 3, 5], np.int32), _HostArray([0, 3], np.int32), _HostArray([2], np.int32),
                  _HostArray([2], np.int32), page_size=4)
    assert t.indices.tolist() == [7, 3, 5] and t.seq_lens.tolist() == [8]
    with pytest.raises(PageTableError, match="indptr must be int32, got int64"):
        PageTable([7, 3, 5], _HostArray([0, 3], np.int64), [2], page_size=4)
    assert PageTable.from_seq_lens(_HostArray([5, 8], np.int64), 4).indptr.tolist() == [0, 2, 4]
