"""GPU tests carry the marker ``gpu`` and skip cleanly where CUDA has no device.

The short summary (``-rfE`` in pyproject.toml) lists failures and errors;
skips are summed up here, one line per reason, instead of one line per
skipping test location (``-ra`` printed 84 such lines on a CPU).
"""

from collections import Counter

import pytest

from cupaged import has_gpu

NO_GPU = "no CUDA GPU on this machine"


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        if isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
            reason = str(report.longrepr[2])
            reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", "skipped, by reason")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n:5d}  {reason}")
