"""Environment variables (issue 16): every one is read and validated in
cupaged/_env.py, a bad value raises InvalidArgumentError naming the variable,
and the README's table lists them all. CPU only."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cupaged
import cupaged.autotune
from cupaged import _env
from cupaged.errors import InvalidArgumentError, UnsupportedConfigError

ROOT = Path(__file__).resolve().parents[1]
plan_launch = importlib.import_module("cupaged._plan_launch")

# variable -> (reader, good value, what it gives, bad values)
CASES = {
    _env.DECODE: (_env.decode_method, "gather", "gather", ("bogus", "V2")),
    _env.CORE: (_env.core, "simt", "simt", ("tensor",)),
    _env.WAIT_MERGE: (_env.wait_merge, "1", True, ("no", "2", "-1")),
    _env.TARGET_CTAS: (_env.target_ctas, "528", 528, ("lots", "0", "-5", "1.5")),
    _env.NUM_SMS: (_env.num_sms, " 132 ", 132, ("zero", "0")),
    _env.MMA_SMEM_KB: (_env.mma_smem_kb, "40", 40, ("0", "228", "72k")),
    _env.MMA_WARPS: (_env.mma_warps, "2", 2, ("abc", "0", "-1", "33")),
    _env.MMA_MIN_BLOCKS: (_env.mma_min_blocks, "1", 1, ("x", "0")),
}
DEFAULTS = {_env.DECODE: "auto", _env.CORE: None, _env.WAIT_MERGE: False, _env.TARGET_CTAS: None, _env.NUM_SMS: None,
            _env.MMA_SMEM_KB: 72, _env.MMA_WARPS: 4, _env.MMA_MIN_BLOCKS: 2}


@pytest.mark.parametrize("name", list(CASES))
def test_each_variable_is_validated(monkeypatch, name):
    reader, good, value, bads = CASES[name]
    monkeypatch.delenv(name, raising=False)
    assert reader() == DEFAULTS[name]
    monkeypatch.setenv(name, "")  # empty counts as unset
    assert reader() == DEFAULTS[name]
    monkeypatch.setenv(name, good)
    assert reader() == value
    for bad in bads:
        monkeypatch.setenv(name, bad)
        with pytest.raises(InvalidArgumentError, match=re.escape(f"environment variable {name}")) as info:
            reader()
        assert repr(bad.strip()) in str(info.value)
        if name in (_env.DECODE, _env.CORE):
            assert isinstance(info.value, UnsupportedConfigError)


def test_path_variables(monkeypatch, tmp_path):
    monkeypatch.delenv(_env.CACHE_DIR, raising=False)
    assert _env.cache_dir() == Path.home() / ".cache" / "cupaged"
    monkeypatch.setenv(_env.CACHE_DIR, str(tmp_path))
    assert _env.cache_dir() == tmp_path
    assert cupaged.autotune.cache_path() == tmp_path / "autotune.json"
    default = tmp_path / "default"
    monkeypatch.delenv(_env.CUDA_SRC, raising=False)
    assert _env.cuda_src(default) == default
    monkeypatch.setenv(_env.CUDA_SRC, str(tmp_path))
    assert _env.cuda_src(default) == tmp_path
    monkeypatch.setenv(_env.CUDA_SRC, str(tmp_path / "missing"))
    with pytest.raises(InvalidArgumentError, match="CUPAGED_CUDA_SRC=.* must be a directory"):
        _env.cuda_src(default)


def _import_with(name: str, value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{name: value}, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", "import cupaged"], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


@pytest.mark.parametrize("name, value", [(_env.MMA_WARPS, "abc"), (_env.MMA_WARPS, "0"), (_env.MMA_WARPS, "-2"),
                                         (_env.MMA_SMEM_KB, "1e3"), (_env.MMA_MIN_BLOCKS, "0"),
                                         (_env.CUDA_SRC, "/nonexistent/cuda_src")])
def test_import_fails_naming_the_variable(name, value):
    """Variables read at import (they configure the compiled kernels): a bad
    value stops `import cupaged` with an InvalidArgumentError naming it, not a
    bare ValueError from int(), and 0 or negative counts no longer pass."""
    r = _import_with(name, value)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("cupaged.errors.InvalidArgumentError: environment variable " + name), r.stderr


def test_only_env_module_reads_the_environment():
    """One place reads environment variables: cupaged/_env.py."""
    offenders = []
    for path in sorted((ROOT / "cupaged").glob("*.py")):
        if path.name == "_env.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(", line.split("#")[0]):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_readme_table_lists_every_variable():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(CUPAGED_\w+)` \|", section, re.MULTILINE)
    assert listed == list(_env.VARIABLES), listed
    in_code = set()
    for path in (ROOT / "cupaged").glob("*.py"):
        in_code |= set(re.findall(r"\"(CUPAGED_[A-Z_]+)\"", path.read_text(encoding="utf-8")))
    assert in_code <= set(_env.VARIABLES), in_code - set(_env.VARIABLES)


def test_decode_methods_agree():
    assert cupaged.selection.METHODS == cupaged.METHODS == _env.METHODS
    assert set(_env.CORES) == set(cupaged._configs.CORES)


def test_hot_path_lookup_follows_os_environ(monkeypatch):
    """decode's hot path compares CUPAGED_DECODE's raw value with one dict
    lookup; it must see every os.environ change."""
    monkeypatch.delenv(_env.DECODE, raising=False)
    assert _env.decode_method_raw() is None
    monkeypatch.setenv(_env.DECODE, "v1")
    assert _env.decode_method_raw() in ("v1", b"v1")
    assert plan_launch._env_method_raw is _env.decode_method_raw


@pytest.mark.parametrize("name", list(_env.VARIABLES))
def test_reads_follow_os_environ(monkeypatch, name):
    """Every variable is read through the mapping behind os.environ (one
    dict lookup): each read must give what os.environ.get gives, after a
    set, a change and a delete."""
    for value in ("", " 12 ", "simt", "caf\u00e9", None):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert _env._get(name) == os.environ.get(name), (name, value)
