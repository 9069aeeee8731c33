"""Host-side block pool: which KV-cache pages each sequence owns.

:class:`BlockPool` keeps a free list, a refcount per physical page and, per
sequence, what :meth:`BlockPool.sequence` shows as a :class:`SequenceState`:
its pages, the absolute position of its first visible token
(``logical_start``) and its written length. It never touches the KV caches;
when a fork must copy a page it returns a :class:`PageCopy` for the caller to
apply (see :func:`apply_page_copies`).

A decode step's host work is O(batch) NumPy: :meth:`BlockPool.advance` grows
a list of sequences at once, and :meth:`BlockPool.page_table` builds the next
table of a list from the last one it built (per-sequence state lives in one
int64 array, each sequence's page ids in its own int32 array).

Positions are absolute: token ``t`` of a sequence lives in block ``t // P`` at
entry ``t % P``. A sequence holds the blocks ``logical_start // P ..
ceil(length / P) - 1`` while it has visible tokens, and none once it is fully
trimmed (``logical_start == length``); blocks wholly before ``logical_start``
are released as soon as a trim retires them.

Free list: lowest page id first (a min-heap), so allocation is deterministic
and independent of the order pages were released in.

Every operation validates all of its inputs and checks that enough pages are
free before it changes anything, so a failure (:class:`OutOfPagesError`,
:class:`UnknownSequenceError` (a ``KeyError``) for an unknown sequence,
:class:`InvalidArgumentError` (a ``ValueError``) for a bad count or id)
leaves refcounts, the free list and every sequence exactly as they were.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np

from ._typing import DeviceArray, IndexArray
from .errors import InvalidArgumentError, OutOfPagesError, PageTableError, UnknownSequenceError
from .page_table import MAX_PAGE_SIZE, PageTable

__all__ = ["SequenceState", "PageCopy", "BlockPool", "apply_page_copies"]


@dataclass(frozen=True)
class SequenceState:
    """One sequence's view of the pool, as :meth:`BlockPool.sequence` returns
    it (a frozen dataclass; the pool replaces it on every change).

    Fields:

    * ``pages`` (``tuple[int, ...]``): physical page ids in token order;
      ``pages[0]`` holds token ``logical_start`` (empty when nothing is
      visible).
    * ``logical_start`` (``int``): absolute position of the first visible
      token.
    * ``length`` (``int``): written length = absolute position of the next
      token (the RoPE offset); ``length - logical_start`` tokens are visible.

    Any object with these three attributes can be fed to
    :func:`~cupaged.build_page_table`.

    Example (page size 4):

    >>> import cupaged
    >>> pool = cupaged.BlockPool(num_pages=8, page_size=4)
    >>> s = pool.add_sequence()
    >>> pool.append(s, 6)
    (0, 1)
    >>> pool.sequence(s)
    SequenceState(pages=(0, 1), logical_start=0, length=6)
    >>> pool.trim_front(s, 5)         # token 5 is left, on page 1
    (0,)
    >>> pool.sequence(s)
    SequenceState(pages=(1,), logical_start=5, length=6)
    """

    pages: tuple[int, ...]
    logical_start: int
    length: int


@dataclass(frozen=True)
class PageCopy:
    """Instruction to copy KV page ``src`` onto page ``dst`` in every cache
    (a frozen dataclass; :meth:`BlockPool.fork` returns them and
    :func:`apply_page_copies` applies them).

    Fields: ``src`` (``int``), the page to read; ``dst`` (``int``), the page
    to overwrite. Both are physical page ids (first index of a cache).

    Example:

    >>> import cupaged
    >>> pool = cupaged.BlockPool(num_pages=8, page_size=4)
    >>> a = pool.add_sequence()
    >>> pool.append(a, 6)             # page 1 is partial (2 of 4 entries)
    (0, 1)
    >>> pool.fork(a)                  # child 1 gets page 2, a copy of page 1
    (1, (PageCopy(src=1, dst=2),))
    """

    src: int
    dst: int


def _count(name: str, value: Any) -> int:
    """``value`` as a non-negative int, else :class:`InvalidArgumentError`."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}") from None
    if n < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {n}")
    return n


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run ``method`` under the pool's lock (one call at a time)."""
    @functools.wraps(method)
    def wrapper(self: "BlockPool", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _pages_for(logical_start: int, length: int, page_size: int) -> int:
    """Pages a sequence holds: blocks ``logical_start // P .. ceil(length/P)-1``,
    or none when nothing is visible (the rule build_page_table checks)."""
    if length == logical_start:
        return 0
    return -(-length // page_size) - logical_start // page_size


# BlockPool._row_state columns, one int64 row per live sequence. Ordinals
# number the pages a sequence has ever held, in token order: it holds ordinals
# [LO, HI), ordinal x at _row_pages[row][x - BASE]. A page keeps its ordinal
# for the sequence's life (appends add ordinals at HI, trims retire them at
# LO), so a table built for the same sequences earlier stays right for every
# ordinal both hold, and the next table copies those and reads only the new
# ones. END = START // P + HI - LO, the first block without a page. GEN is
# unique per (row, sequence) pairing, -1 for a free row.
_START, _LEN, _LO, _HI, _END, _BASE, _GEN = range(7)
_COLUMNS = 7
_NO_PAGES = np.empty(0, dtype=np.int32)
_NO_PAGES.setflags(write=False)
_INT32_MAX = 2**31 - 1
#: Id lists whose rows and last table a pool remembers (the least recently used goes).
_MAX_BATCHES = 4
#: From this batch size a new id list's table is made from the last table
#: (_reuse, ~20 NumPy calls) rather than from one slice per sequence
#: (_gather). Measured with host_profile.py --step, one leave + one join:
#: at 32 sequences 39 µs against 33, at 128 51 against 65.
_REUSE_MIN_BATCH = 64


def _no_table() -> None:
    return None


class _Batch:
    """What the pool remembers of one id list: its rows (with their GENs at
    lookup), whether the ids are distinct, and, once a table was built for it,
    the state rows and table arrays of that table, valid at pool version
    ``version``. ``step`` holds what one :meth:`BlockPool.advance` right after
    that table changed (valid at ``step_version``), so the next table need not
    look for it."""

    __slots__ = ("rows", "cells", "gens", "epoch", "distinct", "used", "version", "state", "indices", "indptr", "pages",
                 "first_page_offset", "last_page_len", "max_page_id", "has_empty", "table", "step", "step_version")

    def __init__(self, rows: np.ndarray, gens: np.ndarray, epoch: int, distinct: bool) -> None:
        self.rows, self.gens, self.epoch, self.distinct = rows, gens, epoch, distinct
        # the rows' flat positions in _row_state, to scatter them back with one assignment
        self.cells = (rows[:, None] * _COLUMNS + np.arange(_COLUMNS)).reshape(-1)
        self.used = 0
        self.version = -1
        self.state: np.ndarray | None = None
        self.indices = self.indptr = self.pages = self.first_page_offset = self.last_page_len = _NO_PAGES
        self.max_page_id = -1
        self.has_empty = False  # a request without pages
        self.table: Callable[[], PageTable | None] = _no_table  # a weakref once built
        # (state rows after, grown positions, their new page counts, new page ids, a view of each's, n)
        self.step: tuple | None = None
        self.step_version = -1


class BlockPool:
    """Refcounted pages of a paged KV cache of ``num_pages`` pages of
    ``page_size`` tokens (host bookkeeping only: it never touches the caches).

    A free list (lowest page id first), a refcount per page and, per
    sequence, its pages, ``logical_start`` and length (:meth:`sequence` shows
    them as a :class:`SequenceState`). Positions are absolute: token ``t``
    lives in block ``t // page_size`` at entry ``t % page_size``.

    Args:
        num_pages: pages in the KV cache (its first dimension), ``>= 0``.
        page_size: tokens per page, ``1..65536`` (the cache's second
            dimension and the :class:`PageTable`'s ``page_size``).

    Properties: ``num_pages``, ``page_size``, ``num_free``, ``seq_ids`` (live
    ids, in insertion order). Methods: :meth:`refcount`, :meth:`sequence`,
    :meth:`add_sequence`, :meth:`append`, :meth:`advance`, :meth:`fork`,
    :meth:`trim_front`, :meth:`apply_window`, :meth:`free`, :meth:`page_table`.

    A decode step is ``pool.advance(ids, 1)`` then ``pool.page_table(ids)``:
    the pool remembers the last table of each of its last few id lists, so
    the next table for the same list copies the previous one's pages and adds
    only the new ones (O(batch) NumPy work plus one copy of the page ids).

    Threads: safe to call from several threads; each call is atomic. One
    ``threading.RLock`` is held for the whole of every method and property,
    so a call sees and leaves the pool consistent and a failed call still
    changes nothing. A sequence of calls is not atomic (another thread may
    run between them).

    Raises:
        OutOfPagesError (a ``MemoryError``): ``append``, ``advance`` or
        ``fork`` needs more free pages than there are. UnknownSequenceError
        (a ``KeyError``): an unknown sequence id. InvalidArgumentError (a
        ``ValueError``): a count (``num_pages``, ``n_tokens``, ``window``)
        or page id that is negative or not an int; a new sequence id that is
        not an int or already exists; trimming more tokens than are visible;
        a page id ``>= num_pages`` given to ``refcount``; ``page_size``
        outside ``1..65536``; an id listed twice or a wrong number of counts
        given to ``advance``. Every operation checks before it changes
        anything, so a failed one leaves the pool exactly as it was.

    Example (page size 4):

    >>> import cupaged
    >>> pool = cupaged.BlockPool(num_pages=8, page_size=4)
    >>> a = pool.add_sequence()
    >>> pool.append(a, 6)             # tokens 0..3 on page 0, 4..5 on page 1
    (0, 1)
    >>> b, copies = pool.fork(a)      # b shares page 0; partial page 1 is copied
    >>> b, copies                     # to page 2: apply it to the caches now
    (1, (PageCopy(src=1, dst=2),))
    >>> pool.trim_front(a, 4)         # a drops page 0 (b still holds it)
    (0,)
    >>> table, rope = pool.page_table([a, b])
    >>> table.seq_lens.tolist(), rope.tolist()
    ([2, 6], [6, 6])
    >>> pool.advance([a, b], [2, 3])  # a fills page 1; b's ninth token needs page 3
    >>> pool.page_table([a, b])[0].indices.tolist()
    [1, 0, 2, 3]
    >>> pool.append(a, 100)
    Traceback (most recent call last):
        ...
    cupaged.errors.OutOfPagesError: out of KV pages appending 100 tokens to sequence 0: need 25, 4 of 8 free
    >>> pool.num_free                 # the failed append changed nothing
    4
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self._num_pages = _count("num_pages", num_pages)
        p = _count("page_size", page_size)
        if not 1 <= p <= MAX_PAGE_SIZE:
            raise InvalidArgumentError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {p}")
        self._page_size = p
        # A request's slots (pages*P at most) fit the kernels' int unless the pool is this big.
        self._may_exceed_slots = self._num_pages * p > _INT32_MAX
        # A sequence's pages are distinct, so refcounts change by fancy-index arithmetic.
        self._refcount = np.zeros(self._num_pages, dtype=np.int64)
        self._free = list(range(self._num_pages))  # sorted, hence a valid heap
        self._row_of_id: dict[int, int] = {}  # live ids in insertion order -> row
        self._row_state = np.zeros((0, _COLUMNS), dtype=np.int64)
        self._row_pages: list[np.ndarray] = []
        self._free_rows: list[int] = []
        self._gens = itertools.count()
        self._epoch = 0  # bumped when a row is freed: remembered rows must be checked again
        self._version = 0  # bumped by every change: a remembered table is current while it matches
        self._batches: dict[tuple, _Batch] = {}
        self._last_built: _Batch | None = None  # whose table a new list starts from
        self._where = np.zeros(0, dtype=np.int64)  # scratch for _reuse, -1 throughout
        self._uses = itertools.count()
        self._next_id = 0
        self._lock = threading.RLock()

    # -- read-only facts ---------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Total physical pages."""
        return self._num_pages

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    @_locked
    def num_free(self) -> int:
        """Pages on the free list (refcount 0)."""
        return len(self._free)

    @property
    @_locked
    def seq_ids(self) -> tuple[int, ...]:
        """Live sequence ids, in the order they were added."""
        return tuple(self._row_of_id)

    @_locked
    def refcount(self, page: int) -> int:
        """Number of sequences holding physical page ``page``."""
        return int(self._refcount[self._page_id(page)])

    @_locked
    def sequence(self, seq_id: int) -> SequenceState:
        """Current state of sequence ``seq_id`` (:class:`UnknownSequenceError`,
        a ``KeyError``, if unknown)."""
        r = self._row(seq_id)
        start, length, lo, hi, _, base, _ = self._row_state[r].tolist()
        return SequenceState(tuple(self._row_pages[r][lo - base : hi - base].tolist()), start, length)

    # -- operations --------------------------------------------------------

    @_locked
    def add_sequence(self, seq_id: int | None = None) -> int:
        """Register an empty sequence; return its id (the lowest unused id
        counting up from the last auto-assigned one, when ``seq_id`` is None).
        A duplicate id raises :class:`InvalidArgumentError` (a ``ValueError``)."""
        sid = self._new_id(seq_id)
        self._row_of_id[sid] = self._new_row(0, 0, _NO_PAGES)
        self._version += 1
        return sid

    @_locked
    def append(self, seq_id: int, n_tokens: int) -> tuple[int, ...]:
        """Grow ``seq_id`` by ``n_tokens`` written tokens; return the ids of
        the pages newly allocated for them (in token order). The caller writes
        the new K/V at positions ``length .. length + n_tokens - 1``.

        Raises ``UnknownSequenceError`` (a ``KeyError``: unknown ``seq_id``),
        ``InvalidArgumentError`` (a ``ValueError``: ``n_tokens`` negative
        or not an int) or :class:`OutOfPagesError`
        (too few free pages; nothing is allocated)."""
        r = self._row(seq_id)
        n = _count("n_tokens", n_tokens)
        if n == 0:
            return ()
        start, length, lo, hi, end, base, _ = self._row_state[r].tolist()
        need = _pages_for(start, length + n, self._page_size) - (hi - lo)
        fresh = self._allocate(need, f"appending {n} tokens to sequence {seq_id}")
        if fresh:
            base = self._store(r, lo, hi, base, fresh)
        self._row_state[r, _LEN : _BASE + 1] = (length + n, lo, hi + need, end + need, base)
        self._version += 1
        return fresh

    @_locked
    def advance(self, seq_ids: Iterable[int], n_tokens: int | IndexArray = 1) -> None:
        """Grow every sequence of ``seq_ids`` by ``n_tokens`` written tokens at
        once (a decode step: ``advance(ids, 1)``), allocating the pages they
        need; the same pages, in the same order, as :meth:`append` called for
        each sequence in turn. The caller writes the new K/V at positions
        ``length .. length + n - 1`` of each, through ``page_table(seq_ids)``.

        ``n_tokens`` is one count for all (an int ``>= 0``) or one per
        sequence (a 1-D integer sequence or array of ``len(seq_ids)``). Pages
        shared with a fork are never written: a fork copies a partial last
        page (:meth:`fork`), so new tokens land on a page the sequence owns
        alone or on a fresh one. The id list is remembered: repeating it
        costs no per-id lookups.

        Raises ``UnknownSequenceError`` (a ``KeyError``: an unknown id),
        ``InvalidArgumentError`` (a ``ValueError``: an id listed twice, a
        count negative or not an int, counts not one per id) or
        :class:`OutOfPagesError` (too few free pages for all of them); a
        failed call changes nothing.

        Example (page size 4):

        >>> import cupaged
        >>> pool = cupaged.BlockPool(num_pages=8, page_size=4)
        >>> a, b = pool.add_sequence(), pool.add_sequence()
        >>> pool.advance([a, b], [3, 5])      # a: page 0; b: pages 1, 2
        >>> pool.advance([a, b], 1)           # a fills page 0; b writes page 2
        >>> [pool.sequence(s).pages for s in (a, b)], pool.num_free
        ([(0,), (1, 2)], 5)
        >>> pool.advance([a, a], 1)
        Traceback (most recent call last):
            ...
        cupaged.errors.InvalidArgumentError: seq_ids lists sequence 0 twice; advance grows each listed sequence once (give it more tokens instead)
        """
        key = _batch_key(seq_ids)
        batch = self._batch(key)
        if not batch.distinct:
            raise InvalidArgumentError(
                f"seq_ids lists sequence {_first_repeat(key)!r} twice; advance grows each listed "
                "sequence once (give it more tokens instead)"
            )
        n = n_tokens if type(n_tokens) is int and n_tokens == 1 else self._token_counts(n_tokens, len(key))
        if not (isinstance(n, int) and n == 0):
            self._grow(batch, n)

    def _grow(self, batch: _Batch, n: int | np.ndarray) -> None:
        """:meth:`advance` of the checked id list ``batch`` by ``n``; when its
        table is current, remember what changed for the next one."""
        one = isinstance(n, int) and n == 1  # the decode step
        rows = batch.rows
        g = self._row_state.take(rows, axis=0)  # take: a quarter of the cost of [rows]
        length = g[:, _LEN] + n
        need = self._need(g, length, one)
        grown = need.nonzero()[0]
        counts = [1] * grown.shape[0] if one else need[grown].tolist()
        total = sum(counts)
        if total > len(self._free):
            raise OutOfPagesError(
                f"out of KV pages advancing {len(need)} sequences: need {total}, "
                f"{len(self._free)} of {self._num_pages} free"
            )
        fresh, added = self._store_each(rows, g, grown, counts, total)
        g[:, _LEN] = length
        if total:
            g[:, _HI] += need  # two columns apart: a quarter of the cost of one broadcast
            g[:, _END] += need
        self._row_state.reshape(-1)[batch.cells] = g.reshape(-1)  # half the cost of [rows] = g
        table_current = batch.version == self._version
        self._version += 1
        if table_current:  # what changed, for the next page_table of this list
            batch.step, batch.step_version = (g, grown, counts, fresh, added, n), self._version

    def _need(self, g: np.ndarray, length: np.ndarray, one: bool) -> np.ndarray:
        """Pages each of the state rows ``g`` needs to hold ``length`` tokens
        (bool when each gets ``one`` token, else int64); none for a row whose
        length did not change."""
        P = self._page_size
        if one:
            # A page exactly when the token passes the held blocks (no integer
            # division, which costs more than the rest of this).
            return length > g[:, _END] * P
        need = (length + (P - 1)) // P - g[:, _END]
        need[length == g[:, _LEN]] = 0  # an empty sequence ending mid-block gets no page for no token
        return need

    @_locked
    def fork(
        self, parent_id: int, child_id: int | None = None
    ) -> tuple[int, tuple[PageCopy, ...]]:
        """Create ``child_id`` with the same tokens as ``parent_id``.

        Full pages are shared (their refcounts rise). A partial last page
        would be written by both sequences' next appends, so it is copied on
        write now: the child gets a fresh page, and the returned
        :class:`PageCopy` tells the caller to copy it in the KV caches before
        either sequence appends. Returns ``(child_id, copies)``; ``child_id``
        None picks an id as :meth:`add_sequence` does.

        Raises ``UnknownSequenceError`` (a ``KeyError``: unknown
        ``parent_id``), ``InvalidArgumentError`` (a ``ValueError``:
        ``child_id`` not an int or already in use) or
        :class:`OutOfPagesError` (no free page for the copy); a failed fork
        changes nothing.
        """
        pr = self._row(parent_id)
        # Check the id before allocating so a duplicate leaves the pool as is.
        cid = self._check_new_id(child_id)
        start, length, lo, hi, _, base, _ = self._row_state[pr].tolist()
        pages = self._row_pages[pr][lo - base : hi - base].copy()
        copies: tuple[PageCopy, ...] = ()
        if pages.size and length % self._page_size:
            (dst,) = self._allocate(1, f"forking sequence {parent_id}")
            copies = (PageCopy(int(pages[-1]), dst),)
            shared = pages[:-1]
            pages[-1] = dst
        else:
            shared = pages
        self._refcount[shared] += 1
        self._commit_id(cid, child_id)
        self._row_of_id[cid] = self._new_row(start, length, pages)
        self._version += 1
        return cid, copies

    @_locked
    def trim_front(self, seq_id: int, n_tokens: int) -> tuple[int, ...]:
        """Retire the first ``n_tokens`` visible tokens of ``seq_id``
        (``logical_start += n_tokens``; at most the visible length).

        Pages wholly before the new ``logical_start`` leave the sequence (all
        of them once nothing is visible); each loses one reference and returns
        to the free list at zero. ``length`` (the RoPE offset) is unchanged.
        Returns the pages the sequence dropped.

        Raises ``UnknownSequenceError`` (a ``KeyError``: unknown ``seq_id``)
        or ``InvalidArgumentError`` (a ``ValueError``: ``n_tokens``
        negative, not an int, or more than are visible)."""
        r = self._row(seq_id)
        n = _count("n_tokens", n_tokens)
        start, length, lo, hi, _, base, _ = self._row_state[r].tolist()
        visible = length - start
        if n > visible:
            raise InvalidArgumentError(
                f"cannot trim {n} tokens from sequence {seq_id}: only {visible} visible"
            )
        if n == 0:
            return ()
        keep = _pages_for(start + n, length, self._page_size)
        dropped = self._row_pages[r][lo - base : hi - base - keep].copy()
        self._release(dropped)
        self._row_state[r, _START] = start + n
        self._row_state[r, _LO] = hi - keep
        self._row_state[r, _END] = (start + n) // self._page_size + keep
        self._version += 1
        return tuple(dropped.tolist())

    @_locked
    def apply_window(self, seq_id: int, window: int) -> tuple[int, ...]:
        """Keep only the last ``window`` visible tokens of ``seq_id`` (a
        sliding window); returns the pages dropped, as :meth:`trim_front`."""
        start, length = self._row_state[self._row(seq_id), :2].tolist()
        w = _count("window", window)
        return self.trim_front(seq_id, max(0, length - start - w))

    @_locked
    def free(self, seq_id: int) -> None:
        """Remove ``seq_id`` and release every page it holds."""
        r = self._row(seq_id)
        _, _, lo, hi, _, base, _ = self._row_state[r].tolist()
        self._release(self._row_pages[r][lo - base : hi - base].copy())
        del self._row_of_id[seq_id]
        self._row_state[r] = (0, 0, 0, 0, 0, 0, -1)
        self._row_pages[r] = _NO_PAGES
        self._free_rows.append(r)
        self._epoch += 1
        self._version += 1

    @_locked
    def page_table(
        self, seq_ids: Iterable[int] | None = None
    ) -> tuple[PageTable, np.ndarray]:
        """CSR view of the given sequences (all live ones, in :attr:`seq_ids`
        order, when None), as :func:`~cupaged.page_table.build_page_table`
        builds it from their :meth:`sequence` states. Returns ``(table,
        rope_offsets int64 [B])``; a sequence may appear more than once.

        The pool remembers the last table of each of its last few id lists.
        For a list it has seen, the next table reuses what is unchanged (the
        page ids, or the whole table object when no listed sequence changed)
        and reads only the pages added or dropped since: O(batch) NumPy work
        plus one copy of the page ids. A new list (joins and leaves) starts
        from the last table built, from _REUSE_MIN_BATCH sequences on, or
        reads one slice per sequence."""
        key = tuple(self._row_of_id) if seq_ids is None else _batch_key(seq_ids)
        batch = self._batch(key)
        if batch.step_version == self._version:  # one advance since its table
            return self._table_after_step(batch)
        if batch.version == self._version:  # no change since its table
            table = batch.table()
            if table is not None:
                return table, batch.state[:, _LEN].copy()
        g = self._row_state.take(batch.rows, axis=0)
        if batch.state is not None and (g == batch.state).all():  # changes elsewhere only
            table = batch.table()
            if table is not None:
                batch.version = self._version
                return table, g[:, _LEN].copy()
        return self._table(batch, g)

    # -- tables ------------------------------------------------------------

    def _table(self, batch: _Batch, g: np.ndarray) -> tuple[PageTable, np.ndarray]:
        """The table of ``batch`` from its state rows ``g``: page ids spliced
        into the previous table's (or gathered, for a new list); the
        per-request arrays computed from (logical_start, length) as
        build_page_table does."""
        lo, hi = g[:, _LO], g[:, _HI]
        prev = batch if batch.state is not None else self._last_built
        if prev is batch:
            moved = ((lo != batch.state[:, _LO]) | (hi != batch.state[:, _HI])).nonzero()[0]
            indices = self._splice(batch, g, moved) if moved.size else batch.indices
        elif prev is not None and prev.rows.shape[0] and batch.rows.shape[0] >= _REUSE_MIN_BATCH:
            indices = self._reuse(prev, batch.rows, g)  # a new list: most requests were in the last one
        else:
            indices = self._gather(batch.rows, g)
        if prev is not None and indices is prev.indices:
            pages, indptr, max_page_id = prev.pages, prev.indptr, prev.max_page_id
        else:
            pages = (hi - lo).astype(np.int32)
            indptr = _indptr(pages, indices.shape[0])
            max_page_id = int(indices.max()) if indices.shape[0] else -1  # the ids may have dropped
        off = (g[:, _START] % self._page_size).astype(np.int32)
        empty = pages == 0
        has_empty = bool(empty.any())
        if has_empty:
            off[empty] = 0  # a request without pages: 0 (what validate requires)
        last = self._last_page_len(g, pages, has_empty)
        return self._finish(batch, g, indices, indptr, pages, off, last, max_page_id, has_empty)

    def _table_after_step(self, batch: _Batch) -> tuple[PageTable, np.ndarray]:
        """The table one :meth:`advance` after the remembered one: each grown
        request gets its new pages appended; nothing else moved."""
        g, grown, counts, fresh, added, n = batch.step  # type: ignore[misc]
        one = isinstance(n, int) and n == 1
        if not counts:
            indices, indptr, pages, max_page_id = batch.indices, batch.indptr, batch.pages, batch.max_page_id
        elif batch.has_empty and not batch.pages[grown].all():
            return self._table(batch, g)  # a request's first pages: its first_page_offset changes
        else:
            old, parts, at = batch.indices, [], 0
            for end, new in zip(batch.indptr[1:][grown].tolist(), added):
                parts += (old[at:end], new)
                at = end
            parts.append(old[at:])
            indices = np.concatenate(parts)
            pages = batch.pages.copy()
            pages[grown] += 1 if one else np.array(counts, dtype=np.int32)
            indptr = _indptr(pages, indices.shape[0])
            max_page_id = max(batch.max_page_id, max(fresh))
        if one and not batch.has_empty:
            # One token each: the last page fills by one, or a new one starts.
            last = batch.last_page_len + 1
            last[grown] = 1
            has_empty = False
        else:
            has_empty = batch.has_empty and not pages.all()  # only sequences given no token stay empty
            last = self._last_page_len(g, pages, has_empty)
        return self._finish(batch, g, indices, indptr, pages, batch.first_page_offset, last, max_page_id,
                            has_empty)

    def _last_page_len(self, g: np.ndarray, pages: np.ndarray, has_empty: bool) -> np.ndarray:
        """``last_page_len`` of state rows ``g`` (0 without pages), as build_page_table computes it."""
        last = ((g[:, _LEN] - 1) % self._page_size + 1).astype(np.int32)  # an exactly full page is P, not 0
        if has_empty:
            last[pages == 0] = 0
        return last

    def _finish(self, batch: _Batch, g: np.ndarray, indices: np.ndarray, indptr: np.ndarray, pages: np.ndarray,
                off: np.ndarray, last: np.ndarray, max_page_id: int,
                has_empty: bool) -> tuple[PageTable, np.ndarray]:
        """The table and rope offsets of state rows ``g`` with these arrays
        (0 in ``off`` and ``last`` where ``pages`` is 0); remembered in
        ``batch`` as its current table."""
        P = self._page_size
        length = g[:, _LEN]
        seq_lens = length - g[:, _START]
        if self._may_exceed_slots and seq_lens.shape[0] and int(seq_lens.max()) > _INT32_MAX - P:
            # Perhaps more slots than the kernels' int counts: let validate judge and name the request.
            table = PageTable._from_owned(indices, indptr, last, off, P)
        else:
            table = PageTable._from_pool(indices, indptr, last, off, P, pages, seq_lens, max_page_id)
        batch.version, batch.state, batch.table = self._version, g, weakref.ref(table)
        batch.step, batch.step_version = None, -1
        self._last_built = batch
        batch.indices, batch.indptr, batch.pages, batch.first_page_offset = indices, indptr, pages, off
        batch.last_page_len, batch.max_page_id, batch.has_empty = last, max_page_id, has_empty
        return table, length.copy()

    def _gather(self, rows: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Every listed sequence's page ids in table order (one slice each)."""
        row_pages = self._row_pages
        firsts = (g[:, _LO] - g[:, _BASE]).tolist()
        ends = (g[:, _HI] - g[:, _BASE]).tolist()
        parts = [row_pages[r][a:z] for r, a, z in zip(rows.tolist(), firsts, ends)]
        return np.concatenate(parts) if parts else _NO_PAGES.copy()

    def _reuse(self, prev: _Batch, rows: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Page ids of state rows ``g`` (rows ``rows``, a list other than
        ``prev``'s) taken from ``prev``'s table where they can be: a run of
        requests that sit in ``prev`` in the same order with unchanged pages
        is one copied piece; a request of ``prev`` whose pages moved is
        spliced as in :meth:`_splice`; any other request reads its row."""
        where = self._where  # row -> position in prev, -1 elsewhere (reset below)
        where[prev.rows] = np.arange(prev.rows.shape[0])
        at = where[rows]
        where[prev.rows] = -1
        before = prev.state.take(np.maximum(at, 0), axis=0)  # type: ignore[union-attr]
        known = (at >= 0) & (before[:, _GEN] == g[:, _GEN])  # the same sequence as then
        same = known & (before[:, _LO] == g[:, _LO]) & (before[:, _HI] == g[:, _HI])
        link = same[1:] & same[:-1] & (at[1:] == at[:-1] + 1)  # i-1 and i are one run
        first, last = same.copy(), same.copy()
        first[1:] &= ~link
        last[:-1] &= ~link
        indptr = prev.indptr
        runs = zip(indptr[at[first]].tolist(), indptr[at[last] + 1].tolist())
        single = (~same).nonzero()[0]
        singles = zip(rows[single].tolist(), known[single].tolist(), indptr[at[single]].tolist(),
                      before[single, _LO : _HI + 1].tolist(), g[single, _LO : _BASE + 1].tolist())
        old, row_pages, parts = prev.indices, self._row_pages, []
        for is_run in same[(first | ~same).nonzero()[0]].tolist():
            if is_run:
                begin, end = next(runs)
                parts.append(old[begin:end])
                continue
            r, was_there, begin, (lo0, hi0), (lo1, hi1, _, base) = next(singles)
            if was_there:  # its old slice, the retired pages cut, the new ones after
                parts.append(old[begin + min(lo1, hi0) - lo0 : begin + hi0 - lo0])
                lo1 = max(hi0, lo1)
            parts.append(row_pages[r][lo1 - base : hi1 - base])
        return np.concatenate(parts)

    def _splice(self, batch: _Batch, g: np.ndarray, moved: np.ndarray) -> np.ndarray:
        """The previous table's page ids with, for each request in ``moved``,
        the retired ordinals cut from the front and the new ones added at the
        end. Requests that did not move are copied in runs, untouched."""
        old, row_pages, parts, at = batch.indices, self._row_pages, [], 0
        spans = zip(batch.rows[moved].tolist(), batch.indptr[moved].tolist(), batch.indptr[moved + 1].tolist())
        before = batch.state[moved, _LO : _HI + 1].tolist()  # type: ignore[index]
        after = g[moved, _LO : _BASE + 1].tolist()
        for (r, begin, end), (lo0, hi0), (lo1, hi1, _, base) in zip(spans, before, after):
            cut = min(lo1, hi0) - lo0  # retired pages still in the old slice
            if cut:
                parts.append(old[at:begin])
                at = begin + cut
            parts += (old[at:end], row_pages[r][max(hi0, lo1) - base : hi1 - base])
            at = end
        parts.append(old[at:])
        return np.concatenate(parts)

    # -- internals ---------------------------------------------------------

    def _row(self, seq_id: int) -> int:
        try:
            return self._row_of_id[seq_id]
        except (KeyError, TypeError):  # TypeError: unhashable id
            raise UnknownSequenceError(f"unknown sequence id {seq_id!r}") from None

    def _batch(self, key: tuple) -> _Batch:
        """The remembered rows of id list ``key``, or new ones (forgetting
        the least recently used list beyond _MAX_BATCHES); an unknown id
        raises UnknownSequenceError."""
        try:
            batch = self._batches.get(key)
        except TypeError:  # an unhashable id: _row names it below
            batch = None
        if batch is not None and batch.epoch != self._epoch:
            # A row was freed since: still valid if each row has the same pairing.
            if np.array_equal(self._row_state[batch.rows, _GEN], batch.gens):
                batch.epoch = self._epoch
            else:
                del self._batches[key]
                batch = None
        if batch is None:
            try:
                rows = np.array([self._row_of_id[s] for s in key], dtype=np.int64)
            except (KeyError, TypeError):
                rows = np.array([self._row(s) for s in key], dtype=np.int64)  # names the unknown id
            distinct = len(set(rows.tolist())) == rows.shape[0]
            batch = _Batch(rows, self._row_state[rows, _GEN], self._epoch, distinct)
            if len(self._batches) >= _MAX_BATCHES:
                del self._batches[min(self._batches, key=lambda k: self._batches[k].used)]
            self._batches[key] = batch
        batch.used = next(self._uses)
        return batch

    def _token_counts(self, n_tokens: Any, batch: int) -> int | np.ndarray:
        """``n_tokens`` of :meth:`advance` as an int or an int64 array
        ``[batch]``, each ``>= 0``; one too large for the free pages raises
        OutOfPagesError here, before int64 arithmetic could wrap."""
        if isinstance(n_tokens, (int, np.integer)) or not hasattr(n_tokens, "__len__"):
            n: int | np.ndarray = _count("n_tokens", n_tokens)
            top = n
        else:
            arr = np.asarray(n_tokens)
            if arr.shape != (batch,):
                raise InvalidArgumentError(
                    f"n_tokens must be an int or {batch} ints (one per sequence), got shape {arr.shape}")
            ints = arr.dtype.kind in "iu" or arr.dtype == object and all(  # Python ints beyond int64: object
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in arr.tolist())
            if batch and not ints:
                raise InvalidArgumentError(f"n_tokens must be ints, got dtype {arr.dtype}")
            low, top = (int(arr.min()), int(arr.max())) if batch else (0, 0)
            if low < 0:
                raise InvalidArgumentError(f"n_tokens must be >= 0, got {low}")
            n = arr  # cast to int64 below, once no count can wrap
        # top tokens span ceil(top / P) blocks, at most one of them already held.
        if top > (len(self._free) + 1) * self._page_size:
            raise OutOfPagesError(
                f"out of KV pages advancing by {top} tokens: need at least "
                f"{-(-top // self._page_size) - 1}, {len(self._free)} of {self._num_pages} free"
            )
        return n if isinstance(n, int) else n.astype(np.int64)

    def _store(self, r: int, lo: int, hi: int, base: int, fresh: Sequence[int]) -> int:
        """Write ``fresh`` as ordinals ``hi..`` of row ``r``; return the row's
        base (moved to ``lo`` when the array is regrown: room doubles, so
        appends cost amortized O(1))."""
        arr, at, m = self._row_pages[r], hi - base, len(fresh)
        if at + m > arr.shape[0]:
            held = hi - lo
            grown = np.empty(max(8, 2 * (held + m)), dtype=np.int32)
            grown[:held] = arr[lo - base : at]
            self._row_pages[r] = arr = grown
            base, at = lo, held
        arr[at : at + m] = fresh
        return base

    def _store_each(self, rows: np.ndarray, g: np.ndarray, grown: np.ndarray, counts: list[int],
                    total: int) -> tuple[list[int], list[np.ndarray]]:
        """Allocate ``total`` pages and give ``counts[j]`` of them to row
        ``rows[grown[j]]``, in list order (what appending to each in turn
        does); returns the page ids and, per grown row, a view of its new
        ones. Updates the BASE column of ``g`` where a row's array is
        regrown."""
        fresh = self._take(total)
        row_pages, taken, added = self._row_pages, 0, []
        states = g.take(grown, axis=0).tolist()
        for i, r, m, (_, _, lo, hi, _, base, _) in zip(grown.tolist(), rows[grown].tolist(), counts, states):
            arr, at = row_pages[r], hi - base
            if m == 1 and at < len(arr):  # the usual decode step: one page into spare room
                arr[at] = fresh[taken]
            else:
                g[i, _BASE] = base = self._store(r, lo, hi, base, fresh[taken : taken + m])
                arr, at = row_pages[r], hi - base
            added.append(arr[at : at + m])  # a view: written entries of a row array never change
            taken += m
        return fresh, added

    def _new_row(self, start: int, length: int, pages: np.ndarray) -> int:
        """A row for a new sequence holding ``pages`` (ordinals 0..)."""
        if self._free_rows:
            r = self._free_rows.pop()
        else:
            r = len(self._row_pages)
            if r == self._row_state.shape[0]:
                grown = np.zeros((max(8, 2 * r), _COLUMNS), dtype=np.int64)
                grown[:r] = self._row_state
                self._row_state = grown
                self._where = np.full(grown.shape[0], -1, dtype=np.int64)
            self._row_pages.append(_NO_PAGES)
        arr = np.empty(max(8, 2 * pages.shape[0]), dtype=np.int32)
        arr[: pages.shape[0]] = pages
        self._row_pages[r] = arr
        n = pages.shape[0]
        self._row_state[r] = (start, length, 0, n, start // self._page_size + n, 0, next(self._gens))
        return r

    def _page_id(self, page: Any) -> int:
        p = _count("page", page)
        if p >= self._num_pages:
            raise InvalidArgumentError(f"page id {p} out of range [0, {self._num_pages})")
        return p

    def _check_new_id(self, seq_id: int | None) -> int:
        """The id a new sequence would get, without reserving it."""
        if seq_id is None:
            sid = self._next_id
            while sid in self._row_of_id:
                sid += 1
            return sid
        if isinstance(seq_id, bool):
            raise InvalidArgumentError(f"sequence id must be an int, got {seq_id!r}")
        try:
            sid = operator.index(seq_id)
        except TypeError:
            raise InvalidArgumentError(
                f"sequence id must be an int, got {type(seq_id).__name__}"
            ) from None
        if sid in self._row_of_id:
            raise InvalidArgumentError(f"sequence id {sid} already exists")
        return sid

    def _commit_id(self, sid: int, requested: int | None) -> None:
        if requested is None:
            self._next_id = sid + 1

    def _new_id(self, seq_id: int | None) -> int:
        sid = self._check_new_id(seq_id)
        self._commit_id(sid, seq_id)
        return sid

    def _allocate(self, n: int, why: str) -> tuple[int, ...]:
        """Take ``n`` pages (lowest ids first) at refcount 1, or raise
        :class:`OutOfPagesError` having changed nothing."""
        if n > len(self._free):
            raise OutOfPagesError(
                f"out of KV pages {why}: need {n}, {len(self._free)} of "
                f"{self._num_pages} free"
            )
        return tuple(self._take(n))

    def _take(self, n: int) -> list[int]:
        """Pop ``n`` pages (there are) off the free list at refcount 1."""
        free, refcount = self._free, self._refcount
        pages = [heapq.heappop(free) for _ in range(n)]
        for p in pages:
            refcount[p] = 1
        return pages

    def _release(self, pages: np.ndarray) -> None:
        """Drop one reference to each of ``pages`` (one sequence's, so no id
        repeats); those at zero go back on the free list."""
        if not len(pages):
            return
        self._refcount[pages] -= 1
        for p in pages[self._refcount[pages] == 0].tolist():
            heapq.heappush(self._free, p)

    @_locked
    def __repr__(self) -> str:
        return (
            f"BlockPool(num_pages={self._num_pages}, page_size={self._page_size}, "
            f"free={len(self._free)}, sequences={len(self._row_of_id)})"
        )


def _indptr(pages: np.ndarray, total: int) -> np.ndarray:
    """int32 ``indptr`` of int32 page counts summing to ``total``."""
    if total > _INT32_MAX:
        raise PageTableError(f"total pages {total} do not fit in int32 indptr")
    indptr = np.empty(pages.shape[0] + 1, dtype=np.int32)
    indptr[0] = 0
    pages.cumsum(out=indptr[1:])
    return indptr


def _batch_key(seq_ids: Iterable[int]) -> tuple:
    """An id list as the tuple the pool remembers it by."""
    if type(seq_ids) is tuple:
        return seq_ids
    if isinstance(seq_ids, np.ndarray):
        return tuple(seq_ids.tolist())
    return tuple(seq_ids)


def _first_repeat(ids: tuple) -> Any:
    seen = set()
    for s in ids:
        if s in seen:
            return s
        seen.add(s)
    return None


def _device_view(a: Any) -> Any:
    """A NumPy array as is; a CUDA array that is not CuPy (a torch CUDA
    tensor, anything with ``__cuda_array_interface__`` or DLPack on the GPU)
    as a zero-copy CuPy view, so the copies land in its own memory."""
    if isinstance(a, np.ndarray):
        return a
    from ._arrays import as_cupy, is_device_array

    return as_cupy(a, "caches") if is_device_array(a) else a


def apply_page_copies(caches: np.ndarray | DeviceArray | Sequence[np.ndarray | DeviceArray],
                      copies: Iterable[PageCopy | tuple[int, int]]) -> None:
    """Apply copy-on-write instructions: ``cache[dst] = cache[src]`` for every
    :class:`PageCopy`, in order, in each cache.

    ``caches`` is one NumPy/CuPy array ``[num_pages, ...]`` (e.g. a KV cache
    ``[num_pages, page_size, num_kv_heads, head_dim]``) or a sequence of them,
    modified in place; any other CUDA array (``__cuda_array_interface__`` /
    DLPack, torch CUDA tensors included) is written in place through a
    zero-copy CuPy view; ``copies`` holds :class:`PageCopy` objects or
    ``(src, dst)`` pairs. Returns None. All ids are checked against every
    cache before anything is written. When no copy reads a page an earlier one
    writes (the usual case) the copies run as one gather/scatter per cache;
    otherwise one by one, which keeps the sequential meaning.

    Raises :class:`~cupaged.errors.InvalidArgumentError` (a ``ValueError``;
    nothing written) for an id that is negative or not
    an int, or ``>=`` some cache's first dimension (a 0-d cache included); an
    entry that is neither a :class:`PageCopy` nor a pair fails to unpack
    (``TypeError`` or ``ValueError``).

    Example:

    >>> import numpy as np
    >>> import cupaged
    >>> k = np.arange(8, dtype=np.float32).reshape(4, 2)   # 4 "pages" of 2 values
    >>> v = k.copy()
    >>> cupaged.apply_page_copies([k, v], [cupaged.PageCopy(src=1, dst=3)])
    >>> k.tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [2.0, 3.0]]
    >>> cupaged.apply_page_copies(k, [(0, 4)])
    Traceback (most recent call last):
        ...
    cupaged.errors.InvalidArgumentError: page id 4 out of range for a cache of shape (4, 2)
    """
    arrays = [caches] if hasattr(caches, "shape") else list(caches)
    arrays = [_device_view(a) for a in arrays]
    pairs = []
    for c in copies:
        src, dst = (c.src, c.dst) if isinstance(c, PageCopy) else c
        pairs.append((_count("src", src), _count("dst", dst)))
    if not pairs:
        return
    top = max(max(s, d) for s, d in pairs)
    for a in arrays:
        if a.ndim < 1 or a.shape[0] <= top:
            raise InvalidArgumentError(
                f"page id {top} out of range for a cache of shape {tuple(a.shape)}"
            )
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    independent = len(set(dsts)) == len(dsts) and not set(dsts) & set(srcs)
    for a in arrays:
        if len(pairs) == 1 or not independent:
            for s, d in pairs:
                a[d] = a[s]
            continue
        if type(a).__module__.split(".")[0] == "cupy":
            import cupy as xp
        else:
            xp = np
        a[xp.asarray(dsts)] = a[xp.asarray(srcs)]
