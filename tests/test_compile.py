"""CI compile check: every declared kernel instance compiles for sm_90 with
NVRTC (no GPU needed) and uses no local memory (no spills, no stack frame).

The check of every instance is marked ``compile``: it takes minutes of CPU,
so the default test run (``python -m pytest -q``) deselects it (``addopts``
in pyproject.toml) and ``.ci/run`` runs it as its own job,
``python -m pytest -q -m compile``. The selected modules compile in parallel
threads (NVRTC releases the GIL), and each module's ptxas report is cached in
pytest's cache under a key of the cuda_src hash (headers included), the NVRTC
version, the options (with the -D defines of CUPAGED_MMA_*), the arch and the
instance names: a rerun with unchanged sources re-checks the cached reports
without compiling (``--cache-clear`` or ``-p no:cacheprovider`` compiles).
The other tests here are cheap and always run.
"""

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest

from cupaged import _configs, _loader

ARCH = "sm_90"
MODULES = _configs.all_modules()


def _cache_key(module) -> str:
    from cupy.cuda import nvrtc

    text = json.dumps([_loader.source_hash(), list(nvrtc.getVersion()), list(_loader.module_options(*module)), ARCH,
                       list(module), _configs.name_expressions(*module)])
    return "cupaged/compile-check/" + hashlib.sha256(text.encode()).hexdigest()[:24]


@pytest.fixture(scope="session")
def compile_reports(request):
    """module -> {instance name: KernelResources} for every module the session
    selected, compiled in parallel threads, or read from pytest's cache."""
    selected = [tuple(item.callspec.params[k] for k in ("family", "dtype", "head_dim"))
                for item in request.session.items
                if item.originalname == "test_module_compiles_without_spills" and hasattr(item, "callspec")]
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    reports, todo = {}, []
    for module in selected:
        hit = cache.get(_cache_key(module), None) if cache is not None else None
        if hit is not None:
            reports[module] = {name: _loader.KernelResources(**res) for name, res in hit.items()}
        else:
            todo.append(module)
    # The first compile alone: NVRTC loads libnvrtc-builtins on first use, and
    # threads racing to load it failed once ("failed to open libnvrtc-builtins").
    with ThreadPoolExecutor(max_workers=1) as first:
        futures = {m: first.submit(_loader.compile_for_arch, *m, arch=ARCH) for m in todo[:1]}
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        futures.update({m: pool.submit(_loader.compile_for_arch, *m, arch=ARCH) for m in todo[1:]})
    for module, future in futures.items():
        if future.exception() is None:
            reports[module] = future.result()
            if cache is not None:
                cache.set(_cache_key(module), {n: asdict(r) for n, r in reports[module].items()})
        else:
            reports[module] = future.exception()  # raised by the module's own test
    return reports


@pytest.mark.compile
@pytest.mark.parametrize("family,dtype,head_dim", MODULES)
def test_module_compiles_without_spills(family, dtype, head_dim, compile_reports):
    report = compile_reports[(family, dtype, head_dim)]
    if isinstance(report, Exception):
        raise report
    assert set(report) == set(_configs.name_expressions(family, dtype, head_dim))
    for res in report.values():
        assert res.spill_stores == 0 and res.spill_loads == 0, res
        assert res.stack_bytes == 0, res
        assert res.registers <= 255, res
    if family in _configs.PARTIAL_FAMILIES:
        # A tensor-core instance must fit the CTAs per SM its plans count: fp8
        # counts 3 (MMA_FP8_RESIDENT_CTAS) without a __launch_bounds__ to hold
        # it there (registers are allocated 8 a thread).
        ctas = _configs.mma_traits(dtype, head_dim, family).resident_ctas
        limit = 65536 // (ctas * _configs.cta_shape(family)[0] * 32) // 8 * 8
        for name, res in report.items():
            if "Core::MMA" in name:
                assert res.registers <= limit, (name, res, f"{ctas} CTAs per SM allow {limit} registers")


def test_source_hash_covers_headers(tmp_path, monkeypatch):
    # CuPy's cache keys on the source text: a header edit must change it.
    for p in _loader.SRC_DIR.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(_loader, "SRC_DIR", tmp_path)
    _loader.source_hash.cache_clear()
    before = _loader.module_source("merge")
    (tmp_path / "common.cuh").write_text((tmp_path / "common.cuh").read_text() + "\n// edit\n")
    _loader.source_hash.cache_clear()
    after = _loader.module_source("merge")
    _loader.source_hash.cache_clear()
    assert before != after


def test_contract_comment_names_every_pointer():
    # Each kernel's header comment documents every pointer parameter by name.
    import re

    for family, fname in _configs.SOURCES.items():
        text = (_loader.SRC_DIR / fname).read_text()
        header, _, body = text.partition("#include")
        sig = body[body.index("__global__"):body.index("{", body.index("__global__"))]
        struct = re.search(r"__grid_constant__\s+(\w+)", sig)
        if struct:  # one parameter struct: its pointer fields
            fields = body[body.index(f"struct {struct.group(1)} {{"):]
            sig = fields[:fields.index("};")].replace(";", ",")
        pointers = re.findall(r"\*\s*(?:__restrict__\s*)?(\w+)\s*[,)]", sig)
        assert pointers, family
        for name in pointers:
            assert re.search(rf"\b{name}\b", header), f"{fname}: pointer {name} undocumented"


