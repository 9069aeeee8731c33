"""DecodeRunner's host-side helper that needs no GPU: the smallest chunk cap
that fits a plan into the runner's unit capacity."""

import numpy as np
import pytest

from cupaged.runner import cap_for_units


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
