"""CPU tests of the host block pool (cupaged.pool)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from cupaged.errors import OutOfPagesError
from cupaged.page_table import PageTable, build_page_table
from cupaged.pool import BlockPool, PageCopy, SequenceState, apply_page_copies


# -- helpers -------------------------------------------------------------------


def snapshot(pool: BlockPool):
    """Everything a failed operation must leave untouched."""
    return (
        [pool.refcount(p) for p in range(pool.num_pages)],
        copy.copy(pool._free),  # exact heap layout, not just the set
        {s: pool.sequence(s) for s in pool.seq_ids},
        pool.seq_ids,
        pool.num_free,
        pool._next_id,
    )


def gather(table: PageTable, cache: np.ndarray) -> list[list[int]]:
    """Visible token values per request, walking the CSR view like a kernel."""
    P = table.page_size
    out = []
    for i in range(table.batch_size):
        lo, hi = int(table.indptr[i]), int(table.indptr[i + 1])
        vals = []
        for j in range(lo, hi):
            first = int(table.first_page_offset[i]) if j == lo else 0
            end = int(table.last_page_len[i]) if j == hi - 1 else P
            vals += cache[table.indices[j], first:end].tolist()
        out.append(vals)
    return out


class Model:
    """A pool plus a fake one-value-per-token KV cache and the tokens each
    sequence should see, so tests can check content, not just bookkeeping."""

    def __init__(self, num_pages, page_size):
        self.pool = BlockPool(num_pages, page_size)
        self.cache = np.full((num_pages, page_size), -1, dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}  # absolute position -> value
        self.counter = 0

    def add(self):
        sid = self.pool.add_sequence()
        self.tokens[sid] = []
        return sid

    def append(self, sid, n):
        pool, P = self.pool, self.pool.page_size
        start_len = pool.sequence(sid).length
        pool.append(sid, n)
        st = pool.sequence(sid)
        for t in range(start_len, start_len + n):
            self.counter += 1
            self.cache[st.pages[t // P - st.logical_start // P], t % P] = self.counter
            self.tokens[sid].append(self.counter)

    def fork(self, sid):
        child, copies = self.pool.fork(sid)
        apply_page_copies(self.cache, copies)
        self.tokens[child] = list(self.tokens[sid])
        return child, copies

    def visible(self, sid):
        st = self.pool.sequence(sid)
        return self.tokens[sid][st.logical_start : st.length]

    def check(self):
        check_invariants(self.pool)
        ids = self.pool.seq_ids
        table, rope = self.pool.page_table(ids)
        assert gather(table, self.cache) == [self.visible(s) for s in ids]
        assert rope.tolist() == [len(self.tokens[s]) for s in ids]


def check_invariants(pool: BlockPool):
    holders = [0] * pool.num_pages
    for s in pool.seq_ids:
        st = pool.sequence(s)
        assert len(set(st.pages)) == len(st.pages)
        for p in st.pages:
            holders[p] += 1
    free = set(pool._free)
    assert len(free) == len(pool._free) == pool.num_free
    for p in range(pool.num_pages):
        assert pool.refcount(p) == holders[p]
        assert (p in free) == (holders[p] == 0)  # free xor held
    table, rope = pool.page_table(pool.seq_ids)
    table.validate()
    states = [pool.sequence(s) for s in pool.seq_ids]
    assert table.seq_lens.tolist() == [s.length - s.logical_start for s in states]
    assert rope.tolist() == [s.length for s in states]
    assert_same_table(pool, pool.seq_ids)


def assert_same_table(pool: BlockPool, ids) -> None:
    """pool.page_table(ids) (cached and incremental) equals build_page_table
    on the sequences' states, derived facts included, and validates."""
    table, rope = pool.page_table(ids)
    expected, expected_rope = build_page_table([pool.sequence(s) for s in ids], pool.page_size)
    for name in ("indices", "indptr", "last_page_len", "first_page_offset", "request_pages", "seq_lens"):
        got, want = getattr(table, name), getattr(expected, name)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), name
        assert not got.flags.writeable, name
    assert table.max_page_id == expected.max_page_id and table.page_size == pool.page_size
    assert rope.dtype == np.int64 and rope.tolist() == expected_rope.tolist() and rope.flags.writeable
    table.validate()


# -- append and allocation -------------------------------------------------------


