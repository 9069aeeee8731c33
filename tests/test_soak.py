"""The serving-loop soak (scripts/soak.py, issue 7 item 6), run in-process.

CPU: a short ``--backend cpu`` soak must pass and must really have forked,
trimmed, freed and rebuilt plans (so it cannot pass vacuously); a tiny pool
must hit exhaustion and still pass; two sabotaged runs (copy-on-write not
applied, pages leaked) must fail. GPU (marker ``gpu``): a short
``--backend gpu`` soak against the float64 reference.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

import cupaged

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

soak = importlib.import_module("soak")


def run_soak(capsys, *argv):
    """``soak.main(argv)`` in-process -> (exit status, parsed summary)."""
    code = soak.main([*argv, "--quiet"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines, "the soak printed no summary"
    return code, json.loads(lines[-1])


def test_cpu_soak_passes_and_exercises_every_operation(capsys):
    # chunks of 4 pages: the default plan keeps these short requests whole,
    # and the soak must check the split/merge path too
    code, s = run_soak(capsys, "--backend", "cpu", "--steps", "120", "--sequences", "64",
                       "--checkpoint-every", "40", "--pages-per-chunk", "4")
    assert code == 0, s["failure"]
    assert s["ok"] and s["failure"] is None
    assert s["steps"] == 120 and s["backend"] == "cpu"
    assert s["arrivals"] == 64 and s["arrivals_pending"] == 0
    assert s["sequences_seen"] >= 64 + s["forks"]
    # the run did what a serving loop does, so the invariants were checked on real churn
    assert s["forks"] > 0 and s["fork_copies"] > 0
    assert s["trims"] > 0 and s["window_trims"] > 0 and s["pages_dropped"] > 0
    assert s["frees"] > 0 and s["finished"] > 0
    assert s["prefill_chunks"] > 0
    assert s["plan_rebuilds"] > 1 and s["plan_reuses"] > 0
    assert s["stale_plan_rejections"] == s["plan_rebuilds"] - 1  # every stale plan was refused
    assert s["merge_steps"] > 0  # the split/merge path was checked, not only single chunks
    assert s["checkpoints"] == 3
    assert 0 < s["worst_max_rel"] <= soak.CPU_TOL and s["worst_lse_err"] <= soak.CPU_TOL
    assert 0 < s["peak_pages_in_use"] <= 224


def test_cpu_soak_survives_pool_exhaustion(capsys):
    code, s = run_soak(capsys, "--backend", "cpu", "--steps", "80", "--sequences", "24", "--num-pages", "40",
                       "--checkpoint-every", "20", "--seed", "3")
    assert code == 0, s["failure"]
    assert s["oom_refusals"] > 0 and s["evictions"] > 0  # refused operations left the pool unchanged
    assert s["peak_pages_in_use"] == 40
    assert s["checkpoints"] >= 3


def test_cpu_soak_writes_the_summary_file(capsys, tmp_path):
    path = tmp_path / "soak.json"
    code, s = run_soak(capsys, "--backend", "cpu", "--steps", "10", "--sequences", "8", "--json", str(path))
    assert code == 0
    assert json.loads(path.read_text()) == s


def test_sabotaged_copy_on_write_is_caught(capsys, monkeypatch):
    monkeypatch.setattr(cupaged, "apply_page_copies", lambda caches, copies: None)
    code, s = run_soak(capsys, "--backend", "cpu", "--steps", "120", "--sequences", "64")
    assert code == 1 and not s["ok"]
    assert "through the page table" in s["failure"]
    capsys.readouterr()


def test_leaked_pages_are_caught(capsys, monkeypatch):
    def leaky_release(self, pages):  # drops references but never returns a page to the free list
        for p in pages:
            self._refcount[p] -= 1

    monkeypatch.setattr(cupaged.BlockPool, "_release", leaky_release)
    code, s = run_soak(capsys, "--backend", "cpu", "--steps", "120", "--sequences", "64")
    assert code == 1 and not s["ok"]
    assert "free list" in s["failure"] or "leak" in s["failure"]


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        soak.main(["--backend", "cpu", "--num-qo-heads", "6", "--num-kv-heads", "4"])
    assert e.value.code == 2


@pytest.mark.skipif(cupaged.has_gpu(), reason="this machine has a GPU")
def test_gpu_backend_without_gpu_exits_3(capsys):
    assert soak.main(["--backend", "gpu", "--steps", "5"]) == 3
    captured = capsys.readouterr()
    assert "no CUDA GPU" in captured.err and captured.out == ""


@pytest.mark.gpu
def test_gpu_soak_short(capsys):
    code, s = run_soak(capsys, "--backend", "gpu", "--steps", "150", "--sequences", "64",
                       "--checkpoint-every", "30")
    assert code == 0, s["failure"]
    assert s["checkpoints"] >= 4 and s["decode_steps"] > 100
    assert s["forks"] > 0 and s["trims"] > 0 and s["frees"] > 0 and s["plan_rebuilds"] > 1
    assert s["stale_plan_rejections"] == s["plan_rebuilds"] - 1
    assert s["worst_max_rel"] <= soak.GPU_TOL["float16"]
