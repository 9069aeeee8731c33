"""The full checks of ``decode(..., validate=True)``: debugging aids.

The default ("cheap") checks of :func:`cupaged.decode` are O(1) comparisons of
host attributes: they never read device memory. They trust the device copy of
the page table, :meth:`PageTable.device`, because it is uploaded from host
arrays that were validated when the table was built. But its arrays are
writable CuPy views cached on the table; a write into them (a bug in the
caller, a stray kernel) bypasses every host check, and the kernels would then
read whatever page ids it holds.

:func:`check_device_table` re-checks every CSR rule on that device copy with
CuPy reductions and one synchronization (to bring the verdicts to the host),
then names the first broken rule and its request, like
:meth:`PageTable.validate`. :func:`check_out_overlap` rejects an ``out``
whose elements share memory (a broadcast view), which the kernels would
write from several CTAs. Both are for debugging, not for the serving loop.
"""

from __future__ import annotations

import numbers
import weakref
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, LayoutError, PageTableError, PlanMismatchError
from .page_table import DeviceTable, PageTable

__all__ = ["check_device_table", "check_out_overlap", "plan_mismatch_reason", "check_plan_structure",
           "trust_plan"]

# Plans whose fields are known consistent: every plan plan_decode returns
# (trust_plan), and every other plan once check_plan_structure passed it.
_SOUND: "weakref.WeakSet" = weakref.WeakSet()


def trust_plan(plan) -> None:
    """Marks a plan made by :func:`cupaged.plan_decode` as consistent (no
    structural check at its first launch)."""
    _SOUND.add(plan)


def check_plan_structure(plan) -> None:
    """Checks that a :class:`~cupaged.DecodePlan`'s fields agree with one
    another, once per plan object: a plan that ``plan_decode`` did not make
    (``dataclasses.replace``, a pickle, a hand-built one) reaches the kernel
    only if they do. The kernel's memory safety rests on them: the grid
    covers exactly the chunks, each request's chunks are the rows
    ``o_indptr[r]:o_indptr[r+1]`` in order, the launch order is a
    permutation, the head split multiplies out and ``needs_merge`` says
    whether any request splits. Raises :class:`PlanMismatchError` naming the
    first field that disagrees."""
    if plan in _SOUND:
        return
    from ._configs import HEADS_PER_CTA

    def bad(what: str):
        raise PlanMismatchError(f"inconsistent DecodePlan: {what}; build plans with plan_decode "
                                "(a plan edited with dataclasses.replace must keep its fields consistent)")

    B, n, hg = int(plan.batch_size), int(plan.num_chunks), int(plan.heads_groups)
    if not (B >= 1 and n >= B and plan.num_kv_heads >= 1 and plan.head_dim >= 1 and plan.page_size >= 1):
        bad(f"batch_size {B}, num_chunks {n}")
    if (plan.heads_per_cta not in HEADS_PER_CTA or plan.group_size * plan.num_kv_heads != plan.num_qo_heads
            or plan.q_groups * plan.heads_per_cta != plan.group_size or hg != plan.num_kv_heads * plan.q_groups):
        bad(f"heads (qo {plan.num_qo_heads}, kv {plan.num_kv_heads}, group {plan.group_size}, per CTA "
            f"{plan.heads_per_cta}, q_groups {plan.q_groups}, heads_groups {hg}) do not multiply out")
    held = getattr(plan, "ctas_per_sm", None)  # (absent from a plan pickled before the field)
    if not (isinstance(held, (int, np.integer)) and not isinstance(held, bool) and held >= 1):
        bad(f"ctas_per_sm {held!r} is not a positive int")
    counts = np.asarray(plan.request_chunks, dtype=np.int64)
    units = n if plan.group_last is None else _check_row_groups(plan, counts, bad)
    if plan.num_ctas != units * hg or tuple(plan.grid) != (units * hg, 1, 1):
        bad(f"grid {plan.grid} / num_ctas {plan.num_ctas} is not units * heads_groups = {units * hg}")
    o = np.asarray(plan.o_indptr, dtype=np.int64)
    if counts.shape != (B,) or counts.min(initial=1) < 1 or o.shape != (B + 1,) or o[0] != 0 \
            or not np.array_equal(np.diff(o), counts) or o[-1] != n:
        bad("o_indptr is not the running sum of request_chunks ending at num_chunks")
    req = np.repeat(np.arange(B), counts)
    if not (np.array_equal(plan.chunk_request, req)
            and np.array_equal(plan.chunk_index, np.arange(n) - o[:-1].repeat(counts))):
        bad("chunk_request / chunk_index do not enumerate each request's chunks in order")
    order = np.asarray(plan.launch_order, dtype=np.int64)
    if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
        bad("launch_order is not a permutation of the chunks")
    pages = np.asarray(plan.request_chunk_pages, dtype=np.int64)
    if pages.shape != (B,) or pages.min(initial=1) < 1 or int(pages.max(initial=1)) > plan.pages_per_chunk:
        bad("request_chunk_pages must be in [1, pages_per_chunk]")
    if bool(plan.needs_merge) != bool((counts > 1).any()):
        bad(f"needs_merge={plan.needs_merge} but {'some' if (counts > 1).any() else 'no'} request has several chunks")
    _SOUND.add(plan)