def test_append_allocates_as_tokens_cross_page_boundaries():
    pool = BlockPool(10, 4)
    s = pool.add_sequence()
    assert pool.sequence(s) == SequenceState((), 0, 0)
    assert pool.append(s, 3) == (0,)
    assert pool.append(s, 1) == ()            # fills page 0 exactly
    assert pool.append(s, 1) == (1,)          # token 4 starts page 1
    assert pool.append(s, 8) == (2, 3)        # tokens 5..12: pages 1 (rest), 2, 3
    assert pool.append(s, 0) == ()
    assert pool.sequence(s) == SequenceState((0, 1, 2, 3), 0, 13)
    assert pool.num_free == 6 and [pool.refcount(p) for p in range(5)] == [1, 1, 1, 1, 0]
    table, rope = pool.page_table([s])
    assert table.last_page_len.tolist() == [1] and rope.tolist() == [13]


@pytest.mark.parametrize("n, pages", [(4, 1), (8, 2), (12, 3)])
def test_exactly_full_pages(n, pages):
    pool = BlockPool(8, 4)
    s = pool.add_sequence()
    assert len(pool.append(s, n)) == pages
    table, _ = pool.page_table([s])
    assert table.last_page_len.tolist() == [4]        # not n % 4 == 0
    assert table.seq_lens.tolist() == [n]
    assert len(pool.append(s, 1)) == 1                # next token needs a new page


def test_sequence_ids():
    pool = BlockPool(4, 4)
    assert pool.add_sequence() == 0
    assert pool.add_sequence(2) == 2
    assert pool.add_sequence() == 1
    assert pool.add_sequence() == 3                   # skips the taken 2
    assert pool.seq_ids == (0, 2, 1, 3)
    with pytest.raises(ValueError, match="sequence id 2 already exists"):
        pool.add_sequence(2)
    with pytest.raises(ValueError, match="must be an int"):
        pool.add_sequence("a")


# -- fork ------------------------------------------------------------------------


def test_fork_full_last_page_shares_everything():
    pool = BlockPool(6, 4)
    a = pool.add_sequence()
    pool.append(a, 8)
    b, copies = pool.fork(a)
    assert copies == ()
    assert pool.sequence(b) == pool.sequence(a) == SequenceState((0, 1), 0, 8)
    assert [pool.refcount(p) for p in (0, 1)] == [2, 2]
    assert pool.num_free == 4
    # both append: each gets its own new page, the shared ones stay shared
    assert pool.append(a, 1) == (2,) and pool.append(b, 1) == (3,)
    check_invariants(pool)


def test_fork_partial_last_page_is_copied_on_write():
    m = Model(6, 4)
    a = m.add()
    m.append(a, 6)                                    # pages 0 (full), 1 (2 of 4)
    b, copies = m.fork(a)
    assert copies == (PageCopy(src=1, dst=2),)
    assert pool_pages(m.pool, a, b) == ((0, 1), (0, 2))
    assert [m.pool.refcount(p) for p in (0, 1, 2)] == [2, 1, 1]
    assert (m.cache[2, :2] == m.cache[1, :2]).all()
    # diverge: each writes into its own partial page
    m.append(a, 1)
    m.append(b, 2)
    assert m.visible(a)[:6] == m.visible(b)[:6] and m.visible(a)[6] != m.visible(b)[6]
    m.check()


def pool_pages(pool, *ids):
    return tuple(pool.sequence(s).pages for s in ids)


def test_fork_of_empty_or_fully_trimmed_sequence_copies_nothing():
    pool = BlockPool(4, 4)
    a = pool.add_sequence()
    b, copies = pool.fork(a)
    assert copies == () and pool.sequence(b) == SequenceState((), 0, 0)
    pool.append(a, 3)
    pool.trim_front(a, 3)
    c, copies = pool.fork(a)
    assert copies == () and pool.sequence(c) == SequenceState((), 3, 3)
    assert pool.num_free == 4


