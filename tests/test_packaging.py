"""The package as a user installs it (issue 16), on the CPU.

- the wheel's configuration ships every file of ``cuda_src/`` as the package
  data folder ``cupaged/cuda_src/``, and the sdist carries ``cuda_src/``;
- ``cupaged._loader`` finds the sources in an installed layout (a copy of the
  package with ``cuda_src/`` inside it, the repository out of reach), in this
  checkout, and under env ``CUPAGED_CUDA_SRC``; without them it says what is
  missing and where it looked;
- the version lives in one place, readable without importing cupaged;
- license, changelog, ``py.typed`` and the project metadata are there.

``.ci/run`` builds the real wheel and installs it in a fresh environment.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cupaged
from cupaged import _configs, _loader

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_wheel_ships_every_cuda_source():
    tool = PYPROJECT["tool"]["setuptools"]
    assert "cupaged.cuda_src" in tool["packages"]
    assert tool["package-dir"]["cupaged.cuda_src"] == "cuda_src"
    globs = tool["package-data"]["cupaged.cuda_src"]
    sources = sorted(p.name for p in (ROOT / "cuda_src").iterdir() if p.is_file())
    assert set(_configs.SOURCES.values()) <= set(sources)
    unshipped = [n for n in sources if not any(fnmatch.fnmatch(n, g) for g in globs)]
    assert not unshipped, f"cuda_src files the wheel would leave out: {unshipped}"
    manifest = (ROOT / "MANIFEST.in").read_text(encoding="utf-8").split("\n")
    assert "graft cuda_src" in manifest


def _installed_copy(site: Path, with_sources: bool) -> Path:
    """A copy of the package laid out as a wheel installs it."""
    pkg = site / "cupaged"
    shutil.copytree(ROOT / "cupaged", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    if with_sources:
        shutil.copytree(ROOT / "cuda_src", pkg / "cuda_src")
    return pkg


def _run(code: str, cwd: Path, pythonpath: Path | None, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUPAGED_CUDA_SRC")}
    if pythonpath is not None:
        environ["PYTHONPATH"] = str(pythonpath)
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=120)


LOAD = "import cupaged._loader as L; print(L.SRC_DIR); print(L.module_source('merge').splitlines()[0])"


def test_loader_finds_the_sources_of_an_installed_wheel(tmp_path):
    site = tmp_path / "site"
    pkg = _installed_copy(site, with_sources=True)
    res = _run(LOAD, cwd=tmp_path, pythonpath=site)
    assert res.returncode == 0, res.stderr
    src_dir, first = res.stdout.splitlines()
    assert Path(src_dir) == pkg / "cuda_src"
    assert first.startswith("// cupaged cuda_src hash ")


def test_loader_says_what_is_missing(tmp_path):
    site = tmp_path / "site"
    _installed_copy(site, with_sources=False)
    res = _run(LOAD, cwd=tmp_path, pythonpath=site)
    assert res.returncode != 0
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith("FileNotFoundError: cupaged's CUDA source merge_states.cu is missing"), err
    assert "CUPAGED_CUDA_SRC" in err and str(site / "cupaged" / "cuda_src") in err
    # the package itself still imports: planning and the reference need no sources
    ok = _run("import cupaged; print(cupaged.__version__)", cwd=tmp_path, pythonpath=site)
    assert ok.returncode == 0 and ok.stdout.strip() == cupaged.__version__


def test_loader_in_the_checkout_and_under_the_env_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("CUPAGED_CUDA_SRC", raising=False)
    assert _loader.find_src_dir() == ROOT / "cuda_src"
    other = tmp_path / "other_src"
    shutil.copytree(ROOT / "cuda_src", other)
    res = _run(LOAD, cwd=tmp_path, pythonpath=ROOT, CUPAGED_CUDA_SRC=str(other))
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.splitlines()[0]) == other


def test_version_lives_in_one_place():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "cupaged._version.__version__"
    # setuptools reads it statically: the module is one literal assignment, no imports
    tree = ast.parse((ROOT / "cupaged" / "_version.py").read_text(encoding="utf-8"))
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assigned = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(n.value, ast.Constant)}
    assert assigned == {"__version__": cupaged.__version__}
    init = (ROOT / "cupaged" / "__init__.py").read_text(encoding="utf-8")
    assert f'"{cupaged.__version__}"' not in init and "from ._version import __version__" in init


def test_license_changelog_and_metadata():
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert project["authors"] == [{"name": "cupaged developers"}]
    assert project["requires-python"] == ">=3.10"
    assert all(u.startswith("https://github.com/cupaged/cupaged") for u in project["urls"].values())
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "cupaged" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["cupaged"]
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{cupaged.__version__}]" in changelog


def test_cupy_is_an_extra_per_cuda_major():
    project = PYPROJECT["project"]
    assert not any(d.startswith("cupy") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert extras["cuda13"] == ["cupy-cuda13x>=14"] and extras["cuda12"] == ["cupy-cuda12x>=14"]


ARRAY_ARGUMENTS = {
    "merge_states": ("v", "lse", "o_indptr"),
    "append_kv": ("k_new", "v_new", "k_cache", "v_cache", "append_indptr", "k_scale", "v_scale"),
    "cascade_decode": ("q", "k_cache", "v_cache", "group_indptr", "k_scale", "v_scale", "out"),
    "plan_cascade": ("group_indptr",),
    "apply_page_copies": ("caches",),
    "PageTable": ("indices", "indptr", "last_page_len", "first_page_offset"),
    "PageTable.from_seq_lens": ("seq_lens", "first_page_offset", "page_ids"),
    "fp8.to_e4m3": ("x", "scale"),
    "fp8.from_e4m3": ("bits", "scale"),
}


@pytest.mark.parametrize("name", list(ARRAY_ARGUMENTS))
def test_array_arguments_are_annotated_with_the_aliases(name):
    import inspect
    import typing

    from cupaged import _typing

    obj = cupaged
    for part in name.split("."):
        obj = getattr(obj, part)
    params = inspect.signature(obj).parameters
    aliases = ("DeviceArray", "HostArray", "IndexArray", "Scale")
    for arg in ARRAY_ARGUMENTS[name]:
        assert any(a in str(params[arg].annotation) for a in aliases), (name, arg, params[arg].annotation)
    typing.get_type_hints(obj.__init__ if inspect.isclass(obj) else obj)  # every annotation resolves
    assert _typing.DeviceArray == typing.Union[_typing.CudaArrayInterface, _typing.DLPackArray]


def test_type_aliases_live_in_one_module():
    defined = [p.name for p in (ROOT / "cupaged").glob("*.py")
               if "DeviceArray =" in p.read_text(encoding="utf-8")]
    assert defined == ["_typing.py"]
