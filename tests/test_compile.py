"""CI compile check: every declared kernel instance compiles for sm_90 with
NVRTC (no GPU needed) and uses no local memory (no spills, no stack frame)."""

import pytest

from cupaged import _configs, _loader


@pytest.mark.parametrize("family,dtype,head_dim", _configs.all_modules())
def test_module_compiles_without_spills(family, dtype, head_dim):
    report = _loader.compile_for_arch(family, dtype, head_dim, arch="sm_90")
    assert set(report) == set(_configs.name_expressions(family, dtype, head_dim))
    for res in report.values():
        assert res.spill_stores == 0 and res.spill_loads == 0, res
        assert res.stack_bytes == 0, res
        assert res.registers <= 255, res


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
        pointers = re.findall(r"\*\s*(?:__restrict__\s*)?(\w+)\s*[,)]", sig)
        assert pointers, family
        for name in pointers:
            assert re.search(rf"\b{name}\b", header), f"{fname}: pointer {name} undocumented"


def test_unsupported_configs_list_what_is_supported():
    with pytest.raises(ValueError, match="64, 96, 128, 256"):
        _configs.check_head_dim(80)
    with pytest.raises(ValueError, match="float16"):
        _configs.dtype_name("int8")
    with pytest.raises(ValueError, match="partial"):
        _configs.name_expressions("nope", "float16", 128)


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