def test_prefix_sharing_through_a_real_pool():
    m = Model(16, 4)
    root = m.add()
    m.append(root, 8)                                 # a two-page prompt
    kids = [m.fork(root)[0] for _ in range(2)]
    for k, n in zip(kids, (3, 6)):
        m.append(k, n)
    assert [m.pool.refcount(p) for p in (0, 1)] == [3, 3]
    table, rope = m.pool.page_table(kids)
    slices = [table.indices[table.indptr[i] : table.indptr[i + 1]].tolist() for i in range(2)]
    assert slices[0][:2] == slices[1][:2] == [0, 1]   # same physical prefix pages
    assert not set(slices[0][2:]) & set(slices[1][2:])
    assert rope.tolist() == [11, 14]
    assert gather(table, m.cache)[0][:8] == gather(table, m.cache)[1][:8] == m.tokens[root]
    m.pool.free(root)
    assert [m.pool.refcount(p) for p in (0, 1)] == [2, 2]
    m.pool.free(kids[0])
    assert [m.pool.refcount(p) for p in (0, 1)] == [1, 1]
    del m.tokens[root], m.tokens[kids[0]]
    m.check()


# -- trimming --------------------------------------------------------------------


def test_trim_front_drops_retired_pages():
    m = Model(8, 4)
    s = m.add()
    m.append(s, 10)                                   # pages 0, 1, 2
    assert m.pool.trim_front(s, 3) == ()              # still inside page 0
    assert m.pool.refcount(0) == 1
    assert m.pool.trim_front(s, 2) == (0,)            # logical_start 5: page 0 retired
    assert m.pool.refcount(0) == 0 and m.pool.num_free == 6
    assert m.pool.sequence(s) == SequenceState((1, 2), 5, 10)
    table, rope = m.pool.page_table([s])
    assert table.first_page_offset.tolist() == [1]
    assert table.seq_lens.tolist() == [5] and rope.tolist() == [10]   # visible != written
    m.append(s, 1)                                    # keeps writing at position 10
    assert m.pool.sequence(s).pages == (1, 2)
    m.check()
    m.append(s, 3)                                    # position 12 needs a page:
    assert m.pool.sequence(s).pages == (1, 2, 0)      # the freed one is reused
    m.check()


def test_trim_of_shared_page_keeps_it_for_the_other_holder():
    pool = BlockPool(8, 4)
    a = pool.add_sequence()
    pool.append(a, 8)
    b, _ = pool.fork(a)
    assert pool.trim_front(a, 4) == (0,)
    assert pool.refcount(0) == 1 and pool.num_free == 6  # b still holds page 0
    assert pool.sequence(b).pages == (0, 1)
    check_invariants(pool)


def test_apply_window():
    m = Model(8, 4)
    s = m.add()
    m.append(s, 11)
    assert m.pool.apply_window(s, 20) == ()           # window wider than the sequence
    assert m.pool.apply_window(s, 6) == (0,)          # keep tokens 5..10
    assert m.pool.sequence(s) == SequenceState((1, 2), 5, 11)
    assert m.visible(s) == m.tokens[s][5:]
    m.append(s, 2)
    assert m.pool.apply_window(s, 6) == ()            # keep 7..12: page 1 holds 7
    assert m.pool.apply_window(s, 5) == (1,)          # keep 8..12: page 1 retired
    m.check()


def test_fully_trimmed_sequence():
    m = Model(4, 4)
    s = m.add()
    m.append(s, 6)
    assert m.pool.apply_window(s, 0) == (0, 1)        # even the partial last page goes
    assert m.pool.num_free == 4
    assert m.pool.sequence(s) == SequenceState((), 6, 6)
    table, rope = m.pool.page_table([s])
    assert table.request_pages.tolist() == [0] and table.seq_lens.tolist() == [0]
    assert rope.tolist() == [6]
    assert m.pool.trim_front(s, 0) == ()
    m.append(s, 3)                                    # positions 6..8: entry 2 of a fresh page
    assert m.pool.sequence(s) == SequenceState((0, 1), 6, 9)
    table, _ = m.pool.page_table([s])
    assert table.first_page_offset.tolist() == [2] and table.last_page_len.tolist() == [1]
    m.check()


def test_free_returns_pages_lowest_id_first():
    pool = BlockPool(6, 2)
    a, b = pool.add_sequence(), pool.add_sequence()
    pool.append(a, 4)                                 # 0, 1
    pool.append(b, 4)                                 # 2, 3
    pool.free(b)
    pool.free(a)
    assert pool.num_free == 6 and pool.seq_ids == ()
    c = pool.add_sequence()
    assert pool.append(c, 6) == (0, 1, 2)             # lowest ids, whatever the release order
    with pytest.raises(KeyError, match="unknown sequence id 0"):
        pool.free(a)


