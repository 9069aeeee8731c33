"""examples/quickstart.ipynb cannot rot (issue 8, item 3); CPU only.

- the file is a valid nbformat-4 notebook (checked by hand with the json
  module: the project does not depend on nbformat; nbformat's own validator
  also runs when it happens to be installed);
- every code cell not tagged ``gpu`` runs, in order, in one namespace, with
  matplotlib's Agg backend (the same code a reader runs on a CPU);
- the ``gpu`` tags are exact: a cell is tagged ``gpu`` if and only if it uses
  CuPy or a cupaged function that needs a device, or reads a name last bound
  in a ``gpu`` cell. So the CPU run skips no host code, and GPU code never runs on CI.
  GPU cells are compiled here, and run on the H200 with
  ``scripts/gpu_run.sh OUT notebook`` (``scripts/run_notebook.py``, nbclient);
- the ``gpu`` cells' host logic (token writes, plan reuse, the sweep's
  bookkeeping, the plot) also runs here, on a NumPy stand-in for CuPy with
  ``cupaged.decode`` answered by the reference and a smaller timing sweep;
- ``scripts/run_notebook.py`` (and the ``.nbpeer`` installer that
  ``scripts/nb_peer.sh`` writes) are checked as far as a CPU allows: executing
  a small notebook only where nbclient and ipykernel are installed
  (``pip install -e ".[notebook]"``; CI does not install them).
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
GPU_TAG = "gpu"

# What needs a CUDA device. Names: modules and functions that only run on a
# GPU. Attributes: reached through any object (``cupaged.decode``,
# ``autotune.graph_time_us``, ``table.device()``); ``decode``,
# ``merge_states`` and ``select_method`` only through ``cupaged`` itself, as
# ``reference.decode`` / ``reference.merge_states`` are host NumPy.
GPU_MODULES = {"cupy"}
GPU_NAMES = {"cp", "cupy", "graph_time_us", "tune", "tuned_plan"}
GPU_ATTRS = {"graph_time_us", "tune", "tuned_plan", "device"}
GPU_CUPAGED_FUNCS = {"decode", "merge_states", "select_method"}
CELL_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


# ----------------------------------------------------------------------- helpers
def load() -> dict:
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def is_gpu(cell: dict) -> bool:
    return GPU_TAG in cell.get("metadata", {}).get("tags", [])


def code_cells(nb: dict) -> list[tuple[int, dict]]:
    """``(index in the notebook, cell)`` of every code cell, in order."""
    return [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def parse(i: int, cell: dict) -> ast.Module:
    return ast.parse(source(cell), filename=f"quickstart.ipynb[cell {i}]")


def gpu_uses(tree: ast.AST) -> set[str]:
    """What in ``tree`` needs a CUDA device (empty when nothing does)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {f"import {a.name}" for a in node.names if a.name.split(".")[0] in GPU_MODULES}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in GPU_MODULES:
                found.add(f"from {mod} import")
            elif mod.split(".")[0] == "cupaged":
                found |= {
                    f"from {mod} import {a.name}"
                    for a in node.names
                    if a.name in GPU_NAMES | GPU_ATTRS | (GPU_CUPAGED_FUNCS if mod == "cupaged" else set())
                }
        elif isinstance(node, ast.Name) and node.id in GPU_NAMES:
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            if node.attr in GPU_ATTRS:
                found.add(f".{node.attr}")
            elif node.attr in GPU_CUPAGED_FUNCS and isinstance(node.value, ast.Name) and node.value.id == "cupaged":
                found.add(f"cupaged.{node.attr}")
    return found


def bound_names(tree: ast.Module) -> set[str]:
    """Names a cell binds at its top level (assignments, loops, defs, imports)."""
    names = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
            continue
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
            continue
        names |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def loaded_names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


