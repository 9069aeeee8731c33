#!/usr/bin/env python3
"""Times v2 over every chunking the planner could choose, per cell, to fit
the step-time model (cupaged/schedule.py) and to check the default plan
against the best chunking found.

    python3 scripts/chunk_sweep.py --csv OUT/chunks.csv                 # uniform + ragged cells
    python3 scripts/chunk_sweep.py --cells 1x131072 4x32768x16x32x8x128 --no-ragged
    python3 scripts/chunk_sweep.py --lengths 64:onelong:131072:512 --kv-dtype fp8
    python3 scripts/chunk_sweep.py --cells --kv-dtype fp8 --check-against SWEEP.csv ...  # the planner check, re-timed
    python3 scripts/chunk_sweep.py --cells 1x8192 2x8192 --no-ragged --qlen 4     # 4 query tokens per request

``--qlen N`` gives every request N query tokens (``qo_indptr``; the cells'
names end in ``qN``). A uniform cell is ``BATCHxCTX[xPAGExHQxHKVxD]`` (default page 16, 32 q / 8 kv
heads, head_dim 128). A ragged cell is ``BATCH:DISTRIBUTION[:SEED]`` with the
distributions of scripts/_common.py (``lognormal:MEDIAN:SIGMA``,
``uniform:LO:HI``, ``bimodal:SHORT:LONG``, ``onelong:LONG:SHORT``,
``zipf:A:UNIT:MAX``); by default the ragged family ``RAGGED_FAMILY`` runs too.
Pages are in random order; cells of under 1 GB alternate between two cache
copies so they do not run from L2.

Knobs timed per cell (µs per call under CUDA-graph replay, median of 5
replays of 20 calls, in ``--rounds`` interleaved rounds):
``cap``: balanced chunks of at most N pages (``max_pages_per_chunk=N``) for
every even split of the longest request into 1-32 chunks, then steps of a
quarter octave down to 4 pages; ``uniform``: every request in chunks
of N pages (``pages_per_chunk=N``), N a power of two; ``default``: the plan
``plan_decode`` picks; ``request_order``: the default's chunks launched in
request order instead of longest first. Each row carries the model's prediction
(at the plan's CTAs per SM) and the plan's ``ctas_per_sm``. ``--check-against``
times, instead of every knob, the best ``cap``/``uniform`` knob of earlier
sweeps at each CTAs-per-SM count they ran at (knob ``cap@2``: held to 2 per
SM), beside the default: the planner check in one run, free of the few
percent by which separate runs differ.

The summary gives, per cell, the default's time against the best knob
(``regret`` = default / best - 1). Exit status: 0 ran, 2 bad arguments, 3 no
CUDA GPU (message on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402

CELLS = ("1x1024", "1x4096", "1x16384", "1x131072", "4x4096", "4x32768", "8x1024", "8x32768", "32x4096",
         "32x32768", "128x8192")
COLUMNS = ("cell", "batch", "kv_dtype", "knob", "value", "num_chunks", "num_ctas", "model_us", "us_round1",
           "us_round2", "us", "default", "ctas_per_sm")
DEFAULT_SHAPE = (16, 32, 8, 128)  # page, hq, hkv, d
MIN_CAP = 4  # the planner's ladder (schedule.candidate_caps) down to chunks of 4 pages


def parse_cell(text: str) -> tuple[int, ...]:
    """``"4x32768"`` -> (4, 32768, 16, 32, 8, 128); all six may be given."""
    try:
        parts = [int(v) for v in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) < 2 or len(parts) > 6 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"cell {text!r}: BATCHxCTX[xPAGExHQxHKVxD], positive integers")
    return tuple(parts + list(DEFAULT_SHAPE[len(parts) - 2:]))


def parse_ragged(text: str) -> tuple[int, str, int]:
    """``"64:onelong:131072:512"`` -> (64, "onelong:131072:512", 0); a last
    ``:SEED`` past the distribution's arguments is the seed."""
    batch, _, spec = text.partition(":")
    try:
        b = int(batch)
        name, args = _common.parse_lengths(spec)
        seed = 0
    except ValueError:
        try:  # a trailing seed
            spec, _, seed_text = spec.rpartition(":")
            b, seed = int(batch), int(seed_text)
            _common.parse_lengths(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"ragged cell {text!r}: BATCH:DISTRIBUTION[:SEED] ({exc})") from None
    if b < 1:
        raise argparse.ArgumentTypeError(f"ragged cell {text!r}: batch must be >= 1")
    return b, spec, seed


