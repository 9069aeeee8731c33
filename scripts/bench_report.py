#!/usr/bin/env python3
"""Issue #5 targets, evaluated per cell of a microbenchmark CSV, and the
markdown report that marks each one met or missed.

Pure host code (no cupy, no GPU): ``scripts/microbench.py --suite issue5``
calls :func:`evaluate_row` on every measured cell and :func:`markdown_report`
after every cell; run as a script it re-renders the report from a CSV (and
the ``*.meta.json`` written next to it)::

    python3 scripts/bench_report.py OUT/microbench-issue5.csv --md OUT/report.md

The targets (issue #5, GPU time under CUDA-graph replay):

* ``target_no_slower``: v2 no slower than FlashInfer-best (the better of its
  CUDA-core and tensor-core decode), every cell;
* sweep geometric mean of FlashInfer-best / v2 over the main sweep
  (:func:`in_main_sweep`) >= 1.25 (:func:`geomean_fi_over_v2`);
* ``target_tbs``: main-shape cells moving >= 256 MB of KV reach >= 4.2 TB/s;
* ``target_small``: main-shape cells moving <= 64 MB of KV take
  <= bytes / 4.6 TB/s + 5 us;
* ``target_v1`` / ``target_gather``: main-shape cells with ctx >= 4096:
  v2 no slower than v1, and at least 2x faster than gather;
* ``target_host``: median host time of one ``cupaged.decode`` call with a
  held plan, no graph, <= 8 us (cells where it was measured; the worse of
  ``method="v2"`` and the default ``method="auto"``).

A mark is ``met``, ``missed``, ``not measured`` (the target applies but a
time is missing: method skipped or failed) or empty (the target does not
apply to the cell). Every cell with a missed target gets a ``bound`` hint
derived from its numbers (:func:`bound_note`), for a person to confirm/edit.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

try:  # run as a script (scripts/ is sys.path[0]) or imported with scripts/ on the path
    import _common
except ImportError:  # imported as scripts.bench_report
    from scripts import _common

# ------------------------------------------------------------------ targets

ROOFLINE_BPS = _common.ROOFLINE_BPS  # 4.6 TB/s read roofline of the H200
NUM_SMS = 132  # H200
TARGET_TBPS = 4.2  # TB/s for cells moving >= LARGE_KV_BYTES
LARGE_KV_BYTES = 256e6
SMALL_KV_BYTES = 64e6
SMALL_SLACK_US = 5.0  # small cells: GPU time <= bytes / roofline + this
HOST_TARGET_US = 8.0
GEOMEAN_TARGET = 1.25
GATHER_FACTOR = 2.0
SLOW_BASELINE_MIN_CTX = 4096  # v1 / gather targets apply from this ctx on

#: The issue's main sweep: 32 q / 8 kv heads, head_dim 128, these dtypes and
#: page sizes, batch x ctx plus ctx 131072 for batch <= 8.
MAIN_SHAPE = {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128}
MAIN_DTYPES = ("float16", "bfloat16")
MAIN_PAGE_SIZES = (16, 32)
MAIN_BATCH = (1, 4, 8, 32, 128)
MAIN_CTX = (1024, 4096, 16384, 32768)
LONG_CTX = 131072
LONG_MAX_BATCH = 8

MET, MISSED, UNMEASURED = "met", "missed", "not measured"

#: (column, short header, rule) in report order.
TARGETS = (
    ("target_no_slower", ">=FI", "v2 GPU time <= FlashInfer-best (every cell)"),
    ("target_tbs", ">=4.2TB/s", "v2 >= 4.2 TB/s where KV >= 256 MB (main shape)"),
    ("target_small", "small", "v2 <= bytes/4.6 TB/s + 5 us where KV <= 64 MB (main shape)"),
    ("target_v1", ">=v1", "v2 GPU time <= v1 where ctx >= 4096 (main shape)"),
    ("target_gather", ">=2x gather", "v2 GPU time <= gather / 2 where ctx >= 4096 (main shape)"),
    ("target_host", "host<=8us", "median host time of one decode call with a held plan <= 8 us (measured cells)"),
)
TARGET_COLUMNS = tuple(t[0] for t in TARGETS)
#: Columns :func:`evaluate_row` adds (microbench appends them to its CSV schema).
EVAL_COLUMNS = ("fi_best_us", "roofline_us", *TARGET_COLUMNS, "bound")


def _num(row: Mapping[str, Any], key: str) -> float | None:
    """``row[key]`` as a float; None when missing, empty or NaN."""
    value = row.get(key)
    if value is None or value == "":
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _int(row: Mapping[str, Any], key: str) -> int | None:
    value = _num(row, key)
    return None if value is None else int(value)


def is_main_shape(row: Mapping[str, Any]) -> bool:
    """32 q / 8 kv heads, head_dim 128, fp16/bf16, page 16/32."""
    return (
        all(_int(row, k) == v for k, v in MAIN_SHAPE.items())
        and row.get("dtype") in MAIN_DTYPES
        and _int(row, "page_size") in MAIN_PAGE_SIZES
    )


def in_main_sweep(row: Mapping[str, Any]) -> bool:
    """A cell of the issue's main sweep (the geometric-mean population)."""
    if not is_main_shape(row):
        return False
    batch, ctx = _int(row, "batch"), _int(row, "ctx")
    return batch in MAIN_BATCH and (ctx in MAIN_CTX or (ctx == LONG_CTX and batch <= LONG_MAX_BATCH))