# ------------------------------------------------------------------------- tests
def test_notebook_is_valid_nbformat4():
    nb = load()
    assert {"cells", "metadata", "nbformat", "nbformat_minor"} <= set(nb), sorted(nb)
    assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int)
    assert isinstance(nb["metadata"], dict)
    assert nb["metadata"].get("kernelspec", {}).get("language") == "python"
    assert isinstance(nb["cells"], list) and nb["cells"]
    ids = []
    for i, cell in enumerate(nb["cells"]):
        where = f"cell {i}"
        assert cell["cell_type"] in {"markdown", "code", "raw"}, where
        assert isinstance(cell["metadata"], dict), where
        tags = cell["metadata"].get("tags", [])
        assert isinstance(tags, list) and all(isinstance(t, str) for t in tags), where
        src = cell["source"]
        assert isinstance(src, str) or (isinstance(src, list) and all(isinstance(s, str) for s in src)), where
        if cell["cell_type"] == "code":
            assert "execution_count" in cell and "outputs" in cell, where
            assert cell["execution_count"] is None or isinstance(cell["execution_count"], int), where
            assert isinstance(cell["outputs"], list), where
            # Outputs come only from a run on the H200; never an error committed.
            assert all(o.get("output_type") != "error" for o in cell["outputs"]), f"{where} has an error output"
        else:
            assert "outputs" not in cell and "execution_count" not in cell, where
        if nb["nbformat_minor"] >= 5:
            assert isinstance(cell.get("id"), str) and CELL_ID.match(cell["id"]), f"{where}: bad id"
            ids.append(cell["id"])
    assert len(ids) == len(set(ids)), "cell ids must be unique"
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4))


def test_gpu_tags_are_exact():
    """``gpu`` tag <=> the cell needs a device: it uses CuPy or a device-only
    cupaged function, or reads a name (that it does not bind itself) whose
    latest binding, in notebook order, is in a ``gpu`` cell."""
    nb = load()
    cells = [(i, c, parse(i, c)) for i, c in code_cells(nb)]
    bound_on_gpu: dict[str, bool] = {}  # name -> its latest binding is in a gpu cell
    untagged, needless = [], []
    for i, cell, tree in cells:
        binds = bound_names(tree)
        needs = sorted(gpu_uses(tree)) + sorted(
            f"{n} (bound in a gpu cell)" for n in loaded_names(tree) - binds if bound_on_gpu.get(n)
        )
        if is_gpu(cell) and not needs:
            needless.append(i)
        elif not is_gpu(cell) and needs:
            untagged.append((i, needs))
        bound_on_gpu.update(dict.fromkeys(binds, is_gpu(cell)))
    assert not untagged, f"cells that need a GPU but are not tagged {GPU_TAG!r}: {untagged}"
    assert not needless, f"cells tagged {GPU_TAG!r} that need no GPU (CI would skip them): {needless}"
    assert any(is_gpu(c) for _, c, _ in cells) and any(not is_gpu(c) for _, c, _ in cells)


def test_cpu_cells_run(monkeypatch):
    """Every untagged code cell runs, in order, in one namespace; the ``gpu``
    cells at least compile (and are pure Python: no magics or shell escapes)."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    for var in ("CUPAGED_TARGET_CTAS", "CUPAGED_NUM_SMS", "CUPAGED_DECODE", "CUPAGED_CORE"):
        monkeypatch.delenv(var, raising=False)
    try:
        import matplotlib
    except ImportError:
        matplotlib = None
    else:
        matplotlib.use("Agg")
    monkeypatch.chdir(NOTEBOOK.parent)  # where nbconvert runs the kernel
    nb = load()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    ran = 0
    for i, cell in code_cells(nb):
        code = compile(source(cell), f"quickstart.ipynb[cell {i}]", "exec")
        if is_gpu(cell):
            continue
        try:
            exec(code, namespace)
        except Exception as e:  # name the cell: the traceback's file is the cell
            pytest.fail(f"notebook cell {i} ({cell.get('id')}) raised {type(e).__name__}: {e}")
        ran += 1
    if matplotlib is not None:
        import matplotlib.pyplot as plt

        plt.close("all")
    assert ran >= 5, f"only {ran} CPU cells ran"
    # the CPU cells got as far as the host check of the split
    assert {"pool", "table", "plan", "out_ref", "out_split"} <= set(namespace)


# ------------------------------------------------ gpu cells on a NumPy stand-in
class _HostArray(np.ndarray):
    """A NumPy array that answers ``.get()`` like a CuPy one."""

    def get(self):
        return np.array(self)


def _fake_cupy(seed: int = 1) -> types.ModuleType:
    """Just the CuPy surface the notebook's gpu cells touch, on the host."""
    rng = np.random.default_rng(seed)
    cp = types.ModuleType("cupy")
    cp.float16, cp.float32 = np.float16, np.float32
    cp.random = types.SimpleNamespace(
        standard_normal=lambda shape, dtype=np.float64: rng.standard_normal(shape, dtype=dtype).view(_HostArray))
    cp.asnumpy = np.asarray
    cp.empty_like = lambda a: np.empty_like(a).view(_HostArray)
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    cp.cuda = types.SimpleNamespace(
        Device=lambda *a: types.SimpleNamespace(id=0),
        runtime=types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"NumPy stand-in"}))
    return cp


