"""The cell loop that ``scripts/microbench.py``'s plain sweep and
``--kv-dtype fp8`` share (``_sweep``), on the CPU: fake cupy, fake run
functions. The happy paths run end to end in tests/test_scripts.py; here a
cell that raises, per-cell failures and notes, the exit status, and a run cut
short by KeyboardInterrupt (reports still written from the rows so far)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

_common = importlib.import_module("_common")
microbench = importlib.import_module("microbench")
bench_report = importlib.import_module("bench_report")

CELLS = [{"batch": 1, "ctx": 1024, "page_size": 16}, {"batch": 8, "ctx": 4096, "page_size": 16},
         {"batch": 32, "ctx": 16384, "page_size": 16}]


def _row(cell: dict, fp8: bool) -> dict:
    row = {"batch": cell["batch"], "ctx": cell["ctx"], "page_size": cell["page_size"], "replicas": 2,
           "v2_pages_per_chunk": 4, "v2_num_chunks": 2, "v2_needs_merge": False, "v2_us": 10.0}
    if fp8:
        row |= {"v2_fp8_us": 5.0, "v2_16bit_over_fp8": 2.0}
    else:
        row |= {"kv_bytes": 1 << 20, "total_bytes": 1 << 20, "v2_timing": "events (capture failed: X)"}
    return row


@pytest.fixture
def loop(monkeypatch, tmp_path):
    """``main(argv)`` over :data:`CELLS` with a run function per mode:
    cell 0 reports a failure and a note, cell 1 (every cell with
    ``loop.fail_all``) raises ``loop.error``, cell 2 is clean."""
    cupy = ModuleType("cupy")
    cupy.cuda = SimpleNamespace(Stream=lambda non_blocking: "stream")
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_common, "require_gpu", lambda: None)
    monkeypatch.setattr(microbench, "cells", lambda args: [dict(c) for c in CELLS])
    monkeypatch.setattr(microbench, "device_name", lambda: "Fake")
    monkeypatch.setattr(microbench, "plot", lambda rows, methods, path, title="": Path(path).write_text("plot"))
    state = SimpleNamespace(error=RuntimeError("out of memory"), fail_all=False, tmp=tmp_path)

    def fake_run(fp8: bool):
        def run(cell, args, stream, flashinfer):
            assert stream == "stream" and flashinfer is None
            if state.fail_all or cell["batch"] == 8:
                raise state.error
            first = cell["batch"] == 1
            return _row(cell, fp8), ["slow"] if first else [], ["odd"] if first else []

        return run

    monkeypatch.setattr(microbench, "run_cell", fake_run(False))
    monkeypatch.setattr(microbench, "run_fp8_cell", fake_run(True))
    return state


@pytest.mark.parametrize("fp8", [False, True])
def test_a_failing_cell_does_not_stop_the_sweep(loop, capsys, fp8):
    extra = ["--kv-dtype", "fp8"] if fp8 else []
    stem = "microbench-fp8" if fp8 else "microbench"
    assert microbench.main([*extra, "--methods", "v2", "--out-dir", str(loop.tmp)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "batch 8 ctx 4096 P 16: FAILED RuntimeError: out of memory" in lines
    i = next(i for i, line in enumerate(lines) if line.startswith("batch") and "v2 10us" in line)
    assert lines[i + 1 : i + 3] == ["  ! slow", "  note: odd"]
    assert f"wrote {loop.tmp / stem}.csv, {loop.tmp / stem}.md" + ("" if fp8 else f", {loop.tmp / stem}.png") in lines
    assert lines.index("failure: batch 1 ctx 1024 P 16: slow") < lines.index(
        "SUMMARY: 2/3 cells measured, 2 failures"
    )
    assert ("timing note: v2: events (capture failed: X)" in lines) != fp8
    rows = bench_report.read_csv_rows(loop.tmp / f"{stem}.csv")
    assert [r["batch"] for r in rows] == [1, 32] and all(r["wall_s"] >= 0 for r in rows)
    assert ("target_no_slower" in rows[0]) != fp8  # bench_report.evaluate_row: the plain sweep only


@pytest.mark.parametrize("fp8", [False, True])
def test_an_interrupted_sweep_keeps_its_rows(loop, capsys, fp8):
    loop.error = KeyboardInterrupt()
    extra = ["--kv-dtype", "fp8"] if fp8 else []
    stem = "microbench-fp8" if fp8 else "microbench"
    with pytest.raises(KeyboardInterrupt):
        microbench.main([*extra, "--methods", "v2", "--out-dir", str(loop.tmp)])
    out = capsys.readouterr().out
    assert "wrote " in out and "SUMMARY" not in out
    assert [r["batch"] for r in bench_report.read_csv_rows(loop.tmp / f"{stem}.csv")] == [1]
    assert (loop.tmp / f"{stem}.md").read_text().startswith("# cupaged paged-decode microbenchmark")


def test_no_rows_no_reports(loop, capsys):
    loop.fail_all = True
    assert microbench.main(["--methods", "v2", "--out-dir", str(loop.tmp)]) == 1
    assert "SUMMARY: 0/3 cells measured, 3 failures" in capsys.readouterr().out
    assert not list(loop.tmp.iterdir())