# -- failures leave the pool exactly as it was ----------------------------------


def build_busy_pool():
    pool = BlockPool(5, 4)
    a = pool.add_sequence()
    pool.append(a, 6)                                 # 0, 1 (partial)
    b, _ = pool.fork(a)                               # shares 0, copy into 2
    pool.trim_front(b, 1)
    return pool, a, b


@pytest.mark.parametrize(
    "op, exc, match",
    [
        (lambda p, a, b: p.append(a, 11), OutOfPagesError, "need 3, 2 of 5 free"),
        (lambda p, a, b: p.append(99, 1), KeyError, "unknown sequence id 99"),
        (lambda p, a, b: p.append(a, -1), ValueError, "n_tokens must be >= 0"),
        (lambda p, a, b: p.append(a, 1.5), ValueError, "n_tokens must be an int"),
        (lambda p, a, b: p.trim_front(b, 6), ValueError, "only 5 visible"),
        (lambda p, a, b: p.trim_front(b, -1), ValueError, "n_tokens must be >= 0"),
        (lambda p, a, b: p.apply_window(a, -2), ValueError, "window must be >= 0"),
        (lambda p, a, b: p.fork(7), KeyError, "unknown sequence id 7"),
        (lambda p, a, b: p.fork(a, b), ValueError, "already exists"),
        (lambda p, a, b: p.free(None), KeyError, "unknown sequence id None"),
        (lambda p, a, b: p.free([1]), KeyError, "unknown sequence id"),
        (lambda p, a, b: p.refcount(5), ValueError, r"page id 5 out of range \[0, 5\)"),
        (lambda p, a, b: p.refcount(-1), ValueError, "page must be >= 0"),
        (lambda p, a, b: p.sequence(3), KeyError, "unknown sequence id 3"),
        (lambda p, a, b: p.page_table([a, 42]), KeyError, "unknown sequence id 42"),
        (lambda p, a, b: p.add_sequence(a), ValueError, "already exists"),
    ],
)
def test_failures_raise_clearly_and_change_nothing(op, exc, match):
    pool, a, b = build_busy_pool()
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        op(pool, a, b)
    assert snapshot(pool) == before
    check_invariants(pool)


def test_fork_out_of_pages_changes_nothing():
    pool, a, b = build_busy_pool()
    pool.append(b, 10)                                # takes the last 2 free pages
    assert pool.num_free == 0 and pool.sequence(a).length % 4   # a ends mid-page
    before = snapshot(pool)
    with pytest.raises(OutOfPagesError, match="forking sequence 0: need 1, 0 of 5 free"):
        pool.fork(a, 9)
    assert snapshot(pool) == before and 9 not in pool.seq_ids
    c, copies = pool.fork(b)                          # b ends on a full page: no copy needed
    assert copies == () and pool.refcount(pool.sequence(b).pages[-1]) == 2
    check_invariants(pool)


def test_out_of_pages_is_a_memory_error_and_pool_still_usable():
    pool = BlockPool(2, 4)
    s = pool.add_sequence()
    pool.append(s, 5)
    before = snapshot(pool)
    with pytest.raises(MemoryError):
        pool.append(s, 4)
    assert snapshot(pool) == before
    assert pool.append(s, 3) == ()                    # what fits still works
    assert pool.sequence(s).length == 8


@pytest.mark.parametrize("args", [(-1, 4), (4, 0), (4, 65537), (4.0, 4)])
def test_pool_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        BlockPool(*args)


# -- advance: a decode step for many sequences at once ----------------------------


def test_advance_grows_each_sequence_and_allocates_in_list_order():
    pool = BlockPool(16, 4)
    a, b, c = (pool.add_sequence() for _ in range(3))
    pool.append(a, 3)                                 # page 0, one entry free
    pool.append(b, 4)                                 # page 1, full
    assert pool.advance([c, b, a], 1) is None         # c: page 2; b: page 3; a fills page 0
    assert [pool.sequence(s) for s in (a, b, c)] == [
        SequenceState((0,), 0, 4), SequenceState((1, 3), 0, 5), SequenceState((2,), 0, 1)]
    pool.advance([a, b, c], [9, 0, 2])                # a: pages 4, 5, 6; b: nothing; c: page 2 only
    assert [pool.sequence(s).pages for s in (a, b, c)] == [(0, 4, 5, 6), (1, 3), (2,)]
    assert pool.sequence(a).length == 13 and pool.sequence(b).length == 5 and pool.sequence(c).length == 3
    pool.advance(np.array([a, c]), np.int64(0))       # ids as an array; nothing to do
    pool.advance([], 5)
    check_invariants(pool)