# The timing cell's sweep, shrunk for the CPU (each must be in the cell verbatim).
SMALL_SWEEP = {
    "BATCHES = (1, 8, 32)": "BATCHES = (1, 3)",
    "CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)": "CONTEXTS = (1024, 2048)",
    "ROTATE_BYTES = 256 << 20": "ROTATE_BYTES = 8 << 20",
}


def test_gpu_cells_run_on_a_numpy_stand_in(monkeypatch):
    """Every cell, in order, with CuPy replaced by host arrays, ``decode`` by
    the float64 reference (plan checks kept) and ``graph_time_us`` by one
    call: catches host-side mistakes in the ``gpu`` cells before the H200 run."""
    import cupaged
    import cupaged.autotune
    from cupaged import reference

    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    for var in ("CUPAGED_TARGET_CTAS", "CUPAGED_NUM_SMS", "CUPAGED_DECODE", "CUPAGED_CORE"):
        monkeypatch.delenv(var, raising=False)
    decoded = []
    real_reference_decode = reference.decode
    memo = {}  # the reference of a stand-in decode, for the cell's own reference call right after it

    def reference_decode(q, k_cache, v_cache, table, *args, **kwargs):
        hit = memo.pop((id(table), np.asarray(q).tobytes()), None)
        return hit if hit is not None and not (args or kwargs) else real_reference_decode(
            q, k_cache, v_cache, table, *args, **kwargs)

    def fake_decode(q, k_cache, v_cache, table, plan=None, *, out=None, return_lse=False, **kw):
        assert all(isinstance(x, _HostArray) for x in (q, k_cache, v_cache)), "not a (stand-in) device array"
        if plan is not None and not plan.matches(table):
            raise cupaged.PlanMismatchError("stale plan")
        o, lse = real_reference_decode(q, k_cache, v_cache, table)
        memo[(id(table), np.asarray(q).tobytes())] = (o, lse)
        o = o.astype(q.dtype).view(_HostArray)
        if out is not None:
            out[...] = o
            o = out
        decoded.append(table.batch_size)
        return (o, lse.astype(np.float32).view(_HostArray)) if return_lse else o

    def fake_graph_time_us(fn, launches=20, reps=5):
        assert launches >= 20
        fn()
        return 100.0

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(cupaged, "decode", fake_decode)
    monkeypatch.setattr(reference, "decode", reference_decode)
    monkeypatch.setattr(cupaged, "select_method", lambda *a, **k: "Selection(stand-in)")
    monkeypatch.setattr(cupaged.autotune, "graph_time_us", fake_graph_time_us)
    monkeypatch.chdir(NOTEBOOK.parent)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for i, cell in code_cells(load()):
        src = source(cell)
        if "graph_time_us" in src:
            for old, new in SMALL_SWEEP.items():
                assert old in src, f"cell {i}: {old!r} not found; update SMALL_SWEEP"
                src = src.replace(old, new)
        try:
            exec(compile(src, f"quickstart.ipynb[cell {i}]", "exec"), namespace)
        except Exception as e:
            pytest.fail(f"notebook cell {i} ({cell.get('id')}) raised {type(e).__name__}: {e}")
    import matplotlib.pyplot as plt

    plt.close("all")
    memo.clear()
    results = namespace["results"]
    assert sorted(results) == [1, 3] and all(len(rows) == 2 for rows in results.values())
    assert len(decoded) >= 1 + 1 + 64 + 4  # first decode, next step, 64 steps, the sweep


