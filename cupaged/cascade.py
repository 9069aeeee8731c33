"""Cascade decode: requests that share a prefix read its pages once per group.

A decode batch often holds requests that share a long prefix (a system prompt,
a few-shot preamble, parallel samples of one prompt). Plain :func:`decode`
reads the shared pages once per request. Cascade decode splits every
request's keys into two **levels**:

1. the **shared prefix** of its group, read once for all query heads of all
   the group's requests;
2. its own **unique suffix**, read by a plain decode of the batch;

and combines the two attention states per request and head with the
variable-length merge kernel (the ``merge_states`` math: the LSE-weighted
average, closed form in log2 units). Softmax over the concatenation equals the
merge of the softmaxes over the parts, so the result is the decode of the
concatenated keys.

**The one-pass trick.** With GQA group ``g = Hq // Hkv``, a group of ``n``
requests has ``n * g`` query heads per KV head. They are reordered into one
*pseudo-request* whose GQA group is ``n * g``:
``qq[0, kvh * (n*g) + r*g + i] = q[r, kvh*g + i]``. One :func:`decode` of that
pseudo-request over the prefix pages makes every CTA of the split-KV partial
kernel read each prefix page once for up to ``MAX_HEADS_PER_CTA`` (8) query
heads: the prefix of a KV head is read ``ceil(n*g / 8)`` times, not ``n``
times with ``g`` heads each. When ``n*g`` has no divisor near 8 (a prime such
as 11), the pseudo-request is padded to a multiple of 8 heads (the padded
heads repeat a real query and their output is dropped; see
:func:`pseudo_group_size`). Groups whose pseudo-requests have the same padded
head count share one decode launch (a :class:`PrefixPass`); usually there is
one group, so one pass.

**Rounding.** :func:`decode` writes its output in q's dtype, so each level is
rounded once to q's dtype before the float32 merge, which rounds again when it
writes q's dtype. The merged output is a convex combination of the two rounded
levels, so for float16/bfloat16 this adds at most half an ulp of q's dtype
(relative to the levels' magnitude) to a plain decode's error, well inside
the 2e-2 relative tolerance the tests use; float32 is unaffected. The LSEs
stay float32 throughout. (A float32 output of ``decode``, or its split-KV
partial states, would remove the extra rounding.)

Everything here is host NumPy except :func:`cascade_decode` (CuPy, lazily).
"""

from __future__ import annotations

import dataclasses
import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np

from . import _configs
from ._typing import DeviceArray, HostArray, IndexArray, Scale
from .errors import (ArgumentTypeError, DTypeError, InvalidArgumentError, LayoutError,
                     PlanMismatchError, ShapeError, UnsupportedConfigError)
from ._checks import KV_LAYOUTS, check_out, dtype_variant
from ._validate import positive_int
from .page_table import PageTable
from .plan import MAX_HEADS_PER_CTA, DecodePlan, heads_per_cta, plan_decode

__all__ = ["CascadePlan", "PrefixPass", "cascade_decode", "plan_cascade", "pseudo_group_size"]