def test_unsupported_configs_list_what_is_supported():
    with pytest.raises(ValueError, match="64, 80, 96, 128, 192, 256"):
        _configs.check_head_dim(40)
    with pytest.raises(ValueError, match="float16"):
        _configs.dtype_name("int8")
    with pytest.raises(ValueError, match="partial"):
        _configs.name_expressions("nope", "float16", 128)


def test_a_head_dims_shared_memory_trait_reaches_its_module_and_its_launch(monkeypatch):
    """The MMA shared memory of a (KV format, head_dim) is compiled into its
    module (CUPAGED_MMA_SMEM_KB) and passed at launch (dynamic_smem), the same
    number: the default for today's instances, and what two ring stages need
    where that is more (16-bit 192)."""
    assert _loader.module_options("partial", "float16", 128) == _loader.OPTIONS
    assert _configs.dynamic_smem("mma", "float16", 128) == _configs.MMA_SMEM_KB * 1024
    assert _configs.dynamic_smem("simt", "float16", 128) == 0
    assert _configs.mma_traits("float16", 192).smem_kb == 97 > _configs.MMA_SMEM_KB
    options = _loader.module_options("partial", "float16", 192)
    assert "-DCUPAGED_MMA_SMEM_KB=97" in options and _configs.dynamic_smem("mma", "float16", 192) == 97 * 1024
    # (no tensor-core instance; no programmatic dependent launch either)
    no_pdl = (*_loader.OPTIONS[:2], *_configs.nvrtc_defines(pdl=False))
    assert _loader.module_options("v1", "float16", 192) == no_pdl
    assert not any("CUPAGED_PDL" in o for o in _loader.module_options("partial", "float32", 128))


def test_core_choice_follows_the_table():
    assert _configs.choose_core("float16", 128) == "mma"
    assert _configs.choose_core("bfloat16", 64) == "mma"
    assert _configs.choose_core("float16", 256) == "simt"  # accumulators would spill
    assert _configs.choose_core("float32", 128) == "simt"
    assert _configs.choose_core("float16", 128, "simt") == "simt"
    with pytest.raises(ValueError, match="does not serve"):
        _configs.choose_core("float32", 128, "mma")
    with pytest.raises(ValueError, match="known"):
        _configs.choose_core("float16", 128, "tensor")
    assert _configs.choose_core("float16+float8_e4m3fn", 96) == "mma"
    with pytest.raises(ValueError, match="no kernel serves"):
        _configs.choose_core("float16+float8_e4m3fn", 256)
    # every (dtype, head_dim, heads, core) the dispatcher can ask for is compiled
    for dtype in [*_configs.DTYPES, *(d for _, _, ds, _ in _configs.CORES.values() for d in ds)]:
        for head_dim in _configs.HEAD_DIMS:
            for core in _configs.CORES:
                if _configs.serves(core, dtype, head_dim):
                    for h in _configs.HEADS_PER_CTA:
                        index, threads = _configs.partial_instance(dtype, head_dim, h, core)
                        assert threads in (64, 128) and index >= 0


def test_roofline_kernels_compile_for_sm90_without_spills():
    """scripts/roofline.py's int4 and bulk-copy (cp.async.bulk + mbarrier)
    read kernels (and --small's empty kernel) compile for sm_90 with NVRTC
    and use no local memory."""
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import roofline

    log = roofline.compile_report()
    for name in ("read_int4", "read_bulk", "empty_kernel"):
        assert f"Compiling entry function '{name}' for 'sm_90'" in log
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) == 3 and all(f == ("0", "0", "0") for f in frames), log


def test_eight_warp_rows_family_compiles_its_shape_and_launches_it():
    """Family rows8 (row-group plans held to one CTA per SM) exists for 16-bit
    head_dim 128 only, with tensor-core instances only; its module is
    compiled for 8 warps and 1 CTA per SM with a 2-stage ring of 8 warps, and
    the launch passes the same shared memory and 256 threads."""
    wide = sorted((d, h) for f, d, h in MODULES if f == "rows8")
    assert wide == [("bfloat16", 128), ("float16", 128)]
    for dtype in ("float16", "bfloat16"):
        names = _configs.name_expressions("rows8", dtype, 128)
        assert len(names) == len(_configs.HEADS_PER_CTA) and all("Core::MMA" in n for n in names)
        smem_kb = _configs.mma_traits(dtype, 128, "rows8").smem_kb
        assert smem_kb * 1024 >= 2 * 8 * 2 * 16 * 256 + _configs.PAGE_WINDOW_BYTES  # two stages of 8 warps
        opts = _loader.module_options("rows8", dtype, 128)
        assert {f"-DCUPAGED_MMA_SMEM_KB={smem_kb}", "-DCUPAGED_MMA_WARPS=8", "-DCUPAGED_MMA_MIN_BLOCKS=1"} <= set(opts)
        assert _configs.dynamic_smem("mma", dtype, 128, "rows8") == smem_kb * 1024
        assert _configs.partial_instance(dtype, 128, 4, "mma", "rows8") == (names.index(
            f"cupaged::paged_decode_rows<{_configs._storage(dtype)}, 128, 4, cupaged::Core::MMA>"), 256)
        assert _configs.resident_ctas(dtype, 128, 4, "mma", "rows8") == 1
    assert _configs.name_expressions("rows8", "float16", 64) == []
    assert _configs.name_expressions("rows8", "float16+float8_e4m3fn", 128) == []
    assert _loader.module_options("rows", "float16", 128) == _loader.OPTIONS  # the 4-warp family as before
    assert _configs.partial_instance("float16", 128, 4, "mma", "rows")[1] == 32 * _configs.MMA_WARPS
