"""CPU tests of the evidence scripts (scripts/correctness.py,
scripts/microbench.py, scripts/_common.py): argument parsing, the sweeps as
data, the writers, the adversarial page-table generator, and the no-GPU exit.
Nothing here needs a GPU."""

from __future__ import annotations

import contextlib
import csv
import argparse
import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

_common = importlib.import_module("_common")
correctness = importlib.import_module("correctness")
microbench = importlib.import_module("microbench")
bench_report = importlib.import_module("bench_report")

# The `scripts` extra (pip install -e ".[scripts]"): without it the tests that
# run a script's main() past its tqdm import skip, and plots are not checked.
HAS_TQDM = importlib.util.find_spec("tqdm") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_tqdm = pytest.mark.skipif(not HAS_TQDM, reason="needs the scripts extra: pip install -e '.[scripts]' (tqdm)")


def _gpu_present() -> bool:
    return _common.has_gpu()


# ------------------------------------------------------------- correctness args


def test_free_gpu_memory_waits_out_what_it_freed(monkeypatch):
    # freed device memory keeps the HBM busy for a while (13 % slower for ~80 ms after 34 GB on the H200): the
    # next benchmark cell waits in proportion to the bytes the pool gave back, and not at all when it gave none
    held = {"bytes": 4 * 10**9}
    pool = SimpleNamespace(total_bytes=lambda: held["bytes"], free_all_blocks=lambda: held.update(bytes=10**6))
    fake = SimpleNamespace(get_default_memory_pool=lambda: pool,
                           get_default_pinned_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None),
                           cuda=SimpleNamespace(get_current_stream=lambda: SimpleNamespace(synchronize=lambda: None)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    slept = []
    monkeypatch.setattr(_common.time, "sleep", slept.append)
    _common.free_gpu_memory()
    assert slept == [pytest.approx((4 * 10**9 - 10**6) / _common.FREED_BYTES_PER_S)]
    _common.free_gpu_memory()  # nothing left to give back
    assert len(slept) == 1
    # the FlashInfer peer's torch cache counts too
    reserved = {"bytes": 2 * 10**9}
    torch = SimpleNamespace(cuda=SimpleNamespace(memory_reserved=lambda: reserved["bytes"],
                                                 empty_cache=lambda: reserved.update(bytes=0)))
    _common.free_gpu_memory(torch)
    assert slept[1:] == [pytest.approx(2 * 10**9 / _common.FREED_BYTES_PER_S)]


def test_reports_name_their_gpu_by_uuid():
    # the suite's GPU line names the instance (two H200s of one morning streamed 2-3 % apart)
    assert microbench.gpu_uuid({"uuid": bytes(range(16))}) == ", GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert microbench.gpu_uuid({"uuid": b"short"}) == microbench.gpu_uuid({}) == ""


def test_correctness_sweeps_are_data():
    assert correctness.DEFAULT_SWEEP == {
        "head_dim": (64, 128),
        "gqa": (1, 4, 8),
        "page_size": (32,),
        "ctx": (512, 4096),
        "batch": (1, 4),
    }
    assert correctness.FULL_SWEEP == {
        "head_dim": (64, 128),
        "gqa": (1, 4, 8),
        "page_size": (16, 32, 64),
        "ctx": (512, 4096, 16384, 32768),
        "batch": (1, 4, 8),
    }
    assert set(correctness.AXES) == set(correctness.DEFAULT_SWEEP) == set(correctness.FULL_SWEEP)


def test_correctness_default_is_24_configs():
    args = correctness.parse_args([])
    cfgs = correctness.configs(args)
    assert len(cfgs) == 24
    assert len(set(cfgs)) == 24
    assert {c.dtype for c in cfgs} == {"float16"}
    assert {c.page_size for c in cfgs} == {32}
    assert {c.num_kv_heads for c in cfgs} == {8}
    assert {c.num_qo_heads for c in cfgs} == {8, 32, 64}
    assert args.methods == ("v2", "v1", "gather")
    assert not args.force_merge and args.csv is None and args.seed == 0


def test_correctness_full_is_216_configs_plus_the_features():
    cfgs = correctness.configs(correctness.parse_args(["--full"]))
    assert len(cfgs) == 216 + len(correctness.FEATURE_CONFIGS)
    product, extra = cfgs[:216], cfgs[216:]
    assert {c.ctx for c in product} == {512, 4096, 16384, 32768}
    assert {c.batch for c in product} == {1, 4, 8}
    assert {c.page_size for c in product} == {16, 32, 64}
    assert all(not c.has_features and c.group == "base" for c in product)  # the 216 as they were
    assert extra == list(correctness.FEATURE_CONFIGS)


@pytest.mark.parametrize(
    "argv, count",
    [
        (["--head-dim", "128"], 12),
        (["--ctx", "512", "4096", "16384"], 36),
        (["--ctx", "512,4096,16384"], 36),
        (["--gqa", "4", "--batch", "8"], 4),
        (["--page-size", "16", "64"], 48),
        (["--full", "--page-size", "16"], 72 + sum(c.page_size == 16 for c in correctness.FEATURE_CONFIGS)),
        (["--full", "--ctx", "32768", "--batch", "8"], 18),  # no feature configuration at 32768
        (["--dtype", "float16", "bfloat16", "float32"], 72),
        (["--dtype", "bfloat16,float32", "--head-dim", "64", "--gqa", "1"], 8),
    ],
)
def test_correctness_axis_flags(argv, count):
    args = correctness.parse_args(argv)
    assert len(correctness.configs(args)) == count


def test_correctness_axis_flag_overrides_only_its_axis():
    args = correctness.parse_args(["--full", "--head-dim", "64"])
    axes = correctness.sweep_axes(args)
    assert axes["head_dim"] == (64,)
    assert axes["ctx"] == correctness.FULL_SWEEP["ctx"]
    cfg = correctness.configs(
        correctness.parse_args(
            [
                "--head-dim",
                "128",
                "--gqa",
                "4",
                "--page-size",
                "16",
                "--ctx",
                "1000",
                "--batch",
                "3",
                "--num-kv-heads",
                "2",
            ]
        )
    )
    assert cfg == [
        correctness.Config(head_dim=128, gqa=4, page_size=16, ctx=1000, batch=3, dtype="float16", num_kv_heads=2)
    ]
    assert cfg[0].num_qo_heads == 8


def test_correctness_chunking_flags():
    lay = correctness._common.plan_layout(4, 1000, 16, seed=0)
    assert correctness.pages_per_chunk(correctness.parse_args([]), lay) is None
    assert correctness.pages_per_chunk(correctness.parse_args(["--force-merge"]), lay) == 1
    assert correctness.pages_per_chunk(correctness.parse_args(["--single-chunk"]), lay) == lay.request_pages.max()
    with pytest.raises(SystemExit):
        correctness.parse_args(["--force-merge", "--single-chunk"])


def test_correctness_flags():
    args = correctness.parse_args(
        ["--force-merge", "--methods", "v2", "--csv", "x.csv", "--tol", "1e-3", "--seed", "7"]
    )
    assert args.force_merge and args.methods == ("v2",) and args.csv == "x.csv" and args.seed == 7
    assert correctness.tolerance(args, "float16") == 1e-3
    default = correctness.parse_args([])
    assert correctness.tolerance(default, "float16") == 2e-2
    assert correctness.tolerance(default, "bfloat16") == 2e-2
    assert correctness.tolerance(default, "float32") == 1e-5


@pytest.mark.parametrize(
    "argv",
    [["--methods", "v3"], ["--dtype", "float64"], ["--ctx", "0"], ["--ctx", "abc"], ["--num-kv-heads", "0"]],
)
def test_correctness_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        correctness.parse_args(argv)
    assert e.value.code == 2


def test_correctness_compare_metrics():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 4, 8))
    lse_ref = rng.standard_normal((2, 4)) + 10
    same = correctness.compare(ref.astype(np.float16), ref, lse_ref.astype(np.float32), lse_ref)
    assert same["finite"] and same["max_rel"] < 1e-3 and same["rel_rms"] < 1e-3 and same["lse_err"] < 1e-6
    bad = ref.copy()
    bad[1, 2, 3] = np.nan
    res = correctness.compare(bad, ref, lse_ref, lse_ref)
    assert not res["finite"] and res["max_rel"] == np.inf
    off = ref.copy()
    off[0, 0, 0] += np.abs(ref).max()  # error as large as the largest value
    assert correctness.compare(off, ref, lse_ref, lse_ref)["max_rel"] == pytest.approx(1.0)
    # an empty request's LSE is -inf in both: fine; -inf against finite: not
    lse_ref2 = lse_ref.copy()
    lse_ref2[1] = -np.inf
    assert correctness.compare(ref, ref, lse_ref2, lse_ref2)["lse_err"] == 0.0
    assert correctness.compare(ref, ref, lse_ref, lse_ref2)["lse_err"] == np.inf


def test_correctness_summary():
    rows = [
        dict(config=0, method="v2", passed=True, max_rel=1e-4, rel_rms=1e-5, lse_err=0.0, ref_s=0.5),
        dict(config=0, method="v1", passed=False, max_rel=3e-2, rel_rms=1e-2, lse_err=0.0, ref_s=0.5),
        dict(config=1, method="v2", passed=False, error="RuntimeError: boom", ref_s=1.5),
    ]
    text, ok = correctness.summarize(rows)
    assert not ok
    assert text.startswith("SUMMARY: 1/3")
    assert "reference: 2.0 s total" in text
    text, ok = correctness.summarize(rows[:1])
    assert ok


# ------------------------------------------------- correctness: serving features

NEW_AXIS_VALUES = {
    "kv_dtype_name": ["float8_e4m3fn"],
    "head_dim": [96, 256],
    "gqa": [3, 5, 6, 7, 16],
    "page_size": [1, 256],
    "soft_cap": [30.0, 50.0],
    "kv_layout": ["HND"],
    "scale_mode": ["tensor", "head"],
}