def test_advance_of_a_trimmed_sequence_starts_its_page_mid_block():
    pool = BlockPool(8, 4)
    s = pool.add_sequence()
    pool.append(s, 6)
    pool.trim_front(s, 6)                             # nothing visible; next token is 6 (entry 2)
    pool.advance([s], [0])                            # no token, no page
    assert pool.sequence(s) == SequenceState((), 6, 6) and pool.num_free == 8
    pool.advance([s], 3)                              # tokens 6, 7 on page 0, 8 on page 1
    assert pool.sequence(s) == SequenceState((0, 1), 6, 9)
    assert_same_table(pool, [s])


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_advance_matches_appending_each_in_turn(page_size):
    """Two pools given the same random history, one through advance and one
    through append per sequence, end with the same pages, free list and
    tables after every step."""
    rng = np.random.default_rng(page_size)
    by_step, by_seq = BlockPool(400, page_size), BlockPool(400, page_size)
    ids: list[int] = []
    for step in range(60):
        if len(ids) < 12 and rng.random() < 0.3:
            ids.append(by_step.add_sequence())
            assert by_seq.add_sequence() == ids[-1]
        if ids and rng.random() < 0.15:
            s = ids.pop(int(rng.integers(len(ids))))
            by_step.free(s)
            by_seq.free(s)
        batch = [int(x) for x in rng.permutation(ids)[: int(rng.integers(0, len(ids) + 1))]]
        n = int(rng.integers(0, 3)) if rng.random() < 0.5 else rng.integers(0, 2 * page_size, len(batch))
        counts = [n] * len(batch) if isinstance(n, int) else n.tolist()
        by_step.advance(batch, n)
        for s, k in zip(batch, counts):
            by_seq.append(s, k)
        assert snapshot(by_step)[:4] == snapshot(by_seq)[:4], step
        assert_same_table(by_step, batch)
        check_invariants(by_step)


def test_advance_after_fork_writes_only_pages_it_owns():
    """A fork shares full pages and copies a partial one, so the tokens of a
    decode step over parent and child land on pages each holds alone."""
    m = Model(16, 4)
    a = m.add()
    m.append(a, 6)
    b, _ = m.fork(a)
    c, _ = m.fork(a)
    pool = m.pool
    pool.advance([a, b, c], 3)                        # each: 2 entries of its own page 1 copy, then a new page
    last_slots = set()
    table, _ = pool.page_table([a, b, c])
    for i in range(3):
        page = int(table.indices[table.indptr[i + 1] - 1])
        assert pool.refcount(page) == 1
        last_slots.add(page)
    assert len(last_slots) == 3
    assert [pool.refcount(p) for p in pool.sequence(a).pages[:1]] == [3]   # the shared full page
    check_invariants(pool)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (([0, 7], 1), KeyError, "unknown sequence id 7"),
        (([0, [1]], 1), KeyError, "unknown sequence id"),
        (([0, 1, 0], 1), ValueError, "seq_ids lists sequence 0 twice"),
        (([0, 1], -1), ValueError, "n_tokens must be >= 0"),
        (([0, 1], 1.0), ValueError, "n_tokens must be an int"),
        (([0, 1], True), ValueError, "n_tokens must be an int"),
        (([0, 1], [1, 2, 3]), ValueError, "n_tokens must be an int or 2 ints"),
        (([0, 1], [1.0, 2.0]), ValueError, "n_tokens must be ints, got dtype float64"),
        (([0, 1], [True, False]), ValueError, "n_tokens must be ints, got dtype bool"),
        (([0, 1], [1, -2]), ValueError, "n_tokens must be >= 0, got -2"),
        (([0, 1], 8), OutOfPagesError, "advancing 2 sequences: need 4, 2 of 5 free"),
        (([0, 1], [0, 2**70]), OutOfPagesError, "need at least"),
        (([0, 1], np.array([0, 2**63], dtype=np.uint64)), OutOfPagesError, "need at least"),
    ],
)
def test_advance_refusals_change_nothing(args, exc, match):
    pool, a, b = build_busy_pool()
    before = snapshot(pool)
    table, _ = pool.page_table([a, b])
    with pytest.raises(exc, match=match):
        pool.advance(*args)
    assert snapshot(pool) == before
    assert pool.page_table([a, b])[0] is table        # nothing changed: the same table
    check_invariants(pool)


