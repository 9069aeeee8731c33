"""Balanced work units and the predicted time of a decode step.

The partial kernel runs one CTA per (chunk, kv head, q-head group). The
default plan splits each request into the fewest **equal** chunks of at most
``L`` pages (:func:`split_pages`), and the kernel launches them longest first,
so the short requests of a ragged batch fill the SMs beside the chunks of a
long one. ``L`` is chosen by :func:`choose_max_pages_per_chunk`: the value of
a small candidate ladder that minimizes :func:`predict_step_us`.

The model (constants in :class:`StepCosts`, fitted on the H200; the sweep and
the fit are in docs/architecture.md, "Ragged batches: balanced units"):

* ``S`` CTA slots (resident CTAs per SM x SMs) run the CTAs in launch order
  (longest first: list scheduling, LPT).
* A CTA of ``c`` pages costs ``cta_us + c * page_bytes / rate``, where the
  rate per CTA is ``min(cta_gbps, hbm_gbps / min(C, S))`` for a grid of ``C``
  CTAs: a full device shares the HBM bandwidth, a small grid is bound by what
  one CTA can keep in flight.
* Requests are taken longest first (past the longest few, as groups of
  equal count with their mean length: the model's cost stays flat in the
  batch size).
* The makespan of LPT is close to its lower bound: over every prefix of the
  CTAs sorted longest first (``N_j`` CTAs, the shortest of them ``u_j`` long,
  ``W_j`` in total), ``max(W_j / S, full waves of u_j + a partial last wave
  of u_j at the rate of its own CTA count)``. This is exact for equal units
  in full waves, and for one long request among short ones gives
  ``max(longest unit, work / S)``.
* A request split into ``n > 1`` chunks adds the merge that its last CTA runs:
  ``merge_us + merge_us_per_chunk * n`` for the request with most chunks
  (the longest: chunk counts grow with the length).

One thing the model cannot see is re-split after it: a one-wave 16-bit grid
of CTAs that each read 4 MB or more goes to two full waves
(:func:`fill_waves`; a one-wave grid of equal CTAs streams slower when it
leaves slots empty, and its CTAs end up to 18 % of the call apart).

Everything here is NumPy on the host.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

__all__ = ["StepCosts", "H200_COSTS", "H200_COSTS_1", "H200_COSTS_ROWS", "H200_COSTS_FP8", "H200_COSTS_FP8_2",
           "costs_for", "residency_choices", "split_pages", "candidate_caps", "predict_step_us",
           "choose_max_pages_per_chunk", "choose_cap_and_residency"]


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Constants of the step-time model (:func:`predict_step_us`).

    * ``hbm_gbps``: KV bytes the whole device streams, GB/s.
    * ``cta_gbps``: what one CTA streams when it has the HBM to itself (GB/s).
    * ``cta_us``: fixed cost of one CTA (query, page ids, ring fill, partial
      write), µs.
    * ``merge_us``, ``merge_us_per_chunk``: the merge run by a split request's
      last CTA, µs (fixed and per chunk).
    """

    hbm_gbps: float
    cta_gbps: float
    cta_us: float
    merge_us: float
    merge_us_per_chunk: float


#: Fitted on the H200 (2026-12-01; fp16, 32 q / 8 kv heads, head_dim 128, page
#: 16) by scripts/fit_step_model.py to the chunk sweep
#: docs/benchmarks/chunk-sweep-h200-2026-12-01.csv; docs/architecture.md
#: "Ragged batches: balanced units" has the sweep and the per-cell regrets.
H200_COSTS = StepCosts(hbm_gbps=4700.0, cta_gbps=18.0, cta_us=3.25, merge_us=9.0, merge_us_per_chunk=0.35)

