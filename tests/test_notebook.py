"""examples/quickstart.ipynb cannot rot (issue 8 item 3, issue 16 item 5); CPU only.

- the file is a valid nbformat-4 notebook (checked by hand with the json
  module: the project does not depend on nbformat; nbformat's own validator
  also runs when it happens to be installed), with no error output stored;
- "Run All" works without a GPU: every use of CuPy or of a device-only
  cupaged function sits under an ``if GPU:`` guard (``GPU =
  cupaged.has_gpu()``), and every code cell runs, in order, in one
  namespace, with ``has_gpu()`` false (the reference stands in for
  ``decode``; the timing cells print ``[skipped: no CUDA GPU]``);
- the stored outputs come from this checkout's planner: the ``plan-rule``
  cell's stored output equals what it prints when run now (it plans on the
  host with ``num_sms=132``), and the check catches another plan rule;
- the commit stamp cell prints the commit;
- the GPU branches' host logic (token writes, plan reuse, the sweep's
  bookkeeping, the plot) also runs here, on a NumPy stand-in for CuPy with
  ``cupaged.decode`` answered by the reference and a smaller timing sweep;
- ``scripts/run_notebook.py`` clears stale outputs and reports what ran,
  what skipped its GPU work and what failed (its summary is tested without
  nbclient; executing notebooks only where nbclient and ipykernel are
  installed: ``pip install -e ".[notebook]"``; CI does not install them),
  and the ``.nbpeer`` installer that ``scripts/nb_peer.sh`` writes parses.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.util
import io
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
GUARD = "GPU"  # the notebook's `GPU = cupaged.has_gpu()`
SKIP_MARK = "[skipped: no CUDA GPU]"
PLAN_RULE_CELL = "plan-rule"
STAMP_CELL = "stamp"
ENV_VARS = ("CUPAGED_TARGET_CTAS", "CUPAGED_NUM_SMS", "CUPAGED_DECODE", "CUPAGED_CORE")

# What needs a CUDA device. Names: modules and functions that only run on a
# GPU. Attributes: reached through any object (``cupaged.decode``,
# ``testing.graph_time_us``, ``table.device()``); ``decode``,
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


def code_cells(nb: dict) -> list[tuple[int, dict]]:
    """``(index in the notebook, cell)`` of every code cell, in order."""
    return [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def cell_by_id(nb: dict, cell_id: str) -> dict:
    found = [c for c in nb["cells"] if c.get("id") == cell_id]
    assert len(found) == 1, f"the notebook needs exactly one cell with id {cell_id!r}"
    return found[0]


def stored_stdout(cell: dict) -> str:
    return "".join(source({"source": o.get("text", "")}) for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def parse(i: int, cell: dict) -> ast.Module:
    return ast.parse(source(cell), filename=f"quickstart.ipynb[cell {i}]")


def gpu_use(node: ast.AST) -> str | None:
    """What ``node`` is that needs a CUDA device, or None."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.split(".")[0] in GPU_MODULES]
        return f"import {names[0]}" if names else None
    if isinstance(node, ast.ImportFrom):
        mod = node.module or ""
        if mod.split(".")[0] in GPU_MODULES:
            return f"from {mod} import"
        if mod.split(".")[0] == "cupaged":
            hits = [a.name for a in node.names
                    if a.name in GPU_NAMES | GPU_ATTRS | (GPU_CUPAGED_FUNCS if mod == "cupaged" else set())]
            return f"from {mod} import {hits[0]}" if hits else None
    if isinstance(node, ast.Name) and node.id in GPU_NAMES:
        return node.id
    if isinstance(node, ast.Attribute):
        if node.attr in GPU_ATTRS:
            return f".{node.attr}"
        if node.attr in GPU_CUPAGED_FUNCS and isinstance(node.value, ast.Name) and node.value.id == "cupaged":
            return f"cupaged.{node.attr}"
    return None


def _guard_polarity(test: ast.expr) -> bool | None:
    """True for ``if GPU:``, False for ``if not GPU:``, None for any other test."""
    if isinstance(test, ast.Name) and test.id == GUARD:
        return True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Name) \
            and test.operand.id == GUARD:
        return False
    return None


