"""GPU tests carry the marker ``gpu`` and skip cleanly where CUDA has no device."""

import pytest

from cupaged import has_gpu


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