#: 16-bit KV with the launches held to 1 CTA per SM (the plan's
#: ``ctas_per_sm``; a grid of at most one CTA per SM runs so anyway):
#: ``scripts/fit_step_model.py 2CTA... --fewer-per-sm 1CTA... --min-pages 8``
#: (a coarse grid, then a coordinate search, every constant free) on chunk
#: sweeps of 62 cells (22 uniform and 4 ragged one-token cells, 21 short
#: contexts 256-3000, 15 of q_len 2-8) at 2 and at 1 per SM, each pair
#: timed in one run (H200, 2026-12-02;
#: docs/benchmarks/chunk-sweep{,-short,-qlen}-fp16-{2,1}cta-h200-2026-12-02.csv),
#: fitted jointly with :data:`H200_COSTS` (:data:`H200_COSTS_ROWS` for the
#: multi-token cells) as shipped. These are choice constants, not a
#: breakdown of the time: a small grid whose CTAs have an SM each runs
#: faster than the 2-per-SM model predicts (1 x 8192: 12.98 µs at 128 CTAs,
#: 14.77 at the 216 the 2-per-SM constants pick; 1 x 8192 q_len 4: 18.66
#: against 24.74), but not for short contexts, which want their many short
#: chunks (1 x 700: 5.6 µs split, 10.1 whole). The planner's regret
#: against the best knob of either count: mean 0.9 %, worst 12.9 % (1 x
#: 512, the same time as the 2-per-SM planner's pick; that planner alone:
#: mean 4.2 %, worst 32.6 %); docs/architecture.md "One CTA per SM" has
#: the per-cell table.
H200_COSTS_1 = StepCosts(hbm_gbps=3600.0, cta_gbps=29.0, cta_us=8.0, merge_us=6.5, merge_us_per_chunk=0.0)

#: 16-bit KV, several query tokens' rows per CTA (``plan_decode(...,
#: qo_indptr=...)`` with some q_len > 1), at 2 CTAs per SM: fp16's with a
#: dearer merge (a split request's last CTA merges every row of its
#: group). Chosen on the 12 q_len 2-8 cells of the 2026-12-02 sweeps above
#: (batch 1-8, ctx 1024-32768, cells named ``...qN``) before the short
#: ones were added: with the 1-per-SM constants of the time, every merge
#: cost from 10 to 14 µs picked a plan within 0.5 % of the best knob of
#: either count on all 12 (the shipped 9.0: 1 x 32768 q_len 4 +11.9 %,
#: 2 x 8192 q_len 4 +11.0 %, 1 x 8192 q_len 8 +5.3 %); 12 is the middle.
#: With :data:`H200_COSTS_1` as shipped: within 1.1 % on all 15.
H200_COSTS_ROWS = StepCosts(hbm_gbps=4700.0, cta_gbps=18.0, cta_us=3.25, merge_us=12.0, merge_us_per_chunk=0.35)

#: The fp8 KV instances' constants (H200; 32 q / 8 kv heads, head_dim 128,
#: page 16, 3 CTAs per SM): ``scripts/fit_step_model.py --min-pages 8`` on
#: the whole ladder of the ragged family, timed at commit 21d806c in two
#: halves (docs/benchmarks/chunk-sweep-ragged-fp8-h200-2026-12-02-half0.csv
#: and -half1.csv, 2026-12-02). Regret of the pick against the best knob
#: timed: worst 12.2 %, mean 3.5 % over the 10 cells (the 2026-12-01
#: constants ``(4600, 14.0, 2.0, 9.0, 0.3)``: 17.2 % / 6.4 %);
#: docs/architecture.md has the per-cell table. One CTA streams fp8 bytes at
#: ~14 GB/s, not fp16's 18: its per-token work (the same MMAs and softmax
#: as fp16's for half the bytes; not the widening to f16, which an H200 A/B
#: found worth 1-2 %), not the bytes, bounds it, so a long request wants
#: more, shorter chunks than its byte count says. (``hbm_gbps`` above the
#: read roofline is the fit's: it sets the per-CTA share of a full device,
#: not a rate any kernel reaches.)
H200_COSTS_FP8 = StepCosts(hbm_gbps=4900.0, cta_gbps=14.0, cta_us=2.75, merge_us=9.0, merge_us_per_chunk=0.3)

