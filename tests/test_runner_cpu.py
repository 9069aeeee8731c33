"""DecodeRunner's host-side parts that need no GPU: the smallest chunk cap
that fits a plan into the runner's unit capacity, and its own plans."""

import numpy as np
import pytest

import cupaged
from cupaged import plan as plan_mod
from cupaged.runner import DecodeRunner, cap_for_units


@pytest.mark.parametrize("seed", range(20))
def test_cap_for_units_is_the_smallest_cap_that_fits(seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 64))
    pages = rng.integers(0, 5000, batch)
    max_units = batch + int(rng.integers(0, 300))
    cap = cap_for_units(pages, max_units)

    def units(c):
        return int(np.maximum(1, -(-pages // c)).sum())

    assert units(cap) <= max_units
    assert cap == 1 or units(cap - 1) > max_units


def _host_runner(max_units: int) -> DecodeRunner:
    """A DecodeRunner's planning state (32 q / 8 kv heads, head_dim 128, fp16,
    row groups) without its GPU constructor: only ``_plan`` is used."""
    runner = DecodeRunner.__new__(DecodeRunner)
    runner.num_qo_heads, runner.num_kv_heads, runner.head_dim = 32, 8, 128
    runner.dtype, runner.kv_dtype, runner.group_tokens, runner.max_units = np.dtype(np.float16), None, True, max_units
    return runner


def test_runner_plans_for_its_four_warp_kernel():
    """The runner's plans are plan_decode's for a 4-warp rows kernel
    (``eight_warps=False``: no 8-warp choices), within ``max_units``."""
    table = cupaged.PageTable.from_seq_lens([32768], page_size=16)
    ptr = np.array([0, 8], np.int32)
    plan = _host_runner(4096)._plan((table, None, ptr), {"num_sms": 132})
    want = plan_mod._plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, num_sms=132, group_tokens=True,
                                 eight_warps=False)
    assert plan.ctas_per_sm == want.ctas_per_sm == 2 and plan.group_last.tolist() == want.group_last.tolist()
    assert plan.request_chunks.tolist() == want.request_chunks.tolist()
    assert cupaged.plan_decode(table, 32, 8, 128, np.float16, qo_indptr=ptr, num_sms=132).ctas_per_sm == 1
    small = _host_runner(16)._plan((table, None, ptr), {"num_sms": 132})  # over max_units: re-planned to fit
    assert small.num_chunks == 16 and small.request_chunks.tolist() == [2] * 8 and small.ctas_per_sm == 2
