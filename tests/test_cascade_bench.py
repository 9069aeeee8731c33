"""CPU tests of scripts/cascade_bench.py: argument parsing, the batch layout
and its tables, byte counts, output names, speedups, the report, and the
no-GPU exit. Nothing here needs a GPU."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

import cupaged

from helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

_common = importlib.import_module("_common")
bench = importlib.import_module("cascade_bench")


_run = run_python


def test_defaults_are_the_issue_cell():
    args = bench.parse_args([])
    assert (args.num_requests, args.prefix_len, args.suffix_len) == (64, 32768, 256)
    assert (args.num_qo_heads, args.num_kv_heads, args.head_dim, args.page_size, args.dtype) == (32, 8, 128, 16,
                                                                                               "float16")
    assert args.methods == ("cascade", "plain", "flashinfer") and args.out_dir == "docs/benchmarks"
    assert args.reps >= 3 and args.stem is None


def test_flags():
    args = bench.parse_args(["--num-requests", "8", "--prefix-len", "1024", "--suffix-len", "0", "--methods",
                             "cascade,plain", "--dtype", "bfloat16", "--reps", "2", "--stem", "x-1"])
    assert (args.num_requests, args.prefix_len, args.suffix_len, args.dtype) == (8, 1024, 0, "bfloat16")
    assert args.methods == ("cascade", "plain") and args.reps == 2 and args.stem == "x-1"


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefix-len", "1000"],  # not a multiple of the page size
        ["--num-requests", "0"],
        ["--suffix-len", "-1"],
        ["--num-qo-heads", "12"],
        ["--methods", "cascade,v9"],
        ["--dtype", "float32"],
        ["--reps", "0"],
        ["--stem", "a/b"],
    ],
)
def test_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_output_paths_and_gpu_tag():
    args = bench.parse_args(["--out-dir", "somewhere"])
    assert bench.output_paths(args, "NVIDIA H200", "2026-11-29") == (
        Path("somewhere/cascade-h200-2026-11-29.csv"), Path("somewhere/cascade-h200-2026-11-29.md"))
    assert bench.gpu_tag("NVIDIA A100-SXM4-80GB") == "a100" and bench.gpu_tag("?") == "gpu"
    named = bench.parse_args(["--stem", "mine"])
    assert bench.output_paths(named, "NVIDIA H200", "d")[0].name == "mine.csv"


def test_layout_and_tables_describe_one_batch():
    lay = bench.plan_layout(5, 64, 20, 16, seed=1)
    assert lay.prefix_pages.shape == (4,) and lay.suffix_pages.shape == (5, 2) and lay.num_pages == 2 * 14
    ids = np.concatenate([lay.prefix_pages, lay.suffix_pages.reshape(-1)])
    assert len(set(ids.tolist())) == 14 and ids.max() < lay.num_pages
    assert not np.array_equal(ids, np.arange(14))  # shuffled
    shared, unique, gi, concat = bench.layout_tables(lay)
    assert shared.seq_lens.tolist() == [64] and unique.seq_lens.tolist() == [20] * 5 and gi.tolist() == [0, 5]
    assert concat.seq_lens.tolist() == [84] * 5 and concat.request_pages.tolist() == [6] * 5
    for b in range(5):
        pages = concat.indices[concat.indptr[b]:concat.indptr[b + 1]].tolist()
        assert pages == lay.prefix_pages.tolist() + lay.suffix_pages[b].tolist()
    assert cupaged.plan_cascade(shared, unique, gi, 32, 8, 128, np.float16).matches(shared, unique, gi)
    with pytest.raises(ValueError, match="multiple"):
        bench.plan_layout(2, 30, 5, 16, seed=0)


def test_empty_suffixes_layout():
    shared, unique, gi, concat = bench.layout_tables(bench.plan_layout(3, 32, 0, 16, seed=0))
    assert unique.request_pages.tolist() == [0, 0, 0] and concat.seq_lens.tolist() == [32] * 3


def test_byte_counts():
    lay = bench.plan_layout(4, 64, 16, 16, seed=0)
    min_bytes, plain = bench.byte_counts(lay, 8, 2, 64, 2)
    per_token = 2 * 2 * 64 * 2
    qo = 2 * 4 * 8 * 64 * 2
    assert min_bytes == (64 + 4 * 16) * per_token + qo
    assert plain == 4 * (64 + 16) * per_token + qo


def test_speedups_without_baselines():
    rows = [{"method": "cascade", "us": 10.0}, {"method": "plain", "us": None}]
    bench.add_speedups(rows)
    assert rows[0]["speedup_vs_plain"] is None and rows[0]["speedup_vs_flashinfer"] is None


def test_report_and_csv(tmp_path):
    args = bench.parse_args(["--num-requests", "2", "--prefix-len", "32", "--suffix-len", "4"])
    row = {"method": "cascade", "us": 12.5, "spread": 0.031, "min_bytes": 2**20, "plain_bytes": 2**21,
           "min_tbps": 0.08, "plan": "prefix pass 8x8 heads, c=2, 8 CTAs; suffix c=1, 16 CTAs"}
    meta = {"command": "python3 scripts/cascade_bench.py", "gpu": "NVIDIA H200", "date": "2026-11-29 12:00 UTC",
            "commit": "abc123", "versions": "CuPy 14"}
    text = bench.markdown_report([row, {"method": "plain", "us": 40.0, "spread": 0.05, "min_bytes": 2**20,
                                        "plain_bytes": 2**21}], meta, args, ["flashinfer unavailable: no torch"])
    for part in ("python3 scripts/cascade_bench.py", "NVIDIA H200", "2026-11-29 12:00 UTC", "abc123",
                 "largest here 5.0%", "| cascade | 12.5 |", "note: flashinfer unavailable"):
        assert part in text, part
    path = tmp_path / "c.csv"
    _common.write_csv(path, bench.CSV_COLUMNS, [row])
    header = path.read_text().splitlines()[0].split(",")
    assert tuple(header) == bench.CSV_COLUMNS and header[:2] == ["method", "num_requests"]


def test_importing_has_no_side_effects():
    code = ("import sys; sys.path.insert(0, 'scripts'); import cascade_bench; "
            "print(sorted(m for m in ('cupy', 'torch', 'flashinfer', 'matplotlib') if m in sys.modules))")
    res = _run("-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_help_documents_exit_codes():
    res = _run("scripts/cascade_bench.py", "--help")
    assert res.returncode == 0, res.stderr
    assert "3 = no CUDA GPU" in res.stdout and "--prefix-len" in res.stdout


@pytest.mark.skipif(_common.has_gpu(), reason="this machine has a GPU")
def test_no_gpu_exits_with_status_3(tmp_path):
    res = _run("scripts/cascade_bench.py", "--out-dir", str(tmp_path))
    assert res.returncode == _common.EXIT_NO_GPU == 3, res.stdout + res.stderr
    assert _common.NO_GPU_MESSAGE in res.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(_common.has_gpu(), reason="this machine has a GPU")
def test_main_exits_3_in_process(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main(["--out-dir", str(tmp_path)])
    assert e.value.code == 3
    assert "no CUDA GPU" in capsys.readouterr().err


def test_bad_arguments_exit_2_before_the_gpu_check():
    res = _run("scripts/cascade_bench.py", "--prefix-len", "1000")
    assert res.returncode == 2 and "multiple of --page-size" in res.stderr