def _check_row_groups(plan, counts: np.ndarray, bad) -> int:
    """The units of a plan with row groups (the chunks of each group's first
    row), after checking ``group_last``: every row's group ends at or after
    it and before the batch's end, groups are runs of consecutive rows of at
    most MAX_Q_LEN, and a group's rows share one split (the kernel reads
    every row's chunk count from the first)."""
    from .page_table import MAX_Q_LEN
    from .plan import group_leaders

    last = np.asarray(plan.group_last, dtype=np.int64)
    B = int(plan.batch_size)
    rows = np.arange(B)
    if last.shape != (B,) or (last < rows).any() or (last >= B).any() or (last[last] != last).any() \
            or (np.diff(last) < 0).any() or (last - rows >= MAX_Q_LEN).any():
        bad(f"group_last is not runs of at most {MAX_Q_LEN} consecutive rows")
    lead = group_leaders(last)
    first = np.maximum.accumulate(np.where(lead, rows, 0))  # each row's group's first row
    pages = np.asarray(plan.request_chunk_pages, dtype=np.int64)
    if counts.shape != (B,) or pages.shape != (B,) or not (
            np.array_equal(counts, counts[first]) and np.array_equal(pages, pages[first])):
        bad("the rows of a row group do not share one split (request_chunks, request_chunk_pages)")
    return int(counts[lead].sum())


