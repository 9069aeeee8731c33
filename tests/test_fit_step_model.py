"""scripts/fit_step_model.py: merging two halves of a chunk sweep (CPU only)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import chunk_sweep  # noqa: E402
import fit_step_model  # noqa: E402


def _write(path: Path, rows: list[tuple]) -> str:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=chunk_sweep.COLUMNS)
        w.writeheader()
        for cell, knob, value, us in rows:
            w.writerow(dict(cell=cell, batch=1, kv_dtype="fp8", knob=knob, value=value, num_chunks=1, num_ctas=8,
                            model_us=0, us_round1=us, us_round2=us, us=us, default=int(knob == "default")))
    return str(path)


def test_a_second_half_adds_its_knobs_scaled_by_the_defaults_ratio(tmp_path):
    first = _write(tmp_path / "h0.csv", [("1x4096", "default", 16, 10.0), ("1x4096", "cap", 32, 12.0),
                                         ("1x4096", "cap", 16, 10.0)])
    # the second run is 25 % slower overall: its default took 12.5 for the first's 10.0
    second = _write(tmp_path / "h1.csv", [("1x4096", "default", 16, 12.5), ("1x4096", "cap", 32, 99.0),
                                          ("1x4096", "cap", 22, 10.0), ("2x1024", "cap", 8, 7.0)])
    rows = fit_step_model.merged_rows([first, second])
    got = {(r["cell"], r["knob"], int(r["value"])): float(r["us"]) for r in rows}
    assert got[("1x4096", "cap", 32)] == 12.0  # the first file's row wins
    assert got[("1x4096", "cap", 22)] == pytest.approx(8.0)  # 10.0 * 10.0 / 12.5
    assert got[("1x4096", "default", 16)] == 10.0
    assert got[("2x1024", "cap", 8)] == 7.0  # a cell only the second file has: as timed
    assert len(rows) == 5  # (the second default and cap 32 are not taken)


def test_load_takes_every_cap_of_both_halves(tmp_path):
    first = _write(tmp_path / "h0.csv", [("1x4096", "default", 256, 20.0), ("1x4096", "cap", 256, 20.0),
                                         ("1x4096", "cap", 64, 15.0)])
    second = _write(tmp_path / "h1.csv", [("1x4096", "default", 256, 40.0), ("1x4096", "cap", 128, 24.0)])
    (cell,) = fit_step_model.load([first, second])
    assert sorted(zip(cell.caps.tolist(), cell.us.tolist())) == [(64, 15.0), (128, 12.0), (256, 20.0)]
    assert cell.best == 12.0 and cell.page_bytes == 16 * 2 * 128