def unguarded_gpu_uses(tree: ast.AST, guarded: bool = False) -> list[str]:
    """GPU uses in ``tree`` that no ``if GPU:`` (or the ``else`` of ``if not
    GPU:``) encloses."""
    if isinstance(tree, ast.If):
        polarity = _guard_polarity(tree.test)
        if polarity is not None:
            body, other = (tree.body, tree.orelse) if polarity else (tree.orelse, tree.body)
            return ([u for n in body for u in unguarded_gpu_uses(n, True)]
                    + [u for n in other for u in unguarded_gpu_uses(n, guarded)])
    found = [] if guarded or (use := gpu_use(tree)) is None else [f"line {getattr(tree, 'lineno', '?')}: {use}"]
    return found + [u for child in ast.iter_child_nodes(tree) for u in unguarded_gpu_uses(child, guarded)]


def run_cells(nb: dict, *, sources=None) -> tuple[dict, dict]:
    """Execute every code cell in order in one namespace; returns (namespace,
    {cell id: its stdout}). ``sources`` optionally maps a cell id to the code
    to run instead."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    printed = {}
    for i, cell in code_cells(nb):
        src = (sources or {}).get(cell.get("id"), source(cell))
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(src, f"quickstart.ipynb[cell {i}]", "exec"), namespace)
        except Exception as e:  # name the cell: the traceback's file is the cell
            pytest.fail(f"notebook cell {i} ({cell.get('id')}) raised {type(e).__name__}: {e}")
        printed[cell.get("id")] = buf.getvalue()
    return namespace, printed


@contextlib.contextmanager
def notebook_context():
    """The notebook's environment: its folder, Agg figures, no cupaged env
    vars; yields the MonkeyPatch (undone on exit)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPLBACKEND", "Agg")
        for var in ENV_VARS:
            mp.delenv(var, raising=False)
        try:
            import matplotlib
        except ImportError:
            matplotlib = None
        else:
            matplotlib.use("Agg")
        mp.chdir(NOTEBOOK.parent)  # where run_notebook.py runs the kernel
        yield mp
        if matplotlib is not None:
            import matplotlib.pyplot as plt

            plt.close("all")


@pytest.fixture
def notebook_env():
    with notebook_context() as mp:
        yield mp


@pytest.fixture(scope="module")
def cpu_run():
    """(namespace, {cell id: stdout}) of every code cell run with
    ``cupaged.has_gpu()`` false, as on a CPU (one run per module)."""
    import cupaged

    with notebook_context() as mp:
        mp.setattr(cupaged, "has_gpu", lambda: False)
        yield run_cells(load())


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
            # Outputs come from one whole run (scripts/run_notebook.py); never an error committed.
            assert all(o.get("output_type") != "error" for o in cell["outputs"]), f"{where} has an error output"
        else:
            assert "outputs" not in cell and "execution_count" not in cell, where
        if nb["nbformat_minor"] >= 5:
            assert isinstance(cell.get("id"), str) and CELL_ID.match(cell["id"]), f"{where}: bad id"
            ids.append(cell["id"])
    assert len(ids) == len(set(ids)), "cell ids must be unique"
    # one run, top to bottom: every code cell ran, in order
    counts = [c["execution_count"] for _, c in code_cells(nb)]
    assert counts == list(range(1, len(counts) + 1)), f"stored outputs are not one Run All: {counts}"
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4))


def test_gpu_uses_are_guarded():
    """Every use of CuPy or of a device-only cupaged function sits under
    ``if GPU:`` (``GPU = cupaged.has_gpu()``, set in the first code cell), so
    "Run All" never stops for want of a GPU."""
    nb = load()
    cells = code_cells(nb)
    assert f"{GUARD} = cupaged.has_gpu()" in source(cells[0][1])
    unguarded = {f"{i} ({c.get('id')})": u for i, c in cells if (u := unguarded_gpu_uses(parse(i, c)))}
    assert not unguarded, f"GPU code outside an `if {GUARD}:` guard: {unguarded}"
    guarded = [c.get("id") for i, c in cells if any(gpu_use(n) for n in ast.walk(parse(i, c)))]
    assert {"stamp", "decode", "time"} <= set(guarded), guarded  # the checker sees the GPU code


