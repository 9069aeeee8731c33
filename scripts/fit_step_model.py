#!/usr/bin/env python3
"""Fits the constants of the step-time model (cupaged/schedule.py) to a
chunk sweep (scripts/chunk_sweep.py --csv), and reports, per cell, the chunk
cap the model picks and its measured regret against the best knob timed.

    python3 scripts/fit_step_model.py docs/benchmarks/chunk-sweep-h200-2026-12-01.csv
    python3 scripts/fit_step_model.py SWEEP.csv --check      # today's constants, no fit
    python3 scripts/fit_step_model.py HALF0.csv HALF1.csv     # two halves of one ladder (--quick 0 / 1)
    python3 scripts/fit_step_model.py HALF0.csv HALF1.csv --fewer-per-sm SWEEP2.csv --min-pages 8
                                                              # fp8's 2-per-SM constants, fitted jointly
    python3 scripts/fit_step_model.py SWEEP.csv --fewer-per-sm SWEEP1.csv --min-pages 8
                                                              # fp16's 1-per-SM constants, likewise

Sweeps of fp8 cells only fit (and --check) fp8's constants at 3 CTAs per SM.
``--fewer-per-sm`` (alias ``--two-per-sm``): with the constants at the kernel's count as
shipped (fp8: 3 per SM, fp16: 2), fits those at one fewer (``schedule.H200_COSTS_FP8_2``,
``schedule.H200_COSTS_1``; hbm, cta_gbps and cta_us, the merge shared) on a sweep run with
``chunk_sweep.py --ctas-per-sm 2`` (fp16: 1), minimizing the regret of the planner's
choice: the count whose best cap the model predicts faster, its measured µs against the
best knob of either count. A cell named ``...qN`` (``chunk_sweep.py --qlen N``) is planned
as its one-token twin: the model does not see query rows.

The fit minimizes the mean regret of the picked caps (the planner's job),
plus a small weight on the model's log error over every timed cap, by
coordinate search over a grid of each constant, keeping the constants
physical (one CTA streams at least its share ``hbm / slots`` of a full
device; the fit is otherwise free to trade one constant for another). No
GPU needed.
Exit status: 0 ran, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import _common  # noqa: E402
import chunk_sweep  # noqa: E402
from cupaged import schedule  # noqa: E402

GRID = {
    "hbm_gbps": np.arange(3600.0, 5001.0, 100.0),
    "cta_gbps": np.arange(12.0, 40.1, 0.5),
    "cta_us": np.arange(0.0, 6.01, 0.25),
    "merge_us": np.arange(0.0, 16.01, 0.5),
    "merge_us_per_chunk": np.arange(0.0, 0.81, 0.025),
}
LOG_WEIGHT = 0.05


@dataclasses.dataclass
class Cell:
    name: str
    pages: np.ndarray
    caps: np.ndarray  # timed caps
    us: np.ndarray  # measured µs per cap
    best: float  # best µs over every knob (uniform chunks too)
    ctas_per_chunk: int
    page_bytes: int
    rows: bool = False  # several query tokens per request (chunk_sweep.py --qlen): the multi-token constants


def merged_rows(paths: list[str]) -> list[dict]:
    """The rows of several sweeps; a cell that an earlier file has keeps
    those rows, and takes only the knobs it lacks from a later file, scaled
    by the ratio of the two files' times of the cell's default plan (two
    halves of one ladder, ``chunk_sweep.py --quick 0`` and ``--quick 1``,
    timed in runs whose GPU state differs by a few percent)."""
    rows: list[dict] = []
    for path in paths:
        new = list(csv.DictReader(open(path)))
        for name in dict.fromkeys(r["cell"] for r in new):
            have = [r for r in rows if r["cell"] == name]
            theirs = [r for r in new if r["cell"] == name]
            if not have:
                rows += theirs
                continue
            mine = [float(r["us"]) for r in have if r["knob"] == "default"]
            other = [float(r["us"]) for r in theirs if r["knob"] == "default"]
            scale = mine[0] / other[0] if mine and other else 1.0
            known = {(r["knob"], r["value"]) for r in have}
            rows += [dict(r, us=str(float(r["us"]) * scale)) for r in theirs if (r["knob"], r["value"]) not in known]
    return rows


def load(paths: list[str], page_size: int = 16) -> list[Cell]:
    rows = merged_rows(paths)
    cells = []
    for name in dict.fromkeys(r["cell"] for r in rows):
        rs = [r for r in rows if r["cell"] == name]
        kv = rs[0]["kv_dtype"]
        base, qlen = re.fullmatch(r"(.*?)(?:q(\d+))?", name).groups()  # (chunk_sweep.py --qlen: the same pages)
        if ":" in base:
            batch, spec, seed = chunk_sweep.parse_ragged(base)
            family = {f"{b}:{sp}": sd for b, sp, sd in _common.RAGGED_FAMILY}
            seed = family.get(base, seed)  # a family cell's name omits its seed
            lens = _common.ragged_lengths(spec, batch, seed)
        else:
            batch, ctx, page, hq, hkv, d = chunk_sweep.parse_cell(base)
            lens = _common.plan_layout(batch, ctx, page, seed=batch * 7 + ctx, mid_page=False,
                                       page_order="random").seq_lens
        pages = -(-np.asarray(lens) // page_size)
        caps = [(int(r["value"]), float(r["us"])) for r in rs if r["knob"] == "cap"]
        caps += [(int(r["value"]), float(r["us"])) for r in rs if r["knob"] == "default"
                 and int(r["value"]) not in {c for c, _ in caps}]  # the default's cap, where no cap row has it
        # CTAs per chunk of a request (a plan of several query rows counts a chunk per row)
        cap_row = next(r for r in rs if r["knob"] in ("cap", "default"))
        chunks = int(schedule.split_pages(pages, int(cap_row["value"]))[1].sum())
        cps = int(cap_row["num_ctas"]) // chunks
        cells.append(Cell(name, pages, np.array([c for c, _ in caps]), np.array([u for _, u in caps]),
                          min(float(r["us"]) for r in rs), cps, page_size * 2 * 128 * (1 if kv == "fp8" else 2),
                          int(qlen or 1) > 1))
    return cells


def regrets(cells: list[Cell], costs: schedule.StepCosts, slots: int, min_pages: int) -> list[tuple]:
    out = []
    for c in cells:
        ok = c.caps >= min(min_pages, int(c.pages.max()))
        caps, us = c.caps[ok], c.us[ok]
        model = schedule.predict_step_us(c.pages, caps, c.ctas_per_chunk, slots, c.page_bytes, costs)
        pick = int(np.argmin(model))  # ties: the largest cap (caps are descending), as the planner
        log_err = float(np.std(np.log(model / us)))
        out.append((c.name, int(caps[pick]), float(us[pick]), c.best, float(us[pick]) / c.best - 1, log_err))
    return out


def loss(cells, costs, slots, min_pages) -> float:
    r = regrets(cells, costs, slots, min_pages)
    return float(np.mean([x[4] for x in r]) + 0.5 * max(x[4] for x in r) + LOG_WEIGHT * np.mean([x[5] for x in r]))


def fit(cells, start: schedule.StepCosts, slots: int, min_pages: int, sweeps: int = 4) -> schedule.StepCosts:
    best = start
    best_loss = loss(cells, best, slots, min_pages)
    for _ in range(sweeps):
        for field, grid in GRID.items():
            for v in grid:
                trial = dataclasses.replace(best, **{field: float(v)})
                if trial.cta_gbps * slots < trial.hbm_gbps:
                    continue  # a CTA streams at least its share of a full device
                value = loss(cells, trial, slots, min_pages)
                if value < best_loss - 1e-12:
                    best, best_loss = trial, value
    return best


JOINT_FIELDS = ("hbm_gbps", "cta_gbps", "cta_us")  # the merge is the same kernel code at either count


def _pick(cell: Cell, costs: schedule.StepCosts, slots: int, min_pages: int) -> tuple[float, int, float, float]:
    """``(predicted µs, cap, measured µs, model log-error)`` of the cap the
    model picks among the cell's timed caps."""
    ok = cell.caps >= min(min_pages, int(cell.pages.max()))
    caps, us = cell.caps[ok], cell.us[ok]
    model = schedule.predict_step_us(cell.pages, caps, cell.ctas_per_chunk, slots, cell.page_bytes, costs)
    i = int(np.argmin(model))
    return float(model[i]), int(caps[i]), float(us[i]), float(np.std(np.log(model / us)))