def knobs(longest_pages: int) -> list[tuple[str, int]]:
    """``(knob, value)`` pairs timed for a cell whose longest request has
    ``longest_pages`` pages.

    >>> [v for k, v in knobs(64) if k == "uniform"]
    [1, 2, 4, 8, 16, 32, 64]
    >>> [v for k, v in knobs(64) if k == "cap"][:6], [v for k, v in knobs(64) if k == "cap"][-3:]
    ([64, 32, 22, 16, 13, 11], [6, 5, 4])
    """
    from cupaged.schedule import candidate_caps

    caps = candidate_caps(longest_pages, MIN_CAP).tolist()
    out = [("cap", c) for c in sorted(caps, reverse=True)]
    c = 1
    while c <= longest_pages:
        out.append(("uniform", c))
        c *= 2
    return out


def hold_ctas_per_sm(n: int) -> None:
    """A what-if for this process: the planner counts, and every partial
    kernel launch holds each SM to, at most ``n`` CTAs per SM (the launch
    through the dynamic shared memory of :func:`cupaged._launch.residency_smem`,
    which PDL's tensor-core launches on sm_90+ use). fp8's instances fit 3
    per SM; ``--ctas-per-sm 2`` asks whether its grids run better at 2."""
    from cupaged import _configs
    from cupaged import plan as plan_mod

    real = _configs.resident_ctas
    _configs.resident_ctas = lambda *args: min(real(*args), n)
    plan_mod._resident_ctas.cache_clear()


def held_ctas_per_sm(plan) -> int | None:
    """The most CTAs per SM the launches of ``plan`` (already run) allow:
    the last entry of its launch state's residency table, None without one."""
    from cupaged._plan_launch import plan_states

    states = plan_states(plan) or {}
    return max((min(len(s._smem_at) - 1, s._held) for s in states.values()), default=None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="*", type=parse_cell, default=None,
                   help="uniform cells BATCHxCTX[xPAGExHQxHKVxD] (default: a ladder of 11 cells, "
                        "none when only --lengths is given)")
    p.add_argument("--lengths", nargs="*", type=parse_ragged, default=None,
                   help="ragged cells BATCH:DISTRIBUTION[:SEED] (default: the ragged family)")
    p.add_argument("--no-ragged", action="store_true", help="skip the ragged family (when --lengths is not given)")
    p.add_argument("--kv-dtype", choices=("fp16", "fp8"), default="fp16",
                   help="KV cache: fp16, or fp8 e4m3 under an fp16 query")
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds (default 2)")
    p.add_argument("--quick", nargs="?", type=int, const=0, choices=(0, 1), default=None,
                   help="time only every second knob (a faster, coarser sweep): the even ones (--quick or "
                        "--quick 0), or the odd ones (--quick 1: with a --quick 0 sweep, every knob)")
    p.add_argument("--ctas-per-sm", type=int, default=None,
                   help="a what-if: plan for and hold every launch to at most N CTAs per SM (tensor-core "
                        "instances with programmatic dependent launch, sm_90+); default the planner's count")
    p.add_argument("--check-against", nargs="+", default=None, metavar="CSV",
                   help="the planner check, re-timed in one run: per cell the default plan against the best "
                        "cap or uniform knob of these sweeps (--csv files) at each CTAs-per-SM count they ran "
                        "at (a file without the column: the planner's count), instead of every knob")
    p.add_argument("--qlen", type=int, default=1,
                   help="query tokens per request (decode(..., qo_indptr=...), 1-16; default 1: one-token decode)")
    p.add_argument("--csv", default=None, help="write every timed row to this CSV file")
    return p.parse_args(argv)


