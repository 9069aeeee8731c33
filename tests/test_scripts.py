"""CPU tests of the evidence scripts (scripts/correctness.py,
scripts/microbench.py, scripts/_common.py): argument parsing, the sweeps as
data, the writers, the adversarial page-table generator, and the no-GPU exit.
Nothing here needs a GPU."""

from __future__ import annotations

import csv
import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

_common = importlib.import_module("_common")
correctness = importlib.import_module("correctness")
microbench = importlib.import_module("microbench")


def _gpu_present() -> bool:
    return _common.has_gpu()


# ------------------------------------------------------------- correctness args


def test_correctness_sweeps_are_data():
    assert correctness.DEFAULT_SWEEP == {
        "head_dim": (64, 128),
        "gqa": (1, 4, 8),
        "page_size": (32,),
        "ctx": (512, 4096),
        "batch": (1, 4),
    }
    assert correctness.FULL_SWEEP == {
        "head_dim": (64, 128),
        "gqa": (1, 4, 8),
        "page_size": (16, 32, 64),
        "ctx": (512, 4096, 16384, 32768),
        "batch": (1, 4, 8),
    }
    assert set(correctness.AXES) == set(correctness.DEFAULT_SWEEP) == set(correctness.FULL_SWEEP)


def test_correctness_default_is_24_configs():
    args = correctness.parse_args([])
    cfgs = correctness.configs(args)
    assert len(cfgs) == 24
    assert len(set(cfgs)) == 24
    assert {c.dtype for c in cfgs} == {"float16"}
    assert {c.page_size for c in cfgs} == {32}
    assert {c.num_kv_heads for c in cfgs} == {8}
    assert {c.num_qo_heads for c in cfgs} == {8, 32, 64}
    assert args.methods == ("v2", "v1", "gather")
    assert not args.force_merge and args.csv is None and args.seed == 0


def test_correctness_full_is_216_configs():
    cfgs = correctness.configs(correctness.parse_args(["--full"]))
    assert len(cfgs) == 216
    assert {c.ctx for c in cfgs} == {512, 4096, 16384, 32768}
    assert {c.batch for c in cfgs} == {1, 4, 8}
    assert {c.page_size for c in cfgs} == {16, 32, 64}


@pytest.mark.parametrize(
    "argv, count",
    [
        (["--head-dim", "128"], 12),
        (["--ctx", "512", "4096", "16384"], 36),
        (["--ctx", "512,4096,16384"], 36),
        (["--gqa", "4", "--batch", "8"], 4),
        (["--page-size", "16", "64"], 48),
        (["--full", "--page-size", "16"], 72),
        (["--full", "--ctx", "32768", "--batch", "8"], 18),
        (["--dtype", "float16", "bfloat16", "float32"], 72),
        (["--dtype", "bfloat16,float32", "--head-dim", "64", "--gqa", "1"], 8),
    ],
)
def test_correctness_axis_flags(argv, count):
    args = correctness.parse_args(argv)
    assert len(correctness.configs(args)) == count


def test_correctness_axis_flag_overrides_only_its_axis():
    args = correctness.parse_args(["--full", "--head-dim", "64"])
    axes = correctness.sweep_axes(args)
    assert axes["head_dim"] == (64,)
    assert axes["ctx"] == correctness.FULL_SWEEP["ctx"]
    cfg = correctness.configs(
        correctness.parse_args(
            [
                "--head-dim",
                "128",
                "--gqa",
                "4",
                "--page-size",
                "16",
                "--ctx",
                "1000",
                "--batch",
                "3",
                "--num-kv-heads",
                "2",
            ]
        )
    )
    assert cfg == [
        correctness.Config(head_dim=128, gqa=4, page_size=16, ctx=1000, batch=3, dtype="float16", num_kv_heads=2)
    ]
    assert cfg[0].num_qo_heads == 8


def test_correctness_chunking_flags():
    lay = correctness._common.plan_layout(4, 1000, 16, seed=0)
    assert correctness.pages_per_chunk(correctness.parse_args([]), lay) is None
    assert correctness.pages_per_chunk(correctness.parse_args(["--force-merge"]), lay) == 1
    assert correctness.pages_per_chunk(correctness.parse_args(["--single-chunk"]), lay) == lay.request_pages.max()
    with pytest.raises(SystemExit):
        correctness.parse_args(["--force-merge", "--single-chunk"])