def test_guard_checker_catches_unguarded_code():
    bad = ast.parse("import cupy as cp\nif GPU:\n    out = cupaged.decode(q)\nelse:\n    x = cp.zeros(3)\n")
    assert unguarded_gpu_uses(bad) == ["line 1: import cupy", "line 5: cp"]
    good = ast.parse("if not GPU:\n    print('skip')\nelse:\n    import cupy\n    cupy.zeros(3)\n")
    assert unguarded_gpu_uses(good) == []


def test_every_cell_runs_without_a_gpu(cpu_run):
    """Run All on a CPU: every code cell runs; the decode story runs on the
    reference; the timing and plot cells say they skipped."""
    namespace, printed = cpu_run
    assert set(printed) == {c.get("id") for _, c in code_cells(load())}
    assert {"pool", "table", "plan", "out_ref", "out_split", "out", "ref", "step_tables", "results"} <= set(namespace)
    assert namespace["results"] == {} and namespace["worst"] < 1e-2
    assert len(namespace["step_tables"]) == 2 + 64
    for cell_id in ("decode", "time", "plot"):
        assert printed[cell_id].startswith(SKIP_MARK), (cell_id, printed[cell_id])
    assert not any(SKIP_MARK in text for cid, text in printed.items() if cid not in ("decode", "time", "plot"))


def test_stored_outputs_come_from_this_planner(cpu_run):
    """The plan-rule cell plans on the host for an H200 (``num_sms=132``) and
    prints the first plan's pages_per_chunk, num_chunks and grid and the
    rebuilds over the decode steps; its stored output must equal what the
    checkout's planner prints now. When this fails, the planner changed:
    rerun the notebook (``python scripts/run_notebook.py
    examples/quickstart.ipynb examples/quickstart.ipynb``; on the H200
    ``scripts/gpu_run.sh OUT notebook``) and commit its outputs."""
    _, printed = cpu_run
    stored = stored_stdout(cell_by_id(load(), PLAN_RULE_CELL))
    assert "num_sms=132" in printed[PLAN_RULE_CELL] and "plan rebuild(s)" in printed[PLAN_RULE_CELL]
    assert stored == printed[PLAN_RULE_CELL], (
        "examples/quickstart.ipynb's stored outputs come from another plan rule than this checkout's "
        f"cupaged.plan_decode: stored\n{stored}\nnow\n{printed[PLAN_RULE_CELL]}\nrerun the notebook "
        "(scripts/run_notebook.py) and commit it")
    # the story's own plan (the device's SM count; 132 on a CPU and on the H200) agrees
    plan_out = stored_stdout(cell_by_id(load(), "plan"))
    pages_per_chunk = re.search(r"pages_per_chunk (\d+), num_chunks (\d+)", printed[PLAN_RULE_CELL]).groups()
    assert f"pages_per_chunk {pages_per_chunk[0]}\n" in plan_out and f"num_chunks      {pages_per_chunk[1]} " in plan_out


def test_plan_rule_check_catches_another_planner(cpu_run, monkeypatch):
    """The plan-rule comparison is sensitive: under another chunk-size rule
    (here: a fixed 4 pages per chunk) the cell prints something else."""
    import cupaged

    namespace, printed = cpu_run
    real = cupaged.plan_decode
    monkeypatch.setattr(cupaged, "plan_decode", lambda *a, **k: real(*a, **{**k, "pages_per_chunk": 4}))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(source(cell_by_id(load(), PLAN_RULE_CELL)), dict(namespace))
    assert buf.getvalue() != printed[PLAN_RULE_CELL]
    assert "pages_per_chunk 4," in buf.getvalue()


def test_commit_stamp(cpu_run):
    """A cell stamps the commit (``git rev-parse --short HEAD``, else
    "unknown") and the device into the output."""
    _, printed = cpu_run
    assert re.fullmatch(r"commit ([0-9a-f]{4,40}|unknown); device: no CUDA GPU\n", printed[STAMP_CELL])
    assert re.fullmatch(r"commit ([0-9a-f]{4,40}|unknown); device: .+\n",
                        stored_stdout(cell_by_id(load(), STAMP_CELL)))