# --------------------------------------------------------------------------- heuristic
def pseudo_group_size(heads: int) -> int:
    """Query heads per KV head of a prefix pseudo-request serving ``heads``
    (``n * g``) real ones: ``heads`` itself when the partial kernel already
    splits it into the fewest possible q-head groups (``ceil(heads / 8)``),
    else ``heads`` rounded up to a multiple of ``MAX_HEADS_PER_CTA`` (8).

    Each q-head group is one CTA per chunk and KV head, and each CTA reads the
    prefix pages once, so fewer groups means fewer reads; a padded head costs
    a little arithmetic and no extra bytes.

    >>> [pseudo_group_size(h) for h in (1, 4, 7, 8, 12, 16, 256)]  # already minimal
    [1, 4, 7, 8, 12, 16, 256]
    >>> pseudo_group_size(11), pseudo_group_size(9), pseudo_group_size(20)  # 11 CTAs -> 2, 3 -> 2, 4 -> 3
    (16, 16, 24)
    """
    h = positive_int(heads, "heads")
    fewest = -(-h // MAX_HEADS_PER_CTA)
    if h // heads_per_cta(h) <= fewest:
        return h
    return fewest * MAX_HEADS_PER_CTA


# ------------------------------------------------------------------------------ checks
def _check_tables(shared_table: Any, unique_table: Any) -> None:
    for name, table in (("shared_table", shared_table), ("unique_table", unique_table)):
        if not isinstance(table, PageTable):
            raise ArgumentTypeError(f"{name} must be a cupaged.PageTable, got {type(table).__name__}")
    if shared_table.page_size != unique_table.page_size:
        raise ShapeError(
            f"shared_table.page_size ({shared_table.page_size}) must equal unique_table.page_size "
            f"({unique_table.page_size}): both index one KV cache"
        )


def _group_indptr(group_indptr: Any, num_groups: int, batch: int) -> np.ndarray:
    """``group_indptr`` as a checked int64 host array ``[G+1]``."""
    if hasattr(group_indptr, "get") and not isinstance(group_indptr, np.ndarray):
        raise ArgumentTypeError(
            "group_indptr must be a host array (NumPy or a sequence of ints), not a device array: "
            "plan_cascade reads it on the host"
        )
    try:
        arr = np.asarray(group_indptr)
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError(f"group_indptr must be a 1-D integer array: {e}") from None
    if arr.ndim != 1:
        raise ShapeError(f"group_indptr must be 1-D [G+1], got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise DTypeError(f"group_indptr must hold integers, got dtype {arr.dtype}")
    if arr.shape[0] != num_groups + 1:
        raise ShapeError(
            f"group_indptr must have G+1 = {num_groups + 1} entries (shared_table.batch_size = {num_groups} "
            f"prefix groups), got {arr.shape[0]}"
        )
    arr = arr.astype(np.int64)
    if arr[0] != 0:
        raise InvalidArgumentError(f"group_indptr must start at 0, got group_indptr[0]={int(arr[0])}")
    sizes = np.diff(arr)
    bad = np.flatnonzero(sizes < 1)
    if bad.size:
        j = int(bad[0])
        raise InvalidArgumentError(
            f"group {j}: group_indptr must increase strictly (every group holds at least one request), "
            f"got group_indptr[{j}]={int(arr[j])}, group_indptr[{j + 1}]={int(arr[j + 1])}"
        )
    if arr[-1] != batch:
        raise InvalidArgumentError(
            f"group_indptr must end at B = {batch} (unique_table.batch_size; every request in exactly one "
            f"group), got group_indptr[-1]={int(arr[-1])}"
        )
    return arr


def _readonly(a: Any, dtype=np.int32) -> np.ndarray:
    out = np.array(a, dtype=dtype, copy=True, order="C")
    out.flags.writeable = False
    return out


def _select_requests(table: PageTable, rows: np.ndarray) -> PageTable:
    """A table of ``table``'s requests ``rows`` (in that order)."""
    rows = np.asarray(rows, dtype=np.int64)
    indptr = table.indptr.astype(np.int64)
    starts, counts = indptr[rows], indptr[rows + 1] - indptr[rows]
    new_indptr = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=new_indptr[1:])
    src = np.repeat(starts - new_indptr[:-1], counts) + np.arange(int(new_indptr[-1]), dtype=np.int64)
    return PageTable(
        table.indices[src].astype(np.int32), new_indptr.astype(np.int32),
        table.last_page_len[rows].astype(np.int32), table.first_page_offset[rows].astype(np.int32),
        page_size=table.page_size,
    )


# -------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True, eq=False)
class PrefixPass:
    """One decode launch over shared prefixes: the groups whose
    pseudo-requests have ``heads_per_kv_head`` query heads per KV head.

    Fields:

    * ``groups``: read-only int32 ``[m]``, the prefix groups (rows of
      ``shared_table``) this pass decodes, in order; pseudo-request ``t`` is
      group ``groups[t]``.
    * ``heads_per_kv_head``: ``G' = pseudo_group_size(n * g)`` (every group
      here has the same ``G'``); the pass's query is ``[m, Hkv * G', D]``.
    * ``plan``: the :class:`~cupaged.DecodePlan` of that query over
      ``CascadePlan.prefix_tables(shared_table)[k]``.
    * ``row_offset``, ``num_rows``: the pass's rows (``m * Hkv * G'`` query
      heads) in the cascade's level buffer.
    """

    groups: np.ndarray = dataclasses.field(repr=False)
    heads_per_kv_head: int
    plan: DecodePlan = dataclasses.field(repr=False)
    row_offset: int
    num_rows: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", _readonly(self.groups))


_ARRAY_FIELDS = ("group_indptr", "request_group", "prefix_nonempty", "q_index", "state_index", "o_indptr")


@dataclasses.dataclass(frozen=True, eq=False)
class CascadePlan:
    """Plain frozen description of one cascade decode, built by
    :func:`plan_cascade` on the host and reused across decode steps while
    :meth:`matches` holds. Compares and hashes by identity.

    Fields:

    * ``batch_size`` (``B``), ``num_groups`` (``G``), ``num_qo_heads``,
      ``num_kv_heads``, ``head_dim``, ``page_size``, ``dtype`` (q/out),
      ``kv_dtype`` (the cache), ``group_size`` (GQA ``g = Hq // Hkv``).
    * ``group_indptr`` int32 ``[G+1]``; ``request_group`` int32 ``[B]`` (the
      group of each request); ``prefix_nonempty`` bool ``[G]`` (the group's
      shared request has pages; an empty prefix is not decoded at all).
    * ``prefix_passes``: tuple of :class:`PrefixPass`, one decode launch each.
    * ``suffix_plan``: the :class:`~cupaged.DecodePlan` of q over
      ``unique_table``.
    * ``prefix_rows`` (``R``): query heads of all passes; the level buffer
      has ``R + B * Hq`` rows of ``D`` (the passes' outputs, then the suffix
      output ``[B, Hq, D]`` flattened).
    * ``q_index`` int32 ``[R]``: row of ``q.reshape(B * Hq, D)`` each
      pseudo-query head copies.
    * ``num_states`` (``N``): merge inputs, one per request with a prefix
      plus one per request; ``state_index`` int32 ``[N * Hq]``: the level
      buffer row of each merge input head; ``o_indptr`` int32 ``[B+1]``:
      request ``b`` merges states ``o_indptr[b]:o_indptr[b+1]`` (its prefix
      state, when it has one, then its suffix state).

    Methods: :meth:`matches` and :meth:`prefix_tables`.

    Example: a group of 3 requests and a group of 1 (GQA 4, so 12 and 4 query
    heads per KV head: two passes), the single request without a prefix:

    >>> import numpy as np
    >>> import cupaged
    >>> shared = cupaged.PageTable.from_seq_lens([100, 0], 16)
    >>> unique = cupaged.PageTable.from_seq_lens([5, 7, 0, 9], 16)
    >>> plan = cupaged.plan_cascade(shared, unique, [0, 3, 4], 32, 8, 128, np.float16)
    >>> [p.heads_per_kv_head for p in plan.prefix_passes], plan.prefix_nonempty.tolist()
    ([12], [True, False])
    >>> plan.o_indptr.tolist(), plan.num_states
    ([0, 2, 4, 6, 7], 7)
    >>> plan.matches(shared, cupaged.PageTable.from_seq_lens([6, 8, 1, 10], 16), [0, 3, 4])  # next step
    True
    """

    batch_size: int
    num_groups: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: np.dtype
    kv_dtype: np.dtype
    group_size: int
    group_indptr: np.ndarray = dataclasses.field(repr=False)
    request_group: np.ndarray = dataclasses.field(repr=False)
    prefix_nonempty: np.ndarray = dataclasses.field(repr=False)
    prefix_passes: tuple = dataclasses.field(repr=False)
    suffix_plan: DecodePlan = dataclasses.field(repr=False)
    prefix_rows: int
    q_index: np.ndarray = dataclasses.field(repr=False)
    num_states: int
    state_index: np.ndarray = dataclasses.field(repr=False)
    o_indptr: np.ndarray = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        for name in _ARRAY_FIELDS:
            dtype = bool if name == "prefix_nonempty" else np.int32
            object.__setattr__(self, name, _readonly(getattr(self, name), dtype))
        object.__setattr__(self, "prefix_passes", tuple(self.prefix_passes))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "kv_dtype", np.dtype(self.kv_dtype))

    # -- reuse across decode steps -----------------------------------------
    def matches(self, shared_table: Any, unique_table: Any, group_indptr: Any) -> bool:
        """True when this plan can serve these tables: the same groups
        (``group_indptr``), batch and page size, the same groups with an empty
        prefix, and every decode's requests keep their chunk counts (see
        :meth:`DecodePlan.matches <cupaged.DecodePlan.matches>`). Cheap: host
        comparisons over ``G`` and ``B``."""
        if not (isinstance(shared_table, PageTable) and isinstance(unique_table, PageTable)):
            return False
        try:
            gi = np.asarray(group_indptr)
        except (TypeError, ValueError):
            return False
        if gi.shape != self.group_indptr.shape or not np.array_equal(gi, self.group_indptr):
            return False
        return self._matches_shared(shared_table) and self.suffix_plan.matches(unique_table)

    def _matches_shared(self, shared_table: PageTable) -> bool:
        if shared_table.batch_size != self.num_groups or shared_table.page_size != self.page_size:
            return False
        pages = shared_table.request_pages
        if not np.array_equal(pages > 0, self.prefix_nonempty):
            return False
        for p in self.prefix_passes:
            view = SimpleNamespace(batch_size=int(p.groups.shape[0]), page_size=self.page_size,
                                   request_pages=pages[p.groups])
            if not p.plan.matches(view):
                return False
        return True

    def prefix_tables(self, shared_table: PageTable) -> tuple:
        """The page table each prefix pass decodes: one :class:`PageTable` per
        entry of ``prefix_passes``, holding ``shared_table``'s requests
        ``groups`` in order (``shared_table`` itself when a pass covers every
        group in order).

        Raises :class:`~cupaged.errors.PlanMismatchError` when the plan does
        not fit ``shared_table`` (group count, page size, which prefixes are
        empty, a chunk count)."""
        if not isinstance(shared_table, PageTable) or not self._matches_shared(shared_table):
            raise PlanMismatchError(
                "plan does not match shared_table (group count, page size, which prefixes are empty or a "
                "prefix's chunk count changed); build a new plan with plan_cascade"
            )
        every = np.arange(self.num_groups, dtype=np.int32)
        return tuple(
            shared_table if np.array_equal(p.groups, every) else _select_requests(shared_table, p.groups)
            for p in self.prefix_passes
        )


