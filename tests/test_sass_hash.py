"""scripts/sass_hash.py: the same sources hash alike, a change that alters
the machine code is reported, a comment-only change is not. NVRTC on the
CPU (marked compile: run with -m compile)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sass_hash = importlib.import_module("sass_hash")


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_hash.py"), *args], capture_output=True,
                          text=True, timeout=900)


def test_text_sections_of_a_minimal_elf():
    import struct

    # an ELF64 with a null section, .shstrtab and one .text.k section of 4 bytes
    names = b"\0.shstrtab\0.text.k\0"
    body = b"ABCD"
    shoff = 64 + len(names) + len(body)
    head = bytearray(64)
    head[:4] = b"\x7fELF"
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 1)
    sec = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
           struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, len(names), 0, 0, 1, 0),
           struct.pack("<IIQQQQIIQQ", 11, 1, 0, 0, 64 + len(names), 4, 0, 0, 1, 0)]
    assert sass_hash.text_sections(bytes(head) + names + body + b"".join(sec)) == {"k": b"ABCD"}


@pytest.mark.compile
def test_code_change_differs_and_comment_change_does_not(tmp_path):
    src = ROOT / "cuda_src"
    comment, code = tmp_path / "comment", tmp_path / "code"
    shutil.copytree(src, comment)
    shutil.copytree(src, code)
    text = (src / "append_kv.cu").read_text()
    (comment / "append_kv.cu").write_text("// a comment only\n" + text)
    old = "__float_as_uint(f[0]), __float_as_uint(f[1])"
    assert old in text
    (code / "append_kv.cu").write_text(text.replace(old, "__float_as_uint(f[1]), __float_as_uint(f[0])"))
    res = _run("--families", "append", "--src", str(comment), "--against", str(src))
    assert res.returncode == 0 and " instances identical" in res.stdout, res.stdout + res.stderr
    res = _run("--families", "append", "--src", str(code), "--against", str(src))
    assert res.returncode == 1 and "differs: append/float32/0" in res.stdout, res.stdout + res.stderr
    assert "differs: append/float16" not in res.stdout  # the float32 packer only


_ALIGN_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import sass_hash
for dtype in ("float16", "float16+float8_e4m3fn"):
    cubin, lowered = sass_hash.compile_cubin("partial", dtype, 128)
    for name, (size, align) in sass_hash.section_sizes(cubin).items():
        if name.startswith(".nv.shared._Z") and "MMA" in lowered.get(name[len(".nv.shared."):], "MMA"):
            print(dtype, size, align)
"""


def _static_shared(src):
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    if src is not None:
        env["CUPAGED_CUDA_SRC"] = str(src)
    res = subprocess.run([sys.executable, "-c", _ALIGN_CHECK, str(ROOT / "scripts")], env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    return [tuple(line.split()) for line in res.stdout.splitlines()]


@pytest.mark.compile
def test_the_mma_ring_starts_128_byte_aligned(tmp_path):
    """The dynamic shared memory (the K/V ring) begins where the static
    shared section ends, rounded up to its alignment: 16 mod 32 made the L2
    serve 1.5x the K/V sectors (docs/architecture.md). Each tensor-core
    instance's static section must end on 128 bytes; the old layout
    (make_variant padded) does not, so this test can fail."""
    rows = _static_shared(None)
    assert rows and all(int(size) % 128 == 0 and int(align) >= 128 for _, size, align in rows), rows
    make_variant = importlib.import_module("make_variant")
    make_variant.apply(["padded"], tmp_path / "padded")
    old = _static_shared(tmp_path / "padded")
    assert old and all(int(size) % 32 == 16 for _, size, _ in old), old
