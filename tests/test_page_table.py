"""CPU tests of the CSR page table (cupaged.page_table)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cupaged.errors import NoGPUError, PageTableError
from cupaged.page_table import DeviceTable, PageTable, build_page_table


# -- helpers -----------------------------------------------------------------


def gather_positions(table: PageTable) -> list[list[tuple[int, int]]]:
    """(physical page, entry) of every visible token, per request, read the way
    a kernel walks the CSR view."""
    P = table.page_size
    out = []
    for i in range(table.batch_size):
        lo, hi = int(table.indptr[i]), int(table.indptr[i + 1])
        toks = []
        for j in range(lo, hi):
            first = int(table.first_page_offset[i]) if j == lo else 0
            end = int(table.last_page_len[i]) if j == hi - 1 else P
            toks += [(int(table.indices[j]), e) for e in range(first, end)]
        out.append(toks)
    return out


def simulate_layout(seq_lens, offsets, page_size, page_ids):
    """Expected (page, entry) per token, by placing tokens one at a time into
    pages taken in order from page_ids (independent of the table formulas)."""
    out, cursor = [], 0
    for n, off in zip(seq_lens, offsets):
        toks, k, e = [], cursor, off
        for t in range(n):
            toks.append((int(page_ids[k]), e))
            e += 1
            if e == page_size and t + 1 < n:
                k, e = k + 1, 0
        cursor = k + 1 if n else cursor
        out.append(toks)
    return out


def assert_identity(table: PageTable) -> None:
    P = table.page_size
    for i in range(table.batch_size):
        pages = int(table.request_pages[i])
        if pages:
            lhs = (pages - 1) * P + int(table.last_page_len[i]) - int(table.first_page_offset[i])
            assert lhs == table.seq_lens[i]
        else:
            assert table.seq_lens[i] == 0


# A valid table (P = 4) the rejection cases below perturb one field at a time:
# request 0: pages [0, 1], tokens 1..7; request 1: page [2], full; request 2: [3, 4].
BASE = dict(
    indices=[0, 1, 2, 3, 4],
    indptr=[0, 2, 3, 5],
    last_page_len=[3, 4, 2],
    first_page_offset=[1, 0, 0],
)


def make(page_size=4, num_pages=None, **changes):
    kw = {**BASE, **changes}
    return PageTable(
        kw["indices"], kw["indptr"], kw["last_page_len"], kw["first_page_offset"],
        page_size=page_size, num_pages=num_pages,
    )


# -- construction and geometry -----------------------------------------------


def test_base_table_facts():
    t = make()
    assert t.batch_size == 3
    assert t.request_pages.tolist() == [2, 1, 2]
    assert t.request_pages.dtype == np.int32
    assert t.seq_lens.tolist() == [6, 4, 6]
    assert t.seq_lens.dtype == np.int64
    assert t.max_page_id == 4
    for a in (t.indices, t.indptr, t.last_page_len, t.first_page_offset):
        assert a.dtype == np.int32 and a.ndim == 1 and not a.flags.writeable
    assert gather_positions(t)[0] == [(0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]


def test_stores_copies_not_views():
    idx = np.arange(5, dtype=np.int32)
    t = make(indices=idx)
    idx[0] = 99
    assert t.indices[0] == 0
    with pytest.raises(ValueError):
        t.indices[0] = 1


def test_first_page_offset_defaults_to_zero():
    t = PageTable([5, 6, 7], [0, 2, 3], [1, 4], page_size=4)
    assert t.first_page_offset.tolist() == [0, 0]
    assert t.seq_lens.tolist() == [5, 4]


@pytest.mark.parametrize(
    "seq_len, off, page_size, pages, last",
    [
        (1, 0, 16, 1, 1),        # single token
        (15, 0, 16, 1, 15),      # partial
        (16, 0, 16, 1, 16),      # exactly full: len % P would say 0
        (17, 0, 16, 2, 1),       # one past full
        (32, 0, 16, 2, 16),      # exactly full, two pages
        (13, 3, 16, 1, 16),      # trimmed front, full last page
        (14, 3, 16, 2, 1),
        (7, 0, 1, 7, 1),         # page_size 1: every page full
        (5, 0, 65536, 1, 5),     # largest page size
    ],
)
def test_from_seq_lens_pages_and_last_page_len(seq_len, off, page_size, pages, last):
    t = PageTable.from_seq_lens([seq_len], page_size, [off])
    assert t.request_pages.tolist() == [pages]
    assert t.last_page_len.tolist() == [last]
    assert t.seq_lens.tolist() == [seq_len]
    assert_identity(t)


def test_exactly_full_last_page_is_page_size_not_zero():
    P = 8
    t = PageTable.from_seq_lens([8, 16, 24, 5], P, [0, 0, 0, 3])
    assert t.last_page_len.tolist() == [8, 8, 8, 8]
    assert [n % P for n in (8, 16, 24)] == [0, 0, 0]  # what a naive build stores
    # the trimmed request's one page comes after the 1 + 2 + 3 pages of the others
    assert gather_positions(t)[3] == [(6, e) for e in range(3, 8)]
    assert_identity(t)


def test_one_page_request_with_front_trim():
    # tokens at entries 2..4 of page 9: off 2 < last 5
    t = PageTable([9], [0, 1], [5], [2], page_size=8)
    assert t.seq_lens.tolist() == [3]
    assert gather_positions(t) == [[(9, 2), (9, 3), (9, 4)]]


def test_front_trimmed_window_multi_page():
    # window starting at entry 3 of page 7, through entry 0 of page 2
    t = PageTable([7, 4, 2], [0, 3], [1], [3], page_size=4)
    assert t.seq_lens.tolist() == [1 + 4 + 1]
    assert gather_positions(t) == [[(7, 3), (4, 0), (4, 1), (4, 2), (4, 3), (2, 0)]]


def test_empty_and_fully_trimmed_requests():
    t = PageTable.from_seq_lens([0, 3, 0, 4], 4, page_ids=[10, 11])
    assert t.request_pages.tolist() == [0, 1, 0, 1]
    assert t.seq_lens.tolist() == [0, 3, 0, 4]
    assert t.last_page_len.tolist() == [0, 3, 0, 4]
    assert t.indptr.tolist() == [0, 0, 1, 1, 2]
    assert gather_positions(t) == [[], [(10, e) for e in range(3)], [], [(11, e) for e in range(4)]]
    # zero-page requests may carry any last_page_len in [0, P] (e.g. a pool's
    # stale value); their seq_len is still 0
    z = PageTable([], [0, 0, 0], [0, 4], page_size=4)
    assert z.seq_lens.tolist() == [0, 0] and z.max_page_id == -1


def test_empty_batch():
    t = PageTable([], [0], [], page_size=16)
    assert t.batch_size == 0 and t.seq_lens.shape == (0,) and t.max_page_id == -1
    assert PageTable.from_seq_lens([], 16).batch_size == 0


def test_python_sequences_and_integer_arrays_accepted_by_builders():
    t = PageTable((3, 1), range(0, 3), [2, 1], np.array([1, 0], np.int32), page_size=2)
    assert t.seq_lens.tolist() == [1, 1]
    u = PageTable.from_seq_lens(np.array([4, 1], np.int64), 2, page_ids=np.array([5, 6, 7], np.uint16))
    assert u.indices.tolist() == [5, 6, 7]


def test_cupy_like_int32_array_accepted():
    class DeviceArray:  # stands in for a cupy array: has dtype, ndim, get()
        def __init__(self, a):
            self._a, self.dtype, self.ndim = a, a.dtype, a.ndim

        def get(self):
            return self._a

    t = make(indices=DeviceArray(np.arange(5, dtype=np.int32)))
    assert t.indices.tolist() == BASE["indices"]
    with pytest.raises(PageTableError, match="indices must be int32, got int64"):
        make(indices=DeviceArray(np.arange(5, dtype=np.int64)))


def test_device_copy_or_no_gpu():
    t = make()
    try:
        import cupy

        cupy.cuda.runtime.getDevice()
        has_gpu = True
    except Exception:
        has_gpu = False
    if not has_gpu:
        with pytest.raises(NoGPUError):
            t.device()
        return
    d = t.device()
    assert isinstance(d, DeviceTable) and t.device() is d
    for name in DeviceTable._fields:
        assert getattr(d, name).dtype == np.int32
        assert getattr(d, name).get().tolist() == getattr(t, name).tolist()


def test_device_upload_layout_with_fake_cupy(monkeypatch):
    """One upload per device, four aligned views of it, cached (no GPU needed)."""
    import sys
    import types

    uploads, current = [], [0]
    runtime = types.SimpleNamespace(
        getDevice=lambda: current[0], CUDARuntimeError=RuntimeError
    )

    def asarray(a):
        uploads.append(a.copy())
        return uploads[-1]

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime), asarray=asarray)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    t = make()
    d = t.device()
    assert len(uploads) == 1 and t.device() is d
    for name in DeviceTable._fields:
        view = getattr(d, name)
        assert view.base is uploads[0] and view.tolist() == getattr(t, name).tolist()
        assert (view.__array_interface__["data"][0] - uploads[0].__array_interface__["data"][0]) % 16 == 0
    current[0] = 1  # another device gets its own copy
    assert t.device() is not d and len(uploads) == 2


# -- randomized geometry sweep -------------------------------------------------


def test_random_geometry_sweep_from_seq_lens():
    rng = np.random.default_rng(0)
    for case in range(600):
        P = int(rng.choice([1, 2, 3, 4, 7, 16, 64]))
        B = int(rng.integers(1, 9))
        lens = [int(x) for x in rng.choice([0, 1, P - 1, P, P + 1, 2 * P, 5 * P + 3, 37], B)]
        lens = [max(0, n) for n in lens]
        lens = [n if rng.random() < 0.5 else int(rng.integers(0, 6 * P + 2)) for n in lens]
        offs = [0 if n == 0 else int(rng.integers(0, P)) for n in lens]
        need = sum(-(-(o + n) // P) if n else 0 for n, o in zip(lens, offs))
        ids = rng.permutation(need + int(rng.integers(0, 5)))  # shuffled, with slack
        t = PageTable.from_seq_lens(lens, P, offs, page_ids=ids)
        assert t.seq_lens.tolist() == lens, case
        assert_identity(t)
        assert gather_positions(t) == simulate_layout(lens, offs, P, ids), case
        assert t.max_page_id == (int(ids[:need].max()) if need else -1)


def test_random_geometry_sweep_build_page_table():
    rng = np.random.default_rng(1)
    for case in range(600):
        P = int(rng.choice([1, 2, 5, 8, 16]))
        B = int(rng.integers(0, 7))
        mapping = rng.permutation(1000)
        states, expect = [], []
        for _ in range(B):
            start = int(rng.integers(0, 5 * P))
            length = start + int(rng.choice([0, 1, P, P - 1, int(rng.integers(0, 6 * P))]))
            length = max(length, start)
            blocks = sorted({t // P for t in range(start, length)})
            block_ids = [int(b) for b in rng.choice(1000, len(blocks), replace=False)]
            states.append(SimpleNamespace(pages=tuple(block_ids), logical_start=start, length=length))
            first = start // P
            expect.append(
                [(int(mapping[block_ids[t // P - first]]), t % P) for t in range(start, length)]
            )
        use_array = case % 2 == 0
        resolve = mapping if use_array else (lambda b: int(mapping[b]))
        t, rope = build_page_table(states, P, resolve)
        assert rope.dtype == np.int64 and rope.tolist() == [s.length for s in states]
        assert t.seq_lens.tolist() == [s.length - s.logical_start for s in states], case
        assert_identity(t)
        assert gather_positions(t) == expect, case


def test_build_page_table_rope_offsets_differ_after_trim():
    P = 4
    states = [
        SimpleNamespace(pages=(9, 2), logical_start=3, length=7),   # trimmed
        SimpleNamespace(pages=(5,), logical_start=0, length=4),     # exactly full
        SimpleNamespace(pages=(), logical_start=6, length=6),       # fully trimmed
    ]
    t, rope = build_page_table(states, P)
    assert rope.tolist() == [7, 4, 6]
    assert t.seq_lens.tolist() == [4, 4, 0]
    assert t.first_page_offset.tolist() == [3, 0, 0]
    assert t.last_page_len.tolist() == [3, 4, 0]
    assert t.indices.tolist() == [9, 2, 5]


# -- rejection paths -------------------------------------------------------------


I64 = np.arange(5, dtype=np.int64)


@pytest.mark.parametrize(
    "changes, request_index, rule",
    [
        (dict(last_page_len=[3, 0, 2]), 1, "last_page_len must be in [1, page_size=4]"),
        (dict(last_page_len=[3, 4, 5]), 2, "last_page_len must be in [1, page_size=4]"),
        (dict(first_page_offset=[4, 0, 0]), 0, "first_page_offset must be in [0, page_size=4)"),
        (dict(first_page_offset=[1, 0, -1]), 2, "first_page_offset must be in [0, page_size=4)"),
        (dict(first_page_offset=[1, 3, 0], last_page_len=[3, 3, 2]), 1,
         "one-page request needs first_page_offset < last_page_len"),
        (dict(indptr=[0, 2, 2, 5], first_page_offset=[1, 1, 0]), 1,
         "zero-page request needs first_page_offset == 0"),
        (dict(indptr=[0, 2, 2, 5], last_page_len=[3, 5, 2]), 1,
         "zero-page request needs last_page_len in [0, page_size=4]"),
        (dict(indptr=[0, 2, 2, 5], last_page_len=[3, -1, 2]), 1,
         "zero-page request needs last_page_len in [0, page_size=4]"),
        (dict(indices=[0, 1, 2, -7, 4]), 2, "page ids must be >= 0, got indices[3]=-7"),
        (dict(indptr=[0, 3, 2, 5]), 1, "indptr must be non-decreasing"),
        # the lowest-numbered bad request is reported, whatever the rule
        (dict(last_page_len=[3, 4, 9], first_page_offset=[1, 7, 0]), 1, "first_page_offset"),
    ],
)
def test_validate_rejects_per_request_rules(changes, request_index, rule):
    with pytest.raises(PageTableError) as e:
        make(**changes)
    assert f"request {request_index}:" in str(e.value)
    assert rule in str(e.value)


@pytest.mark.parametrize(
    "changes, rule",
    [
        (dict(indptr=[1, 2, 3, 5]), "indptr[0] must be 0, got 1"),
        (dict(indptr=[0, 2, 3, 4]), "indptr[-1] must equal len(indices)"),
        (dict(indices=[0, 1, 2, 3, 4, 5]), "indptr[-1] must equal len(indices)"),
        (dict(indptr=[], indices=[], last_page_len=[], first_page_offset=[]), "B+1 >= 1"),
        (dict(last_page_len=[3, 4]), "last_page_len must have B=3 entries"),
        (dict(first_page_offset=[0, 0, 0, 0]), "first_page_offset must have B=3 entries"),
        (dict(indices=I64), "indices must be int32, got int64"),
        (dict(indptr=np.array([0, 2, 3, 5])), "indptr must be int32, got int64"),
        (dict(last_page_len=np.array([3, 4, 2], np.int16)), "last_page_len must be int32, got int16"),
        (dict(first_page_offset=np.array([1, 0, 0], np.uint32)), "first_page_offset must be int32, got uint32"),
        (dict(indices=np.arange(5, dtype=np.float32)), "indices must be int32, got float32"),
        (dict(indices=np.arange(6, dtype=np.int32).reshape(2, 3)), "indices must be 1-D"),
        (dict(last_page_len=[[3, 4, 2]]), "last_page_len must be 1-D"),
        (dict(indptr=np.int32(0)), "indptr must be 1-D"),
        (dict(indices=[0, 1, 2, 3, 2**31]), "indices values must fit in int32"),
        (dict(indices=[0, 1, 2, 3, 2**70]), "indices values must fit in int32"),
        (dict(last_page_len=[3.0, 4.0, 2.0]), "last_page_len must contain integers"),
        (dict(indptr=[0, 2, [3], 5]), "indptr must"),
    ],
)
def test_validate_rejects_structure_and_dtypes(changes, rule):
    with pytest.raises(PageTableError) as e:
        make(**changes)
    assert rule in str(e.value)


@pytest.mark.parametrize("page_size", [0, -4, 65537, 2.0, True, None])
def test_rejects_bad_page_size(page_size):
    with pytest.raises(PageTableError, match="page_size"):
        make(page_size=page_size)
    with pytest.raises(PageTableError, match="page_size"):
        PageTable.from_seq_lens([3], page_size)


def test_page_ids_checked_against_num_pages():
    make(num_pages=5)  # max id 4: fine
    with pytest.raises(PageTableError) as e:
        make(num_pages=4)
    msg = str(e.value)
    assert "request 2:" in msg and "page id 4" in msg and "num_pages=4" in msg
    t = make(indices=[0, 1, 9, 3, 4])
    with pytest.raises(PageTableError, match=r"request 1: page id 9 at indices\[2\]"):
        t.check_page_ids(9)
    t.check_page_ids(10)
    with pytest.raises(PageTableError, match="num_pages must be >= 0"):
        t.check_page_ids(-1)
    PageTable([], [0, 0], [0], page_size=4, num_pages=0)  # no pages, nothing to check


@pytest.mark.parametrize(
    "args, kwargs, rule",
    [
        (([3, -2, 1], 4), {}, "request 1: seq_len must be >= 0, got -2"),
        (([3, 2], 4, [0, 4]), {}, "request 1: first_page_offset must be in [0, page_size=4)"),
        (([3, 2], 4, [-1, 0]), {}, "request 0: first_page_offset must be in [0, page_size=4)"),
        (([3, 0], 4, [1, 2]), {}, "request 1: a zero-length request needs first_page_offset == 0"),
        (([3, 2], 4, [0]), {}, "first_page_offset must have B=2 entries"),
        (([5, 4], 4), dict(page_ids=[1, 2]), "page_ids has 2 ids, the requests need 3"),
        (([5], 4), dict(page_ids=[1, -2]), "page_ids must be in [0,"),
        (([5], 4), dict(page_ids=[1, 2**31]), "page_ids must be in [0,"),
        (([2.5], 4), {}, "seq_lens must contain integers"),
        (([[1, 2]], 4), {}, "seq_lens must be 1-D"),
    ],
)
def test_from_seq_lens_rejections(args, kwargs, rule):
    with pytest.raises(PageTableError) as e:
        PageTable.from_seq_lens(*args, **kwargs)
    assert rule in str(e.value)


def S(pages, start, length):
    return SimpleNamespace(pages=tuple(pages), logical_start=start, length=length)


OK = S([0], 0, 3)


@pytest.mark.parametrize(
    "states, resolve, rule",
    [
        ([OK, S([], -1, 0)], None, "request 1: logical_start must be >= 0"),
        ([OK, S([1], 5, 4)], None, "request 1: length must be >= logical_start"),
        ([S([1, 2], 0, 4), OK], None, "request 0: has 2 pages but logical_start=0, length=4, page_size=4 need 1"),
        ([OK, S([1], 5, 5)], None, "request 1: has 1 pages"),     # fully trimmed must hold none
        ([OK, S([1], 3, 9)], None, "request 1: has 1 pages"),     # spans blocks 0..2
        ([OK, S([7], 1, 2)], lambda b: -b, "request 1: page ids must be"),
        ([OK, S([7], 1, 2)], lambda b: 2**31, "request 0: page ids must be in [0, 2147483647]"),
        ([OK, S([-1], 1, 2)], None, "request 1: page ids must be in [0, 2147483647], got -1"),
        ([OK, S([-1], 1, 2)], np.arange(10), "request 1: block id -1 is outside the resolve map"),
        ([OK, S([10], 1, 2)], np.arange(10), "request 1: block id 10 is outside the resolve map"),
        ([S([0], 0.0, 3)], None, "request 0: logical_start and length must be ints"),
        ([OK, S([1.0], 1, 2)], None, "request 1: page ids must be ints"),
        ([OK, S([2**64], 1, 2)], None, "request 1: page ids must be ints"),
        ([S([2], 0, 1)], lambda b: str(b), "request 0: page ids must be ints"),
    ],
)
def test_build_page_table_rejections(states, resolve, rule):
    with pytest.raises(PageTableError) as e:
        build_page_table(states, 4, resolve)
    assert rule in str(e.value)


def test_repr_is_short():
    r = repr(PageTable.from_seq_lens(list(range(1, 100)), 16))
    assert r.startswith("PageTable(batch_size=99, page_size=16") and len(r) < 200


def test_more_slots_than_int32_is_rejected():
    """The kernels count a request's slots, ``(pages-1)*page_size +
    last_page_len``, in a C ``int``: one request of 2**31 slots (2**15 pages
    of 2**16) is refused, naming the request; 2**31 - 1 slots still fit."""
    P = 2**16
    ok = PageTable.from_seq_lens([5, 2**31 - 1], P)
    assert ok.seq_lens.tolist() == [5, 2**31 - 1]
    with pytest.raises(PageTableError, match=r"^request 1: .*2147483648 slots.* 2\*\*31-1"):
        PageTable.from_seq_lens([5, 2**31], P)
    with pytest.raises(PageTableError, match=r"^request 1: "):  # a mid-page start counts its slots too
        PageTable.from_seq_lens([5, 2**31 - 10], P, [0, 10])
    n = 2**15
    with pytest.raises(PageTableError, match=r"^request 0: "):  # the constructor, not only from_seq_lens
        PageTable(np.arange(n, dtype=np.int32), [0, n], [P], page_size=P)


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
def test_copies_are_frozen_and_consistent(how):
    """A pickled or (deep)copied table is rebuilt through the constructor: the
    same content, read-only arrays (so no out-of-range id can be written into
    a copy behind its cached ``max_page_id``), the same derived facts, and no
    device buffer of the original."""
    import copy
    import pickle

    t = PageTable([7, 3, 5, 1], [0, 3, 4], [2, 1], [2, 0], page_size=4)
    t._device = ("device 0", "a buffer")  # what device() caches
    c = {"pickle": lambda: pickle.loads(pickle.dumps(t)), "deepcopy": lambda: copy.deepcopy(t),
         "copy": lambda: copy.copy(t)}[how]()
    assert type(c) is PageTable and c._device is None and c.page_size == 4
    for name in ("indices", "indptr", "last_page_len", "first_page_offset", "request_pages", "seq_lens"):
        a, b = getattr(t, name), getattr(c, name)
        assert b.dtype == a.dtype and b.tolist() == a.tolist(), name
        assert not b.flags.writeable, name
        with pytest.raises(ValueError):
            b[0] = 1000
    assert c.max_page_id == 7
    c.check_page_ids(8)
    with pytest.raises(PageTableError, match="page id 7 at indices"):
        c.check_page_ids(7)


def test_block_pool_tables_are_the_constructors_tables():
    """BlockPool builds its tables without running validate (_from_pool):
    each must still be what the constructor makes of the same arrays, share
    no writeable array with the tables before or after it, and copy like
    any table."""
    import copy

    from cupaged.pool import BlockPool

    pool = BlockPool(64, 4)
    seqs = [pool.add_sequence() for _ in range(4)]
    pool.advance(seqs, [9, 4, 0, 6])
    pool.trim_front(seqs[0], 5)                       # a mid-page start
    tables = []
    for _ in range(6):
        pool.advance(seqs[:2] + seqs[3:], 1)          # seqs[2] stays empty
        tables.append(pool.page_table(seqs)[0])
    for t in tables:
        rebuilt = PageTable(t.indices, t.indptr, t.last_page_len, t.first_page_offset, page_size=4, num_pages=64)
        for name in ("indices", "indptr", "last_page_len", "first_page_offset", "request_pages", "seq_lens"):
            a, b = getattr(t, name), getattr(rebuilt, name)
            assert a.dtype == b.dtype and a.tolist() == b.tolist() and not a.flags.writeable, name
        assert t.max_page_id == rebuilt.max_page_id and t._device is None
        t.validate()
        assert copy.deepcopy(t).indices.tolist() == t.indices.tolist()
    assert tables[0].seq_lens.tolist() == [5, 5, 0, 7] and tables[-1].seq_lens.tolist() == [10, 10, 0, 12]
