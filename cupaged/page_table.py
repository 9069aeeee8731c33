"""The CSR page table: which physical KV-cache pages each request reads.

A :class:`PageTable` is the view the decode kernels consume. For a batch of
``B`` requests and a cache of pages holding ``page_size`` tokens each:

``indptr``            int32 ``[B+1]``  request ``i`` owns
                                       ``indices[indptr[i]:indptr[i+1]]``
``indices``           int32 ``[indptr[-1]]`` physical page ids, in token order
``last_page_len``     int32 ``[B]``    entries used in the request's last page
``first_page_offset`` int32 ``[B]``    first visible entry of its first page

The visible tokens of request ``i`` start at entry ``first_page_offset[i]`` of
its first page (a sliding window that starts mid-page) and end at entry
``last_page_len[i] - 1`` of its last page, so

    seq_len = (pages - 1) * page_size + last_page_len - first_page_offset.

Every way this geometry can be wrong is an out-of-bounds read in a kernel, not
a wrong number, so :meth:`PageTable.validate` checks every rule on every build
and raises :class:`~cupaged.errors.PageTableError` naming the request and the
rule.

:func:`build_page_table` is the pure builder the block pool uses: it turns
per-sequence state (block ids, ``logical_start``, written length) into a table
plus the RoPE offsets, and is testable without a pool.

CuPy is imported only when a device copy is asked for (:meth:`PageTable.device`).
"""

from __future__ import annotations

import itertools
import operator
import threading
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ._typing import IndexArray
from .errors import ArgumentTypeError, InvalidArgumentError, NoGPUError, PageTableError, ShapeError

__all__ = ["PageTable", "DeviceTable", "build_page_table", "MAX_PAGE_SIZE"]

MAX_PAGE_SIZE = 65536
_INT32_MIN = int(np.iinfo(np.int32).min)
_INT64_MAX = int(np.iinfo(np.int64).max)
_INT32_MAX = int(np.iinfo(np.int32).max)
# Device segments start on 16-byte boundaries so a kernel may use vector loads.
_DEVICE_ALIGN_ELEMS = 4
_UPLOAD_LOCK = threading.Lock()


class DeviceTable(NamedTuple):
    """The four page-table arrays on the GPU, as :meth:`PageTable.device`
    returns them (a ``NamedTuple``; not built by hand).

    Fields, each a 1-D contiguous CuPy int32 array with the same shape and
    values as the host array of the :class:`PageTable` (``B`` requests):

    * ``indices`` ``[indptr[-1]]``: physical page ids in token order.
    * ``indptr`` ``[B+1]``: request ``i`` owns ``indices[indptr[i]:indptr[i+1]]``.
    * ``last_page_len`` ``[B]``: entries used in each request's last page.
    * ``first_page_offset`` ``[B]``: first visible entry of its first page.

    The four are views of one device buffer, each starting on a 16-byte
    boundary.

    Example (needs a GPU)::

        table = cupaged.PageTable.from_seq_lens([5, 8], page_size=4)
        dev = table.device()              # uploaded once per device, then cached
        dev.indptr.get().tolist()         # [0, 2, 4]
        indices, indptr, last_page_len, first_page_offset = dev
    """

    indices: Any
    indptr: Any
    last_page_len: Any
    first_page_offset: Any


def _check_page_size(page_size: Any) -> int:
    """Return ``page_size`` as an int in ``[1, MAX_PAGE_SIZE]`` or raise."""
    if isinstance(page_size, bool):
        raise PageTableError(f"page_size must be an int, got {page_size!r}")
    try:
        p = operator.index(page_size)
    except TypeError:
        raise PageTableError(
            f"page_size must be an int, got {type(page_size).__name__}"
        ) from None
    if not 1 <= p <= MAX_PAGE_SIZE:
        raise PageTableError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {p}")
    return p


def _host_array(name: str, x: Any) -> Any:
    """A NumPy array of an array object that is not NumPy (the table lives on
    the host, so a device array is copied there): CuPy via ``.get()``; any
    other CUDA array (``__cuda_array_interface__`` / DLPack, e.g. a torch CUDA
    tensor) viewed with CuPy, then copied; a host array object with
    ``__array__`` (a CPU torch tensor) viewed with ``np.asarray``. A NumPy
    array or a Python sequence comes back unchanged."""
    if isinstance(x, np.ndarray) or not hasattr(x, "dtype"):
        return x
    if hasattr(x, "get"):
        return x.get()  # cupy -> numpy
    from ._arrays import as_cupy, is_device_array

    if is_device_array(x):
        return as_cupy(x, name).get()
    if hasattr(x, "__array__"):
        try:
            return np.asarray(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise PageTableError(f"{name} could not be read as a host array: {e}") from None
    return x


def _as_int_array(name: str, x: Any) -> np.ndarray:
    """A 1-D integer NumPy array of ``x`` (a sequence or an integer array of
    any width, NumPy, CuPy or another CUDA/host array object); raises
    :class:`PageTableError` for anything else. May return ``x`` itself:
    callers that keep the result must copy."""
    x = _host_array(name, x)
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as e:  # ragged or non-numeric input
        raise PageTableError(f"{name} must be a 1-D integer sequence: {e}") from None
    if arr.ndim != 1:
        raise PageTableError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)  # np.asarray([]) is float64
    if arr.dtype == object:
        # Python ints beyond int64 land here; keep them exact to report range.
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in arr):
            raise PageTableError(f"{name} must contain integers")
        return arr
    if arr.dtype.kind not in "iu":
        raise PageTableError(f"{name} must contain integers, got dtype {arr.dtype}")
    return arr