# ------------------------------------------------ gpu branches on a NumPy stand-in
class _HostArray(np.ndarray):
    """A NumPy array that answers ``.get()`` like a CuPy one."""

    def get(self):
        return np.array(self)


def _fake_cupy(seed: int = 1) -> types.ModuleType:
    """Just the CuPy surface the notebook's GPU branches touch, on the host."""
    rng = np.random.default_rng(seed)
    cp = types.ModuleType("cupy")
    cp.float16, cp.float32 = np.float16, np.float32
    cp.random = types.SimpleNamespace(
        standard_normal=lambda shape, dtype=np.float64: rng.standard_normal(shape, dtype=dtype).view(_HostArray))
    cp.asnumpy = np.asarray
    cp.empty_like = lambda a: np.empty_like(a).view(_HostArray)
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None, total_bytes=lambda: 0)
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


def test_gpu_branches_run_on_a_numpy_stand_in(notebook_env):
    """Every cell, in order, with ``has_gpu()`` true, CuPy replaced by host
    arrays, ``decode`` by the float64 reference (plan checks kept) and
    ``graph_time_us`` by one call: catches host-side mistakes in the GPU
    branches before the H200 run."""
    import cupaged
    import cupaged.testing
    from cupaged import reference

    pytest.importorskip("matplotlib")
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

    notebook_env.setitem(sys.modules, "cupy", _fake_cupy())
    notebook_env.setattr(cupaged, "has_gpu", lambda: True)
    notebook_env.setattr(cupaged, "decode", fake_decode)
    notebook_env.setattr(reference, "decode", reference_decode)
    notebook_env.setattr(cupaged, "select_method", lambda *a, **k: "Selection(stand-in)")
    notebook_env.setattr(cupaged.testing, "graph_time_us", fake_graph_time_us)
    sources = {}
    for i, cell in code_cells(load()):
        src = source(cell)
        if "graph_time_us" in src:
            for old, new in SMALL_SWEEP.items():
                assert old in src, f"cell {i}: {old!r} not found; update SMALL_SWEEP"
                src = src.replace(old, new)
            sources[cell.get("id")] = src
    namespace, printed = run_cells(load(), sources=sources)
    memo.clear()
    assert not any(SKIP_MARK in text for text in printed.values()), printed
    assert "device: NumPy stand-in" in printed[STAMP_CELL]
    results = namespace["results"]
    assert sorted(results) == [1, 3] and all(len(rows) == 2 for rows in results.values())
    assert len(decoded) >= 1 + 1 + 64 + 4  # first decode, next step, 64 steps, the sweep


# ----------------------------------------------------- scripts/run_notebook.py
RUN_NOTEBOOK = ROOT / "scripts" / "run_notebook.py"


