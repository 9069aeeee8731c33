"""The one table of KV formats (``_configs.KV_FORMATS``, issue 19): what the
dtype tables, the q/KV pairs and the storage lookup derive from (CPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupaged import _configs, plan


@pytest.mark.parametrize("fmt", list(_configs.KV_FORMATS.values()), ids=list(_configs.KV_FORMATS))
def test_a_format_is_stored_in_an_array_of_its_own_width(fmt):
    # a cache array of the storage dtype is viewed as the values' dtype (reference, gather)
    assert np.dtype(fmt.storage).itemsize == np.dtype(fmt.name).itemsize
    assert (fmt.storage != fmt.name) == fmt.scaled  # only a scaled format hides behind another dtype
    assert set(fmt.q_dtypes) <= set(_configs.DTYPES)


def test_storage_lookup_names_the_scaled_format_only():
    assert _configs.stored_format(np.uint8).name == _configs.FP8
    for name in _configs.DTYPES:
        assert _configs.stored_format(np.dtype(name)) is None
    assert plan.canonical_kv_dtype(np.uint8) == np.dtype(ml_dtypes.float8_e4m3fn)


def test_pairs_follow_the_table():
    pairs = {(q, kv) for q, kvs in _configs.KV_DTYPES.items() for kv in kvs}
    expected = {(q, q) for q in _configs.DTYPES} | {
        (q, f.name) for f in _configs.KV_FORMATS.values() if f.scaled for q in f.q_dtypes}
    assert pairs == expected
    assert all(kvs[0] == q for q, kvs in _configs.KV_DTYPES.items())  # q's own first
    for q, kv in pairs:
        assert f"{q} q with {kv} KV" in _configs.pairs_text()
        assert (np.dtype(q), np.dtype(kv)) in plan.SUPPORTED_DTYPE_PAIRS