def plan_cascade(shared_table: PageTable, unique_table: PageTable, group_indptr: HostArray, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: Any, *, kv_dtype: Any = None) -> CascadePlan:
    """Plan a cascade decode on the host (NumPy; no GPU needed).

    Args:
        shared_table: :class:`~cupaged.PageTable` of ``G`` requests, request
            ``j`` being the shared prefix of group ``j`` (zero pages: the
            group has no shared prefix). A prefix may start and end mid-page.
        unique_table: :class:`~cupaged.PageTable` of the ``B`` requests'
            own suffixes, in q's batch order (a suffix may be empty). Same
            ``page_size`` as ``shared_table`` (one cache).
        group_indptr: host integer array ``[G+1]`` (NumPy or a sequence):
            requests ``group_indptr[j]:group_indptr[j+1]`` (contiguous in the
            batch) share prefix ``j``; starts at 0, strictly increasing (no
            empty group), ends at ``B``. A group of one is allowed.
        num_qo_heads, num_kv_heads: ``Hq`` and ``Hkv`` (``Hq % Hkv == 0``).
        head_dim: ``D``; the merge kernel serves 64, 80, 96, 128, 192 and 256.
        dtype: q/out dtype (float16, bfloat16 or float32).
        kv_dtype: keyword-only cache dtype, default ``dtype``; forwarded to
            :func:`~cupaged.plan_decode`.

    Returns:
        A :class:`CascadePlan`: one :class:`PrefixPass` per distinct
        pseudo-request head count ``pseudo_group_size(n_j * g)`` among groups
        with a non-empty prefix (each a :func:`~cupaged.plan_decode` plan of
        its pseudo-batch), the suffix plan, and the merge index arrays.

    Raises:
        ArgumentTypeError [TypeError] (a table that is not a PageTable; a
        device ``group_indptr``), ShapeError (page sizes that differ;
        ``group_indptr`` not ``[G+1]``; heads not divisible), DTypeError
        (``group_indptr`` not integers), InvalidArgumentError (``B == 0``; a
        head count not a positive integer; ``group_indptr`` not starting at
        0, with an empty group, or not ending at ``B``),
        UnsupportedConfigError (``head_dim`` without a merge kernel); every
        ValueError of :func:`~cupaged.plan_decode` (an unsupported dtype
        pair, a grid beyond CUDA's limits).

    Example: 64 requests sharing a 32768-token prefix, 256 tokens each of
    their own; one pass whose pseudo-request has 64 * 4 = 256 query heads per
    KV head (32 CTAs of 8 heads per KV head and chunk):

    >>> import numpy as np
    >>> import cupaged
    >>> shared = cupaged.PageTable.from_seq_lens([32768], 16)
    >>> unique = cupaged.PageTable.from_seq_lens([256] * 64, 16, page_ids=np.arange(2048, 3072))
    >>> plan = cupaged.plan_cascade(shared, unique, [0, 64], 32, 8, 128, np.float16)
    >>> (p,) = plan.prefix_passes
    >>> p.heads_per_kv_head, p.plan.num_qo_heads, p.plan.q_groups, plan.num_states
    (256, 2048, 32, 128)
    """
    _check_tables(shared_table, unique_table)
    hq = positive_int(num_qo_heads, "num_qo_heads")
    hkv = positive_int(num_kv_heads, "num_kv_heads")
    if hq % hkv:
        raise ShapeError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    d = positive_int(head_dim, "head_dim")
    if d not in _configs.HEAD_DIMS:
        raise UnsupportedConfigError(
            f"head_dim {d} has no merge kernel; cascade_decode supports head_dim "
            f"{', '.join(map(str, _configs.HEAD_DIMS))}"
        )
    batch = unique_table.batch_size
    if batch < 1:
        raise InvalidArgumentError("unique_table has batch size 0: there is nothing to plan")
    num_groups = shared_table.batch_size
    gi = _group_indptr(group_indptr, num_groups, batch)
    g = hq // hkv
    sizes = np.diff(gi)
    nonempty = shared_table.request_pages > 0
    plan_kw = {} if kv_dtype is None else {"kv_dtype": kv_dtype}

    suffix_plan = plan_decode(unique_table, hq, hkv, d, dtype, **plan_kw)
    # group the non-empty prefixes by pseudo-request head count, in first-seen order
    buckets: dict[int, list[int]] = {}
    for j in np.flatnonzero(nonempty):
        buckets.setdefault(pseudo_group_size(int(sizes[j]) * g), []).append(int(j))

    passes, q_index, prefix_row = [], [], np.full((batch, hq), -1, dtype=np.int64)
    offset = 0
    for gp, groups in buckets.items():
        m = len(groups)
        # pseudo-request t, kv head kvh, slot x: row offset + (t*Hkv + kvh)*G' + x
        t, kvh, x = np.meshgrid(np.arange(m), np.arange(hkv), np.arange(gp), indexing="ij")
        first = gi[np.asarray(groups)][t]
        n = sizes[np.asarray(groups)][t]
        real = x < n * g
        r, i = np.where(real, x // g, 0), np.where(real, x % g, 0)
        # a padded slot repeats the group's first query of that kv head (its output is dropped)
        q_index.append(((first + r) * hq + kvh * g + i).reshape(-1))
        rows = offset + np.arange(m * hkv * gp, dtype=np.int64).reshape(m, hkv, gp)
        prefix_row[(first + r)[real], (kvh * g + i)[real]] = rows[real]
        sub = _select_requests(shared_table, np.asarray(groups))
        pplan = plan_decode(sub, hkv * gp, hkv, d, dtype, **plan_kw)
        passes.append(PrefixPass(np.asarray(groups), gp, pplan, offset, m * hkv * gp))
        offset += m * hkv * gp

    request_group = np.repeat(np.arange(num_groups), sizes)
    o_indptr, states = _merge_states(nonempty[request_group], prefix_row, offset, hq)
    kv = getattr(suffix_plan, "kv_dtype", suffix_plan.dtype)
    return CascadePlan(
        batch_size=batch, num_groups=num_groups, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
        page_size=shared_table.page_size, dtype=suffix_plan.dtype, kv_dtype=kv, group_size=g,
        group_indptr=gi, request_group=request_group, prefix_nonempty=nonempty,
        prefix_passes=tuple(passes), suffix_plan=suffix_plan, prefix_rows=offset,
        q_index=np.concatenate(q_index) if q_index else np.zeros(0, np.int64),
        num_states=int(o_indptr[-1]), state_index=states.reshape(-1), o_indptr=o_indptr,
    )


def _merge_states(has_prefix: np.ndarray, prefix_row: np.ndarray, suffix_offset: int,
                  hq: int) -> tuple[np.ndarray, np.ndarray]:
    """The merge's ``(o_indptr, states [M, Hq])``: request ``b``'s states are
    its prefix row (where it has a prefix, from ``prefix_row [B, Hq]``) then
    its suffix row (``suffix_offset`` on, one row per request and head)."""
    batch = has_prefix.shape[0]
    o_indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(1 + has_prefix.astype(np.int64), out=o_indptr[1:])
    states = np.empty((int(o_indptr[-1]), hq), dtype=np.int64)
    states[o_indptr[1:] - 1] = suffix_offset + np.arange(batch * hq, dtype=np.int64).reshape(batch, hq)
    states[o_indptr[:-1][has_prefix]] = prefix_row[has_prefix]  # the last state of a request is its suffix
    return o_indptr, states


# ------------------------------------------------------------------------- launch state
_UINT = {2: np.uint16, 4: np.uint32}


class _CascadeBuffers:
    """Per-plan device state, made on the plan's first call: the index
    arrays, the pseudo-query and level buffers, the float32 merge inputs, and
    the prefix tables of the last ``shared_table`` (tables are immutable)."""

    def __init__(self, plan: CascadePlan):
        import cupy

        rows = plan.prefix_rows + plan.batch_size * plan.num_qo_heads
        d, n = plan.head_dim, plan.num_states * plan.num_qo_heads
        # int64 on the device: cupy.take would cast narrower indices on every call
        self.q_index = cupy.asarray(plan.q_index, dtype=cupy.int64)
        self.state_index = cupy.asarray(plan.state_index, dtype=cupy.int64)
        self.o_indptr = cupy.asarray(plan.o_indptr)
        self.pseudo_q = cupy.empty((plan.prefix_rows, d), dtype=plan.dtype)
        self.level_out = cupy.empty((rows, d), dtype=plan.dtype)
        self.level_lse = cupy.empty(rows, dtype=cupy.float32)
        self.gathered = cupy.empty((n, d), dtype=plan.dtype)
        self.states_v = cupy.empty((plan.num_states, plan.num_qo_heads, d), dtype=cupy.float32)
        self.states_lse = cupy.empty((plan.num_states, plan.num_qo_heads), dtype=cupy.float32)
        self.shared = None  # weakref to the shared_table the prefix tables came from
        self.tables = ()
        self.checked = None  # (weakref shared_table, weakref unique_table) of the last call

    def prefix_tables(self, plan: CascadePlan, shared_table: PageTable) -> tuple:
        if self.shared is None or self.shared() is not shared_table:
            self.tables = plan.prefix_tables(shared_table)
            self.shared = weakref.ref(shared_table)
        return self.tables


_buffers: "weakref.WeakKeyDictionary[CascadePlan, _CascadeBuffers]" = weakref.WeakKeyDictionary()


def _uint_view(a):
    """The same bytes as unsigned ints of the same width (a pure copy needs no
    float arithmetic, bfloat16 included)."""
    return a.view(_UINT[a.itemsize])


# -------------------------------------------------------------------------------- entry
def cascade_decode(q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, shared_table: PageTable,
                   unique_table: PageTable, group_indptr: IndexArray,
                   plan: CascadePlan | None = None, *, sm_scale: float | None = None,
                   logits_soft_cap: float | None = None, k_scale: Scale = None, v_scale: Scale = None,
                   kv_layout: str = "NHD", out: DeviceArray | None = None, return_lse: bool = False):
    """Decode of requests that share prefixes: each group's prefix pages are
    read once for all its requests' query heads, each request's suffix by a
    plain decode, and the two levels merged.

    Request ``b`` of group ``j`` attends over the visible tokens of
    ``shared_table``'s request ``j`` followed by those of ``unique_table``'s
    request ``b``; the result equals :func:`~cupaged.decode` over that
    concatenation (up to rounding: each level is rounded to q's dtype before
    the float32 merge, see the module docstring).

    Args:
        q: ``[B, Hq, D]`` CuPy array, float16, bfloat16 or float32.
        k_cache, v_cache: the paged cache both tables index, as for
            :func:`~cupaged.decode`: ``[num_pages, P, Hkv, D]`` ("NHD") or
            ``[num_pages, Hkv, P, D]`` (``kv_layout="HND"``).
        shared_table, unique_table, group_indptr: as for
            :func:`plan_cascade` (``G`` prefixes, ``B`` suffixes, host
            ``[G+1]``).
        plan: a :class:`CascadePlan` from :func:`plan_cascade` for these
            tables and shapes, reused while ``plan.matches(...)``; built here
            when None (a host cost every call). A plan owns device buffers:
            order the calls that share a plan on one stream, and make the
            first call with a plan (it uploads the index arrays and prefix
            tables) before capturing a CUDA graph.
        sm_scale, logits_soft_cap, k_scale, v_scale, kv_layout: forwarded
            unchanged to both levels' :func:`~cupaged.decode` calls.
        out: optional ``[B, Hq, D]`` array of q's dtype, head_dim contiguous;
            written by the merge kernel.
        return_lse: also return the LSE, float32 ``[B, Hq]``, **log2 units**
            (natural log = lse * ln 2), of the whole concatenation.

    Returns:
        ``out`` (``[B, Hq, D]``, q's dtype), or ``(out, lse)``. A request
        with an empty prefix and an empty suffix gets zeros and LSE -inf.
        ``B == 0`` (with no plan) launches nothing.

    Launches: one gather of the pseudo-queries, one decode per prefix pass,
    one decode of the suffixes, the gather and float32 cast of the level
    states, and one merge.

    Raises:
        NoGPUError [RuntimeError] (no CUDA device; checked first),
        ArgumentTypeError (an input not a CuPy/CUDA array; a table not a
        PageTable; ``plan`` not a CascadePlan), ShapeError (``q`` not 3-D,
        caches not 4-D, ``unique_table`` not of q's batch, ``group_indptr``
        not ``[G+1]``, ``out`` of another shape), DTypeError, LayoutError (an
        unknown ``kv_layout``; ``out``'s head_dim not contiguous),
        InvalidArgumentError (a malformed ``group_indptr``),
        UnsupportedConfigError (``D`` without a merge kernel),
        PlanMismatchError (a plan for other heads, head_dim or dtype, or a
        stale one), and everything :func:`~cupaged.decode` raises for either
        level.

    Example (needs a GPU)::

        shared = cupaged.PageTable.from_seq_lens([1000], 16)                    # pages 0..62
        unique = cupaged.PageTable.from_seq_lens([5, 20, 0], 16, page_ids=range(63, 66))
        k = cupy.random.standard_normal((66, 16, 8, 128), dtype=cupy.float32).astype(cupy.float16)
        v = cupy.random.standard_normal((66, 16, 8, 128), dtype=cupy.float32).astype(cupy.float16)
        q = cupy.random.standard_normal((3, 32, 128), dtype=cupy.float32).astype(cupy.float16)
        plan = cupaged.plan_cascade(shared, unique, [0, 3], 32, 8, 128, numpy.float16)
        out, lse = cupaged.cascade_decode(q, k, v, shared, unique, [0, 3], plan, return_lse=True)
    """
    from ._device import require_gpu

    require_gpu("cupaged.cascade_decode")
    import cupy

    from ._arrays import as_cupy as _as_cupy
    from .decode import decode
    from .merge import launch_merge

    q, k_cache, v_cache = _as_cupy(q, "q"), _as_cupy(k_cache, "k_cache"), _as_cupy(v_cache, "v_cache")
    batch, hq, d, hkv = _check_call(q, k_cache, v_cache, shared_table, unique_table, kv_layout)
    kw = {"sm_scale": sm_scale, "logits_soft_cap": logits_soft_cap, "k_scale": k_scale, "v_scale": v_scale,
          "kv_layout": kv_layout}
    if plan is None:
        if batch == 0:
            _group_indptr(group_indptr, shared_table.batch_size, 0)
            out = cupy.empty(q.shape, dtype=q.dtype) if out is None else check_out(out, q)
            lse = cupy.empty((0, hq), dtype=cupy.float32)
            return (out, lse) if return_lse else out
        plan = plan_cascade(shared_table, unique_table, group_indptr, hq, hkv, d, q.dtype,
                            kv_dtype=None if k_cache.dtype == q.dtype else k_cache.dtype)
    else:
        _check_plan(plan, q, k_cache, hkv, shared_table, unique_table, group_indptr)
    out = cupy.empty(q.shape, dtype=q.dtype) if out is None else check_out(out, q)
    lse = cupy.empty((batch, hq), dtype=cupy.float32) if return_lse else None

    buf = _buffers.get(plan)
    if buf is None:
        buf = _buffers[plan] = _CascadeBuffers(plan)
    buf.checked = (weakref.ref(shared_table), weakref.ref(unique_table))
    tables = buf.prefix_tables(plan, shared_table)
    if plan.prefix_rows:
        cupy.take(_uint_view(q.reshape(batch * hq, d)), buf.q_index, axis=0, out=_uint_view(buf.pseudo_q))
    for p, table in zip(plan.prefix_passes, tables):
        rows = slice(p.row_offset, p.row_offset + p.num_rows)
        shape = (p.groups.shape[0], hkv * p.heads_per_kv_head, d)
        _, level_lse = decode(buf.pseudo_q[rows].reshape(shape), k_cache, v_cache, table, p.plan,
                              out=buf.level_out[rows].reshape(shape), return_lse=True, **kw)
        buf.level_lse[rows] = level_lse.reshape(-1)
    suffix = slice(plan.prefix_rows, None)
    _, level_lse = decode(q, k_cache, v_cache, unique_table, plan.suffix_plan,
                          out=buf.level_out[suffix].reshape(batch, hq, d), return_lse=True, **kw)
    buf.level_lse[suffix] = level_lse.reshape(-1)

    cupy.take(_uint_view(buf.level_out), buf.state_index, axis=0, out=_uint_view(buf.gathered))
    buf.states_v[...] = buf.gathered.reshape(buf.states_v.shape)  # q's dtype -> float32
    cupy.take(buf.level_lse, buf.state_index, axis=0, out=buf.states_lse.reshape(-1))
    launch_merge(buf.states_v, buf.states_lse, buf.o_indptr, batch, out, lse)
    return (out, lse) if return_lse else out


def _check_call(q, k_cache, v_cache, shared_table, unique_table, kv_layout: str) -> tuple[int, int, int, int]:
    """cascade_decode's argument checks that need no plan; returns (batch,
    num_qo_heads, head_dim, num_kv_heads)."""
    _check_tables(shared_table, unique_table)
    if q.ndim != 3:
        raise ShapeError(f"q must be 3-D [batch, num_qo_heads, head_dim], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ShapeError(f"k_cache must be 4-D (kv_layout {kv_layout!r}), got shape {k_cache.shape}")
    if kv_layout not in KV_LAYOUTS:
        raise LayoutError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    dtype_variant(q.dtype, k_cache.dtype, v_cache.dtype)  # decode's rule and DTypeError
    batch, hq, d = q.shape
    if unique_table.batch_size != batch:
        raise ShapeError(
            f"q's batch (q.shape[0] = {batch}) must equal unique_table.batch_size ({unique_table.batch_size})"
        )
    return batch, hq, d, k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]


def _check_plan(plan, q, k_cache, hkv: int, shared_table, unique_table, group_indptr) -> None:
    if not isinstance(plan, CascadePlan):
        raise ArgumentTypeError(
            f"plan must be a cupaged.CascadePlan from plan_cascade or None, got {type(plan).__name__}"
        )
    _, hq, d = q.shape
    fmt = _configs.stored_format(k_cache.dtype)
    expected = (hq, hkv, d, np.dtype(q.dtype), np.dtype(q.dtype).name if fmt is None else fmt.name)
    got = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.dtype, np.dtype(plan.kv_dtype).name)
    if got != expected:
        raise PlanMismatchError(
            f"plan was built for (num_qo_heads, num_kv_heads, head_dim, dtype, kv_dtype) = {got}, "
            f"the call has {expected}"
        )
    buf = _buffers.get(plan)
    if buf is not None and buf.checked is not None and buf.checked[0]() is shared_table \
            and buf.checked[1]() is unique_table and _same_groups(plan, group_indptr):
        return  # these (immutable) tables matched on an earlier call: skip the chunk-count checks
    if not plan.matches(shared_table, unique_table, group_indptr):
        _group_indptr(group_indptr, shared_table.batch_size, unique_table.batch_size)  # a malformed one says why
        raise PlanMismatchError(
            "stale plan: the groups, a table's batch or page size, which prefixes are empty, or some "
            "request's chunk count changed; build a new one with plan_cascade(...)"
        )


def _same_groups(plan: CascadePlan, group_indptr) -> bool:
    try:
        gi = np.asarray(group_indptr)
    except (TypeError, ValueError):
        return False
    return gi.shape == plan.group_indptr.shape and bool(np.array_equal(gi, plan.group_indptr))
