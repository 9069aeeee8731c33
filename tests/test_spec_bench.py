"""CPU tests of scripts/spec_bench.py: --help, argument errors, the no-GPU
exit, and its pure helpers (KV bytes, spread, relative error, derived
columns, target verdicts, markdown report, CSV rows) on hand-made rows whose
expected values are worked out by hand below. Nothing here needs a GPU."""

from __future__ import annotations

import csv
import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import cupaged

from helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

_common = importlib.import_module("_common")
bench = importlib.import_module("spec_bench")


def _run(*args):
    return run_python("scripts/spec_bench.py", *args)


def test_help_exits_0():
    res = _run("--help")
    assert res.returncode == 0, res.stderr
    for flag in ("--qlen", "--batch", "--ctx", "--rounds", "--csv", "--md"):
        assert flag in res.stdout


def test_bad_arguments_exit_2():
    assert _run("--qlen", "four").returncode == 2
    assert _run("--rounds", "0").returncode == 2


@pytest.mark.skipif(cupaged.has_gpu(), reason="this machine has a GPU: the run would start")
def test_no_gpu_exits_3():
    res = _run("--qlen", "4", "--batch", "1", "--ctx", "1024")
    assert res.returncode == _common.EXIT_NO_GPU == 3
    assert "no CUDA GPU" in res.stderr


def test_kv_bytes():
    # K and V, 8 kv heads x 128 dims x 2 bytes = 2048 bytes per token each: 4096 bytes per token
    assert bench.kv_bytes(1, 1) == 4096
    assert bench.kv_bytes(1, 1024) == 4 << 20  # 4 MiB
    assert bench.kv_bytes(64, 1024) == 256 << 20  # exactly the 256 MB threshold of target (a)
    assert bench.kv_bytes(8, 8192) == 256 << 20  # 65536 tokens, like 64 x 1024
    assert bench.kv_bytes(1, 32768) == 128 << 20  # below the threshold
    assert bench.kv_bytes(8, 32768) == 1 << 30


def test_spread_and_rel_err():
    assert bench.spread_pct([9.0, 10.0, 12.0]) == pytest.approx(30.0)  # (12 - 9) / 10
    assert bench.spread_pct([5.0]) == 0.0
    ref = np.array([1.0, 2.0, -4.0], dtype=np.float16)
    out = np.array([1.0, 2.5, -4.0], dtype=np.float16)
    assert bench.max_rel_err(out, ref) == pytest.approx(0.125)  # 0.5 / 4
    assert bench.max_rel_err(ref, ref) == 0.0
    assert math.isnan(bench.max_rel_err(np.array([1.0, np.nan, -4.0], dtype=np.float16), ref))


def test_finish_row():
    row = bench.finish_row({"q_len": 4, "batch": 64, "ctx": 1024, "v2_us": 100.0, "v2_q1_us": 80.0,
                            "fa2_us": 150.0, "fa3_us": 120.0})
    assert row["kv_mb"] == 256.0
    assert row["v2_tbps"] == pytest.approx(2.68435456)  # 268435456 bytes in 100 µs
    assert row["ratio_q1"] == pytest.approx(1.25)  # 100 / 80
    assert row["fi_best_us"] == 120.0
    assert row["fi_best_over_v2"] == pytest.approx(1.2)
    # FlashInfer absent (fa2 None, fa3 missing) and no q1 time: derived columns empty
    row = bench.finish_row({"q_len": 2, "batch": 1, "ctx": 1024, "v2_us": 10.0, "fa2_us": None})
    assert row["kv_mb"] == 4.0 and row["v2_tbps"] == pytest.approx(0.4194304)
    assert row["ratio_q1"] is None and row["fi_best_us"] is None and row["fi_best_over_v2"] is None
    # only one backend ran
    row = bench.finish_row({"q_len": 2, "batch": 1, "ctx": 1024, "v2_us": 10.0, "fa3_us": 8.0})
    assert row["fi_best_us"] == 8.0 and row["fi_best_over_v2"] == pytest.approx(0.8)


def _rows():
    """4 cells: two q_len-4 cells >= 256 MB (one meets 1.15x, one not), one
    q_len-4 cell of 128 MB (1 x 32768 tokens x 4096 B; not in target a), one q_len-2 cell (not in a).
    Target b: 1.2 and 1.0 meet, 0.9 misses, one cell without FlashInfer."""
    base = [(4, 64, 1024, 1.10, 1.2), (4, 8, 32768, 1.30, 0.9), (4, 1, 32768, 2.0, None), (2, 64, 32768, 1.5, 1.0)]
    return [{"q_len": q, "batch": b, "ctx": c, "ratio_q1": r, "fi_best_over_v2": f, "note": ""}
            for q, b, c, r, f in base]