def _run_script(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, str(RUN_NOTEBOOK), *map(str, args)], check=False, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def _tiny_notebook(path: Path, cells: list[str], stale: bool = False) -> Path:
    """A notebook of code cells; with ``stale``, each carries an old execution
    count and output (what a committed notebook has before a rerun)."""
    old = [{"name": "stdout", "output_type": "stream", "text": "stale\n"}] if stale else []
    nb = {"cells": [{"cell_type": "code", "execution_count": i + 1 if stale else None, "id": f"c{i}", "metadata": {},
                     "outputs": list(old), "source": src} for i, src in enumerate(cells)],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def _run_notebook_module():
    spec = importlib.util.spec_from_file_location("run_notebook", RUN_NOTEBOOK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_run_notebook_help():
    r = _run_script("--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout and "--timeout" in r.stdout and "--no-skips" in r.stdout


def test_run_notebook_report_counts_what_ran():
    """Issue 16: the report says what ran now: executed, skipped by a guard,
    not run, errors (it said "12/12 cells ran" over stale outputs). No nbclient needed."""
    rn = _run_notebook_module()
    assert rn.SKIP_MARK == SKIP_MARK

    def cell(i, count, *outputs):
        return {"cell_type": "code", "id": f"c{i}", "execution_count": count, "metadata": {"execution": {}},
                "outputs": list(outputs), "source": ""}

    text = lambda t: {"output_type": "stream", "name": "stdout", "text": t}  # noqa: E731
    nb = {"cells": [
        {"cell_type": "markdown", "id": "m", "metadata": {}, "source": "# x"},
        cell(1, 1, text("fine\n")),
        cell(2, 2, text("header\n" + SKIP_MARK + " no device\n")),
        cell(3, 3, {"output_type": "error", "ename": "ZeroDivisionError", "evalue": "", "traceback": []}),
        cell(4, 4, text("stale output of an older run\n")),
    ]}
    rn.clear_outputs(nb)
    assert all(c.get("outputs", []) == [] and c.get("execution_count") is None
               for c in nb["cells"] if c["cell_type"] == "code")
    assert "execution" not in nb["cells"][1]["metadata"]
    nb["cells"][1].update(execution_count=1, outputs=[text("fine\n")])  # this run: cells 1-3, then the error
    nb["cells"][2].update(execution_count=2, outputs=[text("header\n" + SKIP_MARK + " no device\n")])
    nb["cells"][3].update(execution_count=3, outputs=[
        {"output_type": "error", "ename": "ZeroDivisionError", "evalue": "", "traceback": []}])
    report = rn.summarize(nb)
    assert report["code"] == 4 and report["ran"] == ["1 (c1)", "2 (c2)", "3 (c3)"]
    assert report["skipped"] == ["2 (c2)"] and report["errors"] == ["3 (c3)"] and report["not_run"] == ["4 (c4)"]
    line = rn.format_report(report)
    assert line.startswith("3/4 code cells executed; 1 skipped their GPU work by a has_gpu() guard (2 (c2))")
    assert "not run: 4 (c4); errors: 3 (c3)" in line


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

    bad = _tiny_notebook(tmp_path / "bad.ipynb", ["x = 1", "1 / 0", "print('never')"], stale=True)
    r = _run_script(bad, tmp_path / "bad.out.ipynb", "--timeout", 120)
    assert r.returncode == 1 and "ZeroDivisionError" in r.stderr, r.stdout + r.stderr
    assert "2/3 code cells executed" in r.stdout and "not run: 2 (c2); errors: 1 (c1)" in r.stdout, r.stdout
    out = json.loads((tmp_path / "bad.out.ipynb").read_text(encoding="utf-8"))
    assert out["cells"][1]["outputs"][-1]["output_type"] == "error"
    assert out["cells"][2]["execution_count"] is None and out["cells"][2]["outputs"] == []  # the stale one is gone

    guarded = _tiny_notebook(tmp_path / "g.ipynb", ["GPU = False", f"print({SKIP_MARK!r}, 'timing')"])
    r = _run_script(guarded, tmp_path / "g.out.ipynb", "--timeout", 120)
    assert r.returncode == 0 and "2/2 code cells executed; 1 skipped their GPU work" in r.stdout, r.stdout
    r = _run_script(guarded, tmp_path / "g.out.ipynb", "--timeout", 120, "--no-skips")
    assert r.returncode == 1, r.stdout


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("nbclient", "nbformat", "ipykernel")),
                    reason="nbclient/ipykernel not installed (pip install -e '.[notebook]')")
def test_quickstart_runs_all_without_a_gpu(tmp_path):
    """Issue 16: "Run All" of examples/quickstart.ipynb on a machine without a
    GPU (CUDA_VISIBLE_DEVICES hides any): every code cell runs, no error,
    and the report names the cells that skipped their GPU work."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for var in ENV_VARS:
        env.pop(var, None)
    r = _run_script(NOTEBOOK, tmp_path / "q.ipynb", "--timeout", 300, env=env, timeout=600)
    n = len(code_cells(load()))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{n}/{n} code cells executed; 3 skipped their GPU work" in r.stdout, r.stdout
    assert "not run: none; errors: none" in r.stdout
    out = json.loads((tmp_path / "q.ipynb").read_text(encoding="utf-8"))
    assert stored_stdout(cell_by_id(out, PLAN_RULE_CELL)) == stored_stdout(cell_by_id(load(), PLAN_RULE_CELL))


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
