"""CPU tests of the autotune cache file (cupaged.autotune): concurrent
writers, planted symlinks, unsafe directories, malformed content and planted
winners that are not valid chunk sizes (issue 17). ``tuned_plan`` runs here
with the device-name lookup and ``tune`` faked."""

from __future__ import annotations

import json
import multiprocessing
import os
import types

import numpy as np
import pytest

from cupaged import autotune
from cupaged.page_table import PageTable

TUNED = 5  # what the fake tune measures


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(autotune.ENV_CACHE_DIR, str(d))
    return d


@pytest.fixture
def fake_gpu(monkeypatch):
    """tuned_plan on the CPU: a device called "Fake GPU" and a tune that
    records its calls and returns TUNED. Yields (arrays, key, tune calls)."""
    import cupy

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda i: {"name": b"Fake GPU"})
    monkeypatch.setattr(cupy.cuda, "Device", lambda: types.SimpleNamespace(id=0))
    calls = []

    def tune(q, k_cache, v_cache, table, *, store=True, kv_layout="NHD"):
        calls.append(table)
        return autotune.TuneResult("key", TUNED, 1, {TUNED: 1.0})

    monkeypatch.setattr(autotune, "tune", tune)
    table = PageTable.from_seq_lens([100, 7], 16)
    q = np.zeros((2, 8, 128), np.float16)
    k = np.zeros((table.indices.size, 16, 8, 128), np.float16)
    key = autotune.cache_key("Fake GPU", np.float16, 128, 1, table, k.dtype)
    return (q, k, k, table), key, calls


def test_a_valid_cached_winner_is_used(cache_dir, fake_gpu):
    arrays, key, calls = fake_gpu
    (cache_dir / "autotune.json").write_text(json.dumps({key: 3}))
    assert autotune.tuned_plan(*arrays).pages_per_chunk == 3 and not calls


@pytest.mark.parametrize("bad", [2**32, 2**31, 0, -3, 2.5, True, "4", None, [4]])
def test_a_planted_winner_that_is_not_a_chunk_size_is_ignored(cache_dir, fake_gpu, bad):
    """2**32 would reach the kernel's int as 0; the rest are not chunk sizes
    (True would pass as 1). Each is ignored with a warning and re-tuned."""
    arrays, key, calls = fake_gpu
    (cache_dir / "autotune.json").write_text(json.dumps({key: bad, "other": 2}))
    with pytest.warns(UserWarning, match="ignored 1 entries"):
        plan = autotune.tuned_plan(*arrays)
    assert plan.pages_per_chunk == TUNED and len(calls) == 1


MALFORMED = {
    "not json": b"{not json",
    "not utf-8": b"\xff\xfe{}",
    "a list": b"[1, 2]",
    "a string": b'"x"',
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "huge int": b'{"k": ' + b"9" * 5000 + b"}",
    "infinity": b'{"k": 1e400}',
}


@pytest.mark.parametrize("content", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_cache_counts_as_empty_with_a_warning(cache_dir, fake_gpu, content):
    arrays, key, calls = fake_gpu
    (cache_dir / "autotune.json").write_bytes(content.replace(b'"k"', json.dumps(key).encode()))
    with pytest.warns(UserWarning, match="cupaged autotune cache"):
        assert autotune._load_cache() == {}
    with pytest.warns(UserWarning, match="cupaged autotune cache"):
        assert autotune.tuned_plan(*arrays).pages_per_chunk == TUNED
    assert len(calls) == 1


def test_a_symlinked_cache_file_is_not_followed(cache_dir, tmp_path, fake_gpu):
    """Links planted at the cache file and at the old fixed temp name: no read
    goes through them and no write reaches their target."""
    arrays, key, calls = fake_gpu
    target = tmp_path / "target.json"
    target.write_text(json.dumps({key: 3}))
    (cache_dir / "autotune.json").symlink_to(target)
    (cache_dir / "autotune.tmp").symlink_to(target)
    with pytest.warns(UserWarning, match="symlink"):
        assert autotune._load_cache() == {}
    with pytest.warns(UserWarning, match="symlink"):
        assert autotune.tuned_plan(*arrays).pages_per_chunk == TUNED
    with pytest.warns(UserWarning, match="symlink"):
        autotune._store(key, 7)
    assert target.read_text() == json.dumps({key: 3})
    assert (cache_dir / "autotune.json").is_symlink()


def test_a_directory_writable_by_others_is_refused(cache_dir):
    (cache_dir / "autotune.json").write_text(json.dumps({"k": 3}))
    cache_dir.chmod(0o777)
    with pytest.warns(UserWarning, match="writable by others"):
        assert autotune._load_cache() == {}
    with pytest.warns(UserWarning, match="writable by others"):
        autotune._store("k2", 4)
    assert json.loads((cache_dir / "autotune.json").read_text()) == {"k": 3}


def test_a_directory_of_another_user_is_refused(cache_dir, monkeypatch):
    autotune._store("k", 3)
    assert autotune._load_cache() == {"k": 3}
    monkeypatch.setattr(autotune, "_current_uid", lambda: os.getuid() + 1)
    with pytest.warns(UserWarning, match="not by the current user"):
        assert autotune._load_cache() == {}
    with pytest.warns(UserWarning, match="not by the current user"):
        autotune._store("k2", 4)
    assert json.loads((cache_dir / "autotune.json").read_text()) == {"k": 3}


def _store_keys(worker: int, n: int) -> None:
    for i in range(n):
        autotune._store(f"worker{worker}|key{i}", i + 1)


def test_concurrent_writers_keep_every_key(cache_dir):
    """Four processes store 200 keys each into one cache: all 800 survive,
    and no temporary file is left behind."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    procs = [ctx.Process(target=_store_keys, args=(w, 200)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    cache = autotune._load_cache()
    assert cache == {f"worker{w}|key{i}": i + 1 for w in range(4) for i in range(200)}
    assert sorted(os.listdir(cache_dir)) == ["autotune.json", "autotune.json.lock"]