# ----------------------------------------------------- scripts/run_notebook.py
RUN_NOTEBOOK = ROOT / "scripts" / "run_notebook.py"


def _run_script(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, str(RUN_NOTEBOOK), *map(str, args)], check=False, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def _tiny_notebook(path: Path, cells: list[str]) -> Path:
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                     "source": src} for i, src in enumerate(cells)],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def test_run_notebook_help():
    r = _run_script("--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout and "--timeout" in r.stdout


def test_run_notebook_says_what_is_missing(tmp_path):
    """Without nbclient: exit 3 and the two ways to get it."""
    (tmp_path / "nbclient").mkdir()
    (tmp_path / "nbclient" / "__init__.py").write_text("raise ImportError('No module named nbclient (test)')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = _run_script(_tiny_notebook(tmp_path / "t.ipynb", ["1"]), tmp_path / "o.ipynb", env=env)
    assert r.returncode == 3, r.stderr
    assert ".nbpeer/activate.sh" in r.stderr and '".[notebook]"' in r.stderr
    assert not (tmp_path / "o.ipynb").exists()


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("nbclient", "nbformat", "ipykernel")),
                    reason="nbclient/ipykernel not installed (pip install -e '.[notebook]')")
def test_run_notebook_executes(tmp_path):
    """A small notebook runs in its own folder, with this checkout importable
    and figures as PNG; a failing cell gives exit 1 and its error, written."""
    cells = ["import os, cupaged\nprint(os.path.basename(os.getcwd()), cupaged.__version__)"]
    if importlib.util.find_spec("matplotlib"):
        cells.append("import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.show()")
    (tmp_path / "nbdir").mkdir()
    src = _tiny_notebook(tmp_path / "nbdir" / "t.ipynb", cells)
    r = _run_script(src, tmp_path / "out.ipynb", "--timeout", 120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads((tmp_path / "out.ipynb").read_text(encoding="utf-8"))
    assert [c["execution_count"] for c in out["cells"]] == list(range(1, len(cells) + 1))
    import cupaged

    assert "".join(out["cells"][0]["outputs"][0]["text"]) == f"nbdir {cupaged.__version__}\n"
    if len(cells) == 2:
        assert any("image/png" in o.get("data", {}) for o in out["cells"][1]["outputs"])

    bad = _tiny_notebook(tmp_path / "bad.ipynb", ["x = 1", "1 / 0", "print('never')"])
    r = _run_script(bad, tmp_path / "bad.out.ipynb", "--timeout", 120)
    assert r.returncode == 1 and "ZeroDivisionError" in r.stderr, r.stdout + r.stderr
    out = json.loads((tmp_path / "bad.out.ipynb").read_text(encoding="utf-8"))
    assert out["cells"][1]["outputs"][-1]["output_type"] == "error"
    assert out["cells"][2]["execution_count"] is None


# ---------------------------------------------------------- scripts/nb_peer.sh
def test_nb_peer_script_parses():
    """nb_peer.sh is valid bash and the Python it writes (.nbpeer/install.py,
    the wheel slimmer) compiles; running it needs the package index."""
    script = ROOT / "scripts" / "nb_peer.sh"
    r = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    blocks = re.findall(r"<<'PY'\n(.*?)\nPY\n", script.read_text(encoding="utf-8"), re.DOTALL)
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        compile(block, f"nb_peer.sh[python block {i}]", "exec")