def best_knobs(paths: list, cell: str) -> list:
    """``[(knob, value, ctas_per_sm)]``: per CTAs-per-SM count in the sweeps
    ``paths`` (None: a file without the column, run at the planner's count),
    the fastest ``cap`` or ``uniform`` row of ``cell``."""
    import csv

    best: dict = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["cell"] != cell or row["knob"] not in ("cap", "uniform"):
                    continue
                held = int(row["ctas_per_sm"]) if row.get("ctas_per_sm") else None
                if held not in best or float(row["us"]) < best[held][0]:
                    best[held] = (float(row["us"]), row["knob"], int(row["value"]))
    return [(knob, value, held) for held, (_, knob, value) in best.items()]


def _cells(args):
    """``(name, shape, ragged)`` per cell: the uniform cells of ``--cells``
    (default the ladder ``CELLS``, unless only ``--lengths`` is given), then
    the ragged ones (default the ragged family, unless ``--no-ragged``)."""
    if args.cells is not None:
        uniform = args.cells
    else:
        uniform = [] if args.lengths is not None else [parse_cell(c) for c in CELLS]
    for batch, ctx, page, hq, hkv, d in uniform:
        yield f"{batch}x{ctx}", (batch, ctx, page, hq, hkv, d), None
    ragged = args.lengths
    if ragged is None:
        ragged = [] if args.no_ragged else list(_common.RAGGED_FAMILY)
    for batch, spec, seed in ragged:
        yield f"{batch}:{spec}:{seed}", (batch, 0) + DEFAULT_SHAPE, (spec, seed)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    if args.ctas_per_sm is not None and args.ctas_per_sm < 1:
        print("--ctas-per-sm must be >= 1", file=sys.stderr)
        return 2
    if not 1 <= args.qlen <= 16:
        print("--qlen must be in [1, 16]", file=sys.stderr)
        return 2
    _common.require_gpu()
    if args.ctas_per_sm is not None:
        hold_ctas_per_sm(args.ctas_per_sm)
    import cupy
    import numpy as np

    import cupaged
    from cupaged import autotune, schedule
    from cupaged.plan import ctas_per_sm, plan_decode, resolve_num_sms

    fp8 = args.kv_dtype == "fp8"
    kv_dtype = np.uint8 if fp8 else None
    rows, summary = [], []
    print(",".join(COLUMNS), flush=True)
    suffix = f"q{args.qlen}" if args.qlen > 1 else ""
    for name, (batch, ctx, page, hq, hkv, d), ragged in _cells(args):
        name += suffix
        if ragged is None:
            layout = _common.plan_layout(batch, ctx, page, seed=batch * 7 + ctx, mid_page=False, page_order="random")
        else:
            lens = _common.ragged_lengths(ragged[0], batch, ragged[1])
            layout = _common.lengths_layout(lens, page, seed=ragged[1])
        kv_bytes = _common.kv_bytes(layout, hkv, d, 1 if fp8 else 2)
        replicas = 2 if kv_bytes < 2**30 else 1
        dev = _common.make_device_batch(layout, hq, hkv, d, np.float16, seed=1, replicas=replicas)
        caches = dev.caches
        if fp8:
            caches = [tuple(cupaged.fp8.to_e4m3(x) for x in pair) for pair in caches]
            _common.free_gpu_memory()
        table, q, qo = dev.table, dev.q, {}
        if args.qlen > 1:  # every request's last qlen slots are its new tokens (the last one sees them all)
            qo["qo_indptr"] = np.arange(batch + 1, dtype=np.int32) * args.qlen
            q = cupy.random.RandomState(1).standard_normal((batch * args.qlen, hq, d), dtype=cupy.float32)
            q = q.astype(cupy.float16)
        pages = np.asarray(layout.request_pages)
        default = plan_decode(table, hq, hkv, d, "float16", kv_dtype=kv_dtype, **qo)
        plans = {("default", default.pages_per_chunk): default,
                 # the same chunks in request order instead of longest first (the LPT A/B)
                 ("request_order", default.pages_per_chunk): dataclasses.replace(
                     default, launch_order=np.arange(default.num_chunks))}
        if args.check_against is not None:  # each sweep's best knob per CTAs-per-SM count, timed beside the default
            chosen = best_knobs(args.check_against, name)
        else:
            chosen = [(knob, value, None) for knob, value in knobs(int(pages.max()))]
        if args.quick is not None:
            chosen = chosen[args.quick::2]
        for knob, value, held in chosen:
            kw = {"max_pages_per_chunk": value} if knob == "cap" else {"pages_per_chunk": value}
            plan = plan_decode(table, hq, hkv, d, "float16", kv_dtype=kv_dtype, **qo, **kw)
            if held is not None and held < plan.ctas_per_sm:
                plan = dataclasses.replace(plan, ctas_per_sm=held)
                knob = f"{knob}@{held}"
            if plan.num_ctas <= 400_000:
                plans[(knob, value)] = plan
        slots = ctas_per_sm(np.dtype(np.float16), default.kv_dtype, d, default.heads_per_cta) * resolve_num_sms()
        page_bytes = page * 2 * d * (1 if fp8 else 2)
        out = cupy.empty_like(q)
        times: dict = {key: [] for key in plans}
        for _ in range(args.rounds):
            for key, plan in plans.items():
                turn = [0]

                def call(plan=plan, turn=turn):
                    k, v = caches[turn[0] % len(caches)]
                    turn[0] += 1
                    cupaged.decode(q, k, v, table, plan, method="v2", out=out, **qo)

                times[key].append(autotune.graph_time_us(call, launches=20, reps=5))
        held = held_ctas_per_sm(default)
        if args.ctas_per_sm is not None and held != slots // resolve_num_sms():  # (slots: the held count)
            print(f"{name}: the launches allow {held} CTAs per SM, not {args.ctas_per_sm} (no residency "
                  "table: a CUDA-core instance, CUPAGED_PDL=0 or a GPU before sm_90)", file=sys.stderr)
            return 1
        min_pages = -(-128 // page)
        held_slots = default.ctas_per_sm * resolve_num_sms()  # the default's count (fp8: 3 or 2 per SM)
        default_cap = schedule.choose_max_pages_per_chunk(pages, default.heads_groups, held_slots, page_bytes,
                                                          min_pages, schedule.costs_for(1 if fp8 else 2,
                                                                                        default.ctas_per_sm,
                                                                                        args.qlen > 1))
        for (knob, value), plan in plans.items():
            if knob in ("cap", "default", "request_order"):  # (the model at the plan's own count)
                cap = value if knob == "cap" else default_cap
                model = float(schedule.predict_step_us(pages, np.array([cap]), plan.heads_groups,
                                                       plan.ctas_per_sm * resolve_num_sms(), page_bytes,
                                                       schedule.costs_for(1 if fp8 else 2, plan.ctas_per_sm,
                                                                          args.qlen > 1))[0])
            else:
                model = float("nan")
            us = float(np.median(times[(knob, value)]))
            row = dict(cell=name, batch=batch, kv_dtype=args.kv_dtype, knob=knob, value=value,
                       num_chunks=plan.num_chunks, num_ctas=plan.num_ctas, model_us=round(model, 2),
                       us_round1=round(times[(knob, value)][0], 2), us_round2=round(times[(knob, value)][-1], 2),
                       us=round(us, 2), default=int(knob == "default"), ctas_per_sm=plan.ctas_per_sm)
            rows.append(row)
            print(",".join(str(row[k]) for k in COLUMNS), flush=True)
        best_key = min(times, key=lambda k: float(np.median(times[k])))
        best = float(np.median(times[best_key]))
        dflt = float(np.median(times[("default", default.pages_per_chunk)]))
        gb = kv_bytes / 1e9
        summary.append((name, args.kv_dtype, dflt, best, f"{best_key[0]}={best_key[1]}", dflt / best - 1,
                        gb / (dflt * 1e-6) / 1e3))
        del dev, caches
        _common.free_gpu_memory()
        if args.csv:  # after every cell: a run cut short by a time limit keeps what it timed
            _common.write_csv(args.csv, COLUMNS, rows)
    print("SUMMARY cell kv default_us best_us best_knob regret default_TB/s")
    for name, kv, dflt, best, knob, regret, tbs in summary:
        print(f"SUMMARY {name} {kv} {dflt:.2f} {best:.2f} {knob} {regret * 100:+.1f}% {tbs:.2f}")
    worst = max(s[5] for s in summary) if summary else 0.0
    print(f"SUMMARY worst regret {worst * 100:+.1f}% over {len(summary)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