def plan_mismatch_reason(plan, table, limit: int = 3) -> str:
    """What makes ``plan`` unfit for ``table`` (``plan.matches(table)`` is
    false), for the message of a :class:`~cupaged.errors.PlanMismatchError`:
    the batch size or page size that changed, else each request (up to
    ``limit``) whose chunk count at ``plan.pages_per_chunk`` changed, with its
    page counts. Reads only public attributes (``batch_size``, ``page_size``,
    ``pages_per_chunk``, ``request_chunks``; ``table.request_pages``).

    >>> import numpy as np, cupaged
    >>> plan = cupaged.plan_decode(cupaged.PageTable.from_seq_lens([700, 33], 16), 32, 8, 128,
    ...                            np.float16, pages_per_chunk=4)
    >>> plan_mismatch_reason(plan, cupaged.PageTable.from_seq_lens([705, 33], 16))
    'request 0: chunk count 11 -> 12 (45 pages at pages_per_chunk=4)'
    >>> plan_mismatch_reason(plan, cupaged.PageTable.from_seq_lens([700, 33, 1], 16))
    'batch size 2 -> 3'
    >>> plan_mismatch_reason(plan, cupaged.PageTable.from_seq_lens([700, 33], 32))
    'page size 16 -> 32'
    """
    batch, page_size = int(table.batch_size), int(table.page_size)
    if batch != plan.batch_size:
        return f"batch size {plan.batch_size} -> {batch}"
    if page_size != plan.page_size:
        return f"page size {plan.page_size} -> {page_size}"
    c = int(plan.pages_per_chunk)
    pages = np.asarray(table.request_pages, dtype=np.int64)
    if getattr(plan, "group_last", None) is not None:
        from .plan import rows_form_groups

        if not rows_form_groups(table, plan.group_last):
            return ("the plan's row groups are not runs of one request's consecutive query tokens in this "
                    "table (a plan made with qo_indptr serves table.query_rows(qo_indptr))")
        pages = pages[plan.group_last]
    chunks = np.maximum(1, -(-pages // c))
    old = np.asarray(plan.request_chunks, dtype=np.int64)
    changed = np.flatnonzero(chunks != old)
    if changed.size == 0:
        return "the plan does not match the table"  # (matches() said so; nothing found here)
    parts = [f"request {i}: chunk count {old[i]} -> {chunks[i]} ({pages[i]} pages at pages_per_chunk={c})"
             for i in changed[:limit].tolist()]
    more = f"; and {changed.size - limit} more request(s)" if changed.size > limit else ""
    return "; ".join(parts) + more


def _owner(indptr: np.ndarray, k: int) -> int:
    """The request whose slice of ``indices`` holds entry ``k`` (host indptr)."""
    return int(np.searchsorted(indptr, k, side="right")) - 1


def check_device_table(table: PageTable, num_pages: int) -> None:
    """Check ``table.device()`` against every rule of the CSR view.

    Re-runs the host checks (:meth:`PageTable.validate`,
    :meth:`PageTable.check_page_ids`), then checks the device arrays: dtype,
    rank, contiguity and length; ``indptr[0] == 0``; ``indptr``
    non-decreasing and ending at ``len(indices)``; every page id in
    ``[0, num_pages)``; per request, the geometry rules of
    :class:`PageTable`; and finally that each array equals the host table's
    (the plan and ``seq_lens`` were derived from those). One device sync.

    Raises :class:`~cupaged.errors.PageTableError` whose message starts with
    ``"table.device()"`` and names the request and the rule.
    """
    table.validate()
    table.check_page_ids(num_pages)
    dev = table.device()
    host = (table.indices, table.indptr, table.last_page_len, table.first_page_offset)
    _check_device_arrays(dev, host)
    found, arrays = _device_verdicts(table, dev, host, num_pages)
    _raise_first(table, num_pages, found, arrays, dev, host)


def _check_device_arrays(dev, host) -> None:
    """Each device array is a contiguous 1-D int32 CuPy array of its host array's shape."""
    import cupy

    for name, d, h in zip(DeviceTable._fields, dev, host):
        if not isinstance(d, cupy.ndarray) or d.dtype != np.int32 or d.ndim != 1 or not d.flags.c_contiguous:
            raise PageTableError(
                f"table.device().{name} must be a contiguous 1-D int32 CuPy array, "
                f"got {type(d).__name__} {getattr(d, 'dtype', '?')} {getattr(d, 'shape', '?')}"
            )
        if d.shape != h.shape:
            raise PageTableError(
                f"table.device().{name} must have the host table's shape {h.shape}, got {d.shape}"
            )


def _device_verdicts(table: PageTable, dev, host, num_pages: int) -> tuple[dict, tuple]:
    """``({rule: first index that breaks it, or -1}, (indices, indptr, last,
    off) as int64 device arrays)``: every rule's mask on the device, one sync."""
    import cupy

    P = table.page_size
    indices, indptr, last, off = arrays = tuple(a.astype(cupy.int64) for a in dev)
    pages = indptr[1:] - indptr[:-1]
    has = pages > 0
    masks = [
        ("indptr_first", indptr[:1] != 0),
        ("indptr_decreasing", pages < 0),
        ("indptr_last", indptr[-1:] != indices.shape[0]),
        ("page_id", (indices < 0) | (indices >= num_pages)),
        ("last", has & ((last < 1) | (last > P))),
        ("off", has & ((off < 0) | (off >= P))),
        ("one_page", (pages == 1) & (off >= last)),
        ("zero_page_off", ~has & (off != 0)),
        ("zero_page_last", ~has & ((last < 0) | (last > P))),
    ]
    for name, d, h in zip(DeviceTable._fields, dev, host):
        masks.append((f"differs_{name}", d != cupy.asarray(h)))
    firsts = [cupy.where(m.any(), m.argmax(), -1) for _, m in masks if m.size]
    verdict = iter(cupy.stack(firsts).get().tolist() if firsts else [])  # the one sync
    return {name: (next(verdict) if m.size else -1) for name, m in masks}, arrays


def _raise_first(table: PageTable, num_pages: int, found: dict, arrays: tuple, dev, host) -> None:
    """Raises the PageTableError of the first rule ``found`` broken (none: returns)."""
    indices, indptr, last, off = arrays
    B, P = table.batch_size, table.page_size

    def value(a, i: int) -> int:
        return int(a[i : i + 1].get()[0])

    prefix = "table.device()"
    if found["indptr_first"] >= 0:
        raise PageTableError(f"{prefix}: indptr[0] must be 0, got {value(indptr, 0)}")
    i = found["indptr_decreasing"]
    if i >= 0:
        raise PageTableError(
            f"{prefix}: request {i}: indptr must be non-decreasing, but "
            f"indptr[{i}]={value(indptr, i)} > indptr[{i + 1}]={value(indptr, i + 1)}"
        )
    if found["indptr_last"] >= 0:
        raise PageTableError(
            f"{prefix}: indptr[-1] must equal len(indices): indptr[-1]={value(indptr, B)}, "
            f"len(indices)={indices.shape[0]}"
        )
    k = found["page_id"]
    if k >= 0:
        raise PageTableError(
            f"{prefix}: request {_owner(table.indptr, k)}: page id {value(indices, k)} at indices[{k}] "
            f"is out of range [0, num_pages={num_pages})"
        )
    rules = {
        "last": lambda i: f"last_page_len must be in [1, page_size={P}] for a request with pages, "
        f"got {value(last, i)}",
        "off": lambda i: f"first_page_offset must be in [0, page_size={P}), got {value(off, i)}",
        "one_page": lambda i: "a one-page request needs first_page_offset < last_page_len, got "
        f"first_page_offset={value(off, i)}, last_page_len={value(last, i)}",
        "zero_page_off": lambda i: f"a zero-page request needs first_page_offset == 0, got {value(off, i)}",
        "zero_page_last": lambda i: f"a zero-page request needs last_page_len in [0, page_size={P}], "
        f"got {value(last, i)}",
    }
    hits = [(found[r], n, r) for n, r in enumerate(rules) if found[r] >= 0]
    if hits:
        i, _, r = min(hits)  # the lowest request; rules in the order above break ties
        raise PageTableError(f"{prefix}: request {i}: {rules[r](i)}")
    for name, d, h in zip(DeviceTable._fields, dev, host):
        k = found[f"differs_{name}"]
        if k >= 0:
            where = f"request {_owner(table.indptr, k)}" if name == "indices" else (
                f"request {min(k, B - 1) if name == 'indptr' else k}")
            raise PageTableError(
                f"{prefix}: {where}: {name}[{k}] = {value(d, k)} differs from the host table's {int(h[k])}; "
                "the device copy was written after the table was built"
            )


def check_out_overlap(out) -> None:
    """Raise :class:`~cupaged.errors.LayoutError` when elements of ``out``
    may share memory (e.g. a ``broadcast_to`` view): sorted by stride, each
    dimension of size > 1 must step past the whole extent of the smaller
    ones. Conservative: an exotic interleaved but disjoint layout is refused
    too (this runs only with ``validate=True``)."""
    dims = sorted((abs(s), n) for s, n in zip(out.strides, out.shape) if n > 1)
    extent = out.itemsize  # bytes spanned by one element
    for stride, n in dims:
        if stride < extent:
            raise LayoutError(
                f"out's elements overlap (shape {out.shape}, strides {out.strides}): several "
                "outputs would be written to one address; pass a C-contiguous out"
            )
        extent = stride * (n - 1) + extent


def positive_int(value: Any, name: str) -> int:
    """``value`` as a Python int >= 1, else InvalidArgumentError naming ``name``
    (plan_decode's and plan_cascade's sizes)."""
    if type(value) is int and value >= 1:  # the common case, without the ABC checks
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    value = int(value)
    if value < 1:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value}")
    return value
