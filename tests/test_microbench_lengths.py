"""Tests of ``scripts/microbench.py --lengths`` (ragged batches vs
FlashInfer): argument parsing, the cells, the target marks and geometric
means, the CSV/markdown/plot writers on synthetic rows, and the whole run
on the CPU stand-in GPU of tests/test_scripts.py (fake cupy, cost-model
kernels). One test runs on a real GPU (marker ``gpu``)."""

from __future__ import annotations

import contextlib
import csv
import importlib
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

_common = importlib.import_module("_common")
microbench = importlib.import_module("microbench")
bench_report = importlib.import_module("bench_report")

MET, MISSED, UNMEASURED = bench_report.MET, bench_report.MISSED, bench_report.UNMEASURED


# ------------------------------------------------------------------ arguments


def test_family_arguments(tmp_path):
    args = microbench.parse_args(["--lengths", "family", "--out-dir", str(tmp_path)])
    assert args.lengths == tuple(_common.RAGGED_FAMILY)
    assert args.ragged_dtypes == ("float16", "bfloat16", "fp8") == microbench.RAGGED_DTYPES
    assert args.methods == ("v2", "flashinfer")
    assert (args.reps, args.budget_s, args.ragged_page_size) == (5, microbench.RAGGED_BUDGET_S, 16)
    assert (args.csv, args.md, args.png) == tuple(str(tmp_path / f"ragged.{x}") for x in ("csv", "md", "png"))
    cells = microbench.cells(args)
    assert len(cells) == 3 * len(_common.RAGGED_FAMILY) == 30
    # dtypes outer, the family in its order inner
    assert [c["choice"] for c in cells[::10]] == ["float16", "bfloat16", "fp8"]
    assert [c["cell"] for c in cells[:2]] == ["64:onelong:131072:512:0", "8:onelong:32768:1024:0"]
    fp8 = cells[-1]
    assert (fp8["dtype"], fp8["kv_dtype"], fp8["cell"]) == ("float16", "float8_e4m3fn", "256:zipf:1.5:256:32768:8")
    assert {c["page_size"] for c in cells} == {16}
    # the other modes are untouched
    plain = microbench.parse_args([])
    assert plain.lengths is None and plain.ragged_dtypes is None and plain.csv.endswith("microbench.csv")


def test_explicit_cells_and_flags():
    args = microbench.parse_args(
        ["--lengths", "64:uniform:1:4096:5,8:onelong:32768:1024", "family", "4:zipf:1.5:16:512:3",
         "--dtypes", "fp8", "bfloat16,fp8", "--reps", "2", "--budget-s", "0", "--page-size", "32",
         "--methods", "v2", "--csv", "x.csv"]
    )
    assert args.lengths[:2] == ((64, "uniform:1:4096", 5), (8, "onelong:32768:1024", 0))
    assert args.lengths[2:-1] == tuple(_common.RAGGED_FAMILY)
    assert args.lengths[-1] == (4, "zipf:1.5:16:512", 3)
    assert args.ragged_dtypes == ("fp8", "bfloat16")  # in order, once each
    assert (args.reps, args.budget_s, args.ragged_page_size, args.methods, args.csv) == (2, 0.0, 32, ("v2",), "x.csv")
    cells = microbench.cells(args)
    assert len(cells) == 2 * 13 and cells[0]["choice"] == "fp8" and cells[13]["dtype"] == "bfloat16"
    assert cells[0]["cell"] == "64:uniform:1:4096:5" and cells[0]["page_size"] == 32
    assert microbench.ragged_label(cells[0]) == "fp8 64:uniform:1:4096:5"