# -- page_table: remembered per id list -------------------------------------------


def test_page_table_returns_the_same_table_until_a_listed_sequence_changes():
    pool = BlockPool(32, 4)
    a, b, c = (pool.add_sequence() for _ in range(3))
    pool.advance([a, b, c], [5, 2, 7])
    t1, rope1 = pool.page_table([a, b])
    t2, rope2 = pool.page_table((a, b))               # a tuple is the same list
    assert t2 is t1 and rope2 is not rope1 and rope2.tolist() == [5, 2]
    rope2[0] = 99                                     # the caller's copy
    pool.append(c, 1)                                 # not listed: same table
    assert pool.page_table([a, b])[0] is t1 and pool.page_table([a, b])[1].tolist() == [5, 2]
    pool.advance([a], 1)
    t3, _ = pool.page_table([a, b])
    assert t3 is not t1 and t3.seq_lens.tolist() == [6, 2] and t1.seq_lens.tolist() == [5, 2]
    assert_same_table(pool, [a, b])


def test_page_table_after_a_freed_id_is_reused():
    pool = BlockPool(32, 4)
    a, b = pool.add_sequence(), pool.add_sequence()
    pool.advance([a, b], [6, 3])
    old, _ = pool.page_table([a, b])
    pool.free(a)
    assert pool.add_sequence(a) == a                  # the same id, a new sequence (and row)
    pool.append(a, 1)
    table, rope = pool.page_table([a, b])
    assert rope.tolist() == [1, 3] and table.seq_lens.tolist() == [1, 3]
    assert old.seq_lens.tolist() == [6, 3]            # the old table is unchanged
    assert_same_table(pool, [a, b])


def test_page_table_of_a_sequence_twice_and_of_empty_sequences():
    pool = BlockPool(16, 4)
    a, b = pool.add_sequence(), pool.add_sequence()
    pool.append(a, 5)
    assert_same_table(pool, [a, b, a])
    pool.advance([a, b], 1)
    assert_same_table(pool, [a, b, a])
    assert_same_table(pool, [])
    assert_same_table(pool, None if False else [b])


def test_long_windowed_sequence_keeps_its_pages_compact():
    """A sliding window over many steps: the pages it drops return to the
    pool and its page array is regrown from the visible ones only."""
    pool = BlockPool(8, 2)
    s = pool.add_sequence()
    for step in range(500):
        pool.advance([s], 1)
        pool.apply_window(s, 5)
        if step % 50 == 0:
            assert_same_table(pool, [s])
    assert pool.sequence(s) == SequenceState(pool.sequence(s).pages, 495, 500)
    assert len(pool.sequence(s).pages) == 3 and pool.num_free == 5
    assert len(pool._row_pages[pool._row_of_id[s]]) <= 64
    check_invariants(pool)


def test_random_decode_steps_keep_tables_exact():
    """Many sequences (more than the size from which a new list reuses the
    last table), decode steps with joins, leaves, forks, windows and
    trims: every table the pool hands out equals build_page_table's."""
    rng = np.random.default_rng(11)
    m = Model(12000, 3)
    live: list[int] = []
    for _ in range(90):
        live.append(m.add())
        m.append(live[-1], int(rng.integers(1, 30)))
    for step in range(120):
        ids = list(live) if rng.random() < 0.7 else [int(x) for x in rng.permutation(live)[:80]]
        m.pool.advance(ids, 1 if rng.random() < 0.8 else rng.integers(0, 5, len(ids)))
        assert_same_table(m.pool, ids)
        op = rng.random()
        if op < 0.2:                                 # leave and join
            gone = live.pop(int(rng.integers(len(live))))
            m.pool.free(gone)
            live.append(m.add())
            m.append(live[-1], int(rng.integers(1, 20)))
        elif op < 0.3:
            live.append(m.fork(int(rng.choice(live)))[0])
        elif op < 0.45:
            m.pool.apply_window(int(rng.choice(live)), int(rng.integers(0, 12)))
        elif op < 0.5:
            s = int(rng.choice(live))
            st = m.pool.sequence(s)
            m.pool.trim_front(s, st.length - st.logical_start)   # fully trimmed
        assert_same_table(m.pool, live)
    check_invariants(m.pool)