def _mark(applies: bool, ok: bool | None) -> str:
    if not applies:
        return ""
    if ok is None:
        return UNMEASURED
    return MET if ok else MISSED


def roofline_us(total_bytes: float) -> float:
    """Time to read ``total_bytes`` at the roofline, in us.

    >>> round(roofline_us(46e6), 3)
    10.0
    """
    return total_bytes / ROOFLINE_BPS * 1e6


def host_time(row: Mapping[str, Any]) -> float | None:
    """The host time the target is judged on: the worse of ``method="v2"``
    and the default method, where measured."""
    vals = [v for v in (_num(row, "v2_host_us"), _num(row, "v2_auto_host_us")) if v is not None]
    return max(vals) if vals else None


def evaluate_row(row: Mapping[str, Any]) -> dict:
    """Target marks of one cell -> ``{column: value}`` for :data:`EVAL_COLUMNS`.

    ``row`` needs the microbench fields (``v2_us``, ``flashinfer_us``,
    ``v1_us``, ``gather_us``, ``v2_tbps``, ``kv_bytes``, ``total_bytes``, the
    shape); strings from a CSV are fine.

    Example: a 4 MB cell where v2 takes 12.5 us and FlashInfer 8.6 us misses
    the no-slower target; 12.5 us > 4.16e6 B / 4.6 TB/s + 5 us = 5.9 us misses
    the small-cell target too.
    """
    v2 = _num(row, "v2_us")
    fi = _num(row, "flashinfer_us")
    v1 = _num(row, "v1_us")
    gather = _num(row, "gather_us")
    tbps = _num(row, "v2_tbps")
    kv = _num(row, "kv_bytes") or 0.0
    total = _num(row, "total_bytes") or kv
    ctx = _int(row, "ctx") or 0
    main = is_main_shape(row)
    roof = roofline_us(total)
    host = host_time(row)
    slow = main and ctx >= SLOW_BASELINE_MIN_CTX
    out = {
        "fi_best_us": fi,
        "roofline_us": roof,
        "target_no_slower": _mark(True, None if v2 is None or fi is None else v2 <= fi),
        "target_tbs": _mark(main and kv >= LARGE_KV_BYTES, None if tbps is None else tbps >= TARGET_TBPS),
        "target_small": _mark(main and kv <= SMALL_KV_BYTES, None if v2 is None else v2 <= roof + SMALL_SLACK_US),
        "target_v1": _mark(slow, None if v2 is None or v1 is None else v2 <= v1),
        "target_gather": _mark(slow, None if v2 is None or gather is None else gather >= GATHER_FACTOR * v2),
        "target_host": _mark(host is not None, None if host is None else host <= HOST_TARGET_US),
    }
    out["bound"] = bound_note(row, [c for c in TARGET_COLUMNS if out[c] == MISSED])
    return out


