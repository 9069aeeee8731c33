"""scripts/make_variant.py: every named kernel variant still applies to
today's cuda_src/ (an edit that no longer matches is reported, not skipped),
changes only what it names, and (with -m compile) compiles for sm_90 without
spills. CPU only."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
make_variant = importlib.import_module("make_variant")


@pytest.mark.parametrize("name", sorted(make_variant.VARIANTS))
def test_each_variant_applies_and_changes_only_its_files(name, tmp_path):
    out = tmp_path / name
    make_variant.apply([name], out)
    changed = {p.name for p in out.iterdir() if p.read_text() != (make_variant.SRC / p.name).read_text()}
    assert changed == {f for f, _, _ in make_variant.VARIANTS[name]}
    for fname, old, new in make_variant.VARIANTS[name]:
        text = (out / fname).read_text()
        assert new in text and (old in new or old not in text)  # (an edit may keep its anchor)


def test_an_edit_that_no_longer_matches_names_the_variant(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for p in make_variant.SRC.iterdir():
        (src / p.name).write_text(p.read_text().replace("const int n = valid ? 16 : 0;", "const int n = 16;"))
    with pytest.raises(ValueError, match="variant predicated: its edit of common.cuh no longer matches"):
        make_variant.apply(["predicated"], tmp_path / "out", src=src)
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_unknown_variant_and_an_existing_folder(tmp_path):
    script = [sys.executable, str(ROOT / "scripts" / "make_variant.py")]
    res = subprocess.run([*script, "predicated+bogus", str(tmp_path / "x")], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown variant 'bogus'" in res.stderr
    res = subprocess.run([*script, "predicated", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and "exists" in res.stderr


@pytest.mark.compile
@pytest.mark.parametrize("combo", ["predicated+padded+no_l2_hint+no_evict_first+no_prefetch", "padded"])
def test_variants_compile_for_sm90_without_spills(combo, tmp_path):
    out = tmp_path / "v"
    make_variant.apply(combo.split("+"), out)
    code = ("import json; from cupaged import _loader; r = {}\n"
            "for dt in ('float16', 'float16+float8_e4m3fn'):\n"
            "    r.update({k: [v.spill_stores, v.stack_bytes] for k, v in _loader.compile_for_arch('partial', dt, 128).items()})\n"
            "print(json.dumps(r))")
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CUPAGED_CUDA_SRC": str(out)},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.splitlines()[-1])
    assert len(report) == 24 and all(v == [0, 0] for v in report.values()), report
