"""Host-side block pool: which KV-cache pages each sequence owns.

:class:`BlockPool` keeps a free list, a refcount per physical page and, per
sequence, a :class:`SequenceState`: its pages, the absolute position of its
first visible token (``logical_start``) and its written length. It never
touches the KV caches; when a fork must copy a page it returns a
:class:`PageCopy` for the caller to apply (see :func:`apply_page_copies`).

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
import operator
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np

from ._typing import DeviceArray
from .errors import InvalidArgumentError, OutOfPagesError, UnknownSequenceError
from .page_table import MAX_PAGE_SIZE, PageTable, _build_page_table

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


class BlockPool:
    """Refcounted pages of a paged KV cache of ``num_pages`` pages of
    ``page_size`` tokens (host bookkeeping only: it never touches the caches).

    A free list (lowest page id first), a refcount per page and a
    :class:`SequenceState` per sequence. Positions are absolute: token ``t``
    lives in block ``t // page_size`` at entry ``t % page_size``.

    Args:
        num_pages: pages in the KV cache (its first dimension), ``>= 0``.
        page_size: tokens per page, ``1..65536`` (the cache's second
            dimension and the :class:`PageTable`'s ``page_size``).

    Properties: ``num_pages``, ``page_size``, ``num_free``, ``seq_ids`` (live
    ids, in insertion order). Methods: :meth:`refcount`, :meth:`sequence`,
    :meth:`add_sequence`, :meth:`append`, :meth:`fork`, :meth:`trim_front`,
    :meth:`apply_window`, :meth:`free`, :meth:`page_table`.

    Threads: safe to call from several threads; each call is atomic. One
    ``threading.RLock`` is held for the whole of every method and property,
    so a call sees and leaves the pool consistent and a failed call still
    changes nothing. A sequence of calls is not atomic (another thread may
    run between them).

    Raises:
        OutOfPagesError (a ``MemoryError``): ``append`` or ``fork`` needs more
        free pages than there are. UnknownSequenceError (a ``KeyError``):
        an unknown sequence id. InvalidArgumentError (a ``ValueError``): a
        count (``num_pages``, ``n_tokens``, ``window``) or page id that is
        negative or not an int; a new sequence id that is not an int or
        already exists; trimming more tokens than are visible; a page
        id ``>= num_pages`` given to ``refcount``; ``page_size`` outside
        ``1..65536``. Every operation checks before it changes anything, so a
        failed one leaves the pool exactly as it was.

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
    >>> pool.append(a, 100)
    Traceback (most recent call last):
        ...
    cupaged.errors.OutOfPagesError: out of KV pages appending 100 tokens to sequence 0: need 25, 5 of 8 free
    >>> pool.num_free                 # the failed append changed nothing
    5
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self._num_pages = _count("num_pages", num_pages)
        p = _count("page_size", page_size)
        if not 1 <= p <= MAX_PAGE_SIZE:
            raise InvalidArgumentError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {p}")
        self._page_size = p
        self._refcount = [0] * self._num_pages
        self._free = list(range(self._num_pages))  # sorted, hence a valid heap
        self._seqs: dict[int, SequenceState] = {}
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
        return tuple(self._seqs)

    @_locked
    def refcount(self, page: int) -> int:
        """Number of sequences holding physical page ``page``."""
        return self._refcount[self._page_id(page)]

    @_locked
    def sequence(self, seq_id: int) -> SequenceState:
        """Current state of sequence ``seq_id`` (:class:`UnknownSequenceError`,
        a ``KeyError``, if unknown)."""
        return self._state(seq_id)

    # -- operations --------------------------------------------------------

    @_locked
    def add_sequence(self, seq_id: int | None = None) -> int:
        """Register an empty sequence; return its id (the lowest unused id
        counting up from the last auto-assigned one, when ``seq_id`` is None).
        A duplicate id raises :class:`InvalidArgumentError` (a ``ValueError``)."""
        sid = self._new_id(seq_id)
        self._seqs[sid] = SequenceState((), 0, 0)
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
        st = self._state(seq_id)
        n = _count("n_tokens", n_tokens)
        if n == 0:
            return ()
        new_len = st.length + n
        need = _pages_for(st.logical_start, new_len, self._page_size) - len(st.pages)
        fresh = self._allocate(need, f"appending {n} tokens to sequence {seq_id}")
        self._seqs[seq_id] = SequenceState(st.pages + fresh, st.logical_start, new_len)
        return fresh

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
        st = self._state(parent_id)
        # Check the id before allocating so a duplicate leaves the pool as is.
        cid = self._check_new_id(child_id)
        pages = st.pages
        copies: tuple[PageCopy, ...] = ()
        if pages and st.length % self._page_size:
            (dst,) = self._allocate(1, f"forking sequence {parent_id}")
            copies = (PageCopy(pages[-1], dst),)
            shared, pages = pages[:-1], pages[:-1] + (dst,)
        else:
            shared = pages
        for p in shared:
            self._refcount[p] += 1
        self._commit_id(cid, child_id)
        self._seqs[cid] = SequenceState(pages, st.logical_start, st.length)
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
        st = self._state(seq_id)
        n = _count("n_tokens", n_tokens)
        visible = st.length - st.logical_start
        if n > visible:
            raise InvalidArgumentError(
                f"cannot trim {n} tokens from sequence {seq_id}: only {visible} visible"
            )
        if n == 0:
            return ()
        start = st.logical_start + n
        keep = _pages_for(start, st.length, self._page_size)
        dropped = st.pages[: len(st.pages) - keep]
        self._release(dropped)
        self._seqs[seq_id] = SequenceState(st.pages[len(dropped) :], start, st.length)
        return dropped

    @_locked
    def apply_window(self, seq_id: int, window: int) -> tuple[int, ...]:
        """Keep only the last ``window`` visible tokens of ``seq_id`` (a
        sliding window); returns the pages dropped, as :meth:`trim_front`."""
        st = self._state(seq_id)
        w = _count("window", window)
        return self.trim_front(seq_id, max(0, st.length - st.logical_start - w))

    @_locked
    def free(self, seq_id: int) -> None:
        """Remove ``seq_id`` and release every page it holds."""
        st = self._state(seq_id)
        self._release(st.pages)
        del self._seqs[seq_id]

    @_locked
    def page_table(
        self, seq_ids: Iterable[int] | None = None
    ) -> tuple[PageTable, np.ndarray]:
        """CSR view of the given sequences (all live ones, in :attr:`seq_ids`
        order, when None) via :func:`~cupaged.page_table.build_page_table`.
        Returns ``(table, rope_offsets int64 [B])``; a sequence may appear
        more than once."""
        ids = self.seq_ids if seq_ids is None else tuple(seq_ids)
        states = [self._state(s) for s in ids]
        # Page ids are ints by construction: skip the per-id check.
        table, rope = _build_page_table(states, self._page_size, None, check_ints=False)
        table.check_page_ids(self._num_pages)
        return table, rope

    # -- internals ---------------------------------------------------------

    def _state(self, seq_id: int) -> SequenceState:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):  # TypeError: unhashable id
            raise UnknownSequenceError(f"unknown sequence id {seq_id!r}") from None

    def _page_id(self, page: Any) -> int:
        p = _count("page", page)
        if p >= self._num_pages:
            raise InvalidArgumentError(f"page id {p} out of range [0, {self._num_pages})")
        return p

    def _check_new_id(self, seq_id: int | None) -> int:
        """The id a new sequence would get, without reserving it."""
        if seq_id is None:
            sid = self._next_id
            while sid in self._seqs:
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
        if sid in self._seqs:
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
        pages = tuple(heapq.heappop(self._free) for _ in range(n))
        for p in pages:
            self._refcount[p] = 1
        return pages

    def _release(self, pages: Iterable[int]) -> None:
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                heapq.heappush(self._free, p)

    @_locked
    def __repr__(self) -> str:
        return (
            f"BlockPool(num_pages={self._num_pages}, page_size={self._page_size}, "
            f"free={len(self._free)}, sequences={len(self._seqs)})"
        )


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