def test_feature_configs_cover_every_new_axis():
    cfgs = correctness.FEATURE_CONFIGS
    assert 100 <= len(cfgs) <= 140 and len(set(cfgs)) == len(cfgs)
    assert all(c.group != "base" and c.num_kv_heads == 8 for c in cfgs)
    for axis, values in NEW_AXIS_VALUES.items():
        for value in values:
            sel = [c for c in cfgs if getattr(c, axis) == value]
            assert len(sel) >= 5, (axis, value, len(sel))
            assert any(c.ctx <= 512 for c in sel) and any(c.ctx >= 4096 for c in sel), (axis, value)
    fp8 = [c for c in cfgs if c.is_fp8]
    assert {c.dtype for c in fp8} == {"float16", "bfloat16"}  # never float32 q
    assert {(c.dtype, c.scale_mode, c.head_dim) for c in fp8 if c.ctx == 512} == {
        (dt, mode, d) for dt in ("float16", "bfloat16") for mode in ("none", "tensor", "head") for d in (64, 96, 128, 256)
    }
    assert {c.head_dim for c in fp8 if c.ctx == 4096} == {64, 96, 128, 256}
    assert {c.dtype for c in cfgs if c.head_dim == 96} == {"float16", "bfloat16", "float32"}
    for value in (1, 256):  # page sizes in every dtype
        assert {c.dtype for c in cfgs if c.page_size == value} == {"float16", "bfloat16", "float32"}
    assert all(c.kv_dtype is None for c in cfgs if not c.is_fp8)  # 16/32-bit caches share q's dtype
    # a custom sm_scale on its own (not only with a soft cap)
    custom = [c for c in cfgs if c.sm_scale is not None and not c.soft_cap]
    assert len(custom) >= 10 and {c.ctx for c in custom} >= {512, 4096}
    # a soft cap comes with a large sm_scale, or the cap would not change the result
    assert all(c.sm_scale is not None and c.sm_scale * math.sqrt(c.head_dim) >= 4 for c in cfgs if c.soft_cap)
    # scales on 16/32-bit caches too (the contract allows them for every KV dtype)
    assert {c.dtype for c in cfgs if c.scale_mode != "none" and not c.is_fp8} == {"float16", "bfloat16", "float32"}


def test_soft_cap_and_sm_scale_configs_change_the_reference():
    """On the sweep's own value distribution (normal q and K), the cap and the
    custom sm_scale of the feature list move the result by more than three
    times the tolerance, so a kernel that ignored them would fail the sweep."""
    from cupaged import reference

    rng = np.random.default_rng(0)
    seen = set()
    for c in correctness.FEATURE_CONFIGS:
        key = (c.head_dim, c.soft_cap, c.sm_scale)
        if key in seen or (not c.soft_cap and c.sm_scale is None):
            continue
        seen.add(key)
        q = rng.standard_normal((2, 4, c.head_dim))
        k = rng.standard_normal((512, 2, c.head_dim))
        v = rng.standard_normal((512, 2, c.head_dim))
        for i in range(2):
            base, _ = reference.attend(q[i], k, v, c.sm_scale)
            plain, _ = reference.attend(q[i], k, v)
            if c.soft_cap:
                capped, _ = reference.attend(q[i], k, v, c.sm_scale, logits_soft_cap=c.soft_cap)
                assert np.abs(capped - base).max() / np.abs(base).max() > 3 * 2e-2, key
            else:
                assert np.abs(plain - base).max() / np.abs(base).max() > 3 * 2e-2, key
    assert len(seen) >= 6


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--features"], lambda c: True),
        (["--features", "--kv-dtype", "float8_e4m3fn"], lambda c: c.is_fp8),
        (["--features", "--kv-layout", "HND"], lambda c: c.kv_layout == "HND"),
        (["--features", "--soft-cap", "30,50"], lambda c: c.soft_cap in (30, 50)),
        (["--features", "--soft-cap", "0"], lambda c: not c.soft_cap),
        (["--features", "--scale-mode", "head"], lambda c: c.scale_mode == "head"),
        (["--features", "--head-dim", "96", "--dtype", "float32"], lambda c: c.head_dim == 96 and c.dtype == "float32"),
        (["--features", "--gqa", "3", "5", "6", "7", "16"], lambda c: c.gqa in (3, 5, 6, 7, 16)),
        (["--features", "--ctx", "4096"], lambda c: c.ctx == 4096),
        (["--full", "--kv-dtype", "float8_e4m3fn", "--dtype", "bfloat16"], None),
    ],
)
def test_features_flag_filters_the_list(argv, expect):
    args = correctness.parse_args(argv)
    cfgs = correctness.configs(args)
    if expect is None:  # --full: product axes, then the filtered list
        product = [c for c in cfgs if c.group == "base"]
        assert len(product) == 216 and all(c.is_fp8 and c.dtype == "bfloat16" for c in product)
        assert cfgs[216:] == [c for c in correctness.FEATURE_CONFIGS if c.is_fp8 and c.dtype == "bfloat16"]
        return
    want = [c for c in correctness.FEATURE_CONFIGS if expect(c)]
    assert cfgs == want and len(want) >= 4


def test_feature_flags_are_axes_of_the_product_sweep():
    def n(*argv):
        return correctness.configs(correctness.parse_args(list(argv)))

    hnd = n("--kv-layout", "HND")
    assert len(hnd) == 24 and all(c.kv_layout == "HND" and c.has_features for c in hnd)
    assert len(n("--kv-layout", "NHD,HND", "--soft-cap", "0", "30")) == 4 * 24
    # fp8 caches only with 16-bit q: the float32 combinations are left out
    fp8 = n("--kv-dtype", "float8_e4m3fn", "--dtype", "float16", "float32")
    assert len(fp8) == 24 and all(c.is_fp8 and c.dtype == "float16" for c in fp8)
    both = n("--kv-dtype", "float16,float8_e4m3fn", "--dtype", "float16,bfloat16,float32")
    assert len(both) == 3 * 24  # fp16/fp16, fp16/fp8, bf16/fp8
    assert sum(not c.has_features for c in both) == 24
    assert n("--kv-dtype", "float8_e4m3fn", "--dtype", "float32") == []
    scaled = n("--scale-mode", "tensor", "head", "--head-dim", "64")
    assert len(scaled) == 24 and {c.scale_mode for c in scaled} == {"tensor", "head"}
    # --num-kv-heads applies to the feature list too
    assert {c.num_kv_heads for c in n("--features", "--num-kv-heads", "4")} == {4}
    with pytest.raises(SystemExit):
        correctness.parse_args(["--full", "--features"])


@pytest.mark.parametrize(
    "argv",
    [["--kv-dtype", "int8"], ["--kv-dtype", "fp8"], ["--kv-layout", "XYZ"], ["--soft-cap", "-1"],
     ["--soft-cap", "inf"], ["--scale-mode", "row"], ["--dtype", "float8_e4m3fn"]],
)
def test_feature_flags_reject_bad_values(argv):
    with pytest.raises(SystemExit) as e:
        correctness.parse_args(argv)
    assert e.value.code == 2


def test_config_rows_fit_the_csv(tmp_path):
    cfg = next(c for c in correctness.FEATURE_CONFIGS if c.is_fp8 and c.kv_layout == "HND" and c.soft_cap)
    row = dict(cfg.fields(), config=3, method="v2", passed=True, error="", max_rel=1e-3)
    assert set(row) <= set(correctness.CSV_COLUMNS)
    assert row["kv_dtype"] == "float8_e4m3fn" and row["num_qo_heads"] == cfg.gqa * 8
    label = cfg.label()
    assert "kv=fp8" in label and "HND" in label and f"cap{cfg.soft_cap:g}" in label
    plain = correctness.Config(64, 4, 16, 512, 1, "bfloat16", 8)
    assert plain.fields()["kv_dtype"] == "bfloat16" and not plain.has_features
    assert plain.label() == "bfloat16 D64 g4 P16 ctx512 B1"
    path = tmp_path / "c.csv"
    _common.write_csv(path, correctness.CSV_COLUMNS, [row, dict(plain.fields(), config=0, method="v1")])
    with path.open() as f:
        got = list(csv.DictReader(f))
    assert got[0]["kv_layout"] == "HND" and float(got[0]["soft_cap"]) == cfg.soft_cap
    assert got[0]["scale_mode"] == cfg.scale_mode and got[0]["group"] == "fp8"
    assert got[1]["sm_scale"] == "" and got[1]["group"] == "base" and got[1]["kv_layout"] == "NHD"


# A NumPy stand-in for the few cupy calls correctness.py makes, so that its
# whole GPU path (batch building, fp8 quantization, scales, the decode keyword
# arguments, rows and CSV) runs here with cupaged.decode replaced by the
# reference.
class _HostArray(np.ndarray):
    def get(self):
        return np.array(self)

    @property
    def data(self):
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self):
        return self.__array_interface__


def _host_cupy() -> ModuleType:
    cupy = ModuleType("cupy")

    def wrap(a):
        return np.asarray(a).view(_HostArray)

    class RandomState:
        def __init__(self, seed):
            self.rng = np.random.default_rng(seed)

        def standard_normal(self, n, dtype=np.float64):
            return wrap(self.rng.standard_normal(n, dtype=np.float32).astype(dtype))

    pool = SimpleNamespace(free_all_blocks=lambda: None, total_bytes=lambda: 0)
    stream = SimpleNamespace(synchronize=lambda: None)
    cupy.ndarray = _HostArray
    cupy.float32, cupy.uint8, cupy.abs = np.float32, np.uint8, np.abs
    cupy.empty = lambda shape, dtype=np.float64: wrap(np.empty(shape, dtype))
    cupy.full = lambda shape, value, dtype=np.float64: wrap(np.full(shape, value, dtype))
    cupy.asarray = lambda a, dtype=None: wrap(np.array(a, dtype=dtype))
    cupy.random = SimpleNamespace(RandomState=RandomState)
    cupy.cuda = SimpleNamespace(
        Device=lambda i=0: SimpleNamespace(synchronize=lambda: None),
        get_current_stream=lambda: stream,
        runtime=SimpleNamespace(deviceSynchronize=lambda: None, getDeviceCount=lambda: 1),
    )
    cupy.get_default_memory_pool = cupy.get_default_pinned_memory_pool = lambda: pool
    return cupy


@pytest.fixture
def host_gpu(monkeypatch):
    """correctness.main on the host: fake cupy, cupaged.decode = the reference
    (minus the keyword arguments in ``host_gpu.drop``); every call recorded."""
    if _gpu_present():
        pytest.skip("this machine has a GPU: the real run covers this")
    import cupaged
    from cupaged import reference

    state = SimpleNamespace(calls=[], drop=())
    monkeypatch.setitem(sys.modules, "cupy", _host_cupy())
    monkeypatch.setattr(_common, "require_gpu", lambda: None)
    monkeypatch.setenv("CUPAGED_NUM_SMS", "132")

    def decode(q, k_cache, v_cache, table, plan=None, *, method="auto", out=None, return_lse=False, **kw):
        state.calls.append(SimpleNamespace(method=method, kw=kw, k=k_cache, plan=plan))
        kw = {name: value for name, value in kw.items() if name not in state.drop}
        ref, lse = reference.decode(q.get(), k_cache.get(), v_cache.get(), table, **kw)
        out[...] = ref.astype(out.dtype)
        return out, lse.astype(np.float32).view(_HostArray)

    monkeypatch.setattr(cupaged, "decode", decode)
    return state