def joint_regrets(many: list[Cell], fewer: dict, costs_many, costs_fewer, min_pages: int,
                  counts: tuple[int, int] = (3, 2), sms: int = 132, hi_picks: dict | None = None) -> list[tuple]:
    """Per cell of ``many`` that ``fewer`` has: ``(name, count, cap, µs,
    best of either count, regret, fewer-per-SM log-error)`` of the
    planner's choice between ``counts`` CTAs per SM (``many`` timed at the
    first, ``fewer`` at the second; the first on ties). ``costs_many`` may
    be a function of the cell (the multi-token cells' constants);
    ``hi_picks`` caches the first count's picks by cell name (fixed
    ``costs_many`` only)."""
    hi, lo = counts
    out = []
    for c_hi in many:
        c_lo = fewer.get(c_hi.name)
        if c_lo is None:
            continue
        costs = costs_many(c_hi) if callable(costs_many) else costs_many
        if hi_picks is None or c_hi.name not in hi_picks:
            picked = _pick(c_hi, costs, hi * sms, min_pages)
            if hi_picks is not None:
                hi_picks[c_hi.name] = picked
        p_hi, cap_hi, u_hi, _ = picked if hi_picks is None else hi_picks[c_hi.name]
        p_lo, cap_lo, u_lo, err_lo = _pick(c_lo, costs_fewer, lo * sms, min_pages)
        count, cap, us = (lo, cap_lo, u_lo) if p_lo < p_hi else (hi, cap_hi, u_hi)
        best = min(c_hi.best, c_lo.best)
        out.append((c_hi.name, count, cap, us, best, us / best - 1, err_lo))
    return out