def test_correctness_flags():
    args = correctness.parse_args(
        ["--force-merge", "--methods", "v2", "--csv", "x.csv", "--tol", "1e-3", "--seed", "7"]
    )
    assert args.force_merge and args.methods == ("v2",) and args.csv == "x.csv" and args.seed == 7
    assert correctness.tolerance(args, "float16") == 1e-3
    default = correctness.parse_args([])
    assert correctness.tolerance(default, "float16") == 2e-2
    assert correctness.tolerance(default, "bfloat16") == 2e-2
    assert correctness.tolerance(default, "float32") == 1e-5


@pytest.mark.parametrize(
    "argv",
    [["--methods", "v3"], ["--dtype", "float64"], ["--ctx", "0"], ["--ctx", "abc"], ["--num-kv-heads", "0"]],
)
def test_correctness_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        correctness.parse_args(argv)
    assert e.value.code == 2


def test_correctness_compare_metrics():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 4, 8))
    lse_ref = rng.standard_normal((2, 4)) + 10
    same = correctness.compare(ref.astype(np.float16), ref, lse_ref.astype(np.float32), lse_ref)
    assert same["finite"] and same["max_rel"] < 1e-3 and same["rel_rms"] < 1e-3 and same["lse_err"] < 1e-6
    bad = ref.copy()
    bad[1, 2, 3] = np.nan
    res = correctness.compare(bad, ref, lse_ref, lse_ref)
    assert not res["finite"] and res["max_rel"] == np.inf
    off = ref.copy()
    off[0, 0, 0] += np.abs(ref).max()  # error as large as the largest value
    assert correctness.compare(off, ref, lse_ref, lse_ref)["max_rel"] == pytest.approx(1.0)
    # an empty request's LSE is -inf in both: fine; -inf against finite: not
    lse_ref2 = lse_ref.copy()
    lse_ref2[1] = -np.inf
    assert correctness.compare(ref, ref, lse_ref2, lse_ref2)["lse_err"] == 0.0
    assert correctness.compare(ref, ref, lse_ref, lse_ref2)["lse_err"] == np.inf


def test_correctness_summary():
    rows = [
        dict(config=0, method="v2", passed=True, max_rel=1e-4, rel_rms=1e-5, lse_err=0.0, ref_s=0.5),
        dict(config=0, method="v1", passed=False, max_rel=3e-2, rel_rms=1e-2, lse_err=0.0, ref_s=0.5),
        dict(config=1, method="v2", passed=False, error="RuntimeError: boom", ref_s=1.5),
    ]
    text, ok = correctness.summarize(rows)
    assert not ok
    assert text.startswith("SUMMARY: 1/3")
    assert "reference: 2.0 s total" in text
    text, ok = correctness.summarize(rows[:1])
    assert ok


# -------------------------------------------------------------- microbench args


def test_microbench_sweeps_are_data():
    assert microbench.DEFAULT_SWEEP == {"batch": (1, 4, 8, 32), "ctx": (1024, 4096, 16384, 32768), "page_size": (16,)}
    assert len(microbench.cells(microbench.parse_args([]))) == 16
    assert len(microbench.cells(microbench.parse_args(["--quick"]))) == 4


def test_microbench_defaults_and_quick(tmp_path):
    args = microbench.parse_args(["--out-dir", str(tmp_path)])
    assert (args.num_qo_heads, args.num_kv_heads, args.head_dim, args.dtype) == (32, 8, 128, "float16")
    assert (args.reps, args.iters, args.host_iters) == (3, 100, 50)
    assert args.methods == ("gather", "v1", "v2", "flashinfer")
    assert args.csv == str(tmp_path / "microbench.csv")
    assert args.md == str(tmp_path / "microbench.md")
    assert args.png == str(tmp_path / "microbench.png")
    quick = microbench.parse_args(["--quick"])
    assert (quick.reps, quick.iters) == (microbench.QUICK_SETTINGS["reps"], microbench.QUICK_SETTINGS["iters"])
    assert microbench.parse_args(["--quick", "--reps", "5"]).reps == 5


def test_microbench_axis_flags(tmp_path):
    args = microbench.parse_args(
        [
            "--batch",
            "2,3",
            "--ctx",
            "100",
            "200",
            "300",
            "--page-size",
            "8",
            "32",
            "--methods",
            "v2",
            "v1",
            "--csv",
            str(tmp_path / "a.csv"),
        ]
    )
    cells = microbench.cells(args)
    assert len(cells) == 12
    assert cells[0] == {"batch": 2, "ctx": 100, "page_size": 8}
    assert args.methods == ("v2", "v1")
    assert args.csv == str(tmp_path / "a.csv")
    assert microbench.cells(microbench.parse_args(["--quick", "--ctx", "512"])) == [
        {"batch": 1, "ctx": 512, "page_size": 16},
        {"batch": 8, "ctx": 512, "page_size": 16},
    ]


