"""scripts/large_report.py: issue #20's marks per cell from a suite CSV,
checked against the issue's rules worked by hand here, and the files it
writes. CPU only."""

from __future__ import annotations

import csv
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
large_report = importlib.import_module("large_report")

SHAPE = {"dtype": "float16", "page_size": "16", "num_qo_heads": "32", "num_kv_heads": "8", "head_dim": "128"}


def cell(batch, ctx, kv_bytes, v2_us, fi_us, replicas=1, group="main-fp16-p16"):
    """A suite CSV row (strings, as csv.DictReader gives them); TB/s from
    the bytes as microbench computes it (total bytes ~ KV bytes here)."""
    return {**SHAPE, "group": group, "batch": str(batch), "ctx": str(ctx), "kv_bytes": str(kv_bytes),
            "total_bytes": str(kv_bytes), "replicas": str(replicas), "v2_us": str(v2_us),
            "v2_tbps": str(kv_bytes / v2_us / 1e6), "flashinfer_us": str(fi_us),
            "flashinfer_tbps": str(kv_bytes / fi_us / 1e6), "flashinfer_variant": "tensor_cores"}


def test_large_cells_need_flashinfer_and_4_45_tbps():
    # 2 GB: 445 us is 4.494 TB/s (>= 4.45) and faster than FI's 450 us
    r = large_report.evaluate(cell(32, 32768, 2e9, 445.0, 450.0))
    assert (r["size_class"], r["target_fi"], r["target_tbs"]) == (">=1GB", "met", "met")
    # 2 GB at 455 us: 4.396 TB/s < 4.45, and slower than FI
    r = large_report.evaluate(cell(32, 32768, 2e9, 455.0, 450.0))
    assert (r["target_fi"], r["target_tbs"]) == ("missed", "missed")
    assert r["fi_over_v2"] == pytest.approx(450 / 455)


def test_mid_cells_need_4_2_tbps_and_no_target_between_64_and_256_mb():
    r = large_report.evaluate(cell(8, 16384, 5e8, 118.0, 120.0))  # 4.237 TB/s
    assert (r["size_class"], r["target_fi"], r["target_tbs"], r["target_small"]) == ("256MB-1GB", "met", "met", "")
    r = large_report.evaluate(cell(8, 16384, 5e8, 120.0, 121.0))  # 4.167 TB/s
    assert r["target_tbs"] == "missed"
    r = large_report.evaluate(cell(1, 32768, 134e6, 43.7, 42.0, replicas=3))
    assert all(r[c] == "" for c in ("target_fi", "target_tbs", "target_small"))


def test_small_cells_against_the_floor_plus_4_us_and_cold_l2():
    floor = 4_157_712 / 4.59e12 * 1e6  # 0.906 us
    r = large_report.evaluate(cell(1, 1024, 4_157_712, floor + 3.9, 9.3, replicas=64))
    assert (r["size_class"], r["target_small"]) == ("<=64MB", "met")
    assert r["floor_us"] == pytest.approx(floor) and r["over_floor_us"] == pytest.approx(3.9)
    assert large_report.evaluate(cell(1, 1024, 4_157_712, floor + 4.1, 9.3, replicas=64))["target_small"] == "missed"
    # 4 copies of 4 MB fit in the 60 MiB L2: not the cold step the target asks for
    assert large_report.evaluate(cell(1, 1024, 4_157_712, 2.0, 9.3, replicas=4))["target_small"] == "not measured"


def test_baseline_within_one_percent_and_missing_cells():
    base = {large_report._key(c): c for c in (cell(8, 4096, 2e8, 50.0, 60.0),)}
    assert large_report.evaluate(cell(8, 4096, 2e8, 50.4, 60.0), base)["target_baseline"] == "met"
    r = large_report.evaluate(cell(8, 4096, 2e8, 51.0, 60.0), base)
    assert r["target_baseline"] == "missed" and r["new_over_baseline"] == pytest.approx(1.02)
    assert large_report.evaluate(cell(8, 1024, 5e7, 20.0, 30.0), base)["target_baseline"] == "not measured"
    assert large_report.evaluate(cell(8, 4096, 2e8, 51.0, 60.0))["target_baseline"] == ""


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["batch"])
        w.writeheader()
        w.writerows(rows)


def test_cli_writes_csv_md_png_and_counts(tmp_path, capsys):
    src = tmp_path / "microbench-issue5.csv"
    _write(src, [cell(32, 32768, 2e9, 445.0, 450.0), cell(1, 1024, 4_157_712, 7.6, 9.3, replicas=64)])
    assert large_report.main([str(src), "--out", str(tmp_path / "h200-large"), "--baseline", str(src),
                              "--baseline-label", "abc1234"]) == 0
    out = capsys.readouterr().out
    assert "SUMMARY 1 met, 0 missed, 0 not measured (of 1): v2 GPU time <= FlashInfer-best" in out
    assert "SUMMARY 0 met, 1 missed" in out and "4 µs where KV <= 64 MB" in out
    with open(tmp_path / "h200-large.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["target_small"] for r in rows] == ["", "missed"] and rows[0]["target_baseline"] == "met"
    md = (tmp_path / "h200-large.md").read_text()
    assert "`abc1234`" in md and "| main-fp16-p16 | 1 | 1024 |" in md and "**missed**" in md
    assert (tmp_path / "h200-large.png").stat().st_size > 0


def test_cli_refuses_an_empty_csv(tmp_path):
    src = tmp_path / "empty.csv"
    _write(src, [])
    assert large_report.main([str(src), "--out", str(tmp_path / "x")]) == 2