def fit_fewer_per_sm(many: list[Cell], fewer: dict, costs_many, start, min_pages: int,
                     counts: tuple[int, int] = (3, 2), sweeps: int = 4, fields=JOINT_FIELDS, coarse: bool = False):
    """The constants at the fewer count (``fields`` free, from ``start``)
    that minimize the joint choice's loss (as :func:`loss`: mean + half the
    worst regret + a small weight on the fewer-per-SM model's log-error),
    those at the larger count fixed (``costs_many``). ``coarse``: start
    from the best point of the coarse grid ``COARSE`` instead (fp16: the
    coordinate search alone stays where it starts)."""
    hi_picks: dict = {}

    def costs_hi(cell):  # (the larger count's picks do not change: computed once a cell)
        return costs_many(cell) if callable(costs_many) else costs_many

    def value(costs_lo) -> float:
        r = joint_regrets(many, fewer, costs_hi, costs_lo, min_pages, counts, hi_picks=hi_picks)
        return float(np.mean([x[5] for x in r]) + 0.5 * max(x[5] for x in r) + LOG_WEIGHT * np.mean([x[6] for x in r]))

    def physical(costs) -> bool:  # a CTA streams at least its share of a full device
        return costs.cta_gbps * counts[1] * 132 >= costs.hbm_gbps

    best, best_loss = start, value(start)
    if coarse:
        for point in itertools.product(*COARSE.values()):
            trial = schedule.StepCosts(*map(float, point))
            if physical(trial):
                trial_loss = value(trial)
                if trial_loss < best_loss - 1e-12:
                    best, best_loss = trial, trial_loss
    for _ in range(sweeps):
        for field in fields:
            for v in GRID[field]:
                trial = dataclasses.replace(best, **{field: float(v)})
                if not physical(trial):
                    continue
                trial_loss = value(trial)
                if trial_loss < best_loss - 1e-12:
                    best, best_loss = trial, trial_loss
    return best


