#!/usr/bin/env python3
"""Execute a notebook top to bottom, headless, and write it with its outputs.

    python3 scripts/run_notebook.py examples/quickstart.ipynb OUT.ipynb [--timeout 600]

Uses ``nbclient`` (with an ``ipykernel`` kernel, spec ``python3`` by default),
as ``jupyter nbconvert --to notebook --execute`` does, without nbconvert. The
kernel runs in the notebook's folder (as in Jupyter; ``--cwd`` to change it)
with this checkout first on ``PYTHONPATH`` (``import cupaged`` needs no
install) and matplotlib's inline backend (figures become ``image/png``
outputs). On the H200 machine, which cannot install packages, first
``source .nbpeer/activate.sh`` (made here by ``scripts/nb_peer.sh``); elsewhere
``pip install -e ".[notebook]"``.

Every code cell's stored outputs and execution count are cleared before the
run, so the report counts only what ran now: code cells executed, those that
skipped their GPU work behind a ``has_gpu()`` guard (a cell says so with an
output line starting ``[skipped: no CUDA GPU]``), cells not reached, and
errors. ``--no-skips`` (for the GPU machine) counts a skipped cell as a failure.

Exit status: 0 when every code cell ran without error (and, with
``--no-skips``, none skipped its GPU work); 1 when a cell raised or timed out
(the output notebook is still written, up to and including that cell's error,
and the error is printed), a cell was not reached, or ``--no-skips`` found a
skipped cell; 3 when nbclient or ipykernel is not importable.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INLINE = "module://matplotlib_inline.backend_inline"
SKIP_MARK = "[skipped: no CUDA GPU]"  # how a has_gpu()-guarded cell says it skipped its work


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook", type=Path, help="the notebook to execute (read only)")
    ap.add_argument("output", type=Path, help="where to write the executed notebook (may be the input)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one cell may run (default 600)")
    ap.add_argument("--startup-timeout", type=int, default=120, help="seconds for the kernel to start (default 120)")
    ap.add_argument("--kernel", default="python3", help="kernel spec name (default python3)")
    ap.add_argument("--cwd", type=Path, default=None, help="the kernel's working directory (default: the notebook's)")
    ap.add_argument("--no-skips", action="store_true",
                    help=f"exit 1 when a cell skipped its GPU work (printed {SKIP_MARK!r}): for the GPU machine")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import ipykernel  # noqa: F401  (the kernel nbclient starts)
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    except ImportError as e:
        print(f"run_notebook: {e}. Install nbclient and ipykernel (pip install -e \".[notebook]\"), "
              "or on the H200 machine `source .nbpeer/activate.sh` (see scripts/nb_peer.sh).", file=sys.stderr)
        return 3

    nb = nbformat.read(args.notebook, as_version=4)
    clear_outputs(nb)  # stale outputs must never pass for this run's
    cwd = (args.cwd or args.notebook.resolve().parent).resolve()
    # The kernel inherits this environment: the checkout first on PYTHONPATH, inline figures as PNG.
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    os.environ["PYTHONPATH"] = os.pathsep.join(path)
    os.environ["MPLBACKEND"] = INLINE
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

    client = NotebookClient(nb, timeout=args.timeout, startup_timeout=args.startup_timeout,
                            kernel_name=args.kernel, resources={"metadata": {"path": str(cwd)}})
    t0 = time.perf_counter()
    status = 0
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # the traceback without its terminal colours
        print(f"run_notebook: a cell failed after {time.perf_counter() - t0:.1f} s:\n{text}", file=sys.stderr)
        status = 1
    elapsed = time.perf_counter() - t0
    nbformat.write(nb, args.output)

    report = summarize(nb)
    print(f"run_notebook: {args.notebook} -> {args.output} in {elapsed:.1f} s: {format_report(report)}")
    slow = sorted(((_seconds(c), i) for i, c in enumerate(nb.cells) if c.cell_type == "code"), reverse=True)[:3]
    print("run_notebook: slowest cells: " + ", ".join(f"{i} ({c.get('id', '?')}) {t:.1f} s"
                                                      for t, i in slow if t >= 0 for c in [nb.cells[i]]))
    if report["errors"] or report["not_run"] or (args.no_skips and report["skipped"]):
        status = 1
    return status


def clear_outputs(nb) -> None:
    """Drop every code cell's outputs and execution count (and nbclient's timing)."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
            cell.get("metadata", {}).pop("execution", None)


def _text(output) -> str:
    if output.get("output_type") == "stream":
        text = output.get("text", "")
    else:
        text = output.get("data", {}).get("text/plain", "")
    return text if isinstance(text, str) else "".join(text)


def summarize(nb) -> dict:
    """What ran, from a notebook executed after :func:`clear_outputs`: lists of
    code-cell labels (``"<index> (<id>)"``): ``ran`` (has an execution count),
    ``skipped`` (ran, and printed a line starting with SKIP_MARK), ``not_run``,
    ``errors`` (an error output); and counts of ``code`` cells, ``images``
    (PNG outputs) and ``stderr`` outputs."""
    report = {"code": 0, "ran": [], "skipped": [], "not_run": [], "errors": [], "images": 0, "stderr": 0}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        label = f"{i} ({cell.get('id', '?')})"
        outputs = cell.get("outputs", [])
        report["code"] += 1
        report["ran" if cell.get("execution_count") is not None else "not_run"].append(label)
        if any(line.startswith(SKIP_MARK) for o in outputs for line in _text(o).splitlines()):
            report["skipped"].append(label)
        if any(o.get("output_type") == "error" for o in outputs):
            report["errors"].append(label)
        report["images"] += sum(1 for o in outputs if "image/png" in o.get("data", {}))
        report["stderr"] += sum(1 for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr")
    return report


def format_report(report: dict) -> str:
    """One line: executed / skipped-by-guard / not run / errors."""
    def cells(labels):
        return ", ".join(labels) if labels else "none"

    return (f"{len(report['ran'])}/{report['code']} code cells executed; "
            f"{len(report['skipped'])} skipped their GPU work by a has_gpu() guard ({cells(report['skipped'])}); "
            f"not run: {cells(report['not_run'])}; errors: {cells(report['errors'])}; "
            f"{report['images']} PNG figure(s), {report['stderr']} stderr output(s)")


def _seconds(cell) -> float:
    """A cell's run time from nbclient's timing metadata (-1 when it did not run)."""
    from datetime import datetime

    times = cell.get("metadata", {}).get("execution", {})
    try:
        start, end = times["iopub.execute_input"], times["shell.execute_reply"]
        return (datetime.fromisoformat(end.replace("Z", "+00:00"))
                - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()
    except (KeyError, ValueError):
        return -1.0


if __name__ == "__main__":
    sys.exit(main())
