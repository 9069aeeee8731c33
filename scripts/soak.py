#!/usr/bin/env python3
"""Soak test of cupaged: a simulated serving loop (issue 7, item 6).

A :class:`cupaged.BlockPool` serves a stream of sequences for ``--steps``
decode steps:

* **arrivals** at random steps over the whole run (``--sequences`` of them,
  four at step 0), each with a random prefill; an arrival the pool cannot
  hold is refused (``OutOfPagesError``) and retried the next step;
* one **decode append** per live sequence per step, plus occasional
  multi-token **prefill chunks** for a live sequence;
* **forks** of random live sequences, their copy-on-write ``PageCopy`` applied
  to the KV caches (and to a host cache of token ids);
* **sliding windows** (``apply_window`` every step for a windowed sequence),
  random **front trims** (sometimes of every visible token, leaving a
  zero-page request in the batch), **frees** when a sequence finishes or is
  aborted, and **evictions** when a decode append finds the pool exhausted.

Every token written gets a unique id; its K and V rows are row ``id % 4093``
of two random banks, and every page is filled with NaN (ids with -1) when it
is allocated, so a read of a slot nobody wrote shows up.

Checked **every step** (any violation is a failure, exit status 1):

* refcount of every page == number of live sequences holding it; no page
  twice in one sequence; free pages are unowned and owned pages are not free;
  no duplicate on the free list; ``num_free + pages held == num_pages``;
* each sequence's ``logical_start`` / ``length`` equal the soak's own
  bookkeeping and it holds exactly the pages its window needs;
* ``pool.page_table()`` validates (and ``check_page_ids``); ``rope_offsets``
  == written length and ``seq_lens`` == visible length of every sequence;
* the token ids read through the CSR view (the way a kernel walks it) are
  exactly the ids each sequence wrote or inherited;
* a page written by an append is held by that sequence alone (copy-on-write);
* an operation the pool must refuse (too few free pages, predicted from the
  soak's own page arithmetic) raises ``OutOfPagesError`` and leaves the pool
  exactly as it was, and one it must accept succeeds;
* a plan reused only while ``plan.matches(table)``; once stale, running it is
  refused with ``PlanMismatchError`` and a new plan is built.

Checked **every ``--checkpoint-every`` steps** (the first step with a
non-empty batch once one is due, and at the end):

* the K/V rows read from the caches through the table equal the bank rows of
  the expected token ids, exactly;
* ``--backend gpu``: ``cupaged.decode`` (run every step with the held plan,
  NaN-poisoned ``out``, every output finite every step) against
  ``cupaged.reference.decode`` on host copies of q and the caches: max_rel
  within 2e-2 (16-bit) / 1e-5 (float32), LSE within the same relative bound,
  empty requests zeros and -inf;
* ``--backend cpu`` (NumPy caches, no GPU needed): the split-KV emulation
  ``cupaged.reference.decode_split(plan)`` against ``reference.decode``
  (max_rel within 1e-9): the pool, the table, the plan and the split/merge
  math, without the kernels.

At the end one line of JSON goes to stdout (progress goes to stderr, unless
``--quiet``): steps, sequences seen, checkpoints, worst max_rel, plan
rebuilds and reuses, peak pages in use and the operation counts. ``--json
PATH`` also writes it to a file.

Exit status: 0 passed, 1 a check failed, 2 bad arguments, 3 ``--backend gpu``
on a machine without a CUDA GPU (message on stderr).

Examples::

    python scripts/soak.py --backend gpu                  # 1000 steps, 64+ sequences
    python scripts/soak.py --backend cpu --steps 200      # host-only, seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:
    import cupaged
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cupaged

try:  # run as a script (scripts/ is sys.path[0]) or imported with scripts/ on the path
    import _common
except ImportError:  # imported as scripts.soak
    from scripts import _common

from cupaged import reference
from cupaged.errors import OutOfPagesError, PlanMismatchError

EXIT_FAILED = 1
EXIT_NO_GPU = _common.EXIT_NO_GPU
NO_GPU_MESSAGE = (
    "no CUDA GPU available (cupaged.has_gpu() is False): --backend gpu needs an NVIDIA GPU "
    "(--backend cpu runs the host-only soak); exiting with status 3"
)
#: Rows in the K/V banks; a prime, so ids that differ by a small amount never share a row.
BANK_ROWS = 4093
#: Window sizes a windowed sequence draws from (1 and 5 are below one page).
WINDOWS = (1, 5, 16, 48, 100, 200)
#: max_rel (and relative LSE error) bounds per backend / dtype.
GPU_TOL = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 1e-5}
CPU_TOL = 1e-9


class SoakFailure(Exception):
    """A check of the soak failed; the message says which and where."""


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _rate(text: str) -> float:
    v = float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="soak.py",
        description="Simulated serving loop over a cupaged.BlockPool: arrivals, appends, prefills, forks, "
        "sliding windows, trims and frees; pool invariants every step, decode vs the float64 reference "
        "every --checkpoint-every steps.",
        epilog=_common.EXIT_CODES_EPILOG,
    )
    p.add_argument("--backend", choices=("gpu", "cpu"), default="gpu",
                   help="gpu: CuPy caches and cupaged.decode; cpu: NumPy caches and reference.decode_split "
                   "(default gpu)")
    p.add_argument("--steps", type=_positive, default=1000, help="decode steps (default 1000)")
    p.add_argument("--sequences", type=_positive, default=64,
                   help="arrivals over the run; forks add more (default 64)")
    p.add_argument("--checkpoint-every", type=_positive, default=50,
                   help="steps between checks against the reference (default 50)")
    p.add_argument("--num-pages", type=_positive, default=224,
                   help="pages in the pool and caches (default 224: the default run exhausts it now and then)")
    p.add_argument("--page-size", type=_positive, default=16, help="tokens per page (default 16)")
    p.add_argument("--num-qo-heads", type=_positive, default=8, help="query heads (default 8)")
    p.add_argument("--num-kv-heads", type=_positive, default=2, help="KV heads (default 2)")
    p.add_argument("--head-dim", type=_positive, default=64, help="head dim (default 64)")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="KV/query dtype")
    p.add_argument("--method", choices=cupaged.METHODS, default="auto", help="decode method (gpu backend)")
    p.add_argument("--pages-per-chunk", type=_positive, default=None,
                   help="pin the plan's chunk size (default: plan_decode's heuristic)")
    p.add_argument("--max-prefill", type=_positive, default=192, help="longest prefill of an arrival")
    p.add_argument("--max-life", type=_positive, default=None,
                   help="most decode steps a sequence lives (default max(8, steps // 4))")
    p.add_argument("--fork-rate", type=_rate, default=0.15, help="chance of a fork per step")
    p.add_argument("--trim-rate", type=_rate, default=0.01,
                   help="chance per step that an unwindowed sequence trims its front")
    p.add_argument("--window-fraction", type=_rate, default=0.3, help="share of sequences with a sliding window")
    p.add_argument("--extend-rate", type=_rate, default=0.02,
                   help="chance per step that a live sequence also appends a prefill chunk")
    p.add_argument("--abort-rate", type=_rate, default=0.002, help="chance per step that a sequence is aborted")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--json", default=None, help="also write the summary line to this file")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.num_qo_heads % args.num_kv_heads:
        build_parser().error("--num-qo-heads must be a multiple of --num-kv-heads")
    if args.max_life is None:
        args.max_life = max(8, args.steps // 4)
    return args


# ----------------------------------------------------------------------------- caches
class Caches:
    """K and V caches (CuPy or NumPy) plus a host cache of token ids, with the
    token writes of a step batched into one scatter per cache.

    Pending writes are flushed before anything that reads the caches or
    overwrites slots (a poison, a copy, a check), so the batched writes keep
    the sequential meaning; a page is only reused after a poison, so a batch
    never writes one slot twice."""

    def __init__(self, xp, num_pages, page_size, num_kv_heads, head_dim, dtype, rng):
        self.xp = xp
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = xp.full(shape, np.nan, dtype=dtype)
        self.v = xp.full(shape, np.nan, dtype=dtype)
        self.ids = np.full((num_pages, page_size), -1, dtype=np.int64)
        # [num_pages * page_size, Hkv, D] views: a token write is one flat scatter
        self._k_slots = self.k.reshape(num_pages * page_size, num_kv_heads, head_dim)
        self._v_slots = self.v.reshape(num_pages * page_size, num_kv_heads, head_dim)
        self.page_size = page_size
        bank = rng.standard_normal((2, BANK_ROWS, num_kv_heads, head_dim), dtype=np.float32)
        self.bank_k, self.bank_v = bank[0].astype(dtype), bank[1].astype(dtype)  # host copies
        self._dev_k, self._dev_v = xp.asarray(self.bank_k), xp.asarray(self.bank_v)
        self._pages: list[int] = []
        self._entries: list[int] = []
        self._uids: list[int] = []

    def write(self, page: int, entry: int, uid: int) -> None:
        self._pages.append(page)
        self._entries.append(entry)
        self._uids.append(uid)

    def flush(self) -> None:
        if not self._pages:
            return
        xp = self.xp
        pages = np.asarray(self._pages, dtype=np.int64)
        entries = np.asarray(self._entries, dtype=np.int64)
        uids = np.asarray(self._uids, dtype=np.int64)
        self.ids[pages, entries] = uids
        rows, slots = xp.asarray(uids % BANK_ROWS), xp.asarray(pages * self.page_size + entries)
        self._k_slots[slots] = self._dev_k[rows]
        self._v_slots[slots] = self._dev_v[rows]
        self._pages, self._entries, self._uids = [], [], []

    def poison_pages(self, pages) -> None:
        if not pages:
            return
        self.flush()
        idx = np.asarray(pages, dtype=np.int64)
        self.ids[idx] = -1
        d = self.xp.asarray(idx)
        self.k[d] = np.nan
        self.v[d] = np.nan

    def poison_head(self, page: int, upto: int) -> None:
        """Slots ``[0, upto)`` of ``page`` (retired by a trim) become NaN / -1."""
        if upto <= 0:
            return
        self.flush()
        self.ids[page, :upto] = -1
        self.k[page, :upto] = np.nan
        self.v[page, :upto] = np.nan

    def copy(self, copies) -> None:
        if not copies:
            return
        self.flush()
        cupaged.apply_page_copies([self.k, self.v], copies)
        cupaged.apply_page_copies(self.ids, copies)

    def host_kv(self):
        self.flush()
        if self.xp is np:
            return self.k, self.v
        return self.k.get(), self.v.get()


# ---------------------------------------------------------------------------- the soak
@dataclass
class Seq:
    tokens: list  # uid of every written absolute position
    start: int  # expected logical_start
    window: int | None
    life: int  # decode steps left


@dataclass
class Stats:
    steps: int = 0
    sequences_seen: int = 0
    arrivals: int = 0
    arrivals_pending: int = 0
    forks: int = 0
    fork_copies: int = 0
    frees: int = 0
    finished: int = 0
    aborted: int = 0
    evictions: int = 0
    oom_refusals: int = 0
    prefill_chunks: int = 0
    tokens_written: int = 0
    trims: int = 0
    window_trims: int = 0
    full_trims: int = 0
    pages_dropped: int = 0
    decode_steps: int = 0
    idle_steps: int = 0
    zero_page_requests: int = 0
    merge_steps: int = 0
    checkpoints: int = 0
    worst_max_rel: float = 0.0
    worst_lse_err: float = 0.0
    plan_rebuilds: int = 0
    plan_reuses: int = 0
    stale_plan_rejections: int = 0
    peak_pages_in_use: int = 0
    peak_live: int = 0
    peak_batch_tokens: int = 0


def _pages_for(start: int, length: int, page_size: int) -> int:
    return 0 if length == start else -(-length // page_size) - start // page_size


def _snapshot(pool: cupaged.BlockPool):
    """Everything a refused operation must leave untouched."""
    return (
        [pool.refcount(p) for p in range(pool.num_pages)],
        copy.copy(getattr(pool, "_free", None)),
        {s: pool.sequence(s) for s in pool.seq_ids},
        pool.seq_ids,
        pool.num_free,
    )


def _rel_errors(out, ref) -> float:
    diff = np.abs(np.asarray(out, dtype=np.float64) - ref)
    scale = max(float(np.abs(ref).max(initial=0.0)), 1e-30)
    return float(diff.max(initial=0.0)) / scale


def _lse_error(lse, ref_lse) -> float:
    lse = np.asarray(lse, dtype=np.float64)
    finite = np.isfinite(ref_lse)
    if not np.array_equal(finite, np.isfinite(lse)):
        raise SoakFailure("the LSE's -inf pattern differs from the reference")
    if not np.array_equal(lse[~finite], ref_lse[~finite]):
        raise SoakFailure("an empty request's LSE is not -inf")
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(lse[finite] - ref_lse[finite]) / np.maximum(1.0, np.abs(ref_lse[finite]))))


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = np.random.default_rng(args.seed)  # every pool decision and the K/V banks
        self.q_rng = np.random.default_rng(args.seed + 1)  # queries (cpu), so both backends run one schedule
        self.gpu = args.backend == "gpu"
        if self.gpu:
            import cupy

            self.cp = cupy
            cupy.random.seed(args.seed)
            xp = cupy
        else:
            xp = np
        self.dtype = np.dtype(args.dtype)
        self.P = args.page_size
        self.pool = cupaged.BlockPool(args.num_pages, args.page_size)
        self.caches = Caches(xp, args.num_pages, args.page_size, args.num_kv_heads, args.head_dim,
                             self.dtype, self.rng)
        self.seqs: dict[int, Seq] = {}
        self.stats = Stats()
        self.next_uid = 0
        self.plan = None
        self.step_no = 0
        self.checkpoint_due = False
        # arrival schedule: a few at step 0, the rest at random steps of the run
        first = min(4, args.sequences)
        when = np.concatenate([np.zeros(first, np.int64),
                               self.rng.integers(0, args.steps, args.sequences - first)])
        self.schedule = np.bincount(when, minlength=args.steps).tolist()
        self.pending_arrivals = 0
        self.tol = GPU_TOL[args.dtype] if self.gpu else CPU_TOL

    # -- helpers -----------------------------------------------------------------
    def fail(self, msg: str):
        raise SoakFailure(f"step {self.step_no}: {msg}")

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            print(msg, file=sys.stderr, flush=True)

    def new_life(self) -> int:
        return int(self.rng.integers(4, self.args.max_life + 1))

    def new_window(self) -> int | None:
        return int(self.rng.choice(WINDOWS)) if self.rng.random() < self.args.window_fraction else None

    def expect_refusal(self, fn, *args):
        """``fn(*args)`` must raise OutOfPagesError and change nothing."""
        before = _snapshot(self.pool)
        try:
            fn(*args)
        except OutOfPagesError:
            pass
        else:
            self.fail(f"{fn.__name__}{args} succeeded with {before[4]} free pages although it needs more")
        if _snapshot(self.pool) != before:
            self.fail(f"a refused {fn.__name__}{args} changed the pool")
        self.stats.oom_refusals += 1

    # -- pool operations ---------------------------------------------------------
    def append(self, sid: int, n: int) -> bool:
        """Append ``n`` tokens (writes their K/V); False when the pool is full."""
        pool, s, P = self.pool, self.seqs[sid], self.P
        st = pool.sequence(sid)
        length = len(s.tokens)
        need = _pages_for(s.start, length + n, P) - len(st.pages)
        if need > pool.num_free:
            self.expect_refusal(pool.append, sid, n)
            return False
        fresh = pool.append(sid, n)
        if len(fresh) != need:
            self.fail(f"append({sid}, {n}) allocated {len(fresh)} pages, expected {need}")
        self.caches.poison_pages(fresh)
        st = pool.sequence(sid)
        base = s.start // P
        for t in range(length, length + n):
            page = st.pages[t // P - base]
            if pool.refcount(page) != 1:
                self.fail(f"sequence {sid} writes position {t} into page {page} "
                          f"shared by {pool.refcount(page)} sequences (copy-on-write broken)")
            uid = self.next_uid
            self.next_uid += 1
            self.caches.write(page, t % P, uid)
            s.tokens.append(uid)
        self.stats.tokens_written += n
        return True

    def free(self, sid: int, why: str) -> None:
        self.pool.free(sid)
        del self.seqs[sid]
        self.stats.frees += 1
        setattr(self.stats, why, getattr(self.stats, why) + 1)

    def fork(self) -> None:
        pool = self.pool
        parent = int(self.rng.choice(pool.seq_ids))
        ps, st = self.seqs[parent], pool.sequence(parent)
        need = 1 if st.pages and len(ps.tokens) % self.P else 0
        if need > pool.num_free:
            self.expect_refusal(pool.fork, parent)
            return
        cid, copies = pool.fork(parent)
        if len(copies) != need:
            self.fail(f"fork({parent}) returned {len(copies)} page copies, expected {need}")
        self.caches.copy(copies)
        self.seqs[cid] = Seq(list(ps.tokens), ps.start, ps.window, self.new_life())
        self.stats.forks += 1
        self.stats.fork_copies += len(copies)
        self.stats.sequences_seen += 1

    def trim(self, sid: int, n: int, window: int | None = None) -> None:
        pool, s, P = self.pool, self.seqs[sid], self.P
        before = pool.sequence(sid).pages
        length = len(s.tokens)
        new_start = s.start + n
        dropped = pool.trim_front(sid, n) if window is None else pool.apply_window(sid, window)
        keep = _pages_for(new_start, length, P)
        if dropped != before[: len(before) - keep]:
            self.fail(f"trim of sequence {sid} dropped {dropped}, expected {before[: len(before) - keep]}")
        s.start = new_start
        self.stats.pages_dropped += len(dropped)
        if window is None:
            self.stats.trims += 1
        elif n:
            self.stats.window_trims += 1
        if new_start == length:
            self.stats.full_trims += 1
        st = pool.sequence(sid)
        if st.pages and new_start % P and pool.refcount(st.pages[0]) == 1:
            self.caches.poison_head(st.pages[0], new_start % P)

    # -- one step ----------------------------------------------------------------
    def step(self) -> None:
        args, rng, pool = self.args, self.rng, self.pool
        # 1. sequences that finished or were aborted leave
        for sid in list(pool.seq_ids):
            if self.seqs[sid].life <= 0:
                self.free(sid, "finished")
            elif rng.random() < args.abort_rate:
                self.free(sid, "aborted")
        # 2. forks
        while pool.seq_ids and rng.random() < args.fork_rate:
            self.fork()
            if rng.random() < 0.5:
                break
        # 3. arrivals (refused ones wait for the next step)
        self.pending_arrivals += self.schedule[self.step_no] if self.step_no < len(self.schedule) else 0
        waiting = self.pending_arrivals
        for _ in range(waiting):
            sid = pool.add_sequence()
            self.seqs[sid] = Seq([], 0, self.new_window(), self.new_life())
            prompt = int(rng.integers(1, args.max_prefill + 1))
            if not self.append(sid, prompt):
                pool.free(sid)  # refused: it holds nothing yet, and waits for the next step
                del self.seqs[sid]
                break
            self.pending_arrivals -= 1
            self.stats.arrivals += 1
            self.stats.sequences_seen += 1
        # 4. the decode step's appends (plus occasional prefill chunks)
        for sid in list(pool.seq_ids):
            n = 1
            if rng.random() < args.extend_rate:
                n += int(rng.integers(2, 3 * self.P + 1))
                self.stats.prefill_chunks += 1
            if not self.append(sid, n):
                self.free(sid, "evictions")
        # 5. sliding windows and front trims
        for sid in list(pool.seq_ids):
            s = self.seqs[sid]
            visible = len(s.tokens) - s.start
            if s.window is not None:
                self.trim(sid, max(0, visible - s.window), window=s.window)
            elif visible and rng.random() < args.trim_rate:
                n = visible if rng.random() < 0.2 else int(rng.integers(1, visible + 1))
                self.trim(sid, n)
        self.caches.flush()
        table = self.check_invariants()
        self.decode(table)
        for s in self.seqs.values():
            s.life -= 1

    # -- checks ------------------------------------------------------------------
    def check_invariants(self):
        pool, P, n = self.pool, self.P, self.pool.num_pages
        holders = np.zeros(n, dtype=np.int64)
        if set(pool.seq_ids) != set(self.seqs):
            self.fail(f"live sequences {sorted(pool.seq_ids)} != expected {sorted(self.seqs)}")
        for sid in pool.seq_ids:
            st, s = pool.sequence(sid), self.seqs[sid]
            if (st.logical_start, st.length) != (s.start, len(s.tokens)):
                self.fail(f"sequence {sid}: pool has logical_start={st.logical_start}, length={st.length}; "
                          f"expected {s.start}, {len(s.tokens)}")
            if len(set(st.pages)) != len(st.pages):
                self.fail(f"sequence {sid} holds a page twice: {st.pages}")
            if len(st.pages) != _pages_for(s.start, len(s.tokens), P):
                self.fail(f"sequence {sid} holds {len(st.pages)} pages, its window needs "
                          f"{_pages_for(s.start, len(s.tokens), P)}")
            for p in st.pages:
                if not 0 <= p < n:
                    self.fail(f"sequence {sid} holds page id {p} outside [0, {n})")
                holders[p] += 1
        refcounts = np.array([pool.refcount(p) for p in range(n)], dtype=np.int64)
        bad = np.flatnonzero(refcounts != holders)
        if bad.size:
            p = int(bad[0])
            self.fail(f"page {p} has refcount {refcounts[p]} but {holders[p]} owners")
        free = getattr(pool, "_free", None)
        if free is not None:
            if len(set(free)) != len(free) or len(free) != pool.num_free:
                self.fail(f"free list has duplicates or disagrees with num_free={pool.num_free}")
            owned_free = [p for p in free if holders[p]]
            if owned_free:
                self.fail(f"pages {owned_free[:5]} are on the free list but owned")
            if set(free) != set(np.flatnonzero(holders == 0).tolist()):
                self.fail("some unowned page is missing from the free list (leaked)")
        held = int(np.count_nonzero(holders))
        if pool.num_free + held != n:
            self.fail(f"num_free {pool.num_free} + held {held} != num_pages {n} (leak or double free)")
        self.stats.peak_pages_in_use = max(self.stats.peak_pages_in_use, held)
        self.stats.peak_live = max(self.stats.peak_live, len(self.seqs))

        table, rope = pool.page_table()
        table.validate()
        table.check_page_ids(n)
        ids = pool.seq_ids
        written = [len(self.seqs[s].tokens) for s in ids]
        if rope.tolist() != written:
            self.fail(f"rope_offsets {rope.tolist()} != written lengths {written}")
        visible = [len(self.seqs[s].tokens) - self.seqs[s].start for s in ids]
        if table.seq_lens.tolist() != visible:
            self.fail(f"seq_lens {table.seq_lens.tolist()} != visible lengths {visible}")
        # the token ids a kernel would read through the CSR view
        for i, sid in enumerate(ids):
            seq = visible[i]
            if not seq:
                continue
            lo, hi = int(table.indptr[i]), int(table.indptr[i + 1])
            off = int(table.first_page_offset[i])
            got = self.caches.ids[table.indices[lo:hi]].reshape(-1)[off:off + seq]
            s = self.seqs[sid]
            want = np.asarray(s.tokens[s.start:], dtype=np.int64)
            if not np.array_equal(got, want):
                k = int(np.flatnonzero(got != want)[0])
                self.fail(f"sequence {sid}: the token at position {s.start + k} reads id {int(got[k])} "
                          f"through the page table, expected {int(want[k])}")
        return table

    def check_content(self, table, k_host, v_host) -> None:
        """The K/V rows read through the table are the expected bank rows, exactly."""
        for i, sid in enumerate(self.pool.seq_ids):
            s = self.seqs[sid]
            rows = np.asarray(s.tokens[s.start:], dtype=np.int64) % BANK_ROWS
            for name, cache, bank in (("K", k_host, self.caches.bank_k), ("V", v_host, self.caches.bank_v)):
                got = reference.gather_kv(cache, table, i)
                if not np.array_equal(got, bank[rows].astype(np.float64)):
                    self.fail(f"sequence {sid}: the {name} cache holds wrong values for its visible tokens")

    # -- decode and the plan -------------------------------------------------------
    def decode(self, table) -> None:
        args, st = self.args, self.stats
        B = table.batch_size
        if self.step_no == args.steps - 1 or (self.step_no + 1) % args.checkpoint_every == 0:
            self.checkpoint_due = True
        if B == 0:
            st.idle_steps += 1
            return
        st.decode_steps += 1
        st.zero_page_requests += int(np.count_nonzero(table.request_pages == 0))
        st.peak_batch_tokens = max(st.peak_batch_tokens, int(table.seq_lens.sum()))
        shape = (B, args.num_qo_heads, args.head_dim)
        if self.gpu:
            cp = self.cp
            q = cp.random.standard_normal(shape, dtype=cp.float32).astype(self.dtype)
        else:
            q = self.q_rng.standard_normal(shape, dtype=np.float32).astype(self.dtype)
        if self.plan is not None and self.plan.matches(table):
            st.plan_reuses += 1
        else:
            if self.plan is not None:
                self.expect_stale(q, table)
            self.plan = cupaged.plan_decode(table, args.num_qo_heads, args.num_kv_heads, args.head_dim,
                                            self.dtype, pages_per_chunk=args.pages_per_chunk)
            st.plan_rebuilds += 1
        st.merge_steps += int(self.plan.needs_merge)
        out = lse = None
        if self.gpu:
            cp = self.cp
            out = cp.full(shape, np.nan, dtype=self.dtype)
            res, lse = cupaged.decode(q, self.caches.k, self.caches.v, table, self.plan, method=args.method,
                                      out=out, return_lse=True)
            if res is not out:
                self.fail("decode did not write into out=")
            if not bool(cp.isfinite(out).all()):
                self.fail("decode left a non-finite value in out (NaN poison or a NaN read)")
        if self.checkpoint_due:
            self.checkpoint(table, q, out, lse)
            self.checkpoint_due = False

    def expect_stale(self, q, table) -> None:
        """Running the held plan on a table it no longer matches must be refused."""
        try:
            if self.gpu:
                k, v = self.caches.k, self.caches.v
                if cupaged.select_method(q, k, v, table, method="v2").method != "v2":
                    return  # a shape the kernels decline runs the gather path, which takes no plan
                cupaged.decode(q, k, v, table, self.plan, method="v2")
            else:
                reference.decode_split(q, self.caches.k, self.caches.v, table, self.plan)
        except PlanMismatchError:
            self.stats.stale_plan_rejections += 1
            return
        self.fail("a stale plan (plan.matches(table) is False) was not refused with PlanMismatchError")

    def checkpoint(self, table, q, out, lse) -> None:
        st = self.stats
        k_host, v_host = self.caches.host_kv()
        self.check_content(table, k_host, v_host)
        q_host = q.get() if self.gpu else q
        ref_out, ref_lse = reference.decode(q_host, k_host, v_host, table)
        if self.gpu:
            out, lse = out.get(), lse.get()
        else:
            out, lse, _, _ = reference.decode_split(q_host, k_host, v_host, table, self.plan)
        if not np.isfinite(out).all():
            self.fail("checkpoint output is not finite")
        empty = table.seq_lens == 0
        if empty.any() and (np.asarray(out[empty], dtype=np.float64) != 0).any():
            self.fail("an empty request's output is not zeros")
        max_rel = _rel_errors(out, ref_out)
        try:
            lse_err = _lse_error(lse, ref_lse)
        except SoakFailure as e:
            self.fail(str(e))
        st.checkpoints += 1
        st.worst_max_rel = max(st.worst_max_rel, max_rel)
        st.worst_lse_err = max(st.worst_lse_err, lse_err)
        self.log(f"step {self.step_no + 1}: checkpoint {st.checkpoints}: batch {table.batch_size}, "
                 f"{int(table.seq_lens.sum())} tokens, {self.plan.num_chunks} chunks "
                 f"(merge={self.plan.needs_merge}), max_rel {max_rel:.3g}, lse_err {lse_err:.3g}, "
                 f"pages in use {self.pool.num_pages - self.pool.num_free}/{self.pool.num_pages}")
        if not (max_rel <= self.tol and lse_err <= self.tol):
            self.fail(f"decode differs from the reference: max_rel {max_rel:.3g}, lse_err {lse_err:.3g} "
                      f"(tolerance {self.tol:g})")

    def run(self) -> None:
        for self.step_no in range(self.args.steps):
            self.step()
            self.stats.steps = self.step_no + 1
        self.stats.arrivals_pending = self.pending_arrivals


def summary(args: argparse.Namespace, stats: Stats, ok: bool, failure: str | None, elapsed: float) -> dict:
    out: dict[str, Any] = {"ok": ok, "backend": args.backend, "seed": args.seed}
    out.update(stats.__dict__)
    out.update(
        requested_steps=args.steps,
        num_pages=args.num_pages,
        page_size=args.page_size,
        dtype=args.dtype,
        heads=f"{args.num_qo_heads}/{args.num_kv_heads}x{args.head_dim}",
        elapsed_s=round(elapsed, 3),
        failure=failure,
    )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend == "gpu" and not _common.has_gpu():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return EXIT_NO_GPU
    t0 = time.perf_counter()
    soak = Soak(args)
    failure = None
    try:
        soak.run()
    except SoakFailure as e:
        failure = str(e)
    except Exception as e:  # an unexpected exception is a failure of the run, reported the same way
        failure = f"step {soak.step_no}: unexpected {type(e).__name__}: {e}"
        if not args.quiet:
            traceback.print_exc()
    if failure:
        print(f"SOAK FAILED: {failure}", file=sys.stderr)
    line = json.dumps(summary(args, soak.stats, failure is None, failure, time.perf_counter() - t0))
    print(line, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0 if failure is None else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