#: The coarse grid of ``fit_fewer_per_sm(..., coarse=True)``, in StepCosts' field order.
COARSE = {
    "hbm_gbps": (3600.0, 4000.0, 4700.0),
    "cta_gbps": np.arange(16.0, 43.0, 2.0),
    "cta_us": np.arange(0.0, 8.5, 1.0),
    "merge_us": np.arange(0.0, 16.5, 2.0),
    "merge_us_per_chunk": (0.0, 0.35, 0.7),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", nargs="+", help="chunk-sweep CSV files (scripts/chunk_sweep.py --csv)")
    p.add_argument("--check", action="store_true", help="report today's constants without fitting")
    p.add_argument("--min-pages", type=int, default=4,
                   help="smallest cap the planner considers, in pages of 16 tokens")
    p.add_argument("--fewer-per-sm", "--two-per-sm", nargs="+", default=None, metavar="CSV", dest="fewer_per_sm",
                   help="fit the constants at one CTA per SM fewer (fp8: 2, chunk_sweep.py --ctas-per-sm 2; "
                        "fp16: 1) jointly on this sweep, those at the kernel's count as shipped (with --check: "
                        "report the shipped pair)")
    p.add_argument("--slots", type=int, default=None,
                   help="resident CTAs on the device (default: 2 per SM x 132 SMs; fp8 sweeps 3 per SM)")
    args = p.parse_args(argv)
    cells = load(args.csv)
    fp8 = all(c.page_bytes == 16 * 2 * 128 for c in cells)  # every cell an fp8 one: fp8's constants
    start = schedule.H200_COSTS_FP8 if fp8 else schedule.H200_COSTS
    if args.slots is None:
        args.slots = (3 if fp8 else 2) * 132
    if args.fewer_per_sm is not None:
        hi = 3 if fp8 else 2
        counts = (hi, hi - 1)

        def costs_hi(cell: Cell) -> schedule.StepCosts:
            return schedule.costs_for(1 if fp8 else 2, hi, cell.rows)

        shipped = schedule.costs_for(1 if fp8 else 2, hi - 1)
        fewer = {c.name: c for c in load(args.fewer_per_sm)}
        # fp8: from the 3-per-SM constants, hbm, cta_gbps and cta_us free (the merge shared); fp16: from
        # the coarse grid's best, every constant free (a lone CTA's merge runs on an SM of its own too)
        start = schedule.costs_for(1 if fp8 else 2, hi)
        fields = JOINT_FIELDS if fp8 else tuple(GRID)
        costs_lo = shipped if args.check else fit_fewer_per_sm(cells, fewer, costs_hi, start, args.min_pages, counts,
                                                               fields=fields, coarse=not fp8)
        print(costs_lo)
        rows = joint_regrets(cells, fewer, costs_hi, costs_lo, args.min_pages, counts)
        for name, count, cap, us, best, regret, _ in rows:
            print(f"{name:28s} {count} per SM, cap {cap:5d} {us:9.2f} us  best of both {best:9.2f}  "
                  f"regret {regret * 100:+5.1f}%")
        print(f"worst regret {max(r[5] for r in rows) * 100:+.1f}%, mean {np.mean([r[5] for r in rows]) * 100:.1f}%")
        return 0
    costs = start if args.check else fit(cells, start, args.slots, args.min_pages)
    print(costs)
    worst = 0.0
    for name, cap, us, best, regret, log_err in regrets(cells, costs, args.slots, args.min_pages):
        worst = max(worst, regret)
        print(f"{name:28s} cap {cap:5d} {us:9.2f} us  best {best:9.2f}  regret {regret * 100:+5.1f}%  "
              f"model log-error {log_err:.2f}")
    print(f"worst regret {worst * 100:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