def test_verdicts():
    a, b = bench.verdicts(_rows())
    assert a == [("batch 64 ctx 1024", 1.10, True), ("batch 8 ctx 32768", 1.30, False)]
    assert b == (2, 1, 1)
    # a cell of target (a) without a q1 time counts as missed
    a, _ = bench.verdicts([{"q_len": 4, "batch": 64, "ctx": 1024, "ratio_q1": None}])
    assert a == [("batch 64 ctx 1024", None, False)]
    # no q_len 4 at all: nothing for (a)
    assert bench.verdicts(_rows()[3:])[0] == []


def test_markdown_report_missed():
    text = bench.markdown_report(_rows(), "NVIDIA H200", "2026-01-02 03:04 UTC", "python scripts/spec_bench.py",
                                 commit="abc1234", peer="0.5.0")
    lines = text.splitlines()
    assert lines[0].startswith("# ")
    header = next(line for line in lines if line.startswith("GPU: "))
    assert all(s in header for s in ("NVIDIA H200", "2026-01-02 03:04 UTC", "abc1234", "0.5.0"))
    assert "Command: `python scripts/spec_bench.py`" in lines
    assert "- (a) q_len 4 <= 1.15x q_len 1 on cells >= 256 MB: missed on 1 of 2 cells" in lines
    assert "  - batch 64 ctx 1024: 1.100x met" in lines
    assert "  - batch 8 ctx 32768: 1.300x missed" in lines
    (b_line,) = [line for line in lines if line.startswith("- (b)")]
    assert b_line.startswith("- (b) v2 >= 1.0x FlashInfer-best prefill on every cell: missed")
    assert "met on 2" in b_line and "missed on 1" in b_line and "no FlashInfer data on 1" in b_line
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + 4  # header, rule, one line per row
    assert [c.strip() for c in table[0].strip("|").split("|")] == list(bench.SHOW_COLUMNS)


def test_markdown_report_met_and_no_commit():
    rows = [{"q_len": 4, "batch": 64, "ctx": 1024, "ratio_q1": 1.05, "fi_best_over_v2": 1.3},
            {"q_len": 8, "batch": 1, "ctx": 1024, "ratio_q1": 3.0, "fi_best_over_v2": 1.0}]
    text = bench.markdown_report(rows, "GPU X", "today", "cmd")
    assert "commit" not in text
    assert "- (a) q_len 4 <= 1.15x q_len 1 on cells >= 256 MB: met" in text.splitlines()
    assert "- (b) v2 >= 1.0x FlashInfer-best prefill on every cell: met: met on 2, missed on 0 cells" in text
    # without FlashInfer and without q_len 4
    text = bench.markdown_report([{"q_len": 2, "batch": 1, "ctx": 1024, "ratio_q1": 1.0}], "G", "d", "c")
    assert "cells >= 256 MB: not measured" in text
    assert "every cell: not fully measured: met on 0, missed on 0, no FlashInfer data on 1 cells" in text


def test_csv_columns_and_rows(tmp_path):
    assert bench.CSV_COLUMNS == ("q_len", "batch", "ctx", "kv_mb", "copies", "v2_us", "v2_spread_pct",
                                 "v2_groups_us", "v2_rows_us", "v2_q1_us", "ratio_q1", "fa2_us", "fa3_us", "fi_best_us",
                                 "fi_best_over_v2", "max_rel_err_vs_fi", "note")
    assert bench.SHOW_COLUMNS[bench.SHOW_COLUMNS.index("v2_us") + 1] == "v2_tbps"  # the report's TB/s beside its time
    row = bench.finish_row({"q_len": 4, "batch": 64, "ctx": 1024, "v2_us": 100.0, "v2_q1_us": 80.0,
                            "v2_spread_pct": 1.5, "fa2_us": 150.0, "note": "fa3: unavailable"})
    path = tmp_path / "out.csv"
    _common.write_csv(path, bench.CSV_COLUMNS, bench.csv_rows([row]))  # v2_tbps is dropped, not an error
    with path.open() as f:
        (got,) = list(csv.DictReader(f))
    assert list(got) == list(bench.CSV_COLUMNS)
    assert float(got["kv_mb"]) == 256.0 and float(got["ratio_q1"]) == 1.25
    assert float(got["fi_best_over_v2"]) == 1.5 and got["fa3_us"] == "" and got["note"] == "fa3: unavailable"


def test_time_calls_warms_every_method_once_untimed(monkeypatch):
    """Each method replays once before the rounds, and that replay is not in its times."""
    import cupaged.testing

    log = []

    class FakeTimer:
        def __init__(self, fn, launches):
            self.name = fn()
            assert launches == 24

        def time_us(self, reps):
            log.append((self.name, reps))
            return 1.0 if reps == 1 else float(len(log))

    monkeypatch.setattr(cupaged.testing, "GraphTimer", FakeTimer)
    times = bench.time_calls({"a": lambda: "a", "b": lambda: "b"}, rounds=2, notes=[], launches=24)
    assert log[:2] == [("a", 1), ("b", 1)]
    assert log[2:] == [("a", bench.REPS), ("b", bench.REPS)] * 2
    assert times == {"a": [3.0, 5.0], "b": [4.0, 6.0]}
