"""examples/quickstart.ipynb cannot rot (issue 8, item 3); CPU only.

- the file is a valid nbformat-4 notebook (checked by hand with the json
  module: the project does not depend on nbformat; nbformat's own validator
  also runs when it happens to be installed);
- every code cell not tagged ``gpu`` runs, in order, in one namespace, with
  matplotlib's Agg backend (the same code a reader runs on a CPU);
- the ``gpu`` tags are exact: a cell is tagged ``gpu`` if and only if it uses
  CuPy or a cupaged function that needs a device, or reads a name last bound
  in a ``gpu`` cell. So the CPU run skips no host code, and GPU code never runs on CI.
  GPU cells are compiled here, not run; they run on the H200 with
  ``jupyter nbconvert --to notebook --execute --inplace examples/quickstart.ipynb``.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
from pathlib import Path

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

