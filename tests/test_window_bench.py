"""CPU tests of scripts/window_bench.py: --help, argument errors, the no-GPU
exit, and its pure helpers (bytes of a window, cache copies, target marks,
the markdown report) on hand-made rows worked out by hand. No GPU."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import cupaged

from helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
bench = importlib.import_module("window_bench")

ROW_BYTES = 8 * 128 * 2 * 2  # one token's K and V over 8 kv heads, head_dim 128, fp16


def _run(*args):
    return run_python("scripts/window_bench.py", *args)


def test_help_and_argument_errors():
    res = _run("--help")
    assert res.returncode == 0 and "--window" in res.stdout and "--no-flashinfer" in res.stdout
    res = _run("--window", "-1")
    assert res.returncode == 2 and "--window must be >= 0" in res.stderr


@pytest.mark.skipif(cupaged.has_gpu(), reason="checks the exit status without a GPU")
def test_exits_3_without_a_gpu():
    assert _run("--batch", "1").returncode == 3


def test_window_bytes_round_out_to_pages():
    assert bench.window_kv_bytes(2, 4096, None) == 2 * 4096 * ROW_BYTES
    assert bench.window_kv_bytes(1, 4096, 15) == 16 * ROW_BYTES       # 16 tokens: one page
    assert bench.window_kv_bytes(1, 4096, 16) == 32 * ROW_BYTES       # 17 tokens span two pages
    assert bench.window_kv_bytes(1, 4096, 5000) == 4096 * ROW_BYTES   # wider than the context


def test_copies_cycle_256_mib_within_the_caps():
    pool = 2 * 32768 * ROW_BYTES  # one request of 32k with 2x slack
    # a 1024 window reads 1040 tokens = 4.26 MB: 64 copies wanted, 16 allowed
    assert bench.copies_for(1, 32768, [1024, 16384], pool) == 16
    # W = 16384 alone: 16400 tokens = 67.2 MB -> 4 copies cycle 268.7 MB >= 256 MiB
    assert bench.copies_for(1, 32768, [16384], pool) == 4
    # a pool of 10 GiB: only 2 fit in 24 GiB
    assert bench.copies_for(1, 32768, [1024], 10 << 30) == 2


def test_finish_row_marks_both_targets():
    # plain 40 us; W = 4096 on ctx 32768: share (4096 + 16) / 32768 = 0.12549 -> 5.02 us expected
    row = bench.finish_row({"batch": 1, "ctx": 32768, "window": 4096, "plain_us": 40.0, "v2_us": 9.9,
                            "fi_cc_us": 12.0, "fi_tc_us": 11.0})
    assert row["expected_us"] == pytest.approx(40 * 4112 / 32768)
    assert row["v2_minus_expected_us"] == pytest.approx(9.9 - 5.01953125)
    assert (row["target_share"], row["target_fi"], row["fi_best_us"]) == ("met", "met", 11.0)
    row = bench.finish_row({"batch": 1, "ctx": 32768, "window": 4096, "plain_us": 40.0, "v2_us": 10.1,
                            "fi_tc_us": 10.0})
    assert (row["target_share"], row["target_fi"]) == ("missed", "missed")
    row = bench.finish_row({"batch": 1, "ctx": 1024, "window": 4096, "plain_us": 8.0, "v2_us": 8.2})
    assert row["expected_us"] == 8.0 and "target_fi" not in row  # a window wider than ctx: the full call


def test_markdown_report_counts_and_rows():
    rows = [bench.finish_row({"batch": 1, "ctx": 32768, "window": w, "copies": 16, "plain_us": 40.0, "v2_us": v2,
                              "fi_tc_us": fi, "note": ""}) for w, v2, fi in ((1024, 6.0, 7.0), (4096, 9.0, 8.5))]
    text = bench.markdown_report(rows, "NVIDIA H200", "2026-12-02 10:00 UTC", "python3 scripts/window_bench.py",
                                 "abc1234", "FlashInfer 0.7.2")
    assert "| (a) v2 within 5 µs of plain × (W + page) / ctx | 2 | 2 | 0 |" in text
    assert "| (b) v2 ≥ FlashInfer-best with the same window | 2 | 1 | 1 |" in text
    # W = 1024: 6.0 - 40 x 1040 / 32768 = 4.73 us over (met); W = 4096: 9.0 - 5.02 = 3.98 (met), FI 8.5 < 9.0
    assert "`abc1234`" in text and "| 1 | 32768 | 4096 | 16 | 40 | 9 |" in text