def bound_note(row: Mapping[str, Any], missed: Sequence[str]) -> str:
    """An automatically derived hint of what bounds a cell that missed
    ``missed`` (target columns); empty when nothing was missed. A hint from
    the numbers, for a person to confirm or edit in the report.

    * GPU-time targets: *latency-bound* when the time over the roofline
      (``v2_us - bytes / 4.6 TB/s``) exceeds the roofline time itself, else
      *bandwidth* at N % of the roofline; FlashInfer's figure alongside, and
      the grid (CTAs per SM, whether requests split and merge).
    * v1 / gather / host: the ratio or time that missed.
    """
    if not missed:
        return ""
    parts = []
    v2 = _num(row, "v2_us")
    fi = _num(row, "flashinfer_us")
    total = _num(row, "total_bytes") or _num(row, "kv_bytes") or 0.0
    roof = roofline_us(total)
    if v2 and {"target_no_slower", "target_tbs", "target_small"} & set(missed):
        over = v2 - roof
        pct = 100.0 * roof / v2
        fi_text = ""
        if fi:
            fi_text = f" (FI {fi - roof:.1f} us over, {100.0 * roof / fi:.0f} %)"
        if over > roof:
            parts.append(f"latency-bound: v2 - bytes/4.6 TB/s = {over:.1f} us, {pct:.0f} % of roofline{fi_text}")
        else:
            parts.append(f"bandwidth: v2 at {pct:.0f} % of roofline, {over:.1f} us over{fi_text}")
        ctas = _int(row, "v2_num_ctas")
        if ctas:
            merge = row.get("v2_needs_merge")
            split = "split+merge" if merge in (True, 1, "1", "True", "yes") else "no split"
            parts.append(f"grid {ctas} CTAs = {ctas / NUM_SMS:.2f}/SM, {split}")
    if "target_v1" in missed:
        v1 = _num(row, "v1_us")
        parts.append(f"v1 faster: v1/v2 time = {v1 / v2:.2f}" if v1 and v2 else "v1 faster")
    if "target_gather" in missed:
        gather = _num(row, "gather_us")
        parts.append(f"gather within 2x: gather/v2 time = {gather / v2:.2f}" if gather and v2 else "gather within 2x")
    if "target_host" in missed:
        host = host_time(row)
        fi_host = _num(row, "flashinfer_host_us")
        text = f"host path {host:.1f} us median"
        if fi_host is not None:
            text += f" (FI {fi_host:.1f} us)"
        parts.append(text)
    return "; ".join(parts)


def geomean_fi_over_v2(rows: Iterable[Mapping[str, Any]], main_only: bool = True) -> tuple[float | None, int]:
    """Geometric mean of FlashInfer-best / v2 over the cells where both were
    timed (by default only the main sweep) -> ``(value or None, cells)``.

    >>> geomean_fi_over_v2([{"v2_us": 1.0, "flashinfer_us": 2.0}, {"v2_us": 2.0, "flashinfer_us": 1.0}], False)
    (1.0, 2)
    """
    logs = []
    for row in rows:
        if main_only and not in_main_sweep(row):
            continue
        v2, fi = _num(row, "v2_us"), _num(row, "flashinfer_us")
        if v2 and fi:
            logs.append(math.log(fi / v2))
    if not logs:
        return None, 0
    return math.exp(sum(logs) / len(logs)), len(logs)


