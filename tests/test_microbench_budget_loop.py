"""The budgeted cell loop that ``scripts/microbench.py --suite issue5`` and
``--lengths`` share (``_budgeted_run``), on the CPU: fake cupy, fake signal
module, fake run functions. A cell that raises, a cell over the time budget,
the JIT estimate per warm key, and a run ended by SIGTERM (the handler
installed, the alarm set and cleared, the old handlers put back)."""

from __future__ import annotations

import importlib
import signal
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

_common = importlib.import_module("_common")
microbench = importlib.import_module("microbench")
bench_report = importlib.import_module("bench_report")

#: per mode: the arguments (4 cells), the output stem, the SUMMARY prefix, the run function's name
MODES = {
    "suite": (["--suite", "issue5", "--groups", "main-fp16-p16", "--batch", "1", "--ctx", "1024,4096,16384,32768"],
              "microbench-issue5", "SUMMARY:", "run_cell"),
    "ragged": (["--lengths", "4:uniform:1:300:1", "8:onelong:2000:20", "--dtypes", "float16,fp8"],
               "ragged", "SUMMARY ragged:", "run_ragged_cell"),
}


def _row(cell: dict) -> dict:
    axes = {k: v for k, v in cell.items() if k not in ("methods", "host", "choice")}  # not CSV columns
    return {**axes, "num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "replicas": 2, "kv_bytes": 1 << 20,
            "total_bytes": 1 << 20, "v2_pages_per_chunk": 4, "v2_num_chunks": 2, "v2_num_ctas": 64,
            "v2_needs_merge": False, "v2_us": 10.0}


@pytest.fixture(params=sorted(MODES))
def loop(request, monkeypatch, tmp_path):
    """``loop.main(*extra)`` runs a mode over its 4 cells; ``loop.actions``
    maps a run call's index to ``"raise"`` or ``"sigterm"``; ``loop.log``
    records signal calls, estimates and frees."""
    argv, stem, summary, run_name = MODES[request.param]
    state = SimpleNamespace(mode=request.param, stem=stem, summary=summary, tmp=tmp_path, actions={}, log=[],
                            handlers={signal.SIGTERM: "old-term", signal.SIGALRM: "old-alarm"}, estimate=1.0)
    cupy = ModuleType("cupy")
    cupy.cuda = SimpleNamespace(Stream=lambda non_blocking: "stream")
    cupy.__version__ = "fake"
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain counter lines

    def set_handler(signum, handler):
        old, state.handlers[signum] = state.handlers[signum], handler
        state.log.append(("signal", signal.Signals(signum).name, getattr(handler, "__name__", handler)))
        return old

    monkeypatch.setattr(microbench, "signal", SimpleNamespace(
        SIGTERM=signal.SIGTERM, SIGALRM=signal.SIGALRM, Signals=signal.Signals, signal=set_handler,
        alarm=lambda n: state.log.append(("alarm", n))))
    monkeypatch.setattr(_common, "require_gpu", lambda: None)
    monkeypatch.setattr(_common, "free_gpu_memory", lambda torch=None: state.log.append(("free",)))
    monkeypatch.setattr(microbench, "FlashInfer", lambda: SimpleNamespace(available=False, reason="none", version="?"))
    monkeypatch.setattr(microbench, "device_name", lambda: "Fake")
    for name in ("plot_suite", "plot_ragged"):
        monkeypatch.setattr(microbench, name, lambda rows, path, title="": Path(path).write_text(title))

    def estimate(cell, args, jit_pending):
        state.log.append(("estimate", jit_pending))
        return state.estimate

    monkeypatch.setattr(microbench, "estimate_cell_s", estimate)
    monkeypatch.setattr(microbench, "estimate_ragged_cell_s", estimate)
    calls = []

    def run(cell, args, stream, flashinfer):
        assert stream == "stream"
        i = len(calls)
        calls.append(i)
        if state.actions.get(i) == "raise":
            raise RuntimeError("out of memory")
        if state.actions.get(i) == "sigterm":
            state.handlers[signal.SIGTERM](signal.SIGTERM, None)
        return _row(cell), [], []

    monkeypatch.setattr(microbench, run_name, run)
    state.main = lambda *extra: microbench.main([*argv, *extra, "--out-dir", str(tmp_path), "--commit", "abc"])
    return state


def _rows(loop) -> list[dict]:
    return bench_report.read_csv_rows(loop.tmp / f"{loop.stem}.csv")


def test_a_failing_cell_does_not_stop_the_run(loop, capsys):
    loop.actions = {1: "raise"}
    assert loop.main("--budget-s", "0") == 1
    lines = capsys.readouterr().out.splitlines()
    failed = [line for line in lines if line.endswith(": FAILED RuntimeError: out of memory")]
    assert len(failed) == 1 and ("free",) in loop.log
    assert any(line.startswith("failure: ") and line.endswith(": RuntimeError: out of memory") for line in lines)
    assert f"{loop.summary} 3/4 cells measured, 0 not run, 1 failures, 0 s" in lines
    assert len(_rows(loop)) == 3 and (loop.tmp / f"{loop.stem}.md").exists()
    assert not any(entry[0] == "alarm" and entry[1] for entry in loop.log)  # no budget: no alarm


def test_the_jit_is_estimated_once_per_warm_key(loop, capsys):
    assert loop.main("--budget-s", "0") == 0
    pending = [entry[1] for entry in loop.log if entry[0] == "estimate"]
    # suite: one (dtype, head_dim); ragged: the dtype choice (float16 x 2 cells, then fp8 x 2)
    assert pending == ([True, False, False, False] if loop.mode == "suite" else [True, False, True, False])
    assert "[4/4]" in capsys.readouterr().err


def test_cells_over_the_budget_are_skipped(loop, capsys):
    loop.estimate = 1000.0
    assert loop.main("--budget-s", "100") == 0
    out = capsys.readouterr().out
    assert f"{loop.summary} 0/4 cells measured, 4 not run, 0 failures" in out
    assert "wrote" not in out and not list(loop.tmp.iterdir())  # no rows, no files
    assert ("alarm", 100 + microbench.HARD_STOP_MARGIN_S) in loop.log and loop.log[-1] != ("alarm", 0)


def test_sigterm_ends_the_run_and_restores_the_handlers(loop, capsys):
    loop.actions = {1: "sigterm"}
    assert loop.main("--budget-s", "50") == 1
    out = capsys.readouterr().out
    assert "INTERRUPTED: Interrupted SIGTERM after 0 s" in out
    assert f"{loop.summary} 1/4 cells measured, 3 not run, 0 failures" in out
    assert len(_rows(loop)) == 1
    meta = (loop.tmp / f"{loop.stem}.meta.json").read_text()
    assert meta.count("interrupted (Interrupted SIGTERM after 0 s)") == 3
    signals = [entry for entry in loop.log if entry[0] in ("signal", "alarm")]
    assert signals == [("signal", "SIGTERM", "_interrupt"), ("signal", "SIGALRM", "_interrupt"), ("alarm", 75),
                       ("alarm", 0), ("signal", "SIGTERM", "old-term"), ("signal", "SIGALRM", "old-alarm")]
    assert loop.handlers == {signal.SIGTERM: "old-term", signal.SIGALRM: "old-alarm"}