@pytest.mark.parametrize("argv", [["--methods", "v9"], ["--num-qo-heads", "12"], ["--reps", "0"], ["--dtype", "int8"]])
def test_microbench_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        microbench.parse_args(argv)
    assert e.value.code == 2


def test_microbench_rotation():
    assert microbench.num_replicas(microbench.ROTATE_BYTES) == 1
    assert microbench.num_replicas(10 * microbench.ROTATE_BYTES) == 1
    assert microbench.num_replicas(microbench.ROTATE_BYTES // 4) == 4
    assert microbench.num_replicas(1) == microbench.MAX_REPLICAS
    for r in (1, 3, 4, 7, 20, 21, 64):
        n = microbench.graph_calls(r)
        assert n >= microbench.GRAPH_CALLS and n % r == 0 and n < microbench.GRAPH_CALLS + r


def test_microbench_summarize_runner():
    r = microbench.Runner("v2", [], None, lambda: None, timing="graph")
    r.samples = {"graph": [10.0, 12.0, 11.0], "event": [20.0, 21.0, 22.0], "host": [5.0, 6.0, 7.0]}
    res = microbench.summarize_runner(r, total_bytes=46_000_000)  # 46 MB in 11 us = 4.18 TB/s
    assert res["us"] == 11.0 and res["graph_us"] == 11.0 and res["event_us"] == 21.0 and res["host_us"] == 6.0
    assert res["tbps"] == pytest.approx(46e6 / 11e-6 / 1e12)
    assert res["pct_roofline"] == pytest.approx(100 * 46e6 / 11e-6 / 4.6e12)
    assert res["spread"] == pytest.approx(2.0 / 11.0)
    assert set(res) <= set(microbench.METHOD_FIELDS)
    # no graph: events are the primary time
    r.samples["graph"] = []
    res = microbench.summarize_runner(r, total_bytes=1)
    assert res["us"] == 21.0 and res["graph_us"] is None


# ------------------------------------------------------------------- writers

# The first released schemas: later versions may append columns, never reorder.
CORRECTNESS_V1 = (
    "config",
    "dtype",
    "head_dim",
    "gqa",
    "num_qo_heads",
    "num_kv_heads",
    "page_size",
    "ctx",
    "batch",
    "seed",
    "force_merge",
    "method",
    "pages_per_chunk",
    "num_chunks",
    "num_ctas",
    "needs_merge",
    "max_rel",
    "rel_rms",
    "lse_err",
    "finite",
    "tol",
    "passed",
    "error",
    "ref_s",
    "run_s",
    "single_chunk",
)
MICROBENCH_V1_HEAD = (
    "batch",
    "ctx",
    "page_size",
    "num_qo_heads",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "page_order",
    "replicas",
    "graph_calls",
    "reps",
    "kv_bytes",
    "total_bytes",
    "v2_pages_per_chunk",
    "v2_num_chunks",
    "v2_num_ctas",
    "v2_needs_merge",
)


def test_csv_schemas_only_append():
    assert correctness.CSV_COLUMNS[: len(CORRECTNESS_V1)] == CORRECTNESS_V1
    cols = microbench.CSV_COLUMNS
    assert cols[: len(MICROBENCH_V1_HEAD)] == MICROBENCH_V1_HEAD
    per_method = tuple(
        f"{m}_{f}"
        for m in ("gather", "v1", "v2", "flashinfer")
        for f in ("us", "graph_us", "event_us", "host_us", "tbps", "pct_roofline", "spread", "timing", "max_rel_vs_v2")
    )
    n = len(MICROBENCH_V1_HEAD)
    assert cols[n : n + len(per_method)] == per_method
    assert cols[n + len(per_method) : n + len(per_method) + 4] == (
        "flashinfer_variant",
        "v2_over_v1",
        "v2_over_gather",
        "v2_over_flashinfer",
    )
    for columns in (correctness.CSV_COLUMNS, microbench.CSV_COLUMNS):
        assert len(set(columns)) == len(columns)
    assert set(microbench.MD_COLUMNS) <= set(microbench.CSV_COLUMNS)
    assert set(microbench.SUMMARY_COLUMNS) <= set(microbench.CSV_COLUMNS)


def test_write_csv_keeps_column_order(tmp_path):
    columns = ("b", "a", "c", "flag", "x")
    rows = [{"a": 1, "b": 2.5, "flag": True}, {"x": float("nan"), "c": "s,t", "flag": False, "b": 1e-7}]
    path = tmp_path / "sub" / "out.csv"
    _common.write_csv(path, columns, rows)
    with path.open() as f:
        got = list(csv.reader(f))
    assert got[0] == list(columns)
    assert got[1] == ["2.5", "1", "", "1", ""]
    assert got[2] == ["1e-07", "", "s,t", "0", ""]
    with pytest.raises(KeyError):
        _common.write_csv(path, columns, [{"unknown": 1}])


def test_markdown_table():
    text = _common.markdown_table(("b", "a"), [{"a": 1.23456789, "b": True}, {"a": None, "b": "x|y"}], {"b": "B"})
    lines = text.splitlines()
    assert lines[0] == "| B | a |"
    assert lines[1] == "|---|---|"
    assert lines[2] == "| yes | 1.235 |"
    assert lines[3] == "| x\\|y |  |"
    assert _common.format_value(2.5e-5) == "2.500e-05"
    assert _common.format_value(float("nan")) == ""
    plain = _common.text_table(("a", "bb"), [{"a": 1, "bb": 2.0}])
    assert plain.splitlines()[0].split() == ["a", "bb"]


def test_microbench_markdown_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = []
    for b in (1, 8):
        for ctx in (1024, 16384):
            row = {
                "batch": b,
                "ctx": ctx,
                "page_size": 16,
                "v2_pages_per_chunk": 2,
                "v2_num_chunks": 64,
                "v2_needs_merge": True,
            }
            for i, m in enumerate(("gather", "v1", "v2")):
                row[f"{m}_us"] = 10.0 * (i + 1)
                row[f"{m}_tbps"] = 1.0 + i
            row["v2_over_v1"] = 0.66
            rows.append(row)
    args = microbench.parse_args(["--out-dir", str(tmp_path), "--methods", "gather,v1,v2"])
    md = microbench.markdown_report(rows, args, None)
    assert "first_page_offset = 0" in md
    assert "| batch | ctx | c | chunks | merge |" in md
    assert md.count("\n| 8 |") == 2
    _common.write_csv(args.csv, microbench.CSV_COLUMNS, rows)
    microbench.plot(rows, ["gather", "v1", "v2"], args.png)
    assert Path(args.png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("v2/v1" in line for line in microbench.summary_lines(rows))


# -------------------------------------------------------------- page layouts


LAYOUT_CASES = [(1, 512, 32), (4, 4096, 32), (8, 1000, 16), (5, 37, 64), (3, 7, 16), (32, 4096, 16)]


@pytest.mark.parametrize("batch, ctx, page_size", LAYOUT_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_reverse_order_with_slack(batch, ctx, page_size, seed):
    lay = _common.plan_layout(batch, ctx, page_size, seed=seed)
    assert lay.batch_size == batch
    # lengths: ctx minus less than one page, never empty
    assert np.all(lay.seq_lens <= ctx) and np.all(lay.seq_lens > max(0, ctx - page_size)) and np.all(lay.seq_lens >= 1)
    # ceil(B/2) requests start mid-page, in [1, P); the others at 0
    mid = lay.first_page_offset > 0
    assert mid.sum() == (batch + 1) // 2
    assert np.all(lay.first_page_offset[mid] < page_size)
    # pages cover offset + length
    np.testing.assert_array_equal(lay.request_pages, -(-(lay.first_page_offset + lay.seq_lens) // page_size))
    assert lay.total_pages == lay.request_pages.sum()
    # 2x slack, reverse physical order, all distinct and in range
    assert lay.num_pages >= 2 * lay.total_pages
    assert lay.page_ids.dtype == np.int32
    ids = lay.page_ids.astype(np.int64)
    assert ids[0] == lay.num_pages - 1
    assert np.all(np.diff(ids) < 0)
    assert ids.min() >= 0 and ids.max() < lay.num_pages
    # logical page j is (at most once, by coincidence) physical page j: a
    # kernel ignoring indices reads the wrong pages
    assert np.sum(ids == np.arange(lay.total_pages)) <= 1


def test_layout_random_order_and_min_pool():
    lay = _common.plan_layout(8, 1024, 16, seed=3, mid_page=False, page_order="random", min_num_pages=100_000)
    assert np.all(lay.first_page_offset == 0)
    assert lay.num_pages == 100_000
    assert len(np.unique(lay.page_ids)) == lay.total_pages
    assert lay.page_ids.max() < lay.num_pages
    assert not np.all(np.diff(lay.page_ids.astype(np.int64)) < 0)  # not simply descending


def test_layout_is_deterministic_and_ragged():
    a = _common.plan_layout(8, 4096, 32, seed=5)
    b = _common.plan_layout(8, 4096, 32, seed=5)
    np.testing.assert_array_equal(a.seq_lens, b.seq_lens)
    np.testing.assert_array_equal(a.page_ids, b.page_ids)
    ends = np.concatenate(
        [
            (lambda lay: (lay.first_page_offset + lay.seq_lens) % lay.page_size)(
                _common.plan_layout(8, 4096, 32, seed=s)
            )
            for s in range(20)
        ]
    )
    assert len(np.unique(ends)) > 5  # last pages are ragged, not all full


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError):
        _common.plan_layout(0, 10, 16, seed=0)
    with pytest.raises(ValueError):
        _common.plan_layout(1, 10, 1, seed=0)
    with pytest.raises(ValueError):
        _common.plan_layout(1, 10, 16, seed=0, page_order="sorted")


@pytest.mark.parametrize("batch, ctx, page_size", LAYOUT_CASES)
def test_layout_table_matches(batch, ctx, page_size):
    lay = _common.plan_layout(batch, ctx, page_size, seed=11)
    table = _common.layout_table(lay)
    assert table.batch_size == batch and table.page_size == page_size
    np.testing.assert_array_equal(table.seq_lens, lay.seq_lens)
    np.testing.assert_array_equal(table.first_page_offset, lay.first_page_offset)
    np.testing.assert_array_equal(table.indices, lay.page_ids)
    np.testing.assert_array_equal(table.request_pages, lay.request_pages)
    assert table.max_page_id < lay.num_pages
    assert np.all((table.last_page_len >= 1) & (table.last_page_len <= page_size))


def test_bytes():
    lay = _common.plan_layout(2, 100, 16, seed=0, mid_page=False)
    kv = _common.kv_bytes(lay, 8, 128, 2)
    assert kv == 2 * int(lay.seq_lens.sum()) * 8 * 128 * 2
    total = _common.decode_bytes(lay, 32, 8, 128, 2)
    assert total == kv + 2 * 2 * 32 * 128 * 2 + 4 * (lay.total_pages + 3 + 2 + 2)


def test_parse_list_and_dtypes():
    assert _common.parse_list(["1,2", "3"], int) == (1, 2, 3)
    assert _common.parse_list(None, int) is None
    with pytest.raises(ValueError):
        _common.parse_list([","], int)
    assert _common.resolve_dtype("float16") == np.float16
    assert _common.resolve_dtype("bfloat16").name == "bfloat16"
    with pytest.raises(ValueError):
        _common.resolve_dtype("int8")


# ----------------------------------------------------------- no GPU, imports


def _run(*argv):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_importing_the_scripts_has_no_side_effects():
    code = (
        "import sys; sys.path.insert(0, 'scripts'); import _common, correctness, microbench; "
        "print(sorted(m for m in ('cupy', 'torch', 'flashinfer', 'matplotlib', 'tqdm') if m in sys.modules))"
    )
    res = _run("-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.parametrize("script", ["correctness.py", "microbench.py"])
def test_help_documents_exit_codes(script):
    res = _run(f"scripts/{script}", "--help")
    assert res.returncode == 0, res.stderr
    assert "3 = no CUDA GPU" in res.stdout


@pytest.mark.skipif("_gpu_present()", reason="this machine has a GPU")
@pytest.mark.parametrize("script, argv", [("correctness.py", []), ("microbench.py", ["--quick"])])
def test_no_gpu_exits_with_status_3(script, argv, tmp_path):
    res = _run(f"scripts/{script}", *argv, "--csv", str(tmp_path / "x.csv"))
    assert res.returncode == _common.EXIT_NO_GPU == 3, res.stdout + res.stderr
    assert _common.NO_GPU_MESSAGE in res.stderr
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.skipif("_gpu_present()", reason="this machine has a GPU")
def test_main_exits_3_in_process(capsys):
    for module, argv in ((correctness, []), (microbench, ["--quick"])):
        with pytest.raises(SystemExit) as e:
            module.main(argv)
        assert e.value.code == 3
        assert "no CUDA GPU" in capsys.readouterr().err