def _minmax(arr: np.ndarray) -> tuple[int, int]:
    """Exact (min, max) of a non-empty integer array, object arrays included."""
    if arr.dtype == object:
        return int(min(arr)), int(max(arr))
    return int(arr.min()), int(arr.max())


def _as_int64(name: str, x: Any) -> np.ndarray:
    """:func:`_as_int_array` narrowed to a fresh int64 array."""
    arr = _as_int_array(name, x)
    if arr.size:
        lo, hi = _minmax(arr)
        if lo < np.iinfo(np.int64).min or hi > np.iinfo(np.int64).max:
            raise PageTableError(f"{name} values must fit in int64")
    return np.array(arr, dtype=np.int64)


def _to_int32(name: str, x: Any) -> np.ndarray:
    """Convert one constructor argument to a fresh read-only 1-D int32 array.

    Arrays (NumPy, CuPy, a torch tensor or any CUDA array; see
    :func:`_host_array`) must already be int32 (a silent cast could wrap a
    page id); Python sequences are converted, with a range check."""
    x = _host_array(name, x)
    if isinstance(x, np.ndarray):
        if x.dtype != np.int32:
            raise PageTableError(f"{name} must be int32, got {x.dtype}")
        if x.ndim != 1:
            raise PageTableError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        out = np.array(x, dtype=np.int32, copy=True)
    else:
        arr = _as_int_array(name, x)
        if arr.size:
            lo, hi = _minmax(arr)
            if lo < _INT32_MIN or hi > _INT32_MAX:
                raise PageTableError(
                    f"{name} values must fit in int32, got range [{lo}, {hi}]"
                )
        out = np.array(arr, dtype=np.int32)
    out.setflags(write=False)
    return out


def _first(mask: np.ndarray) -> int:
    """Index of the first True in a non-empty boolean mask, or -1."""
    return int(mask.argmax()) if mask.any() else -1


