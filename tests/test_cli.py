"""``python -m cupaged``: --version, --help, demo's arguments and output, and
info (run as a subprocess, as a user runs them; CPU only)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cupaged
from cupaged import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "cupaged", *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=timeout)


def test_version():
    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout == f"cupaged {cupaged.__version__}\n", res.stderr


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"], ["info", "--help"]])
def test_help_is_plain_text(args):
    res = run_cli(*args)
    assert res.returncode == 0 and res.stdout.startswith("usage: python -m cupaged"), res.stderr
    assert not re.search(r"``|:func:|:class:|:mod:|:meth:", res.stdout), res.stdout


def test_every_option_has_help():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for p in [parser, *commands.choices.values()]:
        for action in p._actions:
            assert action.help, (p.prog, action.option_strings)
    demo_help = run_cli("demo", "--help").stdout
    assert "number of requests, 1 to 64" in demo_help and "seed of the random" in demo_help


@pytest.mark.parametrize("value, message", [("0", "0 is not in 1..64"), ("65", "65 is not in 1..64"),
                                            ("-3", "-3 is not in 1..64"), ("six", "not an integer")])
def test_demo_rejects_a_bad_batch_cleanly(value, message):
    res = run_cli("demo", "--batch", value)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"error: argument --batch: {message}" in res.stderr


@pytest.mark.parametrize("batch", [1, 2, 6])
def test_demo_decodes_the_batch_it_was_given(batch):
    res = run_cli("demo", "--batch", str(batch))
    assert res.returncode == 0, res.stdout + res.stderr
    first, lens = res.stdout.splitlines()[:2]
    assert first.startswith(f"batch of {batch} request{'s' if batch > 1 else ''}")
    assert len(re.match(r"seq_lens \[([^\]]*)\]", lens).group(1).split(",")) == batch
    if not cupaged.has_gpu():
        assert "no CUDA GPU: cupaged.decode needs one; " in res.stdout


def test_info_without_compiling(tmp_path):
    res = run_cli("info", "--no-compile", CUPAGED_CACHE_DIR=str(tmp_path / "tune"),
                  CUPY_CACHE_DIR=str(tmp_path / "kernels"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"cupaged {cupaged.__version__} (Python ")
    assert f"CuPy kernel cache: {tmp_path / 'kernels'} (env CUPY_CACHE_DIR)" in lines
    assert f"cupaged autotune cache: {tmp_path / 'tune' / 'autotune.json'} (env CUPAGED_CACHE_DIR)" in lines
    assert "kernels: not compiled (--no-compile)" in lines
    if not cupaged.has_gpu():
        assert any(ln.startswith("no CUDA GPU: cupaged.decode needs one; ") for ln in lines)
    else:
        assert any(re.match(r"GPU \d+ of \d+: .*, compute capability \d+\.\d", ln) for ln in lines)


def test_info_compiles_each_family_and_reports_failures(monkeypatch, capsys):
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    from cupaged import _configs, _loader

    monkeypatch.setattr(nvrtc, "getVersion", lambda: (13, 0))
    calls = []

    def fake_compile(family, dtype, head_dim, arch):
        calls.append((family, arch))
        if family == "merge":
            raise RuntimeError("merge/float16/128: NVRTC_ERROR_COMPILATION\nlog ...")
        return {"kernel": None}

    monkeypatch.setattr(_loader, "compile_for_arch", fake_compile)
    assert cli.main(["info"]) == 1
    out = capsys.readouterr().out
    assert [f for f, _ in calls] == list(_configs.SOURCES)
    if not cupaged.has_gpu():
        assert {a for _, a in calls} == {"sm_90"} and "compiling one module per kernel family for sm_90" in out
    assert re.search(r"^  partial  ok \(float16, head_dim 128, 1 instances", out, re.M)
    assert "  merge    FAILED: merge/float16/128: NVRTC_ERROR_COMPILATION\n" in out