def target_counts(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Per target: how many cells it applies to, met, missed, not measured."""
    out = []
    for column, short, rule in TARGETS:
        marks = [r.get(column) or "" for r in rows]
        out.append(
            {
                "target": column,
                "short": short,
                "rule": rule,
                "cells": sum(bool(m) for m in marks),
                MET: marks.count(MET),
                MISSED: marks.count(MISSED),
                UNMEASURED: marks.count(UNMEASURED),
            }
        )
    return out


def spread_stats(rows: Sequence[Mapping[str, Any]], method: str) -> tuple[float, float, int] | None:
    """``(max, median, cells > 5 %)`` of ``<method>_spread`` in percent."""
    vals = [100.0 * v for r in rows if (v := _num(r, f"{method}_spread")) is not None]
    if not vals:
        return None
    return max(vals), statistics.median(vals), sum(v > 5.0 for v in vals)


# ------------------------------------------------------------------ report


def group_label(row: Mapping[str, Any]) -> str:
    """``"float16, page 16, 32 q / 8 kv heads, head_dim 128"``."""
    return (
        f"{row.get('dtype')}, page {row.get('page_size')}, {row.get('num_qo_heads')} q / "
        f"{row.get('num_kv_heads')} kv heads, head_dim {row.get('head_dim')}"
    )


def group_rows(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, list]]:
    """Rows grouped by their ``group`` column (else by shape): groups of the
    main shape first, then the others, each in order of first appearance;
    rows within a group sorted by (batch, ctx)."""
    groups: dict[str, list] = {}
    for row in rows:
        key = row.get("group") or group_label(row)
        groups.setdefault(key, []).append(row)
    # the main sweep's groups first (stable), cells by batch then ctx
    items = sorted(groups.items(), key=lambda kv: not is_main_shape(kv[1][0]))
    return [(k, sorted(g, key=lambda r: (_int(r, "batch") or 0, _int(r, "ctx") or 0))) for k, g in items]


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or value == "":
        return ""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(value):
        return ""
    if abs(value) >= 10 ** digits:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _show_mark(mark: str) -> str:
    return {MET: "met", MISSED: "**missed**", UNMEASURED: "n/m"}.get(mark or "", "–")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


CELL_HEADERS = (
    "batch",
    "ctx",
    "KV MB",
    "v2 µs",
    "FI-best µs",
    "FI variant",
    "FI/v2",
    "v2 TB/s",
    "% roof",
    ">=FI",
    ">=4.2TB/s",
    "small",
    "v1 µs",
    "v1/v2",
    ">=v1",
    "gather µs",
    "gather/v2",
    ">=2x gather",
    "bound (auto hint, edit)",
)


def _cell_line(row: Mapping[str, Any]) -> str:
    v2 = _num(row, "v2_us")
    kv = _num(row, "kv_bytes")
    gather = _num(row, "gather_us")
    gather_text = _fmt(gather, 5)
    if gather is None and row.get("gather_timing"):
        timing = str(row["gather_timing"])
        if timing.startswith("skipped"):
            gather_text = timing.split(":", 1)[0]
    cells = [
        str(row.get("batch", "")),
        str(row.get("ctx", "")),
        _fmt(None if kv is None else kv / 1e6, 4),
        _fmt(v2),
        _fmt(_num(row, "flashinfer_us")),
        {"tensor_cores": "TC", "cuda_cores": "CC"}.get(str(row.get("flashinfer_variant") or ""), ""),
        _fmt(_ratio(_num(row, "flashinfer_us"), v2), 3),
        _fmt(_num(row, "v2_tbps"), 3),
        _fmt(_num(row, "v2_pct_roofline"), 3),
        _show_mark(row.get("target_no_slower", "")),
        _show_mark(row.get("target_tbs", "")),
        _show_mark(row.get("target_small", "")),
        _fmt(_num(row, "v1_us")),
        _fmt(_ratio(_num(row, "v1_us"), v2), 3),
        _show_mark(row.get("target_v1", "")),
        gather_text,
        _fmt(_ratio(gather, v2), 3),
        _show_mark(row.get("target_gather", "")),
        str(row.get("bound") or "").replace("|", "\\|"),
    ]
    return "| " + " | ".join(cells) + " |"


def _table(headers: Sequence[str], lines: Iterable[str]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|", *lines]


def report_header(title: str, meta: Mapping[str, Any], command_suffix: str = "") -> list[str]:
    """The opening lines every report shares: ``# title (date)``, then the
    command (``command_suffix`` appended), GPU, date and commit, and the
    software versions when ``meta`` has them."""
    lines = [f"# {title} ({str(meta.get('date', '?'))[:10]})", ""]
    lines.append(f"- **Command**: `{meta.get('command', '?')}`{command_suffix}")
    lines.append(f"- **GPU**: {meta.get('gpu', '?')}; clocks as found")
    lines.append(f"- **Date**: {meta.get('date', '?')}; **commit**: `{meta.get('commit', '?')}`")
    if meta.get("versions"):
        lines.append(f"- **Software**: {meta['versions']}")
    return lines


def markdown_report(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> str:
    """The issue #5 report: header (command, GPU, date, commit, spread),
    target counts and the geometric mean, host times, then one table per
    group of cells with every target marked and a bound hint per missed
    cell. ``meta`` keys (all optional): command, gpu, date, commit,
    versions, timing, elapsed_s, planned, skipped (list of str), notes (list
    of str)."""
    meta = dict(meta or {})
    lines = report_header("cupaged paged decode vs FlashInfer: issue #5 targets", meta)
    lines.append(
        "- **Time**: GPU µs per call under CUDA-graph replay, median over repetitions (methods interleaved, "
        "same cache buffers and page table for every method; gather cannot be captured (cuBLAS) and is timed "
        "with CUDA events around back-to-back calls). "
        + str(meta.get("timing", ""))
    )
    lines.append(
        "- **Bytes**: every visible K and V element once + q + out + int32 page table; TB/s and % of the "
        f"{ROOFLINE_BPS / 1e12:.1f} TB/s read roofline from them. KV MB (targets' size classes) counts K and V only."
    )
    spreads = []
    for method, name in (("v2", "v2"), ("flashinfer", "FlashInfer"), ("v1", "v1")):
        s = spread_stats(rows, method)
        if s:
            spreads.append(f"{name} max {s[0]:.1f} % (median {s[1]:.1f} %, {s[2]} cells > 5 %)")
    if spreads:
        lines.append("- **Spread** (max − min) / median over repetitions: " + "; ".join(spreads))
    planned = meta.get("planned")
    elapsed = meta.get("elapsed_s")
    run = f"{len(rows)}" + (f"/{planned}" if planned else "") + " cells measured"
    if elapsed is not None:
        run += f" in {float(elapsed):.0f} s"
    skipped = list(meta.get("skipped") or [])
    if skipped:
        run += f"; {len(skipped)} not run (see Notes)"
    lines.append(f"- **Run**: {run}")
    lines += ["", "## Targets", ""]
    counts = target_counts(rows)
    body = [
        f"| {c['rule']} | {c['cells']} | {c[MET]} | {c[MISSED]} | {c[UNMEASURED]} |" for c in counts
    ]
    gm, n = geomean_fi_over_v2(rows)
    gm_mark = "" if gm is None else (MET if gm >= GEOMEAN_TARGET else MISSED)
    lines += _table(("target", "cells", "met", "missed", "not measured"), body)
    lines += [
        "",
        (
            f"**Geometric mean of FlashInfer-best / v2 over the main sweep** ({n} cells): "
            f"**{_fmt(gm, 3) or 'n/a'}** (target ≥ {GEOMEAN_TARGET}: {_show_mark(gm_mark)})"
        ),
        "",
    ]
    per_group = []
    for key, grows in group_rows(rows):
        g, gn = geomean_fi_over_v2(grows, main_only=False)
        if gn:
            per_group.append(f"{key}: {_fmt(g, 3)} ({gn} cells)")
    if per_group:
        lines += ["Per group (FI-best / v2, geometric mean): " + "; ".join(per_group) + ".", ""]
    host_rows = [r for r in rows if r.get("target_host")]
    if host_rows:
        lines += ["## Host time of one call (held plan, no graph, `out` given; median of individually timed calls)", ""]
        body = [
            f"| {r.get('group') or group_label(r)} | {r.get('batch')} | {r.get('ctx')} | "
            f"{_fmt(_num(r, 'v2_host_us'), 3)} | {_fmt(_num(r, 'v2_auto_host_us'), 3)} | "
            f"{_fmt(_num(r, 'flashinfer_host_us'), 3)} | {_show_mark(r.get('target_host', ''))} |"
            for r in host_rows
        ]
        lines += _table(("group", "batch", "ctx", 'v2 µs (method="v2")', "v2 µs (default method)", "FI µs", "≤ 8 µs"), body)
        lines.append("")
    lines += [
        "## Cells",
        "",
        "Marks: met, **missed**, n/m = applies but not measured (method skipped or failed: see Notes and the "
        "CSV's *_timing columns), – = does not apply. FI variant: CC = CUDA cores (use_tensor_cores=False), "
        "TC = tensor cores. The bound column is derived from the numbers (time over the roofline, % of roofline, "
        "grid); confirm or replace it.",
        "",
    ]
    for key, grows in group_rows(rows):
        lines += [f"### {key}: {group_label(grows[0])}", ""]
        lines += _table(CELL_HEADERS, (_cell_line(r) for r in grows))
        lines.append("")
    notes = list(meta.get("notes") or []) + [f"not run: {s}" for s in skipped]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def summary_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """Compact terminal summary: target counts, the geometric mean, and per
    group a batch x ctx grid of FI-best / v2 (``*`` marks a cell with any
    missed target)."""
    out = []
    for c in target_counts(rows):
        out.append(
            f"  {c['short']:>12}: {c[MET]:3d} met, {c[MISSED]:3d} missed, {c[UNMEASURED]:3d} not measured "
            f"(of {c['cells']})"
        )
    gm, n = geomean_fi_over_v2(rows)
    verdict = "n/a" if gm is None else (MET if gm >= GEOMEAN_TARGET else MISSED)
    out.append(f"  geomean FI-best/v2 over main sweep: {_fmt(gm, 3) or 'n/a'} ({n} cells; >= {GEOMEAN_TARGET}: {verdict})")
    hosts = [h for r in rows if (h := host_time(r)) is not None]
    if hosts:
        out.append(f"  host us per decode call (max of v2/auto): min {min(hosts):.1f}, max {max(hosts):.1f}")
    for key, grows in group_rows(rows):
        ctxs = sorted({_int(r, "ctx") for r in grows})
        batches = sorted({_int(r, "batch") for r in grows})
        grid = {(_int(r, "batch"), _int(r, "ctx")): r for r in grows}
        out.append(f"  {key} FI-best/v2 (* = a target missed)")
        out.append("    " + "batch\\ctx".rjust(9) + "".join(f"{c:>9}" for c in ctxs))
        for b in batches:
            cells = []
            for c in ctxs:
                r = grid.get((b, c))
                if r is None:
                    cells.append("")
                    continue
                ratio = _ratio(_num(r, "flashinfer_us"), _num(r, "v2_us"))
                star = "*" if any(r.get(t) == MISSED for t in TARGET_COLUMNS) else " "
                cells.append(("-" if ratio is None else f"{ratio:.2f}") + star)
            out.append("    " + f"{b:>9}" + "".join(f"{x:>9}" for x in cells))
    return "\n".join(out)


# ------------------------------------------------------------------- meta


def git_commit(root: str | Path | None = None) -> str:
    """``git rev-parse --short HEAD`` (``+dirty`` when tracked files
    changed) of ``root``; else env ``CUPAGED_COMMIT`` / ``GIT_COMMIT``; else
    ``"unknown"``."""
    import os

    root = Path(root) if root else Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=False
        )
        if head.returncode == 0 and head.stdout.strip():
            commit = head.stdout.strip()
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            )
            if dirty.returncode == 0 and dirty.stdout.strip():
                commit += "+dirty"
            return commit
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("CUPAGED_COMMIT") or os.environ.get("GIT_COMMIT") or "unknown"


def meta_path(csv_path: str | Path) -> Path:
    """Where the run's metadata goes next to its CSV: ``x.csv`` -> ``x.meta.json``."""
    p = Path(csv_path)
    return p.with_name(p.stem + ".meta.json")


def read_csv_rows(path: str | Path) -> list[dict]:
    """CSV rows with numbers parsed back (empty cells -> None)."""

    def parse(value: str):
        if value == "":
            return None
        for cast in (int, float):
            try:
                return cast(value)
            except ValueError:
                pass
        return value

    with Path(path).open(newline="") as f:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="bench_report.py",
        description="Re-evaluate the performance targets of a microbench.py --suite CSV and write the markdown report.",
    )
    p.add_argument("csv", help="microbench CSV (e.g. OUT/microbench-issue5.csv)")
    p.add_argument("--meta", help="run metadata JSON (default: next to the CSV, <stem>.meta.json)")
    p.add_argument("--md", help="report path (default: the CSV path with .md)")
    p.add_argument("--write-csv", help="also write the re-evaluated rows to this CSV (same columns)")
    args = p.parse_args(argv)
    rows = read_csv_rows(args.csv)
    for row in rows:
        row.update(evaluate_row(row))
    meta_file = Path(args.meta) if args.meta else meta_path(args.csv)
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    md = Path(args.md) if args.md else Path(args.csv).with_suffix(".md")
    md.write_text(markdown_report(rows, meta))
    if args.write_csv and rows:
        _common.write_csv(args.write_csv, list(rows[0]), rows)
    print(summary_text(rows))
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