#: fp8 with the launches held to 2 CTAs per SM (the plan's ``ctas_per_sm``):
#: the chunk sweep of the ragged family at 2 per SM
#: (docs/benchmarks/chunk-sweep-ragged-fp8-2cta-h200-2026-12-02-half0.csv,
#: ``chunk_sweep.py --ctas-per-sm 2``), fitted jointly with the 3-per-SM
#: constants above: the planner takes the count whose best cap the model
#: predicts faster, and the fit minimizes the regret of that choice against
#: the best knob of either count (hbm, cta_gbps and cta_us fitted; the merge
#: shared). One CTA streams fp8 at ~18.5 GB/s beside one other (14 beside
#: two: they share the SM's issue slots), so mid-sized ragged grids run
#: faster at 2 per SM and full devices at 3. docs/architecture.md has the
#: per-cell table.
H200_COSTS_FP8_2 = StepCosts(hbm_gbps=4600.0, cta_gbps=18.5, cta_us=4.25, merge_us=9.0, merge_us_per_chunk=0.3)


def costs_for(kv_itemsize: int, ctas_per_sm: int | None = None, rows: bool = False,
              resident: int | None = None) -> StepCosts:
    """The step model's constants for a KV cache of ``kv_itemsize`` bytes per
    element at ``ctas_per_sm`` CTAs per SM (None: the kernel's count) of an
    instance that fits ``resident`` (None: more than 1), CTAs of several
    query tokens' rows or not (``rows``): fp8 (1) has its own, at 3 and at 2
    per SM; 16-bit and float32 share fp16's, at 2 per SM (with ``rows``:
    :data:`H200_COSTS_ROWS`) and, held to 1 below the kernel's count, at 1.

    >>> costs_for(1) is H200_COSTS_FP8, costs_for(1, 2) is H200_COSTS_FP8_2
    (True, True)
    >>> costs_for(2) is H200_COSTS, costs_for(2, 2, rows=True) is H200_COSTS_ROWS, costs_for(2, 1) is H200_COSTS_1
    (True, True, True)
    >>> costs_for(2, 1, resident=1) is H200_COSTS   # an instance that fits only 1: its own count
    True
    """
    if kv_itemsize != 1:
        if ctas_per_sm == 1 and (resident is None or resident > 1):
            return H200_COSTS_1
        return H200_COSTS_ROWS if rows else H200_COSTS
    return H200_COSTS_FP8_2 if ctas_per_sm == 2 else H200_COSTS_FP8


def residency_choices(kv_itemsize: int, resident: int, head_dim: int = 128) -> tuple[int, ...]:
    """The CTAs-per-SM counts a default plan weighs, most first: the
    kernel's count ``resident``, and one fewer where the model has constants
    for both: fp8 instances that fit 3 (and 2), 16-bit ones of head_dim 128
    that fit 2 (and 1: a small grid's CTA streams faster alone on its SM;
    the sweeps behind :data:`H200_COSTS_1` timed head_dim 128 only).

    >>> residency_choices(1, 3), residency_choices(2, 2), residency_choices(1, 2), residency_choices(4, 2)
    ((3, 2), (2, 1), (2,), (2,))
    >>> residency_choices(2, 2, head_dim=64)
    (2,)
    """
    if (kv_itemsize, resident) == (1, 3) or ((kv_itemsize, resident) == (2, 2) and head_dim == 128):
        return resident, resident - 1
    return (resident,)


#: A one-wave 16-bit plan whose longest chunk reads at least this many bytes
#: per CTA is re-split into two waves (:func:`fill_waves`); a batch of one at
#: :data:`FILL_ONE_BYTES` into every slot of one wave.
FILL_TWO_BYTES = 4 << 20
FILL_ONE_BYTES = 2 << 20


