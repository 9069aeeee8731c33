"""Every script in scripts/ answers --help with its usage, exit status 0,
quickly and without side effects (no GPU run, no compile, no file written),
in plain words; every argparse argument has a help text. CPU only."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir()
                 if p.suffix in (".py", ".sh") and not p.name.startswith("_"))  # _common.py is a module
#: Words of the project's own bookkeeping that mean nothing to a reader of --help.
INTERNAL = re.compile(r"issue ?#\d|\bSPEC\b|SPEC's|\.peer\b|device call|device tool")


def test_every_script_is_covered():
    names = {p.name for p in SCRIPTS}
    assert {"gpu_check.sh", "gpu_run.sh", "kernel_resources.py", "ab_sources.py", "autotune.py",
            "chunk_sweep.py", "host_profile.py", "microbench.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_and_exits_0(script, tmp_path):
    cmd = ["bash", str(script), "--help"] if script.suffix == ".sh" else [sys.executable, str(script), "--help"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("usage: ") and len(res.stdout.splitlines()) >= 3, res.stdout
    assert took < 20, f"{script.name} --help took {took:.1f} s"
    assert not list(tmp_path.iterdir()), f"{script.name} --help wrote {list(tmp_path.iterdir())}"
    words = " ".join(res.stdout.split())  # argparse wraps lines anywhere
    assert not INTERNAL.search(words), INTERNAL.search(words).group(0)


@pytest.mark.parametrize("script", [p for p in SCRIPTS if p.suffix == ".py"], ids=lambda p: p.name)
def test_every_argument_has_help(script):
    tree = ast.parse(script.read_text(encoding="utf-8"))
    bare = [ast.unparse(n)[:80] for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
            and not any(k.arg == "help" for k in n.keywords)]
    assert not bare, f"{script.name}: arguments without help: {bare}"


@pytest.mark.parametrize("script, args", [("gpu_run.sh", []), ("gpu_check.sh", []), ("nb_peer.sh", ["--bogus"])])
def test_shell_scripts_without_arguments_print_usage(script, args, tmp_path):
    res = subprocess.run(["bash", str(ROOT / "scripts" / script), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 2 and res.stderr.startswith("usage: "), res.stdout + res.stderr
    assert not list(tmp_path.iterdir())