class PageTable:
    """CSR page table of a decode batch (see the module docstring).

    Parameters
    ----------
    indices, indptr, last_page_len, first_page_offset:
        1-D int32 arrays (NumPy, CuPy, or any CUDA array through
        ``__cuda_array_interface__`` / DLPack, torch tensors included: the
        host keeps a copy) or Python integer sequences; shapes
        ``[indptr[-1]]``, ``[B+1]``, ``[B]``, ``[B]``. ``first_page_offset``
        defaults to zeros. Arrays of another dtype (int64 included) are
        rejected rather than cast, so a wrapped page id can never slip through.
    page_size:
        Tokens per page, ``1..65536``.
    num_pages:
        If given, also :meth:`check_page_ids` against a cache of this many pages.

    The stored arrays (attributes ``indices``, ``indptr``, ``last_page_len``,
    ``first_page_offset``, plus ``page_size``) are read-only int32 NumPy
    copies. A table is immutable and checked once, at construction. Rules: a
    request with pages needs ``1 <= last_page_len <= page_size``, ``0 <=
    first_page_offset < page_size`` and, with one page, ``first_page_offset <
    last_page_len``; a request with zero pages (fully trimmed, ``seq_len`` 0)
    needs ``first_page_offset == 0`` and ``0 <= last_page_len <= page_size``;
    a request spans at most ``2**31 - 1`` slots, ``(pages - 1) * page_size +
    last_page_len`` (the kernels count them in an ``int``); page ids are
    ``>= 0``.

    Properties: ``batch_size`` (``B``), ``request_pages`` (int32 ``[B]``),
    ``seq_lens`` (int64 ``[B]``, visible tokens), ``max_page_id`` (-1 when
    there are no pages). Methods: :meth:`validate`, :meth:`check_page_ids`,
    :meth:`device` (the CuPy copy the kernels read; needs a GPU) and the
    constructor :meth:`from_seq_lens`.

    Raises
    ------
    PageTableError
        (a ``ValueError``) naming the request and the rule: a NumPy/CuPy
        array that is not int32 or not 1-D, a Python value that is not an
        integer or does not fit int32, ``indptr`` not starting at 0,
        decreasing or not ending at ``len(indices)``, ``last_page_len`` or
        ``first_page_offset`` not ``B`` long, a geometry rule above broken, a
        negative page id, ``page_size`` not an int in ``1..65536``, or (with
        ``num_pages``) a page id ``>= num_pages``.

    Example: pages of 4, one request reading tokens 2..9 of pages ``[7, 3, 5]``
    (entries 2..3 of page 7, all of page 3, entries 0..1 of page 5):

    >>> import cupaged
    >>> t = cupaged.PageTable([7, 3, 5], [0, 3], [2], [2], page_size=4)
    >>> t.batch_size, t.seq_lens.tolist(), t.max_page_id
    (1, [8], 7)
    >>> t.check_page_ids(8)           # a cache of 8 pages holds every id
    >>> t.check_page_ids(6)
    Traceback (most recent call last):
        ...
    cupaged.errors.PageTableError: request 0: page id 7 at indices[0] is out of range for a cache of num_pages=6
    >>> cupaged.PageTable([0], [0, 1], [5], page_size=4)
    Traceback (most recent call last):
        ...
    cupaged.errors.PageTableError: request 0: last_page_len must be in [1, page_size=4] for a request with pages, got 5
    """

    __slots__ = (
        "indices",
        "indptr",
        "last_page_len",
        "first_page_offset",
        "page_size",
        "_request_pages",
        "_seq_lens",
        "_max_page_id",
        "_device",
        "_derived",  # the tables windowed() and query_rows() made from this one, by key
        "__weakref__",  # gather index and plan caches key on the table
    )

    def __init__(
        self,
        indices: IndexArray,
        indptr: IndexArray,
        last_page_len: IndexArray,
        first_page_offset: IndexArray | None = None,
        *,
        page_size: int,
        num_pages: int | None = None,
    ) -> None:
        page_size = _check_page_size(page_size)
        indices_a = _to_int32("indices", indices)
        indptr_a = _to_int32("indptr", indptr)
        last_a = _to_int32("last_page_len", last_page_len)
        if first_page_offset is None:
            off_a = np.zeros(max(indptr_a.shape[0] - 1, 0), dtype=np.int32)
            off_a.setflags(write=False)
        else:
            off_a = _to_int32("first_page_offset", first_page_offset)
        self._init_checked(indices_a, indptr_a, last_a, off_a, page_size)
        if num_pages is not None:
            self.check_page_ids(num_pages)

    @classmethod
    def _from_owned(
        cls,
        indices: np.ndarray,
        indptr: np.ndarray,
        last_page_len: np.ndarray,
        first_page_offset: np.ndarray,
        page_size: int,
    ) -> "PageTable":
        """Build from fresh int32 arrays this module created (no copies); still
        validates, so every table that exists has passed :meth:`validate`."""
        for a in (indices, indptr, last_page_len, first_page_offset):
            a.setflags(write=False)
        self = cls.__new__(cls)
        self._init_checked(indices, indptr, last_page_len, first_page_offset, page_size)
        return self

    @classmethod
    def _from_pool(
        cls,
        indices: np.ndarray,
        indptr: np.ndarray,
        last_page_len: np.ndarray,
        first_page_offset: np.ndarray,
        page_size: int,
        request_pages: np.ndarray,
        seq_lens: np.ndarray,
        max_page_id: int,
    ) -> "PageTable":
        """A table from :class:`~cupaged.BlockPool` arrays, with its derived
        facts, and without running :meth:`validate` (21 µs at batch 128 and
        28k pages, more than the rest of a decode step's table update).

        Only the pool calls it, because only there does every rule hold by
        construction: page ids come from its own free list (``0 <= id <
        num_pages``), ``indptr`` is the cumsum of each sequence's page count,
        ``last_page_len`` / ``first_page_offset`` come from ``(logical_start,
        length)`` by :func:`build_page_table`'s formulas (0 and 0 for a
        request without pages), and the pool checks the int32 totals and the
        2**31-1 slot limit itself (or takes :meth:`_from_owned`). The tests
        compare its tables with ``build_page_table``'s and run ``validate``
        on them. The arrays are int32 (``seq_lens`` int64), made read-only
        here, and may be shared with earlier tables, which are read-only too.
        """
        for a in (indices, indptr, last_page_len, first_page_offset, request_pages, seq_lens):
            a.setflags(write=False)
        self = cls.__new__(cls)
        self.indices, self.indptr = indices, indptr
        self.last_page_len, self.first_page_offset = last_page_len, first_page_offset
        self.page_size = page_size
        self._device = self._derived = None
        self._request_pages, self._seq_lens, self._max_page_id = request_pages, seq_lens, max_page_id
        return self

    def _init_checked(self, indices, indptr, last, off, page_size) -> None:
        self.indices = indices
        self.indptr = indptr
        self.last_page_len = last
        self.first_page_offset = off
        self.page_size = page_size
        self._device = None
        self._derived = None
        self.validate()
        pages = np.diff(indptr).astype(np.int32)
        # Zero-page requests get 0, not (−1)*P + last − 0.
        seq = np.where(
            pages > 0,
            (pages.astype(np.int64) - 1) * page_size
            + last.astype(np.int64)
            - off.astype(np.int64),
            0,
        ).astype(np.int64)
        pages.setflags(write=False)
        seq.setflags(write=False)
        self._request_pages = pages
        self._seq_lens = seq
        self._max_page_id = int(indices.max()) if indices.size else -1

    # -- derived facts -----------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Number of requests ``B``."""
        return int(self.indptr.shape[0]) - 1

    @property
    def request_pages(self) -> np.ndarray:
        """Read-only int32 ``[B]``: pages of each request, ``diff(indptr)``."""
        return self._request_pages

    @property
    def seq_lens(self) -> np.ndarray:
        """Read-only int64 ``[B]``: visible tokens per request (0 for a
        zero-page request)."""
        return self._seq_lens

    @property
    def max_page_id(self) -> int:
        """Largest physical page id in ``indices``; -1 when there are none."""
        return self._max_page_id

    # -- checks ------------------------------------------------------------

    def validate(self) -> None:
        """Check every rule of the CSR view; raise :class:`PageTableError`
        naming the offending request (the lowest-numbered one) and the rule.

        Structural rules come first (shapes, ``indptr``), since the per-request
        rules are meaningless without them. The geometry identity
        ``(pages-1)*P + last - off == seq_len`` then holds by construction of
        :attr:`seq_lens`; the bounds below are what make it describe tokens
        that really lie inside the listed pages.
        """
        indices, indptr = self.indices, self.indptr
        last, off, P = self.last_page_len, self.first_page_offset, self.page_size
        pages = _check_csr_structure(indices, indptr, last, off)
        worst = None
        for mask, msg in _request_rules(indices, indptr, last, off, P, pages):
            i = _first(mask)
            if i >= 0 and (worst is None or i < worst[0]):
                worst = (i, msg)
        if worst is not None:
            i, msg = worst
            raise PageTableError(f"request {i}: {msg(i)}")

    def check_page_ids(self, num_pages: int) -> None:
        """Check every page id is ``< num_pages`` (the cache's first dim);
        raise :class:`PageTableError` naming the first offending request and id.
        O(1) after construction unless some id is out of range."""
        try:
            n = operator.index(num_pages)
        except TypeError:
            raise PageTableError(
                f"num_pages must be an int, got {type(num_pages).__name__}"
            ) from None
        if n < 0:
            raise PageTableError(f"num_pages must be >= 0, got {n}")
        if self._max_page_id < n:
            return
        k = _first(self.indices >= n)
        i = int(np.searchsorted(self.indptr, k, side="right")) - 1
        raise PageTableError(
            f"request {i}: page id {int(self.indices[k])} at indices[{k}] is out "
            f"of range for a cache of num_pages={n}"
        )

    # -- sliding window ----------------------------------------------------

    def windowed(self, window_left: Any) -> "PageTable":
        """The table a sliding window leaves to each request's query, which
        sits at the request's last visible slot ``p`` (positions count from
        the first visible slot, ``first_page_offset`` honoured) and sees slots
        ``p - W .. p`` only (FlashInfer's ``window_left``).

        ``window_left``: None or -1 (no window: returns ``self``), an int
        ``W >= 0``, or an int ``[B]`` array (``-1``: none for that request).
        Pages wholly before the window are dropped and the window's first
        slot becomes ``first_page_offset``, so a kernel never reads them;
        the last visible slot, hence ``last_page_len``, stays. The result is
        cached on the table (tables are immutable).

        >>> t = PageTable.from_seq_lens([37, 5, 0], page_size=16)
        >>> w = t.windowed(20)                 # each query sees its last 21 slots
        >>> w.seq_lens.tolist(), w.request_pages.tolist(), w.first_page_offset.tolist()
        ([21, 5, 0], [2, 1, 0], [0, 0, 0])
        >>> t.windowed(3).first_page_offset.tolist()   # slots 33..36 of request 0: page 2, from entry 1
        [1, 1, 0]
        >>> t.windowed(-1) is t, t.windowed(3) is t.windowed(3)
        (True, True)
        """
        w = window_array(window_left, self.batch_size)
        return self if w is None else self._derive(w.tobytes(), self._windowed, w)

    def _windowed(self, w: np.ndarray) -> "PageTable":
        """:meth:`windowed` of a checked window array (not cached here)."""
        seq = self._seq_lens
        skip = np.where(w < 0, 0, np.maximum(seq - 1 - w, 0))  # visible slots before the window
        if not skip.any():
            return self
        P = self.page_size
        first = self.first_page_offset.astype(np.int64) + skip  # from entry 0 of the first page
        drop = first // P
        pages = self._request_pages.astype(np.int64) - drop
        req = np.repeat(np.arange(self.batch_size), self._request_pages)
        local = np.arange(self.indices.shape[0]) - self.indptr[:-1].astype(np.int64)[req]
        indptr = np.zeros(self.batch_size + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        return PageTable._from_owned(self.indices[local >= drop[req]].astype(np.int32), indptr,
                                     self.last_page_len.copy(), (first % P).astype(np.int32), P)

    def query_rows(self, qo_indptr: Any) -> "PageTable":
        """The table of several query tokens per request (speculative
        decoding): one row per query token, so that each row is one decode
        query against the slots it may see.

        ``qo_indptr``: None (one token each: returns ``self``) or an int
        ``[B+1]`` array from 0, non-decreasing, with ``q_len_i =
        qo_indptr[i+1] - qo_indptr[i]`` in ``[1, 16]`` and ``q_len_i <=
        seq_len_i``. Request ``i``'s new tokens are its last ``q_len_i``
        visible slots; row ``qo_indptr[i] + j`` holds its first
        ``seq_len_i - q_len_i + j + 1`` visible slots (its token ``j`` sees
        the slots before it and itself: causal among the new tokens), on the
        same pages from the same ``first_page_offset``. The result is cached
        on the table.

        >>> t = PageTable.from_seq_lens([37, 5], page_size=16)
        >>> r = t.query_rows([0, 3, 4])          # 3 query tokens for request 0, 1 for request 1
        >>> r.seq_lens.tolist(), r.request_pages.tolist()
        ([35, 36, 37, 5], [3, 3, 3, 1])
        >>> t.query_rows([0, 1, 2]) is t, r is t.query_rows(np.array([0, 3, 4]))
        (True, True)
        """
        return self._rows_of(qo_indptr_array(qo_indptr, self.batch_size, self._seq_lens))

    def _rows_of(self, ptr: np.ndarray | None) -> "PageTable":
        """:meth:`query_rows` of an already checked ``qo_indptr`` (None: self)."""
        return self if ptr is None else self._derive(b"q" + ptr.tobytes(), self._query_rows, ptr)

    def _query_rows(self, ptr: np.ndarray) -> "PageTable":
        """:meth:`query_rows` of a checked int64 ``qo_indptr`` (not cached here)."""
        q_len = np.diff(ptr)
        if (q_len == 1).all():
            return self
        P = self.page_size
        req = np.repeat(np.arange(self.batch_size), q_len)
        j = np.arange(int(ptr[-1])) - ptr[:-1][req]
        off = self.first_page_offset.astype(np.int64)[req]
        seen = off + self._seq_lens.astype(np.int64)[req] - q_len[req] + j + 1  # from entry 0 of the first page
        pages = -(-seen // P)
        indptr = np.zeros(req.shape[0] + 1, dtype=np.int64)
        np.cumsum(pages, out=indptr[1:])
        if indptr[-1] > _INT32_MAX:
            raise PageTableError(f"the query rows hold {int(indptr[-1])} pages in all, beyond int32 indptr")
        # row r's pages are the first pages[r] of its request's
        take = np.arange(int(indptr[-1])) + np.repeat(self.indptr[:-1].astype(np.int64)[req] - indptr[:-1], pages)
        return PageTable._from_owned(self.indices[take].astype(np.int32), indptr.astype(np.int32),
                                     (seen - (pages - 1) * P).astype(np.int32), off.astype(np.int32), P)

    def _derive(self, key: bytes, build: Callable[[np.ndarray], "PageTable"], arg: np.ndarray) -> "PageTable":
        """The table ``build(arg)`` makes from this one, cached under ``key``
        (window keys are whole int64 words, query-row keys start with b"q":
        they cannot clash). ``build`` may return ``self``, which is not cached
        (a table holding itself would wait for the cycle collector)."""
        cache = self._derived
        hit = None if cache is None else cache.get(key)
        if hit is not None:
            return hit
        table = build(arg)
        if table is self:
            return self
        with _UPLOAD_LOCK:
            if self._derived is None:
                self._derived = {}
            return self._derived.setdefault(key, table)

    # -- device copy -------------------------------------------------------

    def device(self) -> DeviceTable:
        """The table as cupy int32 arrays on the current device, uploaded on
        the first call (for that device) and cached.

        The four arrays are views of one device buffer filled by a single
        host-to-device copy. Call this before capturing a CUDA graph: the
        upload itself cannot be captured. Raises
        :class:`~cupaged.errors.NoGPUError` ("no CUDA GPU: ...") when CuPy or
        a CUDA device is missing.
        """
        from ._device import no_gpu_message

        try:
            import cupy
        except ImportError:  # CuPy is an extra (cupaged[cuda13] / [cuda12])
            raise NoGPUError(no_gpu_message("PageTable.device()")) from None
        try:
            dev = cupy.cuda.runtime.getDevice()
        except cupy.cuda.runtime.CUDARuntimeError:
            raise NoGPUError(no_gpu_message("PageTable.device()")) from None
        cached = self._device  # {device id: DeviceTable}, made on the first upload
        table = None if cached is None else cached.get(dev)
        if table is not None:
            return table
        with _UPLOAD_LOCK:  # one upload per (table, device): a second would free a buffer in use
            if self._device is None:
                self._device = {}
            return self._device.get(dev) or self._device.setdefault(dev, self._upload())

    def _upload(self) -> DeviceTable:
        import cupy

        parts = (self.indices, self.indptr, self.last_page_len, self.first_page_offset)
        a = _DEVICE_ALIGN_ELEMS
        starts, total = [], 0
        for p in parts:
            starts.append(total)
            total += -(-p.shape[0] // a) * a
        host = np.zeros(max(total, 1), dtype=np.int32)
        for s, p in zip(starts, parts):
            host[s : s + p.shape[0]] = p
        buf = cupy.asarray(host)
        return DeviceTable(*(buf[s : s + p.shape[0]] for s, p in zip(starts, parts)))

    # -- construction helpers ----------------------------------------------

    @classmethod
    def from_seq_lens(
        cls,
        seq_lens: IndexArray,
        page_size: int,
        first_page_offset: IndexArray | None = None,
        *,
        page_ids: IndexArray | None = None,
    ) -> "PageTable":
        """Table for requests of the given visible lengths.

        Request ``i`` with ``len = seq_lens[i]`` and ``off =
        first_page_offset[i]`` (default 0) gets ``ceil((off + len) / P)`` pages
        (0 when ``len == 0``, which then needs ``off == 0``) and
        ``last_page_len = off + len - (pages - 1) * P`` (0 for zero pages), so
        an exactly full last page gets ``P``, not 0. Physical ids are taken in
        order from ``page_ids`` (any integer array/sequence with at least as
        many ids as pages in total) or ``0, 1, 2, ...``.

        Raises :class:`PageTableError` for a negative length, an offset
        outside ``[0, P)``, a zero-length request with a nonzero offset,
        non-integer input, mismatched lengths, too few ``page_ids`` or one
        outside ``[0, 2**31 - 1]``, totals beyond int32, or ``page_size`` not
        an int in ``1..65536``.

        Example:

        >>> import cupaged
        >>> t = cupaged.PageTable.from_seq_lens([5, 8, 0], 4, [3, 0, 0])
        >>> t.indptr.tolist(), t.last_page_len.tolist(), t.seq_lens.tolist()
        ([0, 2, 4, 4], [4, 4, 0], [5, 8, 0])
        >>> cupaged.PageTable.from_seq_lens([5], 4, page_ids=[9, 2]).indices.tolist()
        [9, 2]
        """
        P = _check_page_size(page_size)
        lens, off = _checked_lengths(seq_lens, first_page_offset, P)
        pages = np.where(lens > 0, -(-(off + lens) // P), 0)
        last = np.where(pages > 0, off + lens - (pages - 1) * P, 0)
        indptr = np.zeros(lens.shape[0] + 1, dtype=np.int64)
        np.cumsum(pages, out=indptr[1:])
        total = int(indptr[-1])
        if total > _INT32_MAX:
            raise PageTableError(f"total pages {total} do not fit in int32 indptr")
        ids = np.arange(total, dtype=np.int32) if page_ids is None else _first_page_ids(page_ids, total)
        return cls._from_owned(
            ids,
            indptr.astype(np.int32),
            last.astype(np.int32),
            off.astype(np.int32),
            P,
        )

    def __reduce__(self) -> tuple:
        """Pickle, ``copy`` and ``deepcopy`` rebuild the table through the
        constructor: the copy's arrays are read-only and checked again, its
        derived facts recomputed, and no device buffer is carried over."""
        return (_rebuild_page_table, (type(self), self.indices, self.indptr, self.last_page_len,
                                      self.first_page_offset, self.page_size))

    def __repr__(self) -> str:
        lens = np.array2string(self._seq_lens, threshold=8)
        return (
            f"PageTable(batch_size={self.batch_size}, page_size={self.page_size}, "
            f"pages={self.indices.shape[0]}, seq_lens={lens})"
        )


def window_array(window_left: Any, batch: int) -> np.ndarray | None:
    """``window_left`` (None, an int, or an int ``[batch]`` array; -1: no
    window) as int64 ``[batch]``, or None when no request has a window."""
    if window_left is None:
        return None
    arr = np.asarray(window_left)
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim > 1 or (arr.ndim == 1 and arr.shape != (batch,)):
        raise ShapeError(f"window_left must be None, an int or an int array [batch = {batch}], got {window_left!r}")
    arr = np.broadcast_to(arr.astype(np.int64), (batch,))
    if (arr < -1).any():
        raise InvalidArgumentError(f"window_left must be >= 0, or -1 (no window), got {arr.tolist()}")
    return None if (arr < 0).all() else arr


MAX_Q_LEN = 16  # query tokens per request with qo_indptr


def qo_indptr_array(qo_indptr: Any, batch: int, seq_lens: np.ndarray) -> np.ndarray | None:
    """``qo_indptr`` (None, or an int ``[batch + 1]`` NumPy or CuPy array or
    sequence) as int64, checked: from 0, ``1..MAX_Q_LEN`` query tokens per
    request, no more than the request's visible slots. None stays None."""
    if qo_indptr is None:
        return None
    ptr = qo_indptr.get() if hasattr(qo_indptr, "get") else np.asarray(qo_indptr)
    if ptr.ndim != 1 or ptr.shape[0] != batch + 1 or not np.issubdtype(ptr.dtype, np.integer):
        raise ShapeError(f"qo_indptr must be an integer array [batch + 1 = {batch + 1}], "
                         f"got shape {ptr.shape} dtype {ptr.dtype}")
    ptr = ptr.astype(np.int64)
    q_len = np.diff(ptr)
    if ptr[0] != 0 or (q_len < 1).any() or (q_len > MAX_Q_LEN).any():
        raise InvalidArgumentError(f"qo_indptr must start at 0 and give every request 1..{MAX_Q_LEN} query "
                                   f"tokens, got {ptr.tolist()}")
    short = np.flatnonzero(q_len > seq_lens)
    if short.size:
        i = int(short[0])
        raise InvalidArgumentError(f"request {i} has {int(q_len[i])} query tokens but {int(seq_lens[i])} visible "
                                   "slots: its new tokens are its last q_len slots")
    return ptr


def kernel_table(table: Any, qo_indptr: Any = None, window_left: Any = None) -> "PageTable":
    """The table a decode runs on: one row per query token
    (:meth:`PageTable.query_rows`), each row's sliding window applied
    (:meth:`PageTable.windowed`; a per-request window holds for every token
    of the request). ``table`` itself when both are None."""
    if qo_indptr is None and window_left is None:
        return table
    if not isinstance(table, PageTable):
        raise ArgumentTypeError(f"table must be a cupaged.PageTable, got {type(table).__name__}")
    ptr = qo_indptr_array(qo_indptr, table.batch_size, table.seq_lens)
    rows = table._rows_of(ptr)  # (ptr is checked: not again)
    if rows is not table and window_left is not None:
        w = window_array(window_left, table.batch_size)
        window_left = None if w is None else np.repeat(w, np.diff(ptr))
    return rows.windowed(window_left)


def _rebuild_page_table(cls: type, indices, indptr, last_page_len, first_page_offset, page_size) -> PageTable:
    """Unpickle / copy a :class:`PageTable` (see ``PageTable.__reduce__``)."""
    return cls(indices, indptr, last_page_len, first_page_offset, page_size=page_size)


def build_page_table(
    states: Sequence[Any],
    page_size: int,
    resolve: Callable[[int], int] | Any = None,
) -> tuple[PageTable, np.ndarray]:
    """Build the CSR view of a batch of sequences; a pure function.

    ``states[i]`` is any object with ``.pages`` (block ids; the first holds
    token ``logical_start``), ``.logical_start`` (first visible absolute
    position) and ``.length`` (written length = absolute next position).
    For each: ``visible = length - logical_start``; ``first_page_offset =
    logical_start % P``; ``pages = 0 if visible == 0 else ceil(length / P) -
    logical_start // P``, which must equal ``len(.pages)``. A zero-page request
    gets ``first_page_offset = last_page_len = 0`` (what :meth:`PageTable.validate`
    requires of it).

    ``resolve`` maps a block id to a physical page id: a callable, an integer
    array indexed by block id, or None for the identity.

    Returns ``(table, rope_offsets)``, ``rope_offsets`` int64 ``[B]`` =
    ``length`` (the absolute position of the next token, which differs from
    the visible length exactly when the front was trimmed).

    Raises :class:`PageTableError` naming the request: ``logical_start`` or
    ``length`` not an int, ``logical_start < 0``, ``length < logical_start``,
    ``length`` beyond int64, ``len(.pages)`` not the count above, a block id
    that is not an int (or a ``resolve`` result that is not), a block id
    outside the ``resolve`` array, a page id negative or beyond int32, total
    pages beyond int32, or ``page_size`` not an int in ``1..65536``.

    Example (P = 4): tokens 3..6 of blocks 9 and 2:

    >>> from types import SimpleNamespace
    >>> import cupaged
    >>> s = SimpleNamespace(pages=(9, 2), logical_start=3, length=7)
    >>> table, rope = cupaged.build_page_table([s], page_size=4)
    >>> table.first_page_offset.tolist(), table.last_page_len.tolist(), table.seq_lens.tolist(), rope.tolist()
    ([3], [3], [4], [7])
    >>> bad = SimpleNamespace(pages=(9,), logical_start=3, length=7)
    >>> cupaged.build_page_table([bad], page_size=4)
    Traceback (most recent call last):
        ...
    cupaged.errors.PageTableError: request 0: has 1 pages but logical_start=3, length=7, page_size=4 need 2
    """
    return _build_page_table(states, page_size, resolve, check_ints=True)



def _checked_lengths(seq_lens: IndexArray, first_page_offset: IndexArray | None,
                     P: int) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`PageTable.from_seq_lens`' lengths and offsets as int64, each
    request's checked (the lowest-numbered offender named)."""
    lens = _as_int64("seq_lens", seq_lens)
    B = lens.shape[0]
    if first_page_offset is None:
        off = np.zeros(B, dtype=np.int64)
    else:
        off = _as_int64("first_page_offset", first_page_offset)
        if off.shape[0] != B:
            raise PageTableError(
                f"first_page_offset must have B={B} entries (len(seq_lens)), "
                f"got {off.shape[0]}"
            )
    for mask, rule in (
        (lens < 0, lambda i: f"seq_len must be >= 0, got {int(lens[i])}"),
        (
            (off < 0) | (off >= P),
            lambda i: f"first_page_offset must be in [0, page_size={P}), "
            f"got {int(off[i])}",
        ),
        (
            (lens == 0) & (off != 0),
            lambda i: "a zero-length request needs first_page_offset == 0, "
            f"got {int(off[i])}",
        ),
        (
            # checked before any int64 arithmetic on it can wrap
            lens > _INT32_MAX * P,
            lambda i: f"seq_len {int(lens[i])} needs more pages than int32 "
            f"indptr can hold at page_size={P}",
        ),
    ):
        i = _first(mask)
        if i >= 0:
            raise PageTableError(f"request {i}: {rule(i)}")
    return lens, off


def _first_page_ids(page_ids: IndexArray, total: int) -> np.ndarray:
    """The first ``total`` of ``page_ids`` as int32, each in ``[0, 2**31 - 1]``."""
    src = _as_int_array("page_ids", page_ids)
    if src.shape[0] < total:
        raise PageTableError(
            f"page_ids has {src.shape[0]} ids, the requests need {total}"
        )
    src = src[:total]
    lo, hi = _minmax(src) if total else (0, 0)
    if lo < 0 or hi > _INT32_MAX:
        raise PageTableError(
            f"page_ids must be in [0, {_INT32_MAX}], got range [{lo}, {hi}]"
        )
    return np.array(src, dtype=np.int32)


def _check_csr_structure(indices: np.ndarray, indptr: np.ndarray, last: np.ndarray,
                         off: np.ndarray) -> np.ndarray:
    """The structural rules of :meth:`PageTable.validate` (dtypes, shapes,
    ``indptr``); returns the pages per request (int64)."""
    for name, a in (
        ("indices", indices),
        ("indptr", indptr),
        ("last_page_len", last),
        ("first_page_offset", off),
    ):
        if a.ndim != 1 or a.dtype != np.int32:
            raise PageTableError(f"{name} must be a 1-D int32 array")
    if indptr.shape[0] < 1:
        raise PageTableError("indptr must have B+1 >= 1 entries, got 0")
    if indptr[0] != 0:
        raise PageTableError(f"indptr[0] must be 0, got {int(indptr[0])}")
    B = indptr.shape[0] - 1
    pages = np.diff(indptr.astype(np.int64))
    i = _first(pages < 0)
    if i >= 0:
        raise PageTableError(
            f"request {i}: indptr must be non-decreasing, but "
            f"indptr[{i}]={int(indptr[i])} > indptr[{i + 1}]={int(indptr[i + 1])}"
        )
    if int(indptr[-1]) != indices.shape[0]:
        raise PageTableError(
            f"indptr[-1] must equal len(indices): indptr[-1]={int(indptr[-1])}, "
            f"len(indices)={indices.shape[0]}"
        )
    for name, a in (("last_page_len", last), ("first_page_offset", off)):
        if a.shape[0] != B:
            raise PageTableError(
                f"{name} must have B={B} entries (len(indptr)-1), got {a.shape[0]}"
            )
    return pages


def _request_rules(indices: np.ndarray, indptr: np.ndarray, last: np.ndarray, off: np.ndarray, P: int,
                   pages: np.ndarray) -> list[tuple[np.ndarray, Callable[[int], str]]]:
    """The per-request rules of :meth:`PageTable.validate`: (mask of the
    requests that break it, message builder), in the order a request is judged."""
    has = pages > 0
    rules: list[tuple[np.ndarray, Callable[[int], str]]] = [
        (
            has & ((last < 1) | (last > P)),
            lambda i: f"last_page_len must be in [1, page_size={P}] for a "
            f"request with pages, got {int(last[i])}",
        ),
        (
            has & ((off < 0) | (off >= P)),
            lambda i: f"first_page_offset must be in [0, page_size={P}), "
            f"got {int(off[i])}",
        ),
        (
            # The kernels count a request's slots in a C int; pages is
            # int64 and at most 2**31, so the product cannot wrap.
            has & ((pages - 1) * P + last > _INT32_MAX),
            lambda i: f"(pages-1)*page_size + last_page_len = "
            f"{(int(pages[i]) - 1) * P + int(last[i])} slots exceed 2**31-1 "
            "(the kernels count slots in an int)",
        ),
        (
            (pages == 1) & (off >= last),
            lambda i: "a one-page request needs first_page_offset < "
            f"last_page_len, got first_page_offset={int(off[i])}, "
            f"last_page_len={int(last[i])}",
        ),
        (
            ~has & (off != 0),
            lambda i: "a zero-page request needs first_page_offset == 0, "
            f"got {int(off[i])}",
        ),
        (
            ~has & ((last < 0) | (last > P)),
            lambda i: f"a zero-page request needs last_page_len in "
            f"[0, page_size={P}], got {int(last[i])}",
        ),
    ]
    neg = indices < 0
    if neg.any():
        # Attribute each bad index to the request whose slice holds it.
        owner = np.searchsorted(indptr, np.flatnonzero(neg), side="right") - 1
        bad_req = np.zeros(pages.shape[0], dtype=bool)
        bad_req[owner] = True

        def neg_msg(i: int) -> str:
            k = int(indptr[i]) + _first(indices[indptr[i] : indptr[i + 1]] < 0)
            return f"page ids must be >= 0, got indices[{k}]={int(indices[k])}"

        rules.append((bad_req, neg_msg))
    return rules


def _build_page_table(
    states: Sequence[Any], page_size: int, resolve: Any, *, check_ints: bool
) -> tuple[PageTable, np.ndarray]:
    """:func:`build_page_table`; ``check_ints=False`` skips the per-id int
    check (np.fromiter would silently truncate a float id) for callers whose
    page ids are ints by construction, such as the block pool."""
    P = _check_page_size(page_size)
    B = len(states)
    indptr = np.zeros(B + 1, dtype=np.int64)
    last = np.zeros(B, dtype=np.int32)
    off = np.zeros(B, dtype=np.int32)
    rope = np.zeros(B, dtype=np.int64)
    for i, st in enumerate(states):
        start, length, n = _state_extent(i, st, P)
        indptr[i + 1] = indptr[i] + n
        if n:
            off[i] = start % P
            last[i] = (length - 1) % P + 1  # an exactly full page is P, not 0
        rope[i] = length
    total = int(indptr[-1])
    if total > _INT32_MAX:
        raise PageTableError(f"total pages {total} do not fit in int32 indptr")
    ids = _page_ids(states, resolve, indptr, total, check_ints)
    # Range-check before the int32 cast, which would wrap silently.
    k = _first((ids < 0) | (ids > _INT32_MAX)) if total else -1
    if k >= 0:
        i = int(np.searchsorted(indptr, k, side="right")) - 1
        raise PageTableError(
            f"request {i}: page ids must be in [0, {_INT32_MAX}], got {int(ids[k])}"
        )
    table = PageTable._from_owned(
        ids.astype(np.int32), indptr.astype(np.int32), last, off, P
    )
    return table, rope


def _state_extent(i: int, st: Any, P: int) -> tuple[int, int, int]:
    """Request ``i``'s ``(logical_start, length, pages)``, checked against
    its page list."""
    try:
        start = operator.index(st.logical_start)
        length = operator.index(st.length)
    except TypeError:
        raise PageTableError(
            f"request {i}: logical_start and length must be ints"
        ) from None
    if start < 0:
        raise PageTableError(f"request {i}: logical_start must be >= 0, got {start}")
    if length > _INT64_MAX:
        raise PageTableError(f"request {i}: length {length} does not fit int64 rope offsets")
    if length < start:
        raise PageTableError(
            f"request {i}: length must be >= logical_start (visible length "
            f"would be negative), got length={length}, logical_start={start}"
        )
    n = 0 if length == start else -(-length // P) - start // P
    if len(st.pages) != n:
        raise PageTableError(
            f"request {i}: has {len(st.pages)} pages but logical_start={start}, "
            f"length={length}, page_size={P} need {n}"
        )
    return start, length, n


def _page_ids(states: Sequence[Any], resolve: Any, indptr: np.ndarray, total: int,
              check_ints: bool) -> np.ndarray:
    """The states' block ids in order, through ``resolve`` (None, a callable
    or a map array), as int64 (not yet range-checked)."""
    blocks = itertools.chain.from_iterable(st.pages for st in states)
    if check_ints:
        blocks = map(operator.index, blocks)
    try:
        if resolve is None:
            ids = np.fromiter(blocks, dtype=np.int64, count=total)
        elif callable(resolve):
            ids = np.fromiter(
                (operator.index(resolve(b)) for b in blocks), dtype=np.int64, count=total
            )
        else:
            bids = np.fromiter(blocks, dtype=np.int64, count=total)
    except (TypeError, OverflowError) as e:
        raise _bad_id_error(states, resolve, e) from None
    if resolve is not None and not callable(resolve):
        table_map = _as_int_array("resolve", resolve)
        # A negative block id would silently index from the end.
        k = _first((bids < 0) | (bids >= table_map.shape[0])) if total else -1
        if k >= 0:
            i = int(np.searchsorted(indptr, k, side="right")) - 1
            raise PageTableError(
                f"request {i}: block id {int(bids[k])} is outside the resolve map "
                f"of {table_map.shape[0]} entries"
            )
        ids = np.asarray(table_map[bids], dtype=np.int64)
    return ids


def _bad_id_error(states: Sequence[Any], resolve: Any, err: Exception) -> PageTableError:
    """Name the request behind a non-int or oversized block/page id (the slow
    path, taken only once the fast conversion has failed)."""
    for i, st in enumerate(states):
        for b in st.pages:
            try:
                v = operator.index(b)
                if callable(resolve):
                    v = operator.index(resolve(b))
                if not -(2**63) <= v < 2**63:
                    raise OverflowError
            except (TypeError, OverflowError):
                return PageTableError(
                    f"request {i}: page ids must be ints in [0, {_INT32_MAX}], got {b!r}"
                )
    return PageTableError(f"page ids must be ints in [0, {_INT32_MAX}]: {err}")