def fill_waves(pages: np.ndarray, units: int, chunk_pages: np.ndarray, most_pages: int, ctas_per_chunk: int,
               slots: int, page_bytes: int) -> np.ndarray | None:
    """Per-request chunk counts that fill the CTA slots, or None to keep the
    split (the model's pick: ``units`` chunks in all, ``chunk_pages`` pages
    per request, an unsplit request's chunk the cap; ``most_pages`` bounds
    what one chunk reads, so most plans are turned down on scalars). Why: a
    one-wave grid of equal CTAs that leaves slots idle streams below what
    the same bytes in full waves do, and the model cannot say so
    (it sees one makespan). Measured on the H200 (2026-12-04, fp16 head_dim
    128, interleaved against the model's plans; docs/architecture.md "Full
    waves for large one-wave plans"): two waves of ``2 * (slots //
    ctas_per_chunk)`` chunks 0.6-0.9 % faster at 4 MB chunks and more (4 x
    131072, 8 x 32768, 32 x 16384, 32 x 32768), slower below (4 x 32768, 8 x
    16384: -0.3 to -0.8 %); one request in ``slots // ctas_per_chunk`` chunks
    1.3 % faster at 2 MB chunks (1 x 131072).

    The chunks go to the requests in proportion to their pages (largest
    remainder, at least one each), so a uniform batch gets equal chunks. Only
    where the slots are a whole number of chunks' CTAs (MHA's 32 CTAs a chunk
    leave 8 of 264 idle either way).

    >>> fill_waves(np.array([2048] * 8), 32, np.array([512] * 8), 512, 8, 264, 8192).tolist()
    [9, 9, 8, 8, 8, 8, 8, 8]
    >>> fill_waves(np.array([8192]), 32, np.array([256]), 256, 8, 264, 8192).tolist()
    [33]
    >>> fill_waves(np.array([2048] * 4), 32, np.array([256] * 4), 256, 8, 264, 8192) is None  # 2 MB, batch 4
    True
    """
    per_wave = slots // ctas_per_chunk
    batch = pages.shape[0]
    if (units * ctas_per_chunk > slots or per_wave < 1 or slots % ctas_per_chunk  # (waves it cannot fill)
            or most_pages * page_bytes < FILL_ONE_BYTES):
        return None
    chunk_bytes = int(np.minimum(chunk_pages, pages).max()) * page_bytes  # the most a CTA reads
    if chunk_bytes >= FILL_TWO_BYTES:
        target = 2 * per_wave
    elif chunk_bytes >= FILL_ONE_BYTES and batch == 1:
        target = per_wave
    else:
        return None
    total = float(pages.sum())
    if target <= units or batch > target or total <= 0:
        return None
    share = pages.astype(np.float64) * (target / total)
    n = np.maximum(np.floor(share), 1).astype(np.int64)
    rest = target - int(n.sum())
    if rest > 0:  # the largest remainders (ties: the earlier request) get one more
        n[np.argsort(-(share - n), kind="stable")[:rest]] += 1
    return n


#: Even splits of the longest request that the candidate ladder lists one by one.
SPLITS = 32


