#!/usr/bin/env python3
"""Issue #20's targets (large batches: HBM streaming and fixed cost per
launch), marked per cell of a ``scripts/microbench.py --suite issue5`` CSV,
written as ``PREFIX.{csv,md,png}`` (``docs/benchmarks/h200-large-<date>``).

Pure host code (no cupy, no GPU)::

    python3 scripts/large_report.py OUT/microbench-issue5.csv --out docs/benchmarks/h200-large-2026-12-02 \\
        [--baseline OLD/microbench-issue5.csv --baseline-label c000a05]

``scripts/gpu_run.sh OUT large`` runs the suite's v2 and FlashInfer columns
(``.peer`` carried) and this report in one step.

The targets, by the KV bytes a cell moves (K and V, each element once):

* ``target_fi``: KV >= 256 MB: v2 GPU time <= FlashInfer-best;
* ``target_tbs``: KV >= 1 GB: v2 >= 4.45 TB/s; 256 MB - 1 GB: >= 4.2 TB/s;
* ``target_small``: KV <= 64 MB: v2 <= bytes / roofline + 4 us, with the
  roofline re-measured for the issue (:data:`ROOFLINE_BPS`, ``roofline.py``).
  The suite times such a cell in a CUDA graph of back-to-back calls that
  rotate over ``replicas`` independent caches until 256 MB of KV is cycled:
  a multi-layer step over distinct caches. A cell whose rotation would fit in
  the L2 (:data:`L2_BYTES`) is marked not measured;
* ``target_baseline`` (with ``--baseline``): v2 no slower than the baseline
  run's v2 on the same cell, beyond :data:`BASELINE_TOLERANCE` (run-to-run
  noise of interleaved A/B runs on the H200).

Times are the suite's (median GPU µs per call under graph replay; TB/s of
every byte a call reads, as microbench reports them).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

try:  # run as a script (scripts/ is sys.path[0]) or imported with scripts/ on the path
    import bench_report as br
except ImportError:  # imported as scripts.large_report
    from scripts import bench_report as br

ROOFLINE_BPS = 4.59e12  # H200 read roofline re-measured for issue 20 (8 GB, cp.async.bulk ring; int4 loads 4.54)
L2_BYTES = 60 << 20
GB, MB = 1e9, 1e6
LARGE_KV, MID_KV, SMALL_KV = 1 * GB, 256 * MB, 64 * MB
TBPS_LARGE, TBPS_MID = 4.45, 4.2
SMALL_SLACK_US = 4.0
BASELINE_TOLERANCE = 0.01

#: (column, short header, rule) in report order.
TARGETS = (
    ("target_fi", ">=FI", "v2 GPU time <= FlashInfer-best where KV >= 256 MB"),
    ("target_tbs", "TB/s", f"v2 >= {TBPS_LARGE} TB/s where KV >= 1 GB, >= {TBPS_MID} TB/s where 256 MB <= KV < 1 GB"),
    ("target_small", "small",
     f"v2 <= bytes / {ROOFLINE_BPS / 1e12:.2f} TB/s + {SMALL_SLACK_US:g} µs where KV <= 64 MB "
     "(graph of back-to-back calls over distinct caches, cold L2)"),
    ("target_baseline", "vs base", f"v2 no slower than the baseline run's v2 (+{BASELINE_TOLERANCE:.0%} noise)"),
)
TARGET_COLUMNS = tuple(t[0] for t in TARGETS)
COLUMNS = ("group", "batch", "ctx", "dtype", "page_size", "num_qo_heads", "num_kv_heads", "head_dim", "kv_bytes",
           "total_bytes", "size_class", "replicas", "graph_calls", "v2_us", "v2_tbps", "fi_best_us",
           "flashinfer_variant", "fi_tbps", "fi_over_v2", "floor_us", "over_floor_us", "baseline_v2_us",
           "new_over_baseline", *TARGET_COLUMNS)


def size_class(kv: float) -> str:
    """``">=1GB"``, ``"256MB-1GB"``, ``"<=64MB"`` or ``""`` (64-256 MB: no
    target).

    >>> [size_class(x) for x in (2e9, 5e8, 1e8, 4e6)]
    ['>=1GB', '256MB-1GB', '', '<=64MB']
    """
    if kv >= LARGE_KV:
        return ">=1GB"
    if kv >= MID_KV:
        return "256MB-1GB"
    return "<=64MB" if kv <= SMALL_KV else ""


def _key(row: Mapping[str, Any]) -> tuple:
    return tuple(str(row.get(k)) for k in ("dtype", "page_size", "num_qo_heads", "num_kv_heads", "head_dim",
                                            "batch", "ctx"))


def evaluate(row: Mapping[str, Any], baseline: Mapping[tuple, Mapping[str, Any]] | None = None) -> dict:
    """One report row (:data:`COLUMNS`) of a suite CSV row.

    Example: a 4.2 MB cell at 7.6 µs misses the small-cell target
    (floor 4157712 B / 4.59 TB/s = 0.91 µs, + 4 µs = 4.91 µs).
    """
    num = br._num
    v2, fi = num(row, "v2_us"), num(row, "flashinfer_us")
    tbps = num(row, "v2_tbps")
    kv = num(row, "kv_bytes") or 0.0
    total = num(row, "total_bytes") or kv
    cls = size_class(kv)
    floor = total / ROOFLINE_BPS * 1e6
    replicas = br._int(row, "replicas") or 1
    base = (baseline or {}).get(_key(row))
    old = num(base, "v2_us") if base else None
    out = {k: row.get(k, "") for k in COLUMNS if k in row}
    out.update({
        "size_class": cls,
        "v2_us": v2, "v2_tbps": tbps, "fi_best_us": fi, "fi_tbps": num(row, "flashinfer_tbps"),
        "fi_over_v2": fi / v2 if fi and v2 else None,
        "floor_us": floor, "over_floor_us": v2 - floor if v2 is not None else None,
        "baseline_v2_us": old, "new_over_baseline": v2 / old if v2 and old else None,
        "target_fi": br._mark(kv >= MID_KV, None if v2 is None or fi is None else v2 <= fi),
        "target_tbs": br._mark(kv >= MID_KV, None if tbps is None else
                               tbps >= (TBPS_LARGE if kv >= LARGE_KV else TBPS_MID)),
        "target_small": br._mark(cls == "<=64MB", None if v2 is None or replicas * kv <= L2_BYTES else
                                 v2 <= floor + SMALL_SLACK_US),
        "target_baseline": br._mark(baseline is not None, None if v2 is None or old is None else
                                    v2 <= old * (1 + BASELINE_TOLERANCE)),
    })
    return out


def read_csv(paths: Sequence[str | Path]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def counts(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, int, int, int, int]]:
    """(rule, cells, met, missed, not measured) per target that applies somewhere."""
    out = []
    for column, _, rule in TARGETS:
        marks = [r.get(column) for r in rows if r.get(column)]
        if marks:
            out.append((rule, len(marks), marks.count(br.MET), marks.count(br.MISSED), marks.count(br.UNMEASURED)))
    return out


HEADERS = ("group", "batch", "ctx", "KV MB", "class", "caches", "v2 µs", "v2 TB/s", "FI-best µs", "FI", "FI TB/s",
           "FI / v2", "floor µs", "v2 − floor µs", "base v2 µs", "new / base", ">=FI", "TB/s", "small", "vs base")


def _line(r: Mapping[str, Any]) -> str:
    f = br._fmt
    kv = br._num(r, "kv_bytes") or 0.0
    variant = {"cuda_cores": "CC", "tensor_cores": "TC"}.get(str(r.get("flashinfer_variant")), "")
    cells = (r.get("group", ""), r.get("batch"), r.get("ctx"), f"{kv / MB:.1f}", r.get("size_class") or "–",
             r.get("replicas", ""), f(r.get("v2_us")), f(r.get("v2_tbps"), 3), f(r.get("fi_best_us")), variant,
             f(r.get("fi_tbps"), 3), f(r.get("fi_over_v2"), 3), f(r.get("floor_us"), 3), f(r.get("over_floor_us"), 3),
             f(r.get("baseline_v2_us")), f(r.get("new_over_baseline"), 3),
             *(br._show_mark(r.get(c, "")) for c in TARGET_COLUMNS))
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], source: str, baseline_label: str) -> str:
    lines = br.report_header("cupaged paged decode on large batches: issue #20 targets", meta,
                             f", then `python3 scripts/large_report.py {source}`")
    lines.append("- **Time**: the issue-5 suite's (GPU µs per call under CUDA-graph replay, median over repetitions, "
                 "v2 and FlashInfer's two decode variants interleaved on the same caches). "
                 + str(meta.get("timing", "")))
    lines.append(f"- **Roofline**: {ROOFLINE_BPS / 1e12:.2f} TB/s, re-measured on the H200 (`scripts/roofline.py`, "
                 "8 GB, cold L2: 4.54 TB/s with int4 loads, 4.59 with cp.async.bulk; "
                 "docs/benchmarks/roofline-h200-2026-12-01.csv); floor = bytes / roofline")
    if baseline_label:
        lines.append(f"- **Baseline**: v2 of `{baseline_label}` from another run of the same suite")
    lines += ["", "## Targets", ""]
    lines += br._table(("target", "cells", "met", "missed", "not measured"),
                       (f"| {rule} | {n} | {met} | {missed} | {nm} |" for rule, n, met, missed, nm in counts(rows)))
    lines += ["", "## Cells", "",
              "Marks: met, **missed**, n/m = applies but not measured, – = does not apply. caches = independent "
              "cache copies the graph rotates through.", ""]
    lines += br._table(HEADERS, (_line(r) for r in rows))
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str) -> None:
    """v2 and FlashInfer-best TB/s per cell of KV >= 256 MB, with the targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    big = [r for r in rows if (br._num(r, "kv_bytes") or 0) >= MID_KV]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(big) + 2), 4))
    x = range(len(big))
    ax.plot(x, [br._num(r, "v2_tbps") for r in big], "o-", label="v2")
    ax.plot(x, [br._num(r, "fi_tbps") for r in big], "s--", label="FlashInfer-best")
    for y, label in ((TBPS_LARGE, f"{TBPS_LARGE} TB/s (>= 1 GB)"), (TBPS_MID, f"{TBPS_MID} TB/s (256 MB-1 GB)")):
        ax.axhline(y, linestyle=":", linewidth=1, color="g" if y == TBPS_LARGE else "y", label=label)
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r.get('group', '')} {r.get('batch')}x{r.get('ctx')}" for r in big], rotation=40,
                       ha="right", fontsize=7)
    ax.set_ylabel("TB/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: Sequence[Mapping[str, Any]], prefix: str | Path, meta: Mapping[str, Any], source: str,
          baseline_label: str = "") -> None:
    prefix = Path(prefix)
    with open(f"{prefix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    Path(f"{prefix}.md").write_text(markdown(rows, meta, source, baseline_label))
    plot(rows, f"{prefix}.png", f"issue #20 cells >= 256 MB ({meta.get('gpu', '?')}, {meta.get('commit', '?')})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="large_report.py",
        description="Mark the large-batch targets (KV >= 256 MB: no slower than FlashInfer-best and >= 4.45 / "
                    "4.2 TB/s; KV <= 64 MB: <= bytes / 4.59 TB/s + 4 us over distinct caches; optionally no "
                    "slower than a baseline run) per cell of a microbench.py --suite issue5 CSV, and write "
                    "PREFIX.csv, PREFIX.md and PREFIX.png.")
    p.add_argument("csv", nargs="+", help="microbench --suite issue5 CSV(s)")
    p.add_argument("--out", required=True, help="output prefix: writes PREFIX.csv, .md and .png")
    p.add_argument("--baseline", nargs="*", default=None, help="another suite run's CSV(s): the no-slower check")
    p.add_argument("--baseline-label", default="", help="the baseline's commit, for the report")
    p.add_argument("--meta", help="the suite's meta.json (default: next to the first CSV)")
    args = p.parse_args(argv)
    meta_path = Path(args.meta) if args.meta else Path(args.csv[0]).with_suffix(".meta.json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    baseline = {_key(r): r for r in read_csv(args.baseline)} if args.baseline else None
    rows = [evaluate(r, baseline) for r in read_csv(args.csv)]
    if not rows:
        print("large_report.py: no cells in the input", file=sys.stderr)
        return 2
    write(rows, args.out, meta, " ".join(args.csv), args.baseline_label)
    for rule, n, met, missed, nm in counts(rows):
        print(f"SUMMARY {met} met, {missed} missed, {nm} not measured (of {n}): {rule}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
