"""Programmatic dependent launch of the partial kernel (on unless env
CUPAGED_PDL=0 at import): the ctypes mirror of cuLaunchKernelEx's structs and
the variable (CPU), and on an sm_90+ GPU (skipped in a process started with
CUPAGED_PDL=0), decode calls launched
back to back without a sync in between (each may start during the previous
one's tail and share its workspace) and the runner's append_kv + decode
graph, every result against the float64 reference."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import cupaged
from cupaged import _configs, _env, _launch, reference
from helpers import check_close, make_caches, make_query


def test_launch_structs_match_cuda_h():
    # CUlaunchAttribute: id (4) + pad (4) + a 64-byte union; CUlaunchConfig: 7 uints, then 8-byte aligned
    # hStream, attrs and numAttrs (cuda.h, CUDA 12/13, LP64)
    assert ctypes.sizeof(_launch.LaunchAttribute) == 72 and _launch.LaunchAttribute.value.offset == 8
    cfg = _launch.LaunchConfig
    assert (cfg.sharedMemBytes.offset, cfg.hStream.offset, cfg.attrs.offset, cfg.numAttrs.offset) == (24, 32, 40, 48)
    assert ctypes.sizeof(cfg) == 56


@pytest.mark.parametrize("value, expected", [(None, True), ("", True), ("0", False), ("1", True)])
def test_env_pdl(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("CUPAGED_PDL", raising=False)
    else:
        monkeypatch.setenv("CUPAGED_PDL", value)
    assert _env.pdl() is expected


def test_env_pdl_rejects_other_values(monkeypatch):
    monkeypatch.setenv("CUPAGED_PDL", "yes")
    with pytest.raises(ValueError, match="CUPAGED_PDL"):
        _env.pdl()


def test_pdl_only_for_modules_with_tensor_core_instances():
    pdl = _configs.PDL
    assert _configs.module_pdl("partial", "float16", 128) is pdl
    assert _configs.module_pdl("rows", "bfloat16+float8_e4m3fn", 64) is pdl
    assert _configs.module_pdl("partial", "float16", 64) is pdl
    # CUDA cores only: PDL made them slower (docs/benchmarks/h200-pdl-residency-2026-12-02.md)
    assert not _configs.module_pdl("partial", "float32", 128)
    assert not _configs.module_pdl("partial", "float16", 256)
    assert not any(_configs.module_pdl(family, "float16", 128) for family in ("v1", "merge", "append"))


def test_launch_shared_memory_follows_the_grid():
    """A launch of n CTAs passes the residency table's entry for
    min(planner's count, ceil(n / SMs)) CTAs per SM (the table here is the
    H200's head_dim-64 tensor-core one, planner's count 2)."""
    state = object.__new__(_launch.PartialLaunch)
    state._sms, state._smem_at = 132, (115712, 115712, 76800)
    assert [state._smem_for(n) for n in (1, 131, 132, 133, 264, 265, 10**6)] == [115712] * 3 + [76800] * 4
    state._held = 1  # a plan held to 1 CTA per SM (DecodePlan.ctas_per_sm): one per SM whatever the grid
    assert [state._smem_for(n) for n in (1, 133, 10**6)] == [115712] * 3
    del state._held
    state._smem_at = (0,)  # no PDL: the core's own dynamic shared memory, whatever the grid
    assert state._smem_for(1) == state._smem_for(10**6) == 0


def test_resident_ctas_is_the_planners_count():
    """The count a launch caps its SMs at (from the kernel variant's name) is
    the one the planner sized the grid with (from the NumPy dtypes), for
    every partial instance: if they drifted apart, the cap would hold an SM
    below (slower) or above (PDL's spare slots) the plan's waves."""
    import ml_dtypes

    checked = 0
    for family, variant, head_dim in _configs.all_modules():
        if family != "partial":
            continue
        q_name, kv_name = _configs.split_variant(variant)
        q = np.dtype(ml_dtypes.bfloat16) if q_name == "bfloat16" else np.dtype(q_name)
        kv = np.dtype(np.uint8) if kv_name == _configs.FP8 else q
        core = _configs.choose_core(variant, head_dim)
        for heads in _configs.HEADS_PER_CTA:
            assert _configs.resident_ctas(variant, head_dim, heads, core) == cupaged.plan.ctas_per_sm(
                q, kv, head_dim, heads), (variant, head_dim, heads)
            checked += 1
    assert checked >= 100


class _FakeDriver:
    """libcuda's two entry points ExLauncher binds, recording each launch's config."""

    def __init__(self):
        seen = self.seen = []

        def launch(config_ref, function, params, extra):  # (a function: ExLauncher sets its restype)
            c = config_ref._obj
            assert all(type(a) is ctypes.c_void_p for a in (function, params, extra))  # no argtypes to convert
            seen.append((c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ,
                         c.sharedMemBytes, c.hStream or 0, function.value, params.value, extra.value or 0,
                         c.numAttrs))
            return 0

        self.entries = {"cuLaunchKernelEx": launch}
        self.cuGetErrorName = lambda err, name: 0

    def __getitem__(self, name):
        return self.entries[name]


def test_ex_launcher_passes_every_launchs_config(monkeypatch):
    """The launcher skips rewriting an unchanged config: each launch must
    still reach the driver with its own grid, block, shared memory and stream."""
    fake = _FakeDriver()
    monkeypatch.setattr(_launch.ctypes, "CDLL", lambda name: fake)
    ex = _launch.ExLauncher(pdl=True)
    launches = [(7, 10, 1, 1, 128, 1, 1, 0, 1, 99, 0), (7, 10, 1, 1, 128, 1, 1, 0, 1, 99, 0),
                (7, 12, 1, 1, 128, 1, 1, 0, 1, 99, 0), (7, 12, 1, 1, 128, 1, 1, 4096, 1, 99, 0),
                (7, 12, 1, 1, 128, 1, 1, 4096, 5, 99, 0), (8, 12, 2, 3, 64, 2, 1, 4096, 5, 98, 0),
                (9, 12, 2, 3, 64, 2, 1, 4096, 5, 98, 0), (9, 12, 2, 3, 64, 2, 1, 4096, 5, 97, 0),
                (9, 12, 2, 3, 64, 2, 1, 4096, 5, 97, 64), (7, 10, 1, 1, 128, 1, 1, 0, 1, 99, 0)]
    for args in launches:
        ex(*args)
    want = [(*a[1:9], a[0], a[9], a[10], 1) for a in launches]
    assert fake.seen == want
    assert _launch.ExLauncher(pdl=False) is not None and fake.seen == want


def _count_pdl_launches(monkeypatch) -> list:
    calls = []
    real = _launch.ExLauncher.launch_key  # (every launch: __call__ goes through it)

    def counted(self, key):
        calls.append(key[1])  # grid x
        return real(self, key)

    monkeypatch.setattr(_launch.ExLauncher, "launch_key", counted)
    return calls


needs_pdl = pytest.mark.skipif(not _configs.PDL, reason="CUPAGED_PDL=0 at import")


def _require_sm90():
    import cupy as cp

    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90+")


@pytest.mark.gpu
@needs_pdl
@pytest.mark.parametrize("merged", [False, True], ids=["single_chunk", "merged"])
def test_layers_back_to_back(merged, monkeypatch):
    """Four layers' calls with one plan queued without a sync: with a merge,
    every call reuses the plan's workspace and counters, so a call that did
    not wait for the one before would read or reset its partials."""
    import cupy as cp

    _require_sm90()
    launches = _count_pdl_launches(monkeypatch)
    rng = np.random.default_rng(91)
    from test_gpu_decode import batch

    dev, table, host = batch(91, [300, 41, 1700, 16, 5000], mid_page=True)
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, target_ctas=10**6 if merged else 1)
    assert plan.needs_merge == merged
    layers = [host[1:]] + [make_caches(rng, table, host[1].shape[0], 8, 128, np.float16) for _ in range(3)]
    qs = [make_query(rng, 5, 32, 128, np.float16) for _ in layers]
    dev_layers = [(cp.asarray(q), cp.asarray(k), cp.asarray(v)) for q, (k, v) in zip(qs, layers)]
    outs = [cp.full((5, 32, 128), np.nan, dtype=cp.float16) for _ in layers]
    lses = [cp.full((5, 32), np.nan, dtype=cp.float32) for _ in layers]
    cp.cuda.runtime.deviceSynchronize()
    for _ in range(2):  # the first round builds the launch state, the second takes the hot path
        for (q, k, v), out, lse in zip(dev_layers, outs, lses):
            cupaged.decode(q, k, v, table, plan, out=out, lse=lse, return_lse=True)
        cp.cuda.runtime.deviceSynchronize()
        for q_h, (k_h, v_h), out, lse in zip(qs, layers, outs, lses):
            check_close(out.get().astype(np.float64), lse.get().astype(np.float64),
                        *reference.decode(q_h, k_h, v_h, table), np.float16)
            out.fill(np.nan)
            lse.fill(np.nan)
    assert len(launches) == 2 * len(layers)


@pytest.mark.gpu
@needs_pdl
def test_runner_graph_with_pdl(monkeypatch):
    """The runner's captured step (append_kv, then decode reading the token
    it wrote, for 3 layers) replayed over changing batches, launched with PDL."""
    import cupy as cp

    import test_runner

    _require_sm90()
    launches = _count_pdl_launches(monkeypatch)
    with cp.cuda.Stream(non_blocking=True):
        test_runner._graph_case(cp)
    assert launches  # the runner's launches went through cuLaunchKernelEx


@pytest.mark.gpu
@needs_pdl
def test_launches_hold_each_sm_to_the_planned_ctas():
    """The head_dim-64 tensor-core instance fits 3 CTAs per SM where the
    planner counts 2: its launch state's shared memory table holds an SM to
    k CTAs (the driver's occupancy query says exactly k), and a grid never
    launches with more per SM than the planner's count or than spreads it
    evenly. The CUDA-core states launch without PDL or padding."""
    import cupy as cp
    from cupy_backends.cuda.api import driver

    _require_sm90()
    state = _launch.PartialLaunch("float16", 32, 8, 64, 4, 16, 4, 4, 16)
    assert state.pdl and state.core == "mma"

    def per_sm(smem: int) -> int:
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(state.function, state.block, smem)

    planned = _configs.resident_ctas("float16", 64, 4, "mma")
    table = _launch.residency_smem(state.function, state.block, state.smem)
    assert table[-1] == state.smem and per_sm(state.smem) == len(table) - 1
    assert [per_sm(b) for b in table[1:]] == list(range(1, len(table)))
    sms = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMultiProcessorCount, state.device)
    for ctas in (1, sms, sms + 1, 2 * sms, 10 * sms):
        assert per_sm(state._smem_for(ctas)) == min(planned, -(-ctas // sms), len(table) - 1)

    simt = _launch.PartialLaunch("float32", 32, 8, 128, 4, 16, 4, 4, 16)
    assert not simt.pdl and not isinstance(simt._launch, _launch.ExLauncher) and simt._smem_for(10 * sms) == 0