@needs_tqdm
def test_correctness_features_end_to_end_on_the_host(host_gpu, tmp_path, capsys):
    path = tmp_path / "features.csv"
    argv = ["--features", "--ctx", "97,512", "--batch", "1,3", "--methods", "v2,gather", "--csv", str(path)]
    cfgs = correctness.configs(correctness.parse_args(argv))
    assert len(cfgs) >= 15 and any(c.is_fp8 for c in cfgs)
    assert correctness.main(argv) == 0
    out = capsys.readouterr().out
    assert f"SUMMARY: {2 * len(cfgs)}/{2 * len(cfgs)}" in out and "serving-feature" in out
    rows = bench_report.read_csv_rows(path)
    assert len(rows) == 2 * len(cfgs)
    assert all(r["passed"] in (1, True, "1") for r in rows)
    # what each configuration handed to cupaged.decode
    assert len(host_gpu.calls) == 2 * len(cfgs)
    for cfg, call in zip([c for c in cfgs for _ in range(2)], host_gpu.calls):
        kw = call.kw
        assert ("logits_soft_cap" in kw) == bool(cfg.soft_cap)
        assert kw.get("kv_layout", "NHD") == cfg.kv_layout
        assert kw.get("sm_scale") == cfg.sm_scale
        assert call.k.dtype == (np.uint8 if cfg.is_fp8 else _common.resolve_dtype(cfg.dtype))
        heads_axis = 2 if cfg.kv_layout == "NHD" else 1
        assert call.k.shape[heads_axis] == cfg.num_kv_heads and call.k.shape[3] == cfg.head_dim
        assert call.plan.kv_dtype.name == cfg.kv_dtype_name
        if cfg.scale_mode == "none":
            assert "k_scale" not in kw and "v_scale" not in kw
        elif cfg.scale_mode == "tensor":
            assert isinstance(kw["k_scale"], float) and isinstance(kw["v_scale"], float)
        else:
            for name in ("k_scale", "v_scale"):
                assert kw[name].shape == (cfg.num_kv_heads,) and kw[name].dtype == np.float32
                assert len(np.unique(kw[name])) > 1  # heads really differ
        if cfg.is_fp8:  # e4m3 bits that use the range
            bits = call.k.get()
            assert not ((bits & 0x7F) == 0x7F).any()  # no NaN code
            if cfg.scale_mode != "none":
                assert (bits & 0x7F).max() >= 0x76  # the largest |value| maps near 448


@pytest.mark.parametrize(
    "drop, flags",
    [
        (("logits_soft_cap",), ["--soft-cap", "30,50", "--batch", "1,3"]),
        (("k_scale",), ["--scale-mode", "tensor,head", "--batch", "1,3"]),
        (("v_scale",), ["--scale-mode", "head", "--batch", "1,3"]),
        (("sm_scale",), ["--soft-cap", "0", "--page-size", "16", "--head-dim", "128", "--batch", "4"]),
    ],
)
@needs_tqdm
def test_correctness_catches_an_ignored_feature(host_gpu, drop, flags, capsys):
    """A decode that ignores a feature fails every configuration using it."""
    argv = ["--features", "--ctx", "97,512", "--methods", "v2", *flags]
    cfgs = correctness.configs(correctness.parse_args(argv))
    host_gpu.drop = drop
    assert correctness.main(argv) == 1
    out = capsys.readouterr().out
    uses = [c for c in cfgs if {"logits_soft_cap": c.soft_cap, "k_scale": c.scale_mode != "none",
                                "v_scale": c.scale_mode != "none", "sm_scale": c.sm_scale is not None}[drop[0]]]
    assert len(uses) >= 3
    assert out.count("FAIL ") == len(uses), out


# -------------------------------------------------------------- microbench args


def test_microbench_sweeps_are_data():
    assert microbench.DEFAULT_SWEEP == {"batch": (1, 4, 8, 32), "ctx": (1024, 4096, 16384, 32768), "page_size": (16,)}
    assert len(microbench.cells(microbench.parse_args([]))) == 16
    assert len(microbench.cells(microbench.parse_args(["--quick"]))) == 4


def test_microbench_defaults_and_quick(tmp_path):
    args = microbench.parse_args(["--out-dir", str(tmp_path)])
    assert (args.num_qo_heads, args.num_kv_heads, args.head_dim, args.dtype) == (32, 8, 128, "float16")
    assert (args.reps, args.iters, args.host_iters) == (3, 100, 50)
    assert args.methods == ("gather", "v1", "v2", "flashinfer")
    assert args.csv == str(tmp_path / "microbench.csv")
    assert args.md == str(tmp_path / "microbench.md")
    assert args.png == str(tmp_path / "microbench.png")
    quick = microbench.parse_args(["--quick"])
    assert (quick.reps, quick.iters) == (microbench.QUICK_SETTINGS["reps"], microbench.QUICK_SETTINGS["iters"])
    assert microbench.parse_args(["--quick", "--reps", "5"]).reps == 5


def test_microbench_axis_flags(tmp_path):
    args = microbench.parse_args(
        [
            "--batch",
            "2,3",
            "--ctx",
            "100",
            "200",
            "300",
            "--page-size",
            "8",
            "32",
            "--methods",
            "v2",
            "v1",
            "--csv",
            str(tmp_path / "a.csv"),
        ]
    )
    cells = microbench.cells(args)
    assert len(cells) == 12
    assert cells[0] == {"batch": 2, "ctx": 100, "page_size": 8}
    assert args.methods == ("v2", "v1")
    assert args.csv == str(tmp_path / "a.csv")
    assert microbench.cells(microbench.parse_args(["--quick", "--ctx", "512"])) == [
        {"batch": 1, "ctx": 512, "page_size": 16},
        {"batch": 8, "ctx": 512, "page_size": 16},
    ]


@pytest.mark.parametrize("argv", [["--methods", "v9"], ["--num-qo-heads", "12"], ["--reps", "0"], ["--dtype", "int8"]])
def test_microbench_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        microbench.parse_args(argv)
    assert e.value.code == 2


