"""decode trusts only consistent plans (issue 17 item 2): a plan that
plan_decode did not make is checked once, and every field the kernel's
memory safety rests on must agree with the others. CPU only."""

import dataclasses
import pickle

import numpy as np
import pytest

import cupaged
from cupaged._validate import check_plan_structure


@pytest.fixture(scope="module")
def plan():
    table = cupaged.PageTable.from_seq_lens([3000, 100, 17], 16)
    p = cupaged.plan_decode(table, 32, 8, 128, np.float16, target_ctas=10**5)
    assert p.needs_merge and p.num_chunks > 3
    return p


def _shifted(a):
    a = np.asarray(a).copy()
    a[1:] += 1
    return a


@pytest.mark.parametrize("field,value", [
    ("needs_merge", False),
    ("grid", lambda p: (p.grid[0] * 2, 1, 1)),
    ("num_ctas", lambda p: p.num_ctas + 8),
    ("heads_per_cta", 8),
    ("heads_groups", lambda p: p.heads_groups * 2),
    ("o_indptr", lambda p: _shifted(p.o_indptr)),
    ("chunk_request", lambda p: np.zeros_like(p.chunk_request)),
    ("chunk_index", lambda p: np.zeros_like(p.chunk_index)),
    ("launch_order", lambda p: np.zeros_like(p.launch_order)),
    ("request_chunk_pages", lambda p: np.full_like(p.request_chunk_pages, p.pages_per_chunk + 1)),
    ("num_chunks", lambda p: p.num_chunks + 1),
])
def test_inconsistent_plans_are_refused(plan, field, value):
    value = value(plan) if callable(value) else value
    bad = dataclasses.replace(plan, **{field: value})
    with pytest.raises(cupaged.PlanMismatchError, match="inconsistent DecodePlan"):
        check_plan_structure(bad)


def test_consistent_copies_pass(plan):
    check_plan_structure(plan)
    check_plan_structure(dataclasses.replace(plan))  # a consistent copy: checked once, passes
    check_plan_structure(pickle.loads(pickle.dumps(plan)))
    # another launch order (a permutation) is a legal plan: the chunk sweep's A/B uses it
    check_plan_structure(dataclasses.replace(plan, launch_order=np.arange(plan.num_chunks)[::-1].copy()))
