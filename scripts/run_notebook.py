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

Exit status: 0 when every cell ran; 1 when a cell raised or timed out (the
output notebook is still written, up to and including that cell's error, and
the error is printed); 3 when nbclient or ipykernel is not importable.
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


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook", type=Path, help="the notebook to execute (read only)")
    ap.add_argument("output", type=Path, help="where to write the executed notebook (may be the input)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one cell may run (default 600)")
    ap.add_argument("--startup-timeout", type=int, default=120, help="seconds for the kernel to start (default 120)")
    ap.add_argument("--kernel", default="python3", help="kernel spec name (default python3)")
    ap.add_argument("--cwd", type=Path, default=None, help="the kernel's working directory (default: the notebook's)")
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

    code = [c for c in nb.cells if c.cell_type == "code"]
    ran = [c for c in code if c.get("execution_count") is not None]
    images = sum(1 for c in code for o in c.outputs if "image/png" in o.get("data", {}))
    errors = [i for i, c in enumerate(nb.cells) if any(o.output_type == "error" for o in c.get("outputs", []))]
    stderr = sum(1 for c in code for o in c.outputs if o.output_type == "stream" and o.name == "stderr")
    print(f"run_notebook: {args.notebook} -> {args.output}: {len(ran)}/{len(code)} code cells ran "
          f"in {elapsed:.1f} s, {images} PNG figure(s), {stderr} stderr output(s), "
          f"error cell(s): {errors or 'none'}")
    slow = sorted(((_seconds(c), i) for i, c in enumerate(nb.cells) if c.cell_type == "code"), reverse=True)[:3]
    print("run_notebook: slowest cells: " + ", ".join(f"{i} ({c.get('id', '?')}) {t:.1f} s"
                                                      for t, i in slow if t >= 0 for c in [nb.cells[i]]))
    if errors:
        status = 1
    return status


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