def test_microbench_rotation():
    assert microbench.num_replicas(microbench.ROTATE_BYTES) == 1
    assert microbench.num_replicas(10 * microbench.ROTATE_BYTES) == 1
    assert microbench.num_replicas(microbench.ROTATE_BYTES // 4) == 4
    assert microbench.num_replicas(1) == microbench.MAX_REPLICAS
    for r in (1, 3, 4, 7, 20, 21, 64):
        n = microbench.graph_calls(r)
        assert n >= microbench.GRAPH_CALLS and n % r == 0 and n < microbench.GRAPH_CALLS + r


def test_microbench_summarize_runner():
    r = microbench.Runner("v2", [], None, lambda: None, timing="graph")
    r.samples = {"graph": [10.0, 12.0, 11.0], "event": [20.0, 21.0, 22.0], "host": [5.0, 6.0, 7.0]}
    res = microbench.summarize_runner(r, total_bytes=46_000_000)  # 46 MB in 11 us = 4.18 TB/s
    assert res["us"] == 11.0 and res["graph_us"] == 11.0 and res["event_us"] == 21.0 and res["host_us"] == 6.0
    assert res["tbps"] == pytest.approx(46e6 / 11e-6 / 1e12)
    assert res["pct_roofline"] == pytest.approx(100 * 46e6 / 11e-6 / 4.6e12)
    assert res["spread"] == pytest.approx(2.0 / 11.0)
    assert set(res) <= set(microbench.METHOD_FIELDS)
    # no graph: events are the primary time
    r.samples["graph"] = []
    res = microbench.summarize_runner(r, total_bytes=1)
    assert res["us"] == 21.0 and res["graph_us"] is None


# ------------------------------------------------------- microbench --suite issue5


def test_suite_cells_cover_the_issue():
    args = microbench.parse_args(["--suite", "issue5"])
    cells = microbench.cells(args)
    assert args.budget_s == microbench.SUITE_BUDGET_S
    assert args.csv.endswith("microbench-issue5.csv") and args.md.endswith("microbench-issue5.md")
    main = [c for c in cells if c["group"].startswith("main-")]
    assert len(main) == 4 * (5 * 4 + 3) == 92
    assert len(cells) == 92 + 3 * 9
    assert {(c["dtype"], c["page_size"]) for c in main} == {
        ("float16", 16),
        ("float16", 32),
        ("bfloat16", 16),
        ("bfloat16", 32),
    }
    assert all((c["num_qo_heads"], c["num_kv_heads"], c["head_dim"]) == (32, 8, 128) for c in main)
    long = sorted(c["batch"] for c in main if c["ctx"] == 131072)
    assert long == [1, 1, 1, 1, 4, 4, 4, 4, 8, 8, 8, 8]
    for c in cells:
        assert c["methods"][:2] == ("v2", "flashinfer")
        slow = c["group"].startswith("main-") and c["ctx"] >= 4096
        assert (set(c["methods"]) == {"v2", "flashinfer", "v1", "gather"}) == slow
        assert c["host"] == (c["group"].startswith("main-") and (c["batch"], c["ctx"]) in microbench.HOST_CELLS)
    extras = {(c["num_qo_heads"], c["num_kv_heads"], c["head_dim"]) for c in cells if not c["group"].startswith("main-")}
    assert extras == {(32, 32, 128), (64, 8, 128), (32, 8, 64)}
    assert cells[0]["group"] == "main-fp16-p16"  # most important first


def test_suite_filters_and_rejects():
    def n(*argv):
        return len(microbench.cells(microbench.parse_args(["--suite", "issue5", *argv])))

    assert n("--groups", "main-bf16-p32") == 23
    assert n("--groups", "mha-fp16-p16,d64-fp16-p16") == 18
    assert n("--dtype", "bfloat16") == 46
    assert n("--batch", "128", "--page-size", "16") == 2 * 4
    assert n("--ctx", "131072") == 12
    args = microbench.parse_args(["--suite", "issue5", "--methods", "v2", "--budget-s", "0", "--commit", "abc"])
    assert {c["methods"] for c in microbench.cells(args)} == {("v2",)}
    assert args.budget_s == 0 and args.commit == "abc"
    for argv in (["--suite", "issue5", "--quick"], ["--suite", "issue5", "--groups", "nope"], ["--groups", "mha"],
                 ["--suite", "nope"], ["--suite", "issue5", "--budget-s", "-1"], ["--dtype", "float16", "bfloat16"]):
        with pytest.raises(SystemExit) as e:
            microbench.parse_args(argv)
        assert e.value.code == 2
    assert microbench.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


def test_suite_estimates_and_schedules():
    args = microbench.parse_args(["--suite", "issue5"])
    cells = {(c["group"], c["batch"], c["ctx"]): c for c in microbench.cells(args)}
    small = microbench.estimate_cell_s(cells[("main-fp16-p16", 1, 1024)], args, False)
    big = microbench.estimate_cell_s(cells[("main-fp16-p16", 128, 32768)], args, False)
    assert 0.3 < small < 1.0 and 1.0 < big < 5.0
    assert microbench.estimate_cell_s(cells[("main-fp16-p16", 1, 1024)], args, True) == pytest.approx(
        small + microbench.JIT_ESTIMATE_S
    )
    # the whole suite, JIT of three (dtype, head_dim) included, fits the default budget with room to spare
    total = sum(microbench.estimate_cell_s(c, args, False) for c in cells.values()) + 3 * microbench.JIT_ESTIMATE_S
    assert total < 0.8 * microbench.SUITE_BUDGET_S
    assert microbench.adaptive_graph_calls(12.0, 64) == 64
    assert microbench.adaptive_graph_calls(12.0, 1) == microbench.GRAPH_CALLS
    assert microbench.adaptive_graph_calls(75.0, 1) == 7
    assert microbench.adaptive_graph_calls(75.0, 3) == 9
    assert microbench.adaptive_graph_calls(4000.0, 1) == 1
    assert microbench.adaptive_repeats(768.0, 3) == (3, 3)
    assert microbench.adaptive_repeats(4800.0, 3) == (1, 3)
    assert microbench.adaptive_repeats(150_000.0, 3) == (1, 1)
    assert microbench.adaptive_repeats(0.5, 3) == (microbench.MAX_REPLAYS, 3)
    assert microbench.adaptive_repeats(1.0, 3, cap=microbench.MAX_EVENT_ITERS) == (microbench.MAX_EVENT_ITERS, 3)


def test_gather_skip_reason():
    kv = 128 * 32768 * 4096  # fp16 batch 128 x ctx 32768, 8 kv heads x 128
    assert microbench.gather_skip_reason(kv, 2 * kv, "float16") == ""
    assert microbench.gather_skip_reason(kv, 2 * kv, "bfloat16").startswith("skipped: memory")
    assert microbench.gather_skip_reason(kv // 2, kv, "bfloat16") == ""
    assert microbench.gather_skip_reason(1 << 20, 1 << 29, "float16", v2_est_us=10.0) == ""
    assert microbench.gather_skip_reason(1 << 20, 1 << 29, "float16", v2_est_us=1e5).startswith("skipped: time")


def _row(**kw):
    row = {
        "batch": 1,
        "ctx": 1024,
        "page_size": 16,
        "num_qo_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "dtype": "float16",
        "kv_bytes": 4_141_056,
        "total_bytes": 4_157_712,
        "v2_num_ctas": 128,
        "v2_needs_merge": True,
    }
    row.update(kw)
    if row.get("v2_us") and "v2_tbps" not in kw:
        row["v2_tbps"] = row["total_bytes"] / (row["v2_us"] * 1e-6) / 1e12
    return row


def test_targets_small_cell():
    # the 2026-11-29 batch 1 x ctx 1024 cell: v2 12.5 us, FlashInfer 8.6 us
    ev = bench_report.evaluate_row(_row(v2_us=12.5, flashinfer_us=8.6))
    assert ev["target_no_slower"] == "missed" and ev["target_small"] == "missed"
    assert ev["target_tbs"] == ev["target_v1"] == ev["target_gather"] == ev["target_host"] == ""
    assert ev["fi_best_us"] == 8.6 and ev["roofline_us"] == pytest.approx(4_157_712 / 4.6e6)
    assert ev["bound"].startswith("latency-bound: v2 - bytes/4.6 TB/s = 11.6 us")
    assert "128 CTAs" in ev["bound"] and "split+merge" in ev["bound"]
    ok = bench_report.evaluate_row(_row(v2_us=5.5, flashinfer_us=8.6, v2_host_us=6.0, v2_auto_host_us=7.9))
    assert ok["target_no_slower"] == ok["target_small"] == ok["target_host"] == "met" and ok["bound"] == ""
    host = bench_report.evaluate_row(_row(v2_us=5.5, flashinfer_us=8.6, v2_host_us=6.0, v2_auto_host_us=8.5))
    assert host["target_host"] == "missed" and host["bound"].startswith("host path 8.5 us")
    nofi = bench_report.evaluate_row(_row(v2_us=5.5))
    assert nofi["target_no_slower"] == "not measured"


def test_targets_large_cell_and_baselines():
    kv = 8 * 32768 * 4096
    base = dict(batch=8, ctx=32768, kv_bytes=kv, total_bytes=kv + 40_000, v2_num_ctas=832)
    ev = bench_report.evaluate_row(_row(**base, v2_us=325.9, flashinfer_us=247.2, v1_us=842.0, gather_us=9867.0))
    assert ev["target_tbs"] == "missed" and ev["target_no_slower"] == "missed" and ev["target_small"] == ""
    assert ev["target_v1"] == ev["target_gather"] == "met"
    assert ev["bound"].startswith("bandwidth: v2 at 72 % of roofline")
    fast = bench_report.evaluate_row(_row(**base, v2_us=240.0, flashinfer_us=247.2, v1_us=200.0, gather_us=400.0))
    assert fast["target_tbs"] == "met" and fast["target_no_slower"] == "met"
    assert fast["target_v1"] == fast["target_gather"] == "missed"
    assert "v1 faster: v1/v2 time = 0.83" in fast["bound"] and "gather/v2 time = 1.67" in fast["bound"]
    skipped = bench_report.evaluate_row(_row(**base, v2_us=240.0, flashinfer_us=247.2, v1_us=900.0))
    assert skipped["target_gather"] == "not measured" and skipped["bound"] == ""
    # middle cells (64 MB < KV < 256 MB) have neither size target; ctx < 4096: no v1/gather target
    mid = bench_report.evaluate_row(_row(ctx=1024, kv_bytes=100e6, total_bytes=100e6, v2_us=30.0, flashinfer_us=40.0))
    assert mid["target_tbs"] == mid["target_small"] == mid["target_v1"] == "" and mid["target_no_slower"] == "met"
    # extra shapes: only the no-slower target
    mha = bench_report.evaluate_row(_row(**base, num_kv_heads=32, v2_us=1.0, flashinfer_us=2.0, v1_us=0.5))
    assert [mha[c] for c in bench_report.TARGET_COLUMNS] == ["met", "", "", "", "", ""]


def test_targets_from_csv_strings_and_geomean():
    row = {k: ("" if v is None else str(v)) for k, v in _row(v2_us=12.5, flashinfer_us=8.6).items()}
    row["v2_needs_merge"] = "1"
    assert bench_report.evaluate_row(row)["target_small"] == "missed"
    rows = [
        _row(v2_us=10.0, flashinfer_us=15.0),
        _row(batch=4, v2_us=10.0, flashinfer_us=20.0),
        _row(batch=4, num_kv_heads=32, v2_us=10.0, flashinfer_us=1.0),  # extra shape: not in the main sweep
        _row(batch=2, v2_us=10.0, flashinfer_us=1.0),  # batch 2 is not a sweep batch
        _row(batch=128, ctx=131072, v2_us=10.0, flashinfer_us=1.0),  # 131072 only for batch <= 8
        _row(batch=8, ctx=131072, v2_us=10.0),  # no FlashInfer time
    ]
    gm, n = bench_report.geomean_fi_over_v2(rows)
    assert n == 2 and gm == pytest.approx((1.5 * 2.0) ** 0.5)
    assert bench_report.geomean_fi_over_v2(rows, main_only=False)[1] == 5
    assert bench_report.geomean_fi_over_v2([]) == (None, 0)


def _suite_rows():
    rows = []
    for group, dtype, hkv in (("main-fp16-p16", "float16", 8), ("mha-fp16-p16", "float16", 32)):
        for b in (1, 8):
            for ctx in (1024, 4096):
                kv = 2 * b * ctx * hkv * 128 * 2
                row = _row(group=group, dtype=dtype, num_kv_heads=hkv, batch=b, ctx=ctx, kv_bytes=kv, total_bytes=kv)
                row.update(v2_us=kv / 3e6 + 6, flashinfer_us=kv / 4e6 + 5, flashinfer_variant="tensor_cores")
                row["v2_tbps"] = kv / (row["v2_us"] * 1e-6) / 1e12
                row["v2_spread"], row["flashinfer_spread"] = 0.01 * b, 0.02
                if ctx >= 4096 and group.startswith("main"):
                    row.update(v1_us=3 * row["v2_us"])
                    row["gather_timing"] = "skipped: memory (x)" if b == 8 else ""
                    row["gather_us"] = None if b == 8 else 40 * row["v2_us"]
                if (b, ctx) == (1, 1024) and group.startswith("main"):
                    row.update(v2_host_us=9.0, v2_auto_host_us=9.5, flashinfer_host_us=20.0)
                row.update(bench_report.evaluate_row(row))
                rows.append(row)
    return rows


def test_suite_report(tmp_path):
    rows = _suite_rows()
    meta = {
        "command": "python3 scripts/microbench.py --suite issue5",
        "gpu": "NVIDIA H200 (132 SMs)",
        "date": "2026-11-30 10:00 UTC",
        "commit": "abc1234",
        "elapsed_s": 200.0,
        "planned": 10,
        "skipped": ["bf16 ...: time budget"],
        "notes": ["main b8 ctx4096: gather skipped: memory"],
    }
    md = bench_report.markdown_report(rows, meta)
    assert md.startswith("# cupaged paged decode vs FlashInfer: issue #5 targets (2026-11-30)")
    for text in ("`python3 scripts/microbench.py --suite issue5`", "NVIDIA H200", "`abc1234`", "**Spread**",
                 "## Targets", "## Host time", "### main-fp16-p16", "### mha-fp16-p16", "8/10 cells measured in 200 s",
                 "not run: bf16 ...: time budget", "gather skipped: memory", "bound (auto hint, edit)"):
        assert text in md, text
    assert "| 1 | 1024 |" in md and "**missed**" in md and "| skipped |" in md
    counts = {c["target"]: c for c in bench_report.target_counts(rows)}
    assert counts["target_no_slower"]["cells"] == 8
    assert counts["target_gather"]["cells"] == 2 and counts["target_gather"]["not measured"] == 1
    assert counts["target_host"]["cells"] == 1 and counts["target_host"]["missed"] == 1
    assert "Geometric mean of FlashInfer-best / v2 over the main sweep** (4 cells)" in md
    # every missed cell has a bound note in its row of the table
    for line in md.splitlines():
        if line.startswith("| ") and "**missed**" in line:
            assert line.rstrip(" |").split("|")[-1].strip(), line
    text = bench_report.summary_text(rows)
    assert "geomean FI-best/v2 over main sweep" in text and "main-fp16-p16 FI-best/v2" in text
    # the report re-renders from the CSV and the meta JSON
    csv_path = tmp_path / "m.csv"
    _common.write_csv(csv_path, microbench.CSV_COLUMNS, rows)
    bench_report.meta_path(csv_path).write_text(json.dumps(meta))
    assert bench_report.main([str(csv_path), "--md", str(tmp_path / "r.md")]) == 0
    again = (tmp_path / "r.md").read_text()
    assert again.count("**missed**") == md.count("**missed**")
    assert bench_report.read_csv_rows(csv_path)[0]["batch"] == 1


def test_suite_csv_columns_and_commit(monkeypatch):
    assert set(bench_report.EVAL_COLUMNS) <= set(microbench.CSV_COLUMNS)
    assert {"group", "wall_s", "v2_auto_host_us"} <= set(microbench.CSV_COLUMNS)
    monkeypatch.setenv("CUPAGED_COMMIT", "fromenv")
    assert bench_report.git_commit(ROOT)  # a short hash (+dirty) here, or the env var outside a checkout
    assert bench_report.git_commit("/") == "fromenv"
    assert bench_report.meta_path("a/b.csv") == Path("a/b.meta.json")


# A CPU stand-in for cupy's few calls the benchmark's control flow makes:
# kernels are Python calls that advance a fake GPU clock (us); capture records
# their cost into a graph; gather refuses capture like cuBLAS does.
class _FakeGPU:
    def __init__(self):
        self.clock = 0.0
        self.capturing = False
        self.captured = 0.0

    def kernel(self, cost_us, name=""):
        if self.capturing:
            if name == "gather":
                raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
            self.captured += cost_us
        else:
            self.clock += cost_us


def _fake_device_batch(layout, hq, hkv, head_dim, dtype, *, seed, replicas=1):
    """_common.make_device_batch on the stand-in GPU: a real table, a host q and empty caches."""
    table = _common.layout_table(layout)
    empty = np.empty((0, layout.page_size, hkv, head_dim), dtype=dtype)
    q = np.ones((layout.batch_size, hq, head_dim), dtype=dtype)
    return _common.DeviceBatch(layout, table, q, [(empty, empty)] * replicas, hq, hkv, head_dim, np.dtype(dtype))


def _fake_cupy(gpu: _FakeGPU) -> ModuleType:
    cupy = ModuleType("cupy")

    class Event:
        t = 0.0

        def record(self, stream=None):
            self.t = gpu.clock

        def synchronize(self):
            pass

    class Graph:
        def __init__(self, cost):
            self.cost = cost

        def launch(self, stream=None):
            gpu.clock += self.cost

    class Stream:
        ptr = 0

        def __init__(self, non_blocking=False):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

        def begin_capture(self):
            gpu.capturing, gpu.captured = True, 0.0

        def end_capture(self):
            if not gpu.capturing:
                raise RuntimeError("not capturing")
            gpu.capturing = False
            return Graph(gpu.captured)

    pool = SimpleNamespace(free_all_blocks=lambda: None, total_bytes=lambda: 0)
    props = {"name": b"Fake H200", "multiProcessorCount": 132, "totalGlobalMem": 150e9}
    runtime = SimpleNamespace(
        getDeviceProperties=lambda i: props,
        getDeviceCount=lambda: 1,
        getDevice=lambda: 0,
        driverGetVersion=lambda: 13000,
        runtimeGetVersion=lambda: 13000,
    )
    stream = Stream()
    cupy.cuda = SimpleNamespace(
        Event=Event,
        Stream=Stream,
        get_elapsed_time=lambda a, b: (b.t - a.t) / 1e3,
        get_current_stream=lambda: stream,
        Device=lambda i=0: SimpleNamespace(id=0, synchronize=lambda: None, attributes={"MultiProcessorCount": 132}),
        runtime=runtime,
    )
    cupy.get_default_memory_pool = cupy.get_default_pinned_memory_pool = lambda: pool
    cupy.float32, cupy.int16, cupy.abs, cupy.full, cupy.__version__ = np.float32, np.int16, np.abs, np.full, "fake"
    return cupy


def _kv_of(table, k_cache):
    return 2 * int(table.seq_lens.sum()) * k_cache.shape[2] * k_cache.shape[3] * k_cache.dtype.itemsize


@pytest.fixture
def fake_gpu(monkeypatch):
    """The benchmark runs against :class:`_FakeGPU`: fake cupy, empty caches,
    cupaged.decode and FlashInfer as cost models (v2 at 3.8 TB/s + 6 us, v1
    3x, gather 40x; FlashInfer 3.2 TB/s + 4 us and 4.4 TB/s + 5 us)."""
    if _gpu_present():
        pytest.skip("this machine has a GPU: the real run covers this")
    import cupaged

    gpu = _FakeGPU()
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(gpu))
    monkeypatch.setenv("CUPAGED_NUM_SMS", "132")

    factor = {"v2": 1.0, "auto": 1.0, "v1": 3.0, "gather": 40.0}

    def decode(q, k_cache, v_cache, table, plan=None, *, method="auto", out=None, **kw):
        gpu.kernel(factor[method] * (_kv_of(table, k_cache) / 3.8e6 + 6.0), method)
        out = np.empty(q.shape, q.dtype) if out is None else out
        out[...] = 1.0
        return out

    class FlashInfer:
        reason, version, available = "", "fake", True
        torch = SimpleNamespace(cuda=SimpleNamespace(empty_cache=lambda: None, memory_reserved=lambda: 0), __version__="fake")

        def runners(self, batch, stream):
            kv = _kv_of(batch.table, batch.k_cache)
            out = []
            for name, rate, fixed in (("cuda_cores", 3.2e6, 4.0), ("tensor_cores", 4.4e6, 5.0)):
                o = np.ones(batch.q.shape, batch.q.dtype)
                calls = [(lambda c=kv / rate + fixed: gpu.kernel(c)) for _ in batch.caches]
                out.append(microbench.Runner(f"flashinfer_{name}", calls, o, contextlib.nullcontext))
            return out

    monkeypatch.setattr(_common, "make_device_batch", _fake_device_batch)
    monkeypatch.setattr(_common, "require_gpu", lambda: None)
    monkeypatch.setattr(cupaged, "decode", decode)
    monkeypatch.setattr(microbench, "FlashInfer", FlashInfer)
    return gpu


def test_suite_runs_end_to_end_on_a_fake_gpu(fake_gpu, tmp_path, capsys):
    argv = ["--suite", "issue5", "--groups", "main-fp16-p16,mha-fp16-p16,main-bf16-p32", "--batch", "1,8",
            "--ctx", "1024,4096", "--out-dir", str(tmp_path), "--commit", "abc1234"]
    assert microbench.main(argv) == 0
    out = capsys.readouterr().out
    assert "SUMMARY: 12/12 cells measured, 0 not run, 0 failures" in out
    assert out.rstrip().splitlines()[-1].strip().startswith("8")  # the last grid line (batch 8) is printed last
    rows = bench_report.read_csv_rows(tmp_path / "microbench-issue5.csv")
    assert len(rows) == 12 and {r["group"] for r in rows} == {"main-fp16-p16", "mha-fp16-p16", "main-bf16-p32"}
    for r in rows:
        assert r["v2_us"] == pytest.approx(r["kv_bytes"] / 3.8e6 + 6.0, rel=1e-6)  # graph replay, per call
        assert r["flashinfer_variant"] in ("cuda_cores", "tensor_cores")
        assert r["flashinfer_us"] == pytest.approx(min(r["kv_bytes"] / 3.2e6 + 4.0, r["kv_bytes"] / 4.4e6 + 5.0))
        assert r["v2_max_rel_vs_v2"] == 0.0 and r["target_no_slower"] == "missed"
        assert "replays of" in r["v2_timing"]
        slow = r["group"].startswith("main") and r["ctx"] >= 4096
        assert (r["v1_us"] is not None) == (r["gather_us"] is not None) == slow
        if slow:
            assert r["v1_us"] == pytest.approx(3 * r["v2_us"], rel=1e-6)
            assert r["gather_us"] == pytest.approx(40 * r["v2_us"], rel=1e-6)  # events: capture refused
            assert r["gather_timing"].startswith("events (capture failed: NotImplementedError")
            assert r["target_v1"] == r["target_gather"] == "met"
        host = r["group"].startswith("main") and (r["batch"], r["ctx"]) in microbench.HOST_CELLS
        assert (r["v2_host_us"] is not None) == (r["v2_auto_host_us"] is not None) == host
        assert (r["target_host"] is not None) == host
        assert r["wall_s"] > 0
    md = (tmp_path / "microbench-issue5.md").read_text()
    assert "`abc1234`" in md and "Fake H200" in md and "### main-bf16-p32" in md
    meta = json.loads((tmp_path / "microbench-issue5.meta.json").read_text())
    assert meta["planned"] == 12 and meta["skipped"] == [] and meta["commit"] == "abc1234"
    if HAS_MATPLOTLIB:  # the scripts extra; without it the report has no figure
        assert (tmp_path / "microbench-issue5.png").read_bytes()[:4] == b"\x89PNG"


def test_suite_budget_and_interrupt_on_a_fake_gpu(fake_gpu, tmp_path, capsys, monkeypatch):
    base = ["--suite", "issue5", "--groups", "main-fp16-p16", "--batch", "1", "--out-dir", str(tmp_path)]
    # a budget too small for the first cell's JIT: everything skipped, nothing written
    assert microbench.main([*base, "--budget-s", "10"]) == 0
    out = capsys.readouterr().out
    assert "SUMMARY: 0/5 cells measured, 5 not run" in out
    assert not (tmp_path / "microbench-issue5.csv").exists()
    # interrupted (SIGTERM from `timeout`, or the alarm) during the third cell: two cells kept, exit 1
    real = microbench.run_cell
    calls = []

    def run_cell(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise microbench.Interrupted("SIGTERM")
        return real(*a, **k)

    monkeypatch.setattr(microbench, "run_cell", run_cell)
    assert microbench.main(base) == 1
    out = capsys.readouterr().out
    assert "INTERRUPTED" in out and "SUMMARY: 2/5 cells measured, 3 not run" in out
    assert len(bench_report.read_csv_rows(tmp_path / "microbench-issue5.csv")) == 2
    assert "interrupted (Interrupted SIGTERM" in (tmp_path / "microbench-issue5.md").read_text()


def test_default_mode_on_a_fake_gpu(fake_gpu, tmp_path, capsys):
    argv = ["--batch", "1", "--ctx", "1024,4096", "--reps", "2", "--iters", "10", "--host-iters", "5",
            "--out-dir", str(tmp_path)]
    assert microbench.main(argv) == 0
    out = capsys.readouterr().out
    assert "SUMMARY: 2/2 cells measured, 0 failures" in out
    rows = bench_report.read_csv_rows(tmp_path / "microbench.csv")
    assert [r["ctx"] for r in rows] == [1024, 4096]
    for r in rows:
        for m in ("v2", "v1", "gather", "flashinfer"):
            assert r[f"{m}_us"] and r[f"{m}_event_us"] and r[f"{m}_host_us"]
        assert r["graph_calls"] == microbench.graph_calls(r["replicas"]) and r["reps"] == 2
        assert r["target_no_slower"] == "missed" and r["target_host"] in ("met", "missed")
    assert (tmp_path / "microbench.md").read_text().startswith("# cupaged paged-decode microbenchmark")


# ------------------------------------------------------------------- writers

# The first released schemas: later versions may append columns, never reorder.
CORRECTNESS_V1 = (
    "config",
    "dtype",
    "head_dim",
    "gqa",
    "num_qo_heads",
    "num_kv_heads",
    "page_size",
    "ctx",
    "batch",
    "seed",
    "force_merge",
    "method",
    "pages_per_chunk",
    "num_chunks",
    "num_ctas",
    "needs_merge",
    "max_rel",
    "rel_rms",
    "lse_err",
    "finite",
    "tol",
    "passed",
    "error",
    "ref_s",
    "run_s",
    "single_chunk",
)
# issue 6 appended the serving-feature columns
CORRECTNESS_V2 = CORRECTNESS_V1 + ("kv_dtype", "kv_layout", "soft_cap", "scale_mode", "sm_scale", "group")
MICROBENCH_V1_HEAD = (
    "batch",
    "ctx",
    "page_size",
    "num_qo_heads",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "page_order",
    "replicas",
    "graph_calls",
    "reps",
    "kv_bytes",
    "total_bytes",
    "v2_pages_per_chunk",
    "v2_num_chunks",
    "v2_num_ctas",
    "v2_needs_merge",
)


def test_csv_schemas_only_append():
    assert correctness.CSV_COLUMNS[: len(CORRECTNESS_V1)] == CORRECTNESS_V1
    assert correctness.CSV_COLUMNS[: len(CORRECTNESS_V2)] == CORRECTNESS_V2
    cols = microbench.CSV_COLUMNS
    assert cols[: len(MICROBENCH_V1_HEAD)] == MICROBENCH_V1_HEAD
    per_method = tuple(
        f"{m}_{f}"
        for m in ("gather", "v1", "v2", "flashinfer")
        for f in ("us", "graph_us", "event_us", "host_us", "tbps", "pct_roofline", "spread", "timing", "max_rel_vs_v2")
    )
    n = len(MICROBENCH_V1_HEAD)
    assert cols[n : n + len(per_method)] == per_method
    assert cols[n + len(per_method) : n + len(per_method) + 4] == (
        "flashinfer_variant",
        "v2_over_v1",
        "v2_over_gather",
        "v2_over_flashinfer",
    )
    for columns in (correctness.CSV_COLUMNS, microbench.CSV_COLUMNS):
        assert len(set(columns)) == len(columns)
    assert set(microbench.MD_COLUMNS) <= set(microbench.CSV_COLUMNS)
    assert set(microbench.SUMMARY_COLUMNS) <= set(microbench.CSV_COLUMNS)


def test_write_csv_keeps_column_order(tmp_path):
    columns = ("b", "a", "c", "flag", "x")
    rows = [{"a": 1, "b": 2.5, "flag": True}, {"x": float("nan"), "c": "s,t", "flag": False, "b": 1e-7}]
    path = tmp_path / "sub" / "out.csv"
    _common.write_csv(path, columns, rows)
    with path.open() as f:
        got = list(csv.reader(f))
    assert got[0] == list(columns)
    assert got[1] == ["2.5", "1", "", "1", ""]
    assert got[2] == ["1e-07", "", "s,t", "0", ""]
    with pytest.raises(KeyError):
        _common.write_csv(path, columns, [{"unknown": 1}])


def test_markdown_table():
    text = _common.markdown_table(("b", "a"), [{"a": 1.23456789, "b": True}, {"a": None, "b": "x|y"}], {"b": "B"})
    lines = text.splitlines()
    assert lines[0] == "| B | a |"
    assert lines[1] == "|---|---|"
    assert lines[2] == "| yes | 1.235 |"
    assert lines[3] == "| x\\|y |  |"
    assert _common.format_value(2.5e-5) == "2.500e-05"
    assert _common.format_value(float("nan")) == ""
    plain = _common.text_table(("a", "bb"), [{"a": 1, "bb": 2.0}])
    assert plain.splitlines()[0].split() == ["a", "bb"]


def test_microbench_markdown_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = []
    for b in (1, 8):
        for ctx in (1024, 16384):
            row = {
                "batch": b,
                "ctx": ctx,
                "page_size": 16,
                "v2_pages_per_chunk": 2,
                "v2_num_chunks": 64,
                "v2_needs_merge": True,
            }
            for i, m in enumerate(("gather", "v1", "v2")):
                row[f"{m}_us"] = 10.0 * (i + 1)
                row[f"{m}_tbps"] = 1.0 + i
            row["v2_over_v1"] = 0.66
            rows.append(row)
    args = microbench.parse_args(["--out-dir", str(tmp_path), "--methods", "gather,v1,v2"])
    md = microbench.markdown_report(rows, args, None)
    assert "first_page_offset = 0" in md
    assert "| batch | ctx | c | chunks | merge |" in md
    assert md.count("\n| 8 |") == 2
    _common.write_csv(args.csv, microbench.CSV_COLUMNS, rows)
    microbench.plot(rows, ["gather", "v1", "v2"], args.png)
    assert Path(args.png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("v2/v1" in line for line in microbench.summary_lines(rows))


# -------------------------------------------------------------- page layouts


LAYOUT_CASES = [(1, 512, 32), (4, 4096, 32), (8, 1000, 16), (5, 37, 64), (3, 7, 16), (32, 4096, 16)]


@pytest.mark.parametrize("batch, ctx, page_size", LAYOUT_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_reverse_order_with_slack(batch, ctx, page_size, seed):
    lay = _common.plan_layout(batch, ctx, page_size, seed=seed)
    assert lay.batch_size == batch
    # lengths: ctx minus less than one page, never empty
    assert np.all(lay.seq_lens <= ctx) and np.all(lay.seq_lens > max(0, ctx - page_size)) and np.all(lay.seq_lens >= 1)
    # ceil(B/2) requests start mid-page, in [1, P); the others at 0
    mid = lay.first_page_offset > 0
    assert mid.sum() == (batch + 1) // 2
    assert np.all(lay.first_page_offset[mid] < page_size)
    # pages cover offset + length
    np.testing.assert_array_equal(lay.request_pages, -(-(lay.first_page_offset + lay.seq_lens) // page_size))
    assert lay.total_pages == lay.request_pages.sum()
    # 2x slack, reverse physical order, all distinct and in range
    assert lay.num_pages >= 2 * lay.total_pages
    assert lay.page_ids.dtype == np.int32
    ids = lay.page_ids.astype(np.int64)
    assert ids[0] == lay.num_pages - 1
    assert np.all(np.diff(ids) < 0)
    assert ids.min() >= 0 and ids.max() < lay.num_pages
    # logical page j is (at most once, by coincidence) physical page j: a
    # kernel ignoring indices reads the wrong pages
    assert np.sum(ids == np.arange(lay.total_pages)) <= 1


def test_layout_random_order_and_min_pool():
    lay = _common.plan_layout(8, 1024, 16, seed=3, mid_page=False, page_order="random", min_num_pages=100_000)
    assert np.all(lay.first_page_offset == 0)
    assert lay.num_pages == 100_000
    assert len(np.unique(lay.page_ids)) == lay.total_pages
    assert lay.page_ids.max() < lay.num_pages
    assert not np.all(np.diff(lay.page_ids.astype(np.int64)) < 0)  # not simply descending


def test_layout_is_deterministic_and_ragged():
    a = _common.plan_layout(8, 4096, 32, seed=5)
    b = _common.plan_layout(8, 4096, 32, seed=5)
    np.testing.assert_array_equal(a.seq_lens, b.seq_lens)
    np.testing.assert_array_equal(a.page_ids, b.page_ids)
    ends = np.concatenate(
        [
            (lambda lay: (lay.first_page_offset + lay.seq_lens) % lay.page_size)(
                _common.plan_layout(8, 4096, 32, seed=s)
            )
            for s in range(20)
        ]
    )
    assert len(np.unique(ends)) > 5  # last pages are ragged, not all full


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError):
        _common.plan_layout(0, 10, 16, seed=0)
    with pytest.raises(ValueError):
        _common.plan_layout(1, 10, 1, seed=0)
    with pytest.raises(ValueError):
        _common.plan_layout(1, 10, 16, seed=0, page_order="sorted")


@pytest.mark.parametrize("batch, ctx, page_size", LAYOUT_CASES)
def test_layout_table_matches(batch, ctx, page_size):
    lay = _common.plan_layout(batch, ctx, page_size, seed=11)
    table = _common.layout_table(lay)
    assert table.batch_size == batch and table.page_size == page_size
    np.testing.assert_array_equal(table.seq_lens, lay.seq_lens)
    np.testing.assert_array_equal(table.first_page_offset, lay.first_page_offset)
    np.testing.assert_array_equal(table.indices, lay.page_ids)
    np.testing.assert_array_equal(table.request_pages, lay.request_pages)
    assert table.max_page_id < lay.num_pages
    assert np.all((table.last_page_len >= 1) & (table.last_page_len <= page_size))


def test_bytes():
    lay = _common.plan_layout(2, 100, 16, seed=0, mid_page=False)
    kv = _common.kv_bytes(lay, 8, 128, 2)
    assert kv == 2 * int(lay.seq_lens.sum()) * 8 * 128 * 2
    total = _common.decode_bytes(lay, 32, 8, 128, 2)
    assert total == kv + 2 * 2 * 32 * 128 * 2 + 4 * (lay.total_pages + 3 + 2 + 2)


def test_parse_list_and_dtypes():
    assert _common.parse_list(["1,2", "3"], int) == (1, 2, 3)
    assert _common.parse_list(None, int) is None
    with pytest.raises(ValueError):
        _common.parse_list([","], int)
    assert _common.resolve_dtype("float16") == np.float16
    assert _common.resolve_dtype("bfloat16").name == "bfloat16"
    with pytest.raises(ValueError):
        _common.resolve_dtype("int8")


# ----------------------------------------------------------- no GPU, imports


_run = run_python


def test_importing_the_scripts_has_no_side_effects():
    code = (
        "import sys; sys.path.insert(0, 'scripts'); import _common, correctness, microbench; "
        "print(sorted(m for m in ('cupy', 'torch', 'flashinfer', 'matplotlib', 'tqdm') if m in sys.modules))"
    )
    res = _run("-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.parametrize("script", ["correctness.py", "microbench.py"])
def test_help_documents_exit_codes(script):
    res = _run(f"scripts/{script}", "--help")
    assert res.returncode == 0, res.stderr
    assert "3 = no CUDA GPU" in res.stdout


@pytest.mark.skipif("_gpu_present()", reason="this machine has a GPU")
@pytest.mark.parametrize("script, argv", [("correctness.py", []), ("microbench.py", ["--quick"])])
def test_no_gpu_exits_with_status_3(script, argv, tmp_path):
    res = _run(f"scripts/{script}", *argv, "--csv", str(tmp_path / "x.csv"))
    assert res.returncode == _common.EXIT_NO_GPU == 3, res.stdout + res.stderr
    assert _common.NO_GPU_MESSAGE in res.stderr
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.skipif("_gpu_present()", reason="this machine has a GPU")
def test_ab_sources_exit_codes():
    res = _run("scripts/ab_sources.py", "fp16")
    assert res.returncode == 3 and "no CUDA GPU" in res.stderr, res.stdout + res.stderr
    assert _run("scripts/ab_sources.py", "int4").returncode == 2


@pytest.mark.skipif("_gpu_present()", reason="this machine has a GPU")
def test_chunk_sweep_exit_codes():
    res = _run("scripts/chunk_sweep.py", "--cells", "1x4096")
    assert res.returncode == 3 and "no CUDA GPU" in res.stderr, res.stdout + res.stderr
    assert _run("scripts/chunk_sweep.py", "--cells", "4").returncode == 2
    assert _run("scripts/chunk_sweep.py", "--ctas-per-sm", "0").returncode == 2


def test_correctness_ragged_configs():
    args = correctness.parse_args(["--ragged"])
    cfgs = correctness.configs(args)
    assert cfgs == list(correctness.RAGGED_CONFIGS) and len(cfgs) == len(_common.RAGGED_FAMILY)
    assert {c.kv_dtype_name for c in cfgs} == {"float16", "bfloat16", "float8_e4m3fn"}
    for cfg, (batch, spec, seed) in zip(cfgs, _common.RAGGED_FAMILY):
        lspec, _, lseed = cfg.lengths.rpartition(":")
        lens = _common.ragged_lengths(lspec, batch, int(lseed))
        assert cfg.batch == batch and int(lseed) == seed and lens.max() <= _common.ragged_lengths(spec, batch, seed).max()
        assert "lengths=" in cfg.label()
    with pytest.raises(SystemExit):
        correctness.parse_args(["--ragged", "--full"])


def test_chunk_sweep_cells_and_knobs():
    chunk_sweep = importlib.import_module("chunk_sweep")
    assert chunk_sweep.parse_cell("4x32768") == (4, 32768, 16, 32, 8, 128)
    assert chunk_sweep.parse_cell("1X4096x16x64x8x64") == (1, 4096, 16, 64, 8, 64)
    assert chunk_sweep.parse_ragged("64:onelong:131072:512") == (64, "onelong:131072:512", 0)
    assert chunk_sweep.parse_ragged("8:uniform:1:32768:6") == (8, "uniform:1:32768", 6)
    for bad in ("0:uniform:1:5", "8:normal:1:2", "8:uniform:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            chunk_sweep.parse_ragged(bad)
    # batch 1, ctx 131072 at page 16: every even split of the longest request
    # into 1-32 chunks, the planner's whole ladder, and powers of two
    knobs = chunk_sweep.knobs(8192)
    caps = [v for k, v in knobs if k == "cap"]
    assert caps == sorted(set(caps), reverse=True) and caps[0] == 8192 and caps[-1] == 4
    assert {-(-8192 // n) for n in range(1, 33)} <= set(caps)
    from cupaged import schedule
    assert set(schedule.candidate_caps(8192, 8).tolist()) <= set(caps)
    assert [v for k, v in knobs if k == "uniform"] == [2**i for i in range(14)]


def test_chunk_sweep_cell_selection_and_check_knobs(tmp_path):
    """--lengths alone times only its ragged cells (the uniform ladder needs
    --cells); --check-against takes each sweep's fastest cap/uniform row per
    CTAs-per-SM count (a file without the column: the planner's, None)."""
    chunk_sweep = importlib.import_module("chunk_sweep")

    def names(argv):
        return [name for name, _, _ in chunk_sweep._cells(chunk_sweep.parse_args(argv))]

    assert names(["--lengths", "8:uniform:1:32768:6"]) == ["8:uniform:1:32768:6"]
    assert names(["--cells", "--no-ragged"]) == []
    assert names(["--cells", "4x4096", "--lengths", "8:uniform:1:32768:6"]) == ["4x4096", "8:uniform:1:32768:6"]
    assert len(names([])) == len(chunk_sweep.CELLS) + len(_common.RAGGED_FAMILY)
    old, new = tmp_path / "old.csv", tmp_path / "new.csv"
    old.write_text("cell,knob,value,us\nc,cap,64,10.0\nc,uniform,32,9.0\nc,default,50,5.0\nd,cap,8,1.0\n")
    new.write_text("cell,knob,value,us,ctas_per_sm\nc,cap,64,8.5,2\nc,cap,96,8.0,2\nc,cap,64,8.9,3\n")
    assert sorted(chunk_sweep.best_knobs([str(old), str(new)], "c"), key=str) == sorted(
        [("uniform", 32, None), ("cap", 96, 2), ("cap", 64, 3)], key=str)


def test_chunk_sweep_holds_the_planners_ctas_per_sm(monkeypatch):
    """--ctas-per-sm N: the planner counts at most N CTAs per SM (and the
    launches' residency table, built from the same function, holds N)."""
    chunk_sweep = importlib.import_module("chunk_sweep")
    from cupaged import _configs
    from cupaged import plan as plan_mod

    monkeypatch.setattr(_configs, "resident_ctas", _configs.resident_ctas)  # restored after the test
    f16, fp8 = np.dtype(np.float16), np.dtype(np.uint8)
    plan_mod._resident_ctas.cache_clear()
    assert plan_mod.ctas_per_sm(f16, fp8, 128, 4) == 3 and plan_mod.ctas_per_sm(f16, f16, 128, 4) == 2
    chunk_sweep.hold_ctas_per_sm(2)
    assert plan_mod.ctas_per_sm(f16, fp8, 128, 4) == 2 and plan_mod.ctas_per_sm(f16, f16, 128, 4) == 2
    assert _configs.resident_ctas(_configs.variant("float16", "float8_e4m3fn"), 128, 4, "mma") == 2
    chunk_sweep.hold_ctas_per_sm(1)
    assert plan_mod.ctas_per_sm(f16, fp8, 128, 4) == 1
    monkeypatch.undo()
    plan_mod._resident_ctas.cache_clear()
    assert plan_mod.ctas_per_sm(f16, fp8, 128, 4) == 3
    assert chunk_sweep.held_ctas_per_sm(object()) is None  # no launch state: no table
    assert chunk_sweep.parse_args(["--ctas-per-sm", "2"]).ctas_per_sm == 2


@pytest.mark.skipif("_gpu_present()", reason="this machine has a GPU")
def test_main_exits_3_in_process(capsys):
    for module, argv in ((correctness, []), (microbench, ["--quick"])):
        with pytest.raises(SystemExit) as e:
            module.main(argv)
        assert e.value.code == 3
        assert "no CUDA GPU" in capsys.readouterr().err


# ------------------------------------------------------ microbench --kv-dtype fp8


def test_fp8_args(tmp_path):
    args = microbench.parse_args(["--kv-dtype", "fp8", "--out-dir", str(tmp_path)])
    assert (args.kv_dtype, args.fp8_scale, args.dtype) == ("float8_e4m3fn", microbench.FP8_SCALE, "float16")
    assert args.methods == ("v2", "flashinfer")
    assert args.csv == str(tmp_path / "microbench-fp8.csv") and args.md == str(tmp_path / "microbench-fp8.md")
    assert len(microbench.cells(args)) == 16  # the default sweep
    args = microbench.parse_args(["--kv-dtype", "float8_e4m3fn", "--dtype", "bfloat16", "--fp8-scale", "0.25",
                                  "--methods", "v2", "--quick"])
    assert (args.kv_dtype, args.fp8_scale, args.dtype, args.methods) == ("float8_e4m3fn", 0.25, "bfloat16", ("v2",))
    assert microbench.parse_args([]).kv_dtype is None  # the other modes are untouched
    for argv in (["--kv-dtype", "fp8", "--suite", "issue5"], ["--kv-dtype", "fp8", "--dtype", "float32"],
                 ["--kv-dtype", "fp8", "--methods", "v2,gather"], ["--fp8-scale", "2"],
                 ["--kv-dtype", "fp8", "--fp8-scale", "0"], ["--kv-dtype", "fp8", "--fp8-scale", "nan"],
                 ["--kv-dtype", "int8"]):
        with pytest.raises(SystemExit) as e:
            microbench.parse_args(argv)
        assert e.value.code == 2, argv


def test_fp8_schema():
    cols = microbench.FP8_CSV_COLUMNS
    assert len(set(cols)) == len(cols)
    assert cols[:7] == MICROBENCH_V1_HEAD[:7]
    for m in microbench.FP8_METHODS:
        assert {f"{m}_{f}" for f in microbench.METHOD_FIELDS} <= set(cols)
    assert {"v2_16bit_over_fp8", "flashinfer_16bit_over_fp8", "v2_fp8_over_flashinfer_fp8"} <= set(cols)
    assert set(microbench.FP8_MD_COLUMNS) <= set(cols)
    assert not any("fp8" in c for c in microbench.CSV_COLUMNS)  # a file of its own: the main CSV is untouched


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_e4m3_lut(dtype):
    dt = _common.resolve_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    lut = microbench.e4m3_lut(dt, 1.0)
    assert lut.dtype == np.uint8 and lut.shape == (65536,)
    # the same table from the ml_dtypes rule (clip to +-448, round to nearest even)
    assert np.array_equal(lut, microbench.e4m3_lut(dt, 1.0, to_e4m3=microbench._to_e4m3_ml_dtypes))
    x = np.array([1.0, -2.0, 0.3, 448.0, 1000.0, -1e4, 0.0], dtype=dt)
    assert lut[x.view(np.uint16)].tolist() == [0x38, 0xC0, 0x2A, 0x7E, 0x7E, 0xFE, 0x00]
    # a scale divides first: 3 / 0.5 = 6 (0x4c in e4m3)
    assert microbench.e4m3_lut(dt, 0.5)[np.array([3.0], dt).view(np.uint16)][0] == 0x4C


def test_fp8_mode_on_a_fake_gpu(fake_gpu, tmp_path, capsys, monkeypatch):
    gpu = fake_gpu

    def fp8_caches(caches, dtype, scale):
        return [tuple(np.empty(a.shape, np.uint8) for a in pair) for pair in caches]

    class FlashInfer:
        reason, version, available = "", "fake", True
        torch = SimpleNamespace(cuda=SimpleNamespace(empty_cache=lambda: None, memory_reserved=lambda: 0), __version__="fake")
        seen = []

        def runners(self, batch, stream, *, caches=None, kv_dtype=None, k_scale=None, v_scale=None,
                    prefix="flashinfer"):
            self.seen.append((prefix, kv_dtype, k_scale, v_scale))
            k = (caches or batch.caches)[0][0]
            kv = _kv_of(batch.table, k)
            out = []
            for name, rate, fixed in (("cuda_cores", 3.2e6, 4.0), ("tensor_cores", 4.4e6, 5.0)):
                o = np.ones(batch.q.shape, batch.q.dtype)
                calls = [(lambda c=kv / rate + fixed: gpu.kernel(c)) for _ in batch.caches]
                out.append(microbench.Runner(f"{prefix}_{name}", calls, o, contextlib.nullcontext))
            return out

    monkeypatch.setattr(microbench, "fp8_caches", fp8_caches)
    monkeypatch.setattr(microbench, "FlashInfer", FlashInfer)
    argv = ["--kv-dtype", "fp8", "--batch", "1,8", "--ctx", "1024,4096", "--reps", "2", "--iters", "10",
            "--host-iters", "5", "--fp8-scale", "0.5", "--out-dir", str(tmp_path)]
    assert microbench.main(argv) == 0
    out = capsys.readouterr().out
    assert "SUMMARY: 4/4 cells measured, 0 failures" in out
    assert FlashInfer.seen[:2] == [("flashinfer", None, None, None), ("flashinfer_fp8", "float8_e4m3fn", 0.5, 0.5)]
    rows = bench_report.read_csv_rows(tmp_path / "microbench-fp8.csv")
    assert [(r["batch"], r["ctx"]) for r in rows] == [(1, 1024), (1, 4096), (8, 1024), (8, 4096)]
    for r in rows:
        assert r["kv_dtype"] == "float8_e4m3fn" and r["fp8_scale"] == 0.5 and r["kv_bytes_fp8"] * 2 == r["kv_bytes"]
        assert r["total_bytes"] - r["total_bytes_fp8"] == r["kv_bytes_fp8"]
        assert r["v2_us"] == pytest.approx(r["kv_bytes"] / 3.8e6 + 6.0, rel=1e-6)
        assert r["v2_fp8_us"] == pytest.approx(r["kv_bytes_fp8"] / 3.8e6 + 6.0, rel=1e-6)
        assert r["v2_16bit_over_fp8"] == pytest.approx(r["v2_us"] / r["v2_fp8_us"])
        assert r["v2_16bit_over_fp8"] > 1.0
        fi8 = min(r["kv_bytes_fp8"] / 3.2e6 + 4.0, r["kv_bytes_fp8"] / 4.4e6 + 5.0)
        assert r["flashinfer_fp8_us"] == pytest.approx(fi8) and r["flashinfer_fp8_variant"] in ("cuda_cores", "tensor_cores")
        assert r["flashinfer_16bit_over_fp8"] == pytest.approx(r["flashinfer_us"] / r["flashinfer_fp8_us"])
        assert r["v2_fp8_over_flashinfer_fp8"] == pytest.approx(fi8 / r["v2_fp8_us"])
        assert r["v2_fp8_tbps"] == pytest.approx(r["total_bytes_fp8"] / (r["v2_fp8_us"] * 1e-6) / 1e12)
        assert r["v2_fp8_max_rel_vs_v2"] == 0.0 and r["v2_fp8_host_us"] is not None
    md = (tmp_path / "microbench-fp8.md").read_text()
    assert md.startswith("# cupaged paged-decode microbenchmark: fp8") and "| v2 16/8 |" in md
    assert not (tmp_path / "microbench.csv").exists()


def test_decode18_configs_make_valid_arguments():
    """The sweep's issue-18 configurations (several query tokens, sinks,
    windows) give arguments the row table and the reference accept, with
    every q_len at ctx 512 or 4096 and windows smaller than a page."""
    from cupaged.page_table import kernel_table

    cfgs = [c for c in correctness.FEATURE_CONFIGS if c.group == "decode18"]
    assert {c.q_len for c in cfgs} == {1, 2, 4, 8, 16} and any(c.window == 0 for c in cfgs)
    assert any(c.sinks and c.q_len > 1 and c.window >= 0 for c in cfgs)
    for i, c in enumerate(cfgs):
        layout = _common.plan_layout(c.batch, c.ctx, c.page_size, seed=i, mid_page=c.page_size > 1,
                                     page_order="reverse")
        table = _common.layout_table(layout)
        kw, ptr = correctness.decode18_kwargs(c, table, seed=i)
        assert (ptr is None) == (c.q_len == 1) and ("sinks" in kw) == c.sinks
        rows = kernel_table(table, kw.get("qo_indptr"), kw.get("window_left"))
        assert rows.batch_size == (table.batch_size if ptr is None else int(ptr[-1]))
        if c.window >= 0:
            assert int(rows.seq_lens.max()) <= c.window + 1
        assert c.has_features and f"q_len{c.q_len}" in c.label() or c.q_len == 1


def test_serving_loop_example_refuses_a_draft_beyond_16_tokens():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_loop", ROOT / "examples" / "serving_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_args(["--draft", "15"]).draft == 15
    with pytest.raises(SystemExit) as e:
        mod.parse_args(["--draft", "16"])
    assert e.value.code == 2


def test_plan_hash_sees_a_changed_plan(monkeypatch):
    """scripts/plan_hash.py's hash is repeatable and moves when a plan does
    (here: the step model's fp16 constants changed), so equal hashes mean
    equal plans."""
    import plan_hash

    from cupaged import schedule

    base = plan_hash.plans_hash(tables=6)
    assert base == plan_hash.plans_hash(tables=6) and base[0] == 6 * 20
    monkeypatch.setattr(schedule, "H200_COSTS", schedule.StepCosts(4700.0, 18.0, 30.0, 9.0, 0.35))
    assert plan_hash.plans_hash(tables=6) != base


def test_host_profile_times_the_hot_path_without_a_gpu(capsys):
    """--hot-path-cpu runs decode's real hot path (a held plan's record, its
    checks, the pointer writes and the PDL launcher) over made-up device
    addresses with a no-op driver, on a machine without a GPU too."""
    host_profile = importlib.import_module("host_profile")
    assert host_profile.main(["--hot-path-cpu", "--calls", "20", "--batch", "4", "--ctx", "512"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "Python only" in ln]
    assert [ln.split(",")[0] for ln in lines] == [
        "host us per decode", "host us per HotCall.launch", "host us per launch_pointers"]
    from cupaged._plan_launch import PLAN_STATES

    assert not any(s.last is not None and s.last.function == 1 for s in PLAN_STATES.values())  # removed after


# ------------------------------------------------------------- cta_timeline


def test_cta_timeline_reads_a_call_from_its_stamps():
    cta_timeline = importlib.import_module("cta_timeline")
    assert cta_timeline.parse_cell("8x32768") == (8, 32768)
    for bad in ("8", "8x", "0x16", "8x16x2", "ax16"):
        with pytest.raises(ValueError, match="BATCHxCTX"):
            cta_timeline.parse_cell(bad)
    # 4 CTAs, 3 SMs (SM 0 holds two): released at 1 and 1.1 us, attention done at 3, 3.5, 4, 5, the last exits
    # at 6 after merging; 6 us per call
    s = np.zeros((cta_timeline.ROWS, 8), dtype=np.int64)
    s[cta_timeline.RELEASED, :4] = [1000, 1000, 1100, 1100]
    s[cta_timeline.ATTENDED, :4] = [3000, 3500, 4000, 5000]
    s[cta_timeline.EXIT, :4] = [3000, 3500, 4000, 6000]
    s[cta_timeline.SM, :4] = [0, 0, 1, 2]
    s[:, 4:] = 10**9  # past num_ctas: ignored
    r = cta_timeline.summarize(s, 4, 6.0)
    assert r["release_spread"] == pytest.approx(0.1) and r["attention_last"] == 4.0 and r["exit"] == 5.0
    assert (r["merge"], r["gap"], r["attention_median"]) == (1.0, 1.0, 2.75)
    assert (r["lone_median"], r["shared_median"]) == (3.5, 2.25)
    s[cta_timeline.SM, :4] = [0, 0, 1, 1]  # every SM holds two: no lone CTAs
    assert math.isnan(cta_timeline.summarize(s, 4, 6.0)["lone_median"])


@pytest.mark.skipif("_gpu_present()", reason="this machine has a GPU")
def test_cta_timeline_exit_codes():
    res = _run("scripts/cta_timeline.py", "1x1024")
    assert res.returncode == 3 and "no CUDA GPU" in res.stderr, res.stdout + res.stderr
    assert _run("scripts/cta_timeline.py", "1x").returncode == 2
    assert _run("scripts/cta_timeline.py", "1x1024", "--layers", "0").returncode == 2