@pytest.mark.parametrize(
    "argv",
    [
        ["--lengths", "64:gauss:1:2"],  # unknown distribution
        ["--lengths", "0:uniform:1:4096"],  # batch < 1
        ["--lengths", "x:uniform:1:4096"],
        ["--lengths", "64:uniform:1"],  # too few numbers
        ["--lengths", "64:uniform:1:4096:5:6"],  # too many
        ["--lengths", "64:uniform:5:5"],  # nothing to draw
        ["--lengths", "64:uniform:1:4096:-1"],  # negative seed
        ["--lengths", "64:lognormal:1024:0"],
        ["--lengths", "64"],
        ["--lengths", "families"],
        ["--lengths"],
        ["--lengths", "family", "--dtypes", "int8"],
        ["--lengths", "family", "--dtypes", "float32"],
        ["--dtypes", "fp8"],  # --dtypes needs --lengths
        ["--lengths", "family", "--dtype", "float16"],
        ["--lengths", "family", "--kv-dtype", "fp8"],
        ["--lengths", "family", "--suite", "issue5"],
        ["--lengths", "family", "--quick"],
        ["--lengths", "family", "--batch", "4"],
        ["--lengths", "family", "--ctx", "4096"],
        ["--lengths", "family", "--methods", "gather"],
        ["--lengths", "family", "--methods", "v1,v2"],
        ["--lengths", "family", "--page-size", "16,32"],
        ["--lengths", "family", "--page-order", "reverse"],
        ["--lengths", "family", "--reps", "0"],
        ["--lengths", "family", "--budget-s", "-1"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        microbench.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_describes_the_new_flags():
    text = microbench.build_parser().format_help()
    assert "BATCH:DISTRIBUTION[:SEED]" in text and "--dtypes" in text and "ragged.{csv,md,png}" in text
    for name in ("lognormal:MEDIAN:SIGMA", "uniform:LO:HI", "bimodal:SHORT:LONG", "onelong:LONG:SHORT",
                 "zipf:A:UNIT:MAX"):
        assert name in text


# ------------------------------------------------------- marks and geomeans


def test_length_stats():
    assert microbench.length_stats([5, 1, 10, 2]) == {"total_tokens": 18, "min_len": 1, "median_len": 3.5,
                                                       "max_len": 10}


@pytest.mark.parametrize(
    "row, marks",
    [
        ({"v2_us": 100.0, "flashinfer_us": 100.0, "v2_tbps": 3.9, "kv_bytes": 256e6}, (MET, MET)),
        ({"v2_us": 100.0, "flashinfer_us": 99.0, "v2_tbps": 4.4, "kv_bytes": 1e9}, (MISSED, MET)),
        ({"v2_us": 100.0, "flashinfer_us": 150.0, "v2_tbps": 3.89, "kv_bytes": 3e8}, (MET, MISSED)),
        ({"v2_us": 10.0, "flashinfer_us": 20.0, "v2_tbps": 1.0, "kv_bytes": 255e6}, (MET, "")),  # small: no TB/s target
        ({"v2_us": 10.0, "v2_tbps": 4.0, "kv_bytes": 1e9}, (UNMEASURED, MET)),  # FlashInfer missing
        ({"flashinfer_us": 10.0, "kv_bytes": 1e9}, (UNMEASURED, UNMEASURED)),  # v2 failed
        ({"v2_us": "100", "flashinfer_us": "120", "v2_tbps": "4.0", "kv_bytes": "4e8"}, (MET, MET)),  # CSV strings
    ],
)
def test_ragged_marks(row, marks):
    assert microbench.ragged_marks(row) == dict(zip(("target_no_slower", "target_tbs"), marks, strict=True))


def test_geomeans_per_dtype_and_overall():
    rows = [
        {"dtype": "float16", "kv_dtype": "float16", "v2_us": 1.0, "flashinfer_us": 2.0},
        {"dtype": "float16", "kv_dtype": "float16", "v2_us": 2.0, "flashinfer_us": 1.0},
        {"dtype": "float16", "kv_dtype": "float8_e4m3fn", "v2_us": 1.0, "flashinfer_us": 1.69},
        {"dtype": "float16", "kv_dtype": "float8_e4m3fn", "v2_us": 1.0},  # no FlashInfer time: left out
    ]
    (name, gm, n), *per = microbench.ragged_geomeans(rows)
    assert name == "all" and n == 3 and gm == pytest.approx(1.69 ** (1 / 3))
    assert [(c, k) for c, _, k in per] == [("float16", 2), ("fp8", 1)]
    assert per[0][1] == pytest.approx(1.0) and per[1][1] == pytest.approx(1.69)
    assert microbench._geomean_mark(1.3) == MET and microbench._geomean_mark(1.29) == MISSED
    assert microbench._geomean_mark(None) == ""
    assert microbench.ragged_geomeans([]) == [("all", None, 0)]


# ------------------------------------------------------------------ writers


def _synthetic_rows() -> list[dict]:
    """Rows as the ragged run makes them: fp16 and fp8 of two cells."""
    rows = []
    for choice, kv_dtype, itemsize in (("float16", "float16", 2), ("fp8", "float8_e4m3fn", 1)):
        for cell, batch, spec, seed, tokens, v2_us, fi_us in (
            ("64:onelong:131072:512:0", 64, "onelong:131072:512", 0, 163328, 180.0, 200.0),
            ("8:uniform:1:300:1", 8, "uniform:1:300", 1, 1200, 9.0, 7.5),
        ):
            kv = 2 * tokens * 8 * 128 * itemsize
            total = kv + 2 * batch * 32 * 128 * 2 + 4 * (tokens // 16 + 3 * batch + 1)
            row = {
                "cell": cell, "batch": batch, "lengths": spec, "seed": seed, "dtype": "float16",
                "kv_dtype": kv_dtype, "page_size": 16, "num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                "total_tokens": tokens, "min_len": 1, "median_len": 150.5, "max_len": 131072, "kv_bytes": kv,
                "total_bytes": total, "replicas": 1, "reps": 5, "v2_us": v2_us, "v2_spread": 0.012,
                "v2_tbps": total / v2_us / 1e6, "v2_pct_roofline": 100 * total / v2_us / 1e6 / 4.6,
                "v2_timing": "graph <5 replays of 3 calls, 5 reps>", "flashinfer_us": fi_us,
                "flashinfer_variant": "tensor_cores", "flashinfer_spread": 0.03,
                "flashinfer_tbps": total / fi_us / 1e6, "flashinfer_timing": "graph",
                "flashinfer_cuda_cores_us": fi_us * 1.2,
                "flashinfer_tensor_cores_us": fi_us, "v2_over_flashinfer": fi_us / v2_us, "max_rel_vs_fi": 1.2e-3,
                "v2_pages_per_chunk": 64, "v2_num_chunks": 200, "v2_num_ctas": 1600, "v2_needs_merge": True,
                "v2_path": "v2", "wall_s": 1.5,
            }
            row.update(microbench.ragged_marks(row))
            rows.append(row)
    return rows


def _meta(**extra) -> dict:
    meta = {"command": "python3 scripts/microbench.py --lengths family", "gpu": "NVIDIA H200 (132 SMs)",
            "date": "2026-12-01 10:00 UTC", "commit": "abc1234", "versions": "CuPy x", "timing": "graph replay",
            "planned": 4, "elapsed_s": 12.0, "skipped": [], "notes": []}
    meta.update(extra)
    return meta


def test_writers_on_synthetic_rows(tmp_path):
    rows = _synthetic_rows()
    args = SimpleNamespace(csv=str(tmp_path / "r" / "ragged.csv"), md=str(tmp_path / "r" / "ragged.md"))
    microbench.write_ragged_outputs(rows, _meta(skipped=["fp8 1:uniform:1:2:0: time budget"]), args)
    with open(args.csv, newline="") as f:
        reader = csv.reader(f)
        assert tuple(next(reader)) == microbench.RAGGED_CSV_COLUMNS
        assert len(list(reader)) == 4
    back = bench_report.read_csv_rows(args.csv)
    assert back[0]["cell"] == "64:onelong:131072:512:0" and back[0]["v2_over_flashinfer"] == pytest.approx(200 / 180)
    assert [r["target_no_slower"] for r in back] == [MET, MISSED, MET, MISSED]
    # the marks from the CSV's strings are the same
    assert [microbench.ragged_marks(r) for r in back] == [microbench.ragged_marks(r) for r in rows]
    meta = json.loads(bench_report.meta_path(args.csv).read_text())
    assert meta["commit"] == "abc1234"
    md = Path(args.md).read_text()
    for text in ("`python3 scripts/microbench.py --lengths family`", "NVIDIA H200", "2026-12-01 10:00 UTC",
                 "`abc1234`", "**Spread**", "v2 max 1.2 %", "**Check**", "### float16:", "### fp8:",
                 "KV float8_e4m3fn", "**missed**", "not run: fp8 1:uniform:1:2:0: time budget", "1 not run"):
        assert text in md, text
    gm = math.exp(sum(math.log(r["v2_over_flashinfer"]) for r in rows) / 4)
    assert f"({4} cells): **{gm:.3g}** (target ≥ 1.3: **missed**)" in md
    # the cell tables have one line per row, each with as many cells as headers
    table = [line for line in md.splitlines() if line.startswith("| 64:") or line.startswith("| 8:")]
    assert len(table) == 4
    assert {line.count(" | ") + 1 for line in table} == {len(microbench.RAGGED_CELL_HEADERS)}
    # 669 MB in 180 us = 3.7 TB/s misses 3.9 TB/s; a 20 MB cell has no TB/s target
    assert rows[0]["target_tbs"] == MISSED and rows[1]["target_tbs"] == ""
    png = tmp_path / "ragged.png"
    microbench.plot_ragged(rows, str(png), "title")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_summary_lines():
    rows = _synthetic_rows()
    lines = microbench.ragged_summary_lines(rows)
    assert all(line.startswith("SUMMARY ") for line in lines)
    cell_lines = [line for line in lines if line.startswith("SUMMARY 64:") or line.startswith("SUMMARY 8:")]
    assert len(cell_lines) == 4
    assert cell_lines[0].split()[1:5] == ["64:onelong:131072:512:0", "fp16", "180", "200"]
    assert cell_lines[0].endswith("met missed") and cell_lines[1].endswith("missed -")
    assert "SUMMARY target >=FI: 2 met, 2 missed, 0 not measured (of 4)" in lines
    assert lines[-1].startswith("SUMMARY geomean fi/v2 all:") and lines[-1].endswith("(4 cells; target >= 1.3: missed)")
    assert any(line.startswith("SUMMARY geomean fi/v2 fp8:") for line in lines)
    assert microbench.ragged_summary_lines([])[-1] == "SUMMARY geomean fi/v2 all: n/a (0 cells; target >= 1.3: n/a)"


def test_csv_schema_is_its_own():
    cols = microbench.RAGGED_CSV_COLUMNS
    assert len(set(cols)) == len(cols)
    # the first released schema: later versions may append columns, never reorder
    assert cols[:8] == ("cell", "batch", "lengths", "seed", "dtype", "kv_dtype", "page_size", "num_qo_heads")
    for column, _, _ in microbench.RAGGED_TARGETS:
        assert column in cols
    assert "lengths" not in microbench.CSV_COLUMNS  # the other modes' files are untouched


# ------------------------------------------------------- a run on a fake GPU

# The CPU stand-in GPU of tests/test_scripts.py (fake cupy whose kernels
# advance a clock; capture records their cost into a graph).
from test_scripts import _fake_cupy, _fake_device_batch, _FakeGPU, _gpu_present, _kv_of  # noqa: E402


class _FakeFlashInfer:
    """FlashInfer as a cost model: CUDA cores 3.2 TB/s + 4 us, tensor cores
    4.4 TB/s + 5 us; ``outputs`` sets what each variant writes (v2 writes 1)."""

    reason, version, available = "", "fake", True
    torch = SimpleNamespace(cuda=SimpleNamespace(empty_cache=lambda: None, memory_reserved=lambda: 0), __version__="fake")
    outputs = {"cuda_cores": 1.0, "tensor_cores": 1.0}

    def __init__(self):
        self.seen = []

    def runners(self, batch, stream, *, caches=None, kv_dtype=None, k_scale=None, v_scale=None, prefix="flashinfer"):
        self.seen.append((kv_dtype, None if caches is None else caches[0][0].dtype))
        k = (caches or batch.caches)[0][0]
        kv = _kv_of(batch.table, k)
        out = []
        for name, rate, fixed in (("cuda_cores", 3.2e6, 4.0), ("tensor_cores", 4.4e6, 5.0)):
            o = np.full(batch.q.shape, self.outputs[name], batch.q.dtype)
            calls = [(lambda c=kv / rate + fixed: self.gpu.kernel(c)) for _ in batch.caches]
            out.append(microbench.Runner(f"{prefix}_{name}", calls, o, contextlib.nullcontext))
        return out


@pytest.fixture
def fake_run(monkeypatch):
    """``microbench.main`` against the fake GPU: empty caches, v2 at 3.8 TB/s
    + 6 us, fp8 caches of uint8, FlashInfer as :class:`_FakeFlashInfer`
    (its instances in ``fake_run.flashinfers``)."""
    if _gpu_present():
        pytest.skip("this machine has a GPU: the real run covers this")
    import cupaged

    gpu = _FakeGPU()
    state = SimpleNamespace(gpu=gpu, flashinfers=[], decodes=[])
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(gpu))
    monkeypatch.setenv("CUPAGED_NUM_SMS", "132")

    def decode(q, k_cache, v_cache, table, plan=None, *, method="auto", out=None, **kw):
        state.decodes.append((method, k_cache.dtype, plan.kv_dtype, kw))
        gpu.kernel(_kv_of(table, k_cache) / 3.8e6 + 6.0, method)
        out = np.empty(q.shape, q.dtype) if out is None else out
        out[...] = 1.0
        return out

    def fp8_caches(caches, dtype, scale):
        assert scale == 1.0
        return [tuple(np.empty(a.shape, np.uint8) for a in pair) for pair in caches]

    class FlashInfer(_FakeFlashInfer):
        def __init__(self):
            super().__init__()
            self.gpu = gpu
            state.flashinfers.append(self)

    monkeypatch.setattr(_common, "make_device_batch", _fake_device_batch)
    monkeypatch.setattr(_common, "require_gpu", lambda: None)
    monkeypatch.setattr(cupaged, "decode", decode)
    monkeypatch.setattr(cupaged, "select_method", lambda *a, **k: cupaged.Selection("v2", "requested"))
    monkeypatch.setattr(microbench, "fp8_caches", fp8_caches)
    monkeypatch.setattr(microbench, "FlashInfer", FlashInfer)
    monkeypatch.setattr(_FakeFlashInfer, "outputs", {"cuda_cores": 1.0, "tensor_cores": 1.0})
    return state


def _summary(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("SUMMARY")]


def test_ragged_run_on_a_fake_gpu(fake_run, tmp_path, capsys):
    argv = ["--lengths", "4:uniform:1:300:1", "8:onelong:2000:20", "--dtypes", "float16,fp8",
            "--out-dir", str(tmp_path), "--commit", "abc1234"]
    assert microbench.main(argv) == 0
    out = capsys.readouterr().out
    summary = _summary(out)
    assert summary[0].startswith("SUMMARY ragged: 4/4 cells measured, 0 not run, 0 failures")
    assert summary[-1].startswith("SUMMARY geomean fi/v2 all:") and "(4 cells; target >= 1.3:" in summary[-1]
    assert len([s for s in summary if s.split()[1].count(":") >= 2]) == 4  # one line per cell
    rows = bench_report.read_csv_rows(tmp_path / "ragged.csv")
    assert [(r["cell"], r["dtype"], r["kv_dtype"]) for r in rows] == [
        ("4:uniform:1:300:1", "float16", "float16"),
        ("8:onelong:2000:20:0", "float16", "float16"),
        ("4:uniform:1:300:1", "float16", "float8_e4m3fn"),
        ("8:onelong:2000:20:0", "float16", "float8_e4m3fn"),
    ]
    for r in rows:
        lens = _common.ragged_lengths(r["lengths"], r["batch"], r["seed"])
        assert (r["total_tokens"], r["min_len"], r["max_len"]) == (lens.sum(), lens.min(), lens.max())
        itemsize = 1 if r["kv_dtype"] == "float8_e4m3fn" else 2
        assert r["kv_bytes"] == 2 * lens.sum() * 8 * 128 * itemsize
        assert r["replicas"] == microbench.num_replicas(r["kv_bytes"]) > 1  # small cells rotate copies
        assert r["v2_us"] == pytest.approx(r["kv_bytes"] / 3.8e6 + 6.0, rel=1e-6)  # graph replay, per call
        fi = {"cuda_cores": r["kv_bytes"] / 3.2e6 + 4.0, "tensor_cores": r["kv_bytes"] / 4.4e6 + 5.0}
        assert r["flashinfer_us"] == pytest.approx(min(fi.values()))
        assert r["flashinfer_variant"] == min(fi, key=fi.get)
        assert r["flashinfer_cuda_cores_us"] == pytest.approx(fi["cuda_cores"])
        assert r["v2_over_flashinfer"] == pytest.approx(r["flashinfer_us"] / r["v2_us"])
        assert r["v2_tbps"] == pytest.approx(r["total_bytes"] / (r["v2_us"] * 1e-6) / 1e12)
        assert r["max_rel_vs_fi"] == 0.0 and r["v2_path"] == "v2" and r["reps"] == 5
        assert "replays of" in r["v2_timing"] and "replays of" in r["flashinfer_timing"]
        assert r["v2_num_ctas"] >= r["v2_num_chunks"] >= r["batch"]
        assert r["target_no_slower"] == microbench.ragged_marks(r)["target_no_slower"] != ""
        assert r["target_tbs"] is None  # (empty) a few MB: the TB/s target does not apply
        assert r["wall_s"] > 0
    # fp8: v2 planned and run over uint8 caches, FlashInfer told the KV is float8_e4m3fn
    assert {(k, str(p)) for m, k, p, _ in fake_run.decodes} == {(np.dtype(np.float16), "float16"),
                                                                      (np.dtype(np.uint8), "float8_e4m3fn")}
    assert {m for m, *_ in fake_run.decodes} == {"v2"}
    assert all(kw == {} for *_, kw in fake_run.decodes)  # no k_scale/v_scale (scale 1)
    assert fake_run.flashinfers[0].seen == [(None, None), (None, None), ("float8_e4m3fn", np.uint8),
                                             ("float8_e4m3fn", np.uint8)]
    md = (tmp_path / "ragged.md").read_text()
    assert md.startswith("# cupaged paged decode vs FlashInfer: ragged batches")
    for text in ("`abc1234`", "Fake H200", "--lengths 4:uniform:1:300:1", "**Spread**", "### fp8:",
                 "4/4 cells measured", "Geometric mean of FlashInfer-best / v2"):
        assert text in md, text
    assert (tmp_path / "ragged.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "ragged.meta.json").read_text())["planned"] == 4


def test_the_family_runs_on_a_fake_gpu(fake_run, tmp_path, capsys):
    argv = ["--lengths", "family", "--dtypes", "bfloat16", "--budget-s", "0", "--out-dir", str(tmp_path)]
    assert microbench.main(argv) == 0
    summary = _summary(capsys.readouterr().out)
    assert summary[0].startswith("SUMMARY ragged: 10/10 cells measured, 0 not run, 0 failures")
    rows = bench_report.read_csv_rows(tmp_path / "ragged.csv")
    assert [(r["batch"], r["lengths"], r["seed"]) for r in rows] == [tuple(c) for c in _common.RAGGED_FAMILY]
    big = [r for r in rows if r["kv_bytes"] >= 256e6]
    assert big and all(r["target_tbs"] in (MET, MISSED) and r["replicas"] == 1 for r in big)
    assert all(r["target_tbs"] is None for r in rows if r["kv_bytes"] < 256e6)  # empty: n/a
    assert all(r["dtype"] == r["kv_dtype"] == "bfloat16" for r in rows)


def test_v2_output_checked_against_flashinfer(fake_run, tmp_path, capsys, monkeypatch):
    base = ["--lengths", "4:uniform:1:300:1", "--dtypes", "float16", "--out-dir", str(tmp_path)]
    # one variant disagrees: a note, the run passes
    monkeypatch.setattr(_FakeFlashInfer, "outputs", {"cuda_cores": 1.0, "tensor_cores": 1.5})
    assert microbench.main(base) == 0
    out = capsys.readouterr().out
    row = bench_report.read_csv_rows(tmp_path / "ragged.csv")[0]
    assert row["max_rel_vs_fi"] == pytest.approx(0.5)  # |1.5 - 1| / |1|
    assert "FlashInfer's variants disagree" in (tmp_path / "ragged.md").read_text()
    assert "0 failures" in out
    # both disagree: the cell fails, exit 1
    monkeypatch.setattr(_FakeFlashInfer, "outputs", {"cuda_cores": 2.0, "tensor_cores": 2.0})
    assert microbench.main(base) == 1
    out = capsys.readouterr().out
    assert "v2 differs from FlashInfer" in out and "1 failures" in out


def test_without_flashinfer_and_with_v2_only(fake_run, tmp_path, capsys, monkeypatch):
    class Unavailable:
        reason, available, version = "No module named 'flashinfer'", False, "?"

    monkeypatch.setattr(microbench, "FlashInfer", Unavailable)
    base = ["--lengths", "4:uniform:1:300:1", "--dtypes", "fp8", "--out-dir", str(tmp_path)]
    assert microbench.main(base) == 0
    out = capsys.readouterr().out
    r = bench_report.read_csv_rows(tmp_path / "ragged.csv")[0]
    assert r["v2_us"] and r["flashinfer_us"] is None and r["target_no_slower"] == UNMEASURED
    assert r["flashinfer_timing"].startswith("unavailable: No module")
    assert _summary(out)[-1] == "SUMMARY geomean fi/v2 all: n/a (0 cells; target >= 1.3: n/a)"
    assert microbench.main([*base, "--methods", "v2"]) == 0
    r = bench_report.read_csv_rows(tmp_path / "ragged.csv")[0]
    assert r["v2_us"] and r["flashinfer_timing"] is None


def test_budget_skips_cells_on_a_fake_gpu(fake_run, tmp_path, capsys):
    argv = ["--lengths", "4:uniform:1:300:1", "8:onelong:2000:20", "--dtypes", "float16", "--budget-s", "10",
            "--out-dir", str(tmp_path)]
    assert microbench.main(argv) == 0  # the first cell's JIT alone is estimated past 10 s
    assert _summary(capsys.readouterr().out)[0].startswith("SUMMARY ragged: 0/2 cells measured, 2 not run")
    assert not (tmp_path / "ragged.csv").exists()


def test_estimate_of_the_family_fits_the_budget():
    args = microbench.parse_args(["--lengths", "family"])
    cells = microbench.cells(args)
    first = {c["choice"]: i for i, c in reversed(list(enumerate(cells)))}
    total = sum(microbench.estimate_ragged_cell_s(c, args, i in first.values()) for i, c in enumerate(cells))
    assert 3 * microbench.RAGGED_JIT_ESTIMATE_S < total < 0.8 * microbench.RAGGED_BUDGET_S


# ------------------------------------------------------------------ real GPU


@pytest.mark.gpu
def test_ragged_run_on_the_gpu(tmp_path, capsys):
    argv = ["--lengths", "4:uniform:1:300:1", "--dtypes", "float16,fp8", "--budget-s", "0", "--reps", "2",
            "--out-dir", str(tmp_path)]
    assert microbench.main(argv) == 0, capsys.readouterr().out
    rows = bench_report.read_csv_rows(tmp_path / "ragged.csv")
    assert len(rows) == 2
    for r in rows:
        assert r["v2_us"] > 0 and r["v2_path"] == "v2"
        if r["flashinfer_us"] is not None:  # FlashInfer importable: outputs agree
            assert r["max_rel_vs_fi"] < microbench.RAGGED_MAX_REL
