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


def test_the_shipped_two_per_sm_constants_are_the_joint_fit():
    """schedule.H200_COSTS_FP8_2 is what --two-per-sm fits on the committed
    sweeps (3 per SM in two halves, 2 per SM in one), and the choice it
    makes is within 5 % of the best knob of either count on every cell of
    those sweeps (a refit or an edited constant that breaks this fails)."""
    from cupaged import schedule

    bench = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
    three = fit_step_model.load([str(bench / f"chunk-sweep-ragged-fp8-h200-2026-12-02-half{i}.csv") for i in (0, 1)])
    two = {c.name: c for c in fit_step_model.load([str(bench / "chunk-sweep-ragged-fp8-2cta-h200-2026-12-02-half0.csv")])}
    fitted = fit_step_model.fit_two_per_sm(three, two, schedule.H200_COSTS_FP8, schedule.H200_COSTS_FP8, 8)
    assert fitted == schedule.H200_COSTS_FP8_2
    rows = fit_step_model.joint_regrets(three, two, schedule.H200_COSTS_FP8, fitted, 8)
    assert len(rows) == 10 and max(r[5] for r in rows) < 0.05
    assert {r[1] for r in rows} == {2, 3}  # both counts are chosen somewhere