def split_pages(pages: np.ndarray, max_pages_per_chunk) -> tuple[np.ndarray, np.ndarray]:
    """``(chunk_pages, chunks)`` per request: the fewest chunks of at most
    ``max_pages_per_chunk`` pages, ``chunks = max(1, ceil(p / L))``, made equal
    (``chunk_pages = ceil(p / chunks)``, at least 1; the last chunk may be
    shorter). ``chunks == max(1, ceil(p / chunk_pages))`` holds, so a plan can
    recount a grown table with ``chunk_pages`` alone. Broadcasts: ``pages``
    ``[B]`` and ``max_pages_per_chunk`` a scalar or ``[K, 1]``.

    >>> c, n = split_pages(np.array([0, 1, 10, 11, 64]), 8)
    >>> c.tolist(), n.tolist()
    ([1, 1, 5, 6, 8], [1, 1, 2, 2, 8])
    """
    pages = np.asarray(pages, dtype=np.int64)
    chunks = np.maximum(1, -(-pages // max_pages_per_chunk))
    chunk_pages = np.maximum(1, -(-pages // chunks))
    return chunk_pages, chunks


def candidate_caps(longest: int, min_pages: int) -> np.ndarray:
    """Chunk caps ``L`` the default plan considers, descending: the even
    splits ``ceil(longest / n)`` of the longest request into ``n`` = 1-32
    chunks, then ``n`` in steps of a quarter octave, never below
    ``min_pages`` (capped at ``longest``). Each is an exact even split of the
    longest request, so uniform batches meet their wave-aligned splits.
    scripts/chunk_sweep.py times the same ladder.

    >>> candidate_caps(2048, 8)[:6].tolist()
    [2048, 1024, 683, 512, 410, 342]
    >>> candidate_caps(2048, 8)[-3:].tolist()
    [12, 10, 8]
    >>> candidate_caps(4, 8).tolist()
    [4]
    """
    return _ladder(max(1, int(longest)), max(1, int(min_pages)))[0]


@functools.lru_cache(maxsize=256)
def _ladder(longest: int, min_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """The caps of :func:`candidate_caps`, as int64 and as float64 (what the
    model divides by); cached, read-only, shared by every caller."""
    floor = min(min_pages, longest)
    counts = list(range(1, SPLITS + 1))
    n = float(SPLITS)
    while longest / n >= floor:
        n *= 2 ** 0.25
        counts.append(int(round(n)))
    caps = -(-longest // np.array(counts, dtype=np.int64))
    caps = np.unique(np.clip(caps, floor, longest))[::-1].copy()
    caps_float = caps.astype(np.float64)
    caps.flags.writeable = caps_float.flags.writeable = False
    return caps, caps_float


def predict_step_us(pages: np.ndarray, caps: np.ndarray, ctas_per_chunk: int, slots: int,
                    page_bytes: int, costs: StepCosts = H200_COSTS) -> np.ndarray:
    """Predicted µs of the attention part of a step (launch overhead aside)
    for each chunk cap in ``caps`` (``[K]``), requests of ``pages`` pages
    (``[B]``), ``ctas_per_chunk`` CTAs per chunk (kv heads x q-head groups),
    ``slots`` resident CTAs on the device and ``page_bytes`` KV bytes one CTA
    reads per page (``page_size * 2 * head_dim * kv itemsize``). The model is
    the module docstring's.

    >>> pages = np.array([8192] + [32] * 63)       # one 131072-token request + 63 of 512
    >>> t = predict_step_us(pages, np.array([8192, 512, 256, 64]), 8, 264, 16 * 512)
    >>> int(np.argmin(t))                          # unsplit, the long request runs alone
    2
    """
    length, weight = _groups(pages)
    caps = np.asarray(caps, dtype=np.float64)
    return _step_us(length, (weight * ctas_per_chunk)[:, None], caps, _model_constants(costs, slots, page_bytes),
                    _merge_us(length[0], caps, costs))


def choose_max_pages_per_chunk(pages: np.ndarray, ctas_per_chunk: int, slots: int, page_bytes: int,
                               min_pages: int, costs: StepCosts = H200_COSTS) -> int:
    """The chunk cap of :func:`candidate_caps` with the least
    :func:`predict_step_us` (the largest one among ties: fewer merges).

    >>> choose_max_pages_per_chunk(np.array([2048] * 4), 8, 264, 16 * 512, 8)  # 8 chunks each: 256 CTAs
    256
    """
    length, first = _sorted_lengths(pages)
    return _best_cap(_pool(length[::-1]), length[0] <= 0, first, length.size, ctas_per_chunk, slots, page_bytes,
                     min_pages, costs)[1]


def choose_cap_and_residency(pages: np.ndarray, ctas_per_chunk: int, sms: int, resident: int, page_bytes: int,
                             min_pages: int, kv_itemsize: int, rows: bool = False,
                             fewer: bool = True, head_dim: int = 128) -> tuple[int, int, int]:
    """``(ctas_per_sm, cap, longest)``: over the CTAs-per-SM counts of
    :func:`residency_choices` (each with its own constants, of
    :func:`costs_for` with ``rows``, and ``count * sms`` slots; only
    ``resident`` when not ``fewer``), the count and chunk cap of least
    predicted step time (the most CTAs per SM among ties), and the longest
    request's pages. One count: :func:`choose_max_pages_per_chunk`'s cap.

    >>> choose_cap_and_residency(np.array([2048] * 4), 8, 132, 2, 16 * 512, 8, 2)[:2]
    (2, 256)
    """
    length, first = _sorted_lengths(pages)
    pooled, some_empty = _pool(length[::-1]), length[0] <= 0
    best = None
    for count in residency_choices(kv_itemsize, resident, head_dim) if fewer else (resident,):
        t, cap = _best_cap(pooled, some_empty, first, length.size, ctas_per_chunk, count * sms, page_bytes,
                           min_pages, costs_for(kv_itemsize, count, rows, resident))
        if best is None or t < best[0]:
            best = (t, count, cap)
    return best[1], best[2], first


def _best_cap(pooled: np.ndarray, some_empty: bool, first: int, batch: int, ctas_per_chunk: int, slots: int,
              page_bytes: int, min_pages: int, costs: StepCosts) -> tuple[float, int]:
    """``(µs, cap)``: the least predicted step time over the candidate
    ladder and its cap (the largest among ties), for the lengths of
    ``batch`` requests pooled by :func:`_pool`, the longest ``first`` pages
    (``some_empty``: see :func:`_step_us`)."""
    caps, caps_float, group_ctas, merge, constants = _ladder_setup(
        first, max(1, int(min_pages)), batch, ctas_per_chunk, slots, page_bytes, costs)
    t = _step_us(pooled, group_ctas, caps_float, constants, merge, some_empty=some_empty)
    i = t.argmin()
    return float(t[i]), int(caps[i])


def _sorted_lengths(pages) -> tuple[np.ndarray, int]:
    """``(length, longest)``: the page counts as float64 in ascending order
    (one sort: the model's length order, and the longest request), and the
    longest's pages as an int (0 for no request)."""
    pages = np.asarray(pages)
    if pages.dtype.kind not in "iu":
        pages = pages.astype(np.int64)
    length = pages.astype(np.float64)
    length.sort()
    first = int(length[-1]) if length.size else 0
    if first >= 2**53:  # (a float64 holds every page count below 2**53 exactly)
        first = int(pages.max())
    return length, first


# --------------------------------------------------------------------------
# the model, fast: the plain formulas are in tests/test_schedule_fast.py
# --------------------------------------------------------------------------
class _Constants(NamedTuple):
    """The model's scalars for one device and KV format, as 0-d float64
    arrays: NumPy takes one ~0.1 µs faster than a Python float (no scalar
    conversion per call), and the values are the same doubles. ``cta_alone``
    and ``one`` may have the shape of the model's arrays instead
    (:func:`_model_constants`)."""

    page_bytes: np.ndarray
    inv_rate: np.ndarray     # µs per byte of a CTA on a full device
    cta_us: np.ndarray
    slots: np.ndarray
    inv_slots: np.ndarray
    hbm_share: np.ndarray    # µs per byte per concurrent CTA of a partial wave (HBM-bound)
    cta_alone: np.ndarray    # µs per byte of a lone CTA
    one: np.ndarray


def _step_us(length: np.ndarray, group_ctas: np.ndarray, caps: np.ndarray, k: _Constants, merge: np.ndarray,
             some_empty: bool = True) -> np.ndarray:
    """:func:`predict_step_us` of the groups of :func:`_groups`: ``length``
    ``[G]``, ``group_ctas`` (a group's requests times CTAs per chunk,
    ``[G, 1]`` or ``[G, K]``), float64 ``caps`` (``[K]``, or ``[G, K]``: the
    same caps on every row), the constants and the ``merge`` term
    (:func:`_merge_us`) of the caps. ``some_empty=False`` promises that
    every group has a chunk at every cap (lengths > 0, caps finite and
    >= 1), which makes the at-least-one-chunk pass a no-op.

    The model runs on every default plan (~40 caps x 32 groups), where a
    NumPy call costs more than its elements: each formula is one pass, in
    place into an array that is not read again, over operands of one shape
    where it can (a broadcast operand costs ~1 µs more a pass). The
    operations and their operand order are the plain formulas', so the
    result is bitwise theirs.
    """
    # (locals: an attribute lookup per use would cost ~0.5 µs in all)
    page_bytes, inv_rate, cta_us, slots, inv_slots, hbm_share, cta_alone, one = k
    groups, count = length.shape[0], caps.shape[-1]
    rows = length.repeat(count).reshape(groups, count)               # each group's length at every cap
    per_request = rows / caps                                        # [G, K]
    np.ceil(per_request, out=per_request)                            # chunks (0 for an empty request)
    if some_empty:
        np.maximum(per_request, one, out=per_request)
    unit_bytes = np.divide(rows, per_request, out=rows)
    np.ceil(unit_bytes, out=unit_bytes)
    unit_bytes *= page_bytes                                         # bytes one CTA of the group reads
    ctas = per_request                                               # (chunk counts: not read again)
    ctas *= group_ctas
    # prefix sums by a product with the lower triangle of ones: the CTA counts
    # are whole numbers far below 2**53, so any summation order gives the
    # same doubles, in ~2 µs less than np.add.accumulate along axis 0 (np.dot:
    # ~0.4 µs less than np.matmul)
    n_prefix = np.dot(_lower_ones(groups), ctas)
    unit_full = unit_bytes * inv_rate
    unit_full += cta_us                                              # µs of a CTA on a full device
    ctas *= unit_full                                                # (CTA counts: not read again)
    # the bound of every prefix (rows 0..G-1) and the work bound (row G),
    # for one maximum over the rows
    bounds = np.empty((groups + 1, count))
    work = np.add.reduce(ctas, axis=0, out=bounds[groups])
    work /= slots
    # every prefix of the CTAs (longest first): its shortest CTAs in full
    # waves, and a partial last wave that runs at the rate of its own count
    waves = np.multiply(n_prefix, inv_slots, out=bounds[:groups])
    np.floor(waves, out=waves)
    rest = waves * slots
    np.subtract(n_prefix, rest, out=rest)
    partial = np.multiply(rest, hbm_share, out=n_prefix)             # (prefix counts: not read again)
    np.maximum(cta_alone, partial, out=partial)
    partial *= unit_bytes
    partial += cta_us
    np.minimum(rest, one, out=rest)                                  # 1 where a partial wave runs, else 0
    partial *= rest                                                  # (rest: a whole number >= 0)
    waves *= unit_full
    waves += partial
    bound = np.maximum.reduce(bounds, axis=0)
    bound += merge
    return bound


@functools.lru_cache(maxsize=64)
def _lower_ones(groups: int) -> np.ndarray:
    """``[G, G]`` float64 lower triangle of ones (a prefix sum as a matrix
    product), read-only, cached per group count."""
    tri = np.tri(groups)
    tri.flags.writeable = False
    return tri


def _merge_us(longest: float, caps: np.ndarray, costs: StepCosts) -> np.ndarray:
    """The merge that the request with the most chunks (the longest, of
    ``longest`` pages) adds at each cap, 0 where it is not split."""
    most = np.ceil(longest / caps)
    return (most > 1) * (costs.merge_us + costs.merge_us_per_chunk * most)


@functools.lru_cache(maxsize=64)
def _model_constants(costs: StepCosts, slots: int, page_bytes: int, shape: tuple[int, ...] = ()) -> _Constants:
    """The :class:`_Constants` of a device (``slots``), KV format
    (``page_bytes``) and cost table; ``cta_alone`` and ``one`` filled to
    ``shape``, that of the model's arrays (np.maximum and np.minimum take an
    operand of their own shape ~0.6 µs faster than a 0-d one); cached."""
    def const(value, shape=()) -> np.ndarray:
        arr = np.full(shape, value, dtype=np.float64)
        arr.flags.writeable = False
        return arr

    return _Constants(const(page_bytes), const(1.0 / _rate(costs, slots)), const(costs.cta_us), const(slots),
                      const(1.0 / slots), const(1e-3 / costs.hbm_gbps), const(1e-3 / costs.cta_gbps, shape),
                      const(1.0, shape))


class _Setup(NamedTuple):
    """What :func:`_ladder_setup` caches."""

    caps: np.ndarray         # the ladder, int64 [K]
    caps_float: np.ndarray   # and as float64, on every row: [G, K]
    group_ctas: np.ndarray   # [G, K]
    merge: np.ndarray        # [K]
    constants: _Constants


@functools.lru_cache(maxsize=256)
def _ladder_setup(first: int, min_pages: int, batch: int, ctas_per_chunk: int, slots: int, page_bytes: int,
                  costs: StepCosts) -> _Setup:
    """What :func:`choose_max_pages_per_chunk` evaluates the model with,
    besides the request lengths: it depends only on the longest request
    (``first`` pages, 0 too), the batch size, the shapes and the device, so
    one cached lookup replaces ~8 small NumPy calls a plan. Read-only."""
    caps, caps_float = _ladder(max(1, first), min_pages)
    # repeated along the caps (and the caps along the groups): a broadcast
    # operand costs ~0.6 µs more a pass
    weight = _cuts(batch)[1]
    group_ctas = np.repeat((weight * ctas_per_chunk)[:, None], caps.size, axis=1)
    caps_rows = np.repeat(caps_float[None, :], weight.size, axis=0)
    merge = _merge_us(np.float64(first), caps_float, costs)
    group_ctas.flags.writeable = caps_rows.flags.writeable = merge.flags.writeable = False
    return _Setup(caps, caps_rows, group_ctas, merge, _model_constants(costs, slots, page_bytes, caps_rows.shape))


#: Requests the model keeps one by one (the longest); the rest it pools into
#: equal-count groups of the length order, so a plan's cost stays flat in
#: the batch size.
EXACT_REQUESTS = 8
GROUPS = 24


def _groups(pages) -> tuple[np.ndarray, np.ndarray]:
    """``(length, weight)`` float64 ``[G]``: the requests' page counts in
    descending order (the launch order of their chunks, LPT), the longest
    ``EXACT_REQUESTS`` one by one and the rest as the mean of up to
    ``GROUPS`` runs of equal count (``weight`` requests each).

    >>> _groups(np.array([3, 9, 1]))
    (array([9., 3., 1.]), array([1., 1., 1.]))
    """
    length = np.sort(np.asarray(pages, dtype=np.float64))[::-1]
    return _pool(length), _cuts(length.size)[1]


def _pool(length: np.ndarray) -> np.ndarray:
    """The group lengths of :func:`_groups` from page counts already
    float64 and longest first."""
    if length.size <= EXACT_REQUESTS + GROUPS:
        return length
    cuts, weight = _cuts(length.size)
    return np.add.reduceat(length, cuts) / weight


@functools.lru_cache(maxsize=64)
def _cuts(batch: int) -> tuple[np.ndarray | None, np.ndarray]:
    """``(cuts, weight)`` of :func:`_groups` for ``batch`` requests: the
    first index and the size of each group (cuts None: one request each)."""
    if batch <= EXACT_REQUESTS + GROUPS:
        cuts, weight = None, np.ones(batch)
    else:
        cuts = np.unique(np.concatenate([np.arange(EXACT_REQUESTS),
                                         np.linspace(EXACT_REQUESTS, batch, GROUPS + 1)[:-1].astype(np.int64)]))
        weight = np.diff(np.append(cuts, batch)).astype(np.float64)
        cuts.flags.writeable = False
    weight.flags.writeable = False
    return cuts, weight


def _rate(costs: StepCosts, concurrent):
    """Bytes per µs one CTA streams beside ``concurrent - 1`` others."""
    return np.minimum(costs.cta_gbps, costs.hbm_gbps / concurrent) * 1e3