# -- apply_page_copies -------------------------------------------------------------


def test_apply_page_copies_numpy():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((6, 4, 2, 8)).astype(np.float16)
    v = rng.standard_normal((6, 4, 2, 8)).astype(np.float32)
    k0, v0 = k.copy(), v.copy()
    apply_page_copies([k, v], [PageCopy(1, 4), PageCopy(2, 5)])   # independent: vectorized
    for cache, orig in ((k, k0), (v, v0)):
        assert (cache[4] == orig[1]).all() and (cache[5] == orig[2]).all()
        assert (cache[:4] == orig[:4]).all()
    # a chain keeps its sequential meaning: 0 -> 3, then 3 -> 1 copies page 0 twice
    apply_page_copies(k, (PageCopy(0, 3), PageCopy(3, 1)))
    assert (k[3] == k0[0]).all() and (k[1] == k0[0]).all()
    apply_page_copies(k, [])
    # ids are checked against every cache before anything is written
    before = v.copy()
    with pytest.raises(ValueError, match="out of range"):
        apply_page_copies([v, v[:3]], [PageCopy(0, 1), PageCopy(2, 3)])
    assert (v == before).all()


# -- randomized operations ---------------------------------------------------------


def test_random_operation_sequences_keep_invariants():
    rng = np.random.default_rng(7)
    for trial in range(12):
        m = Model(int(rng.integers(4, 24)), int(rng.choice([1, 2, 4, 5])))
        for step in range(60):
            ids = list(m.pool.seq_ids)
            op = rng.choice(["add", "append", "append", "fork", "trim", "window", "free"])
            sid = int(rng.choice(ids)) if ids else None
            before = snapshot(m.pool)
            try:
                if op == "add" or sid is None:
                    m.add()
                elif op == "append":
                    m.append(sid, int(rng.integers(0, 3 * m.pool.page_size)))
                elif op == "fork":
                    m.fork(sid)
                elif op == "trim":
                    st = m.pool.sequence(sid)
                    m.pool.trim_front(sid, int(rng.integers(0, st.length - st.logical_start + 1)))
                elif op == "window":
                    m.pool.apply_window(sid, int(rng.integers(0, 10)))
                else:
                    m.pool.free(sid)
                    del m.tokens[sid]
            except OutOfPagesError:
                assert snapshot(m.pool) == before, (trial, step)
            m.check()


def test_threads_keep_the_pool_consistent():
    """Eight threads add, append to, advance, fork, trim and free their own
    sequences (and read the pool) at once: every call is atomic, so the only error is
    the documented OutOfPagesError and afterwards each page's refcount is the
    number of sequences holding it, and free + held pages are all pages.
    (A tiny switch interval forces interleavings inside calls.)"""
    import random
    import sys
    import threading

    pool = BlockPool(num_pages=96, page_size=4)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            start.wait()
            for _ in range(400):
                op = rng.randrange(8)
                try:
                    if op == 0 or not mine:
                        mine.append(pool.add_sequence())
                    elif op == 1:
                        pool.append(rng.choice(mine), rng.randint(1, 9))
                    elif op == 2:
                        mine.append(pool.fork(rng.choice(mine))[0])
                    elif op == 3:
                        pool.free(mine.pop(rng.randrange(len(mine))))
                    elif op == 4:
                        s = rng.choice(mine)
                        st = pool.sequence(s)
                        pool.trim_front(s, rng.randint(0, st.length - st.logical_start))
                    elif op == 5:
                        pool.page_table(mine)
                    elif op == 6:
                        pool.advance(mine, rng.randint(0, 2))
                    else:
                        pool.num_free, pool.seq_ids, pool.refcount(rng.randrange(pool.num_pages))
                except OutOfPagesError:
                    pass
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    held: dict[int, int] = {}
    for s in pool.seq_ids:
        for p in pool.sequence(s).pages:
            held[p] = held.get(p, 0) + 1
    free = list(pool._free)
    assert len(free) == len(set(free)) == pool.num_free
    assert not set(free) & set(held)
    assert len(free) + len(held) == pool.num_pages
    assert [pool.refcount(p) for p in range(pool.num_pages)] == [held.get(p, 0) for p in range(pool.num_pages)]
    check_invariants(pool)                            # and every table matches build_page_table
