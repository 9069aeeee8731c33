"""Host-side planning of a split-KV paged-attention decode.

The partial kernel runs one CTA per **(chunk, kv head, q-head group)** triple.
A *chunk* is a run of at most ``pages_per_chunk`` consecutive pages of one
request; every request gets at least one chunk (a zero-page request gets one
empty chunk, so the output keeps exactly one row per request).  The CTA reads
each KV element of its chunk once and serves every query head of its group.

:func:`plan_decode` turns a :class:`~cupaged.page_table.PageTable` into a
:class:`DecodePlan`: plain, frozen, read-only data that the kernels and the
dispatcher read field by field.  A plan can be reused across decode steps as
long as :meth:`DecodePlan.matches` holds for the new table (no request changed
its chunk count, same batch and page size).

Everything here is NumPy on the host; cupy is imported lazily and only to read
the SM count of the current device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import ml_dtypes  # noqa: F401  (registers "bfloat16" with np.dtype)
import numpy as np

from . import _configs, _env, _validate, schedule
from ._validate import positive_int
from .errors import ArgumentTypeError, InvalidArgumentError, PlanMismatchError, ShapeError
from .page_table import PageTable, kernel_table, qo_indptr_array, window_array

__all__ = [
    "MAX_HEADS_PER_CTA",
    "CTAS_PER_SM",
    "DEFAULT_NUM_SMS",
    "MAX_GRID_X",
    "SUPPORTED_DTYPES",
    "FLOAT8_E4M3",
    "SUPPORTED_DTYPE_PAIRS",
    "DETERMINISTIC_CHUNK_TOKENS",
    "deterministic_pages_per_chunk",
    "canonical_kv_dtype",
    "heads_per_cta",
    "default_target_ctas",
    "num_chunks",
    "choose_pages_per_chunk",
    "ctas_per_sm",
    "device_num_sms",
    "resolve_num_sms",
    "resolve_target_ctas",
    "DecodePlan",
    "plan_decode",
]

#: Most query heads one CTA serves (its q-head group).
MAX_HEADS_PER_CTA = max(_configs.HEADS_PER_CTA)
#: CTAs one SM holds at once (the tensor-core kernel: 128 threads and 72 KB of
#: shared memory each, 2 per SM): ``CTAS_PER_SM * num_sms`` CTAs are one wave
#: (the ``target_ctas`` a plan reports). :func:`ctas_per_sm` gives each
#: kernel instance's own count.
CTAS_PER_SM = 2
#: Chunks never drop below MIN_CHUNK_TOKENS tokens (capped at the longest
#: request): shorter ones measured slower everywhere on the H200 but at one
#: request of 1024 tokens (docs/architecture.md "Ragged batches").
MIN_CHUNK_TOKENS = 128
#: SM count used when neither the argument, a device nor the env var gives one
#: (an NVIDIA H200 has 132 SMs).
DEFAULT_NUM_SMS = 132
#: CUDA grid limits.
MAX_GRID_X = 2**31 - 1
#: Row groups of more tokens than one warp's tile holds run on warp pairs
#: (one K/V read for twice the rows) unless a group splits into more chunks
#: than this: then its last CTA's merge of twice the rows outlasts the saving
#: (H200, docs/architecture.md "Warp pairs for q_len 8").
PAIR_MAX_CHUNKS = 4
#: ... except on 8-warp CTAs (family rows8: a default plan held to one CTA
#: per SM): a step whose requests hold at least PAIR_WIDE_MIN_BYTES of KV in
#: chunks of at least PAIR_WIDE_CHUNK_TOKENS keeps its warp pairs at any
#: chunk count on a grid of at least half the SMs (H200, timed at 4 and 8
#: heads per CTA; docs/architecture.md "Warp pairs on eight warps").
PAIR_WIDE_CHUNK_TOKENS = 1024
PAIR_WIDE_MIN_BYTES = 48 << 20
#: A default multi-token plan (``group_tokens=None``) of a 16-bit cache runs
#: one row per query token, without row groups, when its rows read at most
#: this many KV bytes in all (each row its own visible pages, all kv heads):
#: such a step is a few tiles per CTA, where a group's last CTA merging all
#: its rows costs more than the repeated (L2-resident) K/V reads (H200, q_len
#: 2-8, batch 1-4, ctx 512-4096: one row per token faster on every cell up to
#: 32 MiB, groups on all but one above; docs/architecture.md "Small steps:
#: one row per token").
ROW_TABLE_MAX_BYTES = 32 << 20

ENV_NUM_SMS = "CUPAGED_NUM_SMS"
ENV_TARGET_CTAS = "CUPAGED_TARGET_CTAS"

#: q/out dtypes the kernels are instantiated for (and KV dtypes, alone):
#: float16, bfloat16, float32 (``_configs.DTYPES``).
SUPPORTED_DTYPES = tuple(np.dtype(name) for name in _configs.DTYPES)
#: The fp8 KV dtype (``ml_dtypes.float8_e4m3fn``: bias 7, max 448, no inf).
#: CuPy has no float8 dtype: on the GPU such a cache is a uint8 array of its
#: bit patterns, which is why ``plan_decode`` also accepts ``np.uint8`` for it.
FLOAT8_E4M3 = np.dtype(_configs.FP8)
#: ``(dtype, kv_dtype)`` pairs (q/out dtype, KV-cache dtype) a plan may have:
#: one shared dtype, or an fp8 cache read by a float16/bfloat16 query
#: (``_configs.KV_DTYPES``).
SUPPORTED_DTYPE_PAIRS = tuple((np.dtype(q), np.dtype(kv)) for q, kvs in _configs.KV_DTYPES.items() for kv in kvs)
#: Tokens per chunk of a ``deterministic=True`` plan (rounded down to whole
#: pages, at least one page). Fixed, so a request's chunking depends on its
#: own length alone. 1024 sits between the two ends of the calibrated default
#: on the H200 (128-token chunks for one short request, 8192 for batch 8 at
#: ctx 32768): one request of 32k tokens alone still gets 32 chunks (256 CTAs
#: at 8 KV heads, ~2 per SM), a request of at most 1024 tokens is never split
#: (no merge), and the merge traffic stays small: a float32 partial
#: ``[g, D]`` written and read per 1024 tokens of fp16 K+V is ``g / 512`` of
#: the KV bytes (under 2 % for GQA groups up to 8).
DETERMINISTIC_CHUNK_TOKENS = 1024


# --------------------------------------------------------------------------
# argument checking
# --------------------------------------------------------------------------
#: The largest chunk size: the kernels take ``pages_per_chunk`` as a C ``int``
#: and the plan stores it as int32 (2**32 would arrive as 0).
MAX_PAGES_PER_CHUNK = 2**31 - 1


def _chunk_size(value: Any, name: str) -> int:
    """``value`` as an int in ``[1, MAX_PAGES_PER_CHUNK]``, else InvalidArgumentError naming ``name``."""
    value = positive_int(value, name)
    if value > MAX_PAGES_PER_CHUNK:
        raise InvalidArgumentError(
            f"{name} must be a positive integer <= {MAX_PAGES_PER_CHUNK}, got {value}")
    return value


def _request_pages(request_pages: Any) -> np.ndarray:
    """``request_pages`` as a 1-D non-negative int64 array."""
    arr = np.asarray(request_pages)
    if arr.ndim != 1:
        raise InvalidArgumentError(
            f"request_pages must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(
            f"request_pages must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        raise InvalidArgumentError("request_pages must be non-negative")
    return arr


def _q_dtype(dtype: Any) -> np.dtype:
    """The q/out dtype as a supported ``np.dtype``, else InvalidArgumentError."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise InvalidArgumentError(f"dtype must be {_DTYPES_TEXT}, got {dtype!r}") from exc
    if dt not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(f"dtype must be {_DTYPES_TEXT}, got {dt}")
    return dt


_DTYPES_TEXT = ", ".join(_configs.DTYPES)


def canonical_kv_dtype(kv_dtype: Any) -> np.dtype:
    """``kv_dtype`` as an ``np.dtype``; the fp8 spellings ``"float8_e4m3fn"``,
    ``ml_dtypes.float8_e4m3fn`` and ``np.uint8`` (its bits on the GPU) all give
    :data:`FLOAT8_E4M3`. No pair check (see :func:`plan_decode`).

    >>> canonical_kv_dtype(np.uint8) == canonical_kv_dtype("float8_e4m3fn") == FLOAT8_E4M3
    True
    """
    try:
        dt = np.dtype(kv_dtype)
    except TypeError as exc:
        raise InvalidArgumentError(
            f"kv_dtype must be a dtype; supported: {_configs.pairs_text()}, got {kv_dtype!r}") from exc
    fmt = _configs.stored_format(dt)  # (uint8: fp8 bits)
    return dt if fmt is None else np.dtype(fmt.name)


def _kv_dtype(kv_dtype: Any, dtype: np.dtype) -> np.dtype:
    """The plan's KV dtype: ``dtype`` when None, else the canonical
    ``kv_dtype``, which must form a supported pair with ``dtype``."""
    if kv_dtype is None:
        return dtype
    kv = canonical_kv_dtype(kv_dtype)
    if (dtype, kv) not in SUPPORTED_DTYPE_PAIRS:
        raise InvalidArgumentError(
            f"unsupported (dtype, kv_dtype) = ({dtype}, {kv}); supported: "
            f"{_configs.pairs_text()} (an fp8 cache may be given as np.uint8 bits)")
    return kv


# --------------------------------------------------------------------------
# heuristics (pure functions)
# --------------------------------------------------------------------------
def heads_per_cta(group_size: int) -> int:
    """Query heads one CTA serves: the largest divisor of ``group_size`` that
    is ``<= MAX_HEADS_PER_CTA`` (8).

    The query heads of one KV head (its group of ``group_size`` heads) are split
    into ``group_size // heads_per_cta`` equal q-head groups, each one CTA.

    >>> [heads_per_cta(g) for g in (1, 4, 6, 8, 12, 16)]
    [1, 4, 6, 8, 6, 8]
    >>> heads_per_cta(7), heads_per_cta(11)   # primes above 8 -> 1 head per CTA
    (7, 1)
    """
    g = positive_int(group_size, "group_size")
    for h in range(min(g, MAX_HEADS_PER_CTA), 0, -1):
        if g % h == 0:
            return h
    return 1  # pragma: no cover (h == 1 always divides)


def default_target_ctas(num_sms: int) -> int:
    """CTAs of one wave on a device: ``CTAS_PER_SM * num_sms``, the most the
    default chunk size plans for.

    >>> default_target_ctas(132)   # H200
    264
    """
    return max(1, int(CTAS_PER_SM * positive_int(num_sms, "num_sms")))


def _chunks_per_request(pages: np.ndarray, c: int) -> np.ndarray:
    # ceil(p / c) without overflow (p + c - 1 may overflow for huge c),
    # and at least one chunk per request.
    return np.maximum(1, -((-pages) // c))


def num_chunks(request_pages: Any, pages_per_chunk: int) -> int:
    """Total chunk count ``sum_i max(1, ceil(pages_i / c))`` (vectorized).

    Non-increasing in ``c``.

    >>> num_chunks([256], 3), num_chunks([256], 4)
    (86, 64)
    >>> num_chunks([0, 1, 5], 2)   # the zero-page request still gets one chunk
    5
    """
    c = positive_int(pages_per_chunk, "pages_per_chunk")
    pages = _request_pages(request_pages)
    return int(_chunks_per_request(pages, c).sum())


def choose_pages_per_chunk(request_pages: Any, ctas_per_chunk: int,
                           target_ctas: int) -> int:
    """Largest ``c`` in ``[1, max(1, max pages)]`` with
    ``num_chunks(request_pages, c) * ctas_per_chunk >= target_ctas``;
    1 when even ``c = 1`` falls short of the target.

    Among chunk sizes that still saturate the device, the largest one does the
    least merge work.  ``num_chunks`` is non-increasing in ``c``, so the set of
    feasible ``c`` is a prefix ``[1, c*]`` and a binary search finds ``c*``.

    Worked example: batch 1, ctx 4096 at page size 16 -> 256 pages; 8 KV heads
    and 1 q group -> 8 CTAs per chunk; target 528 (4 x 132 SMs).
    ``c = 3`` gives ``ceil(256/3) = 86`` chunks -> 688 CTAs >= 528, while
    ``c = 4`` gives 64 chunks -> 512 CTAs < 528, so ``c = 3``.

    >>> choose_pages_per_chunk([256], 8, 528)
    3
    >>> choose_pages_per_chunk([4, 4], 8, 10_000)   # falls short -> 1
    1
    >>> choose_pages_per_chunk([0, 0], 8, 1)        # no pages at all
    1
    """
    cpc = positive_int(ctas_per_chunk, "ctas_per_chunk")
    target = positive_int(target_ctas, "target_ctas")
    pages = _request_pages(request_pages)
    hi = max(1, int(pages.max()) if pages.size else 1)
    lo = 1
    if int(_chunks_per_request(pages, lo).sum()) * cpc < target:
        return 1
    # invariant: lo is feasible; answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(_chunks_per_request(pages, mid).sum()) * cpc >= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --------------------------------------------------------------------------
# device / environment
# --------------------------------------------------------------------------
_SM_CACHE: dict[int, int] = {}


def ctas_per_sm(dtype: np.dtype, kv_dtype: np.dtype, head_dim: int, heads: int) -> int:
    """Resident CTAs per SM of the partial kernel instance that serves these
    shapes (its ``__launch_bounds__`` minimum, which the register and shared
    memory budgets are sized for): the tensor-core core's
    :func:`cupaged._configs.mma_traits` (2; 3 for its fp8 instances up to
    head_dim 128, which the driver reports), 3 or 1 for the CUDA-core core (``MinBlocks`` in attend.cuh); 2 where no
    kernel serves the shapes (the gather path ignores the plan).

    >>> ctas_per_sm(np.dtype(np.float16), np.dtype(np.float16), 128, 4)
    2
    >>> ctas_per_sm(np.dtype(np.float32), np.dtype(np.float32), 128, 4), ctas_per_sm(np.dtype(np.float32), np.dtype(np.float32), 128, 8)
    (3, 1)
    """
    variant = _variant_of(np.dtype(dtype), np.dtype(kv_dtype))
    try:
        requested = _env.core()  # read every call (a malformed value gives the default, as before)
    except ValueError:
        return CTAS_PER_SM
    return _resident_ctas(variant, head_dim, heads, requested)


@functools.lru_cache(maxsize=64)
def _variant_of(dtype: np.dtype, kv_dtype: np.dtype) -> str:
    """The kernel variant of a (q, KV) dtype pair (uint8 KV: fp8 bits),
    cached: ``dtype.name`` costs ~1.5 µs, and every default plan asks."""
    return _configs.variant(_configs.dtype_name(dtype), canonical_kv_dtype(kv_dtype).name)


@functools.lru_cache(maxsize=64)
def _resident_ctas(variant: str, head_dim: int, heads: int, requested: str | None) -> int:
    """:func:`ctas_per_sm` of a kernel variant and a core request: a
    function of the fixed tables in _configs, cached (every default plan
    asks)."""
    try:
        core = _configs.choose_core(variant, head_dim, requested)
    except ValueError:
        return CTAS_PER_SM
    return _configs.resident_ctas(variant, head_dim, heads, core)


def deterministic_pages_per_chunk(page_size: int) -> int:
    """Chunk size of a ``deterministic=True`` plan:
    ``max(1, DETERMINISTIC_CHUNK_TOKENS // page_size)`` pages.

    A function of the page size alone (never of the batch or the device), so
    each request's chunk boundaries, chunk count and merge order are functions
    of the request alone: decoding it alone or inside any batch gives the
    same bits (batch invariance).

    >>> [deterministic_pages_per_chunk(p) for p in (1, 16, 32, 1000, 4096)]
    [1024, 64, 32, 1, 1]
    """
    return max(1, DETERMINISTIC_CHUNK_TOKENS // positive_int(page_size, "page_size"))


def device_num_sms() -> int | None:
    """SM count of the current CUDA device, or None when cupy cannot be
    imported or no device is visible (every exception is swallowed)."""
    try:
        import cupy  # noqa: WPS433 (lazy on purpose)

        if cupy.cuda.runtime.getDeviceCount() <= 0:
            return None
        dev = int(cupy.cuda.runtime.getDevice())
        sms = _SM_CACHE.get(dev)
        if sms is None:
            attrs = cupy.cuda.Device(dev).attributes
            sms = int(attrs["MultiProcessorCount"])
            _SM_CACHE[dev] = sms
        return sms if sms > 0 else None
    except Exception:  # noqa: BLE001  no cupy, no driver, no device ...
        return None


def _env_positive_int(name: str) -> int | None:
    # read and validated in cupaged/_env.py, with every other variable
    return {ENV_NUM_SMS: _env.num_sms, ENV_TARGET_CTAS: _env.target_ctas}[name]()


def resolve_num_sms(num_sms: int | None = None) -> int:
    """SM count: argument > current CUDA device > env ``CUPAGED_NUM_SMS`` > 132.

    The env variable is read at call time.
    """
    if num_sms is not None:
        return positive_int(num_sms, "num_sms")
    dev = device_num_sms()
    if dev is not None:
        return dev
    env = _env_positive_int(ENV_NUM_SMS)
    if env is not None:
        return env
    return DEFAULT_NUM_SMS


def resolve_target_ctas(target_ctas: int | None = None,
                        num_sms: int | None = None) -> int:
    """CTA target: argument > env ``CUPAGED_TARGET_CTAS`` >
    ``default_target_ctas(resolve_num_sms(num_sms))``; env read at call time."""
    if target_ctas is not None:
        return positive_int(target_ctas, "target_ctas")
    env = _env_positive_int(ENV_TARGET_CTAS)
    if env is not None:
        return env
    return default_target_ctas(resolve_num_sms(num_sms))


# --------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------
def _readonly_int32(arr: Any, name: str) -> np.ndarray:
    a = np.asarray(arr)
    if (a.dtype == np.int32 and a.ndim == 1 and a.base is None and a.flags.c_contiguous
            and not a.flags.writeable):
        return a  # plan_decode's own frozen arrays: nobody else holds them
    if a.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {a.shape}")
    a = np.array(a, dtype=np.int32, copy=True, order="C")
    a.flags.writeable = False
    return a


_ARRAY_FIELDS = ("chunk_request", "chunk_index", "o_indptr", "request_chunks", "request_chunk_pages",
                 "launch_order")


@dataclasses.dataclass(frozen=True, eq=False)
class DecodePlan:
    """Plain frozen description of one split-KV decode launch.

    ``eq=False``: plans compare and hash by identity (usable as dict keys and
    through ``weakref``).  Every array is a read-only C-contiguous ``np.int32``.

    Fields (the kernels and the dispatcher read exactly these):

    * ``batch_size, num_qo_heads, num_kv_heads, head_dim, page_size``
    * ``dtype``: ``np.dtype`` of q and out (float16, float32, bfloat16).
    * ``group_size = num_qo_heads // num_kv_heads``; query head ``h`` reads
      KV head ``h // group_size``.
    * ``heads_per_cta``: query heads served by one CTA;
      ``q_groups = group_size // heads_per_cta``.
    * ``pages_per_chunk``: the largest chunk size ``max(c_i)`` (pages),
      ``target_ctas``, ``num_chunks``.
    * ``request_chunk_pages [B]``: request ``i``'s chunk size ``c_i`` in pages
      (``pages_per_chunk`` for every request under a uniform split; the
      default plan splits each request evenly, see
      :func:`cupaged.schedule.split_pages`, and gives an unsplit request the
      cap: the plan serves it as it grows, up to ``c_i`` pages).
    * ``chunk_request [num_chunks]``: request of each chunk (non-decreasing).
    * ``chunk_index [num_chunks]``: index ``j`` of the chunk within its
      request; its pages are ``[j*c_i, min((j+1)*c_i, pages_i))`` relative to
      the request's first page.
    * ``o_indptr [B+1]``: chunks of request ``i`` are
      ``o_indptr[i]:o_indptr[i+1]`` (the merge kernel's CSR).
    * ``request_chunks [B]``: ``max(1, ceil(pages_i / c_i))``.
    * ``launch_order [num_chunks]``: the chunks in the order the kernel runs
      them, longest first (ties in chunk order), so short requests fill the
      SMs beside a long one's chunks.
    * ``heads_groups = num_kv_heads * q_groups``: CTAs per chunk.
    * ``num_ctas = num_units * heads_groups`` (:attr:`num_units`: the
      chunks, or with row groups the chunks of each group's first row).
    * ``grid = (num_ctas, 1, 1)``: CTA ``x`` runs unit ``x // heads_groups``
      (the chunks in ``launch_order``) for head group ``x % heads_groups``.
    * ``needs_merge``: some request has more than one chunk.
    * ``workspace_bytes``: float32 partial outputs ``[num_chunks, Hq, D]`` plus
      partial LSEs ``[num_chunks, Hq]`` when ``needs_merge``, else 0.
    * ``kv_dtype``: ``np.dtype`` of the KV cache: ``dtype``, or
      :data:`FLOAT8_E4M3` (``ml_dtypes.float8_e4m3fn``; uint8 bits on the GPU)
      under a float16/bfloat16 ``dtype``. Optional when constructing (None:
      ``dtype``; ``np.uint8`` means fp8).
    * ``deterministic``: the chunk size came from
      :func:`deterministic_pages_per_chunk` (or was given explicitly) under
      ``plan_decode(..., deterministic=True)``: it depends on no other request
      of the batch. Optional when constructing (default False).
    * ``group_last``: None, or with several query tokens per request
      (``plan_decode(..., qo_indptr=...)``; the table is
      ``PageTable.query_rows``) an int32 ``[B]`` array: row ``r``'s row group
      ends at row ``group_last[r]``. A group is up to
      :func:`cupaged._configs.tokens_per_cta` consecutive tokens of one
      request; its rows share the last row's split (``request_chunks``,
      ``request_chunk_pages``), and one CTA per chunk reads the chunk's K/V
      once for all of them (the kernel's ``paged_decode_rows``).
    * ``ctas_per_sm``: the most CTAs per SM the plan's launches put on an
      SM (the grid is sized for them; with programmatic dependent launch,
      sm_90+ tensor-core instances, the launch holds each SM to them through
      its dynamic shared memory). The kernel instance's count
      (:func:`ctas_per_sm`), or one fewer where the step model predicts the
      step faster so (the default plan weighs fp8's 3 against 2, and 16-bit
      KV's 2 against 1: :func:`cupaged.schedule.choose_cap_and_residency`).
    * ``request_chunk_pages``, ``launch_order``, ``heads_groups``,
      ``group_last``, ``ctas_per_sm`` (above) are optional when
      constructing: a uniform split of ``pages_per_chunk`` pages in chunk
      order, no row groups, the instance's CTAs per SM.

    Methods: :meth:`matches` (can this plan serve a new table?),
    :meth:`chunk_page_ranges` and :meth:`chunk_token_ranges` (each chunk's
    pages and tokens); the two range methods raise
    :class:`~cupaged.errors.PlanMismatchError` when ``matches(table)`` is
    false.

    Example: 700 and 33 tokens at page size 16 are 44 and 3 pages; 4 pages
    per chunk give 11 + 1 chunks, one CTA per (chunk, KV head):

    >>> import numpy as np
    >>> import cupaged
    >>> table = cupaged.PageTable.from_seq_lens([700, 33], page_size=16)
    >>> plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=4)
    >>> plan.num_chunks, plan.grid, plan.needs_merge, plan.o_indptr.tolist()
    (12, (96, 1, 1), True, [0, 11, 12])
    >>> start, end = plan.chunk_token_ranges(table)   # 64 tokens per chunk
    >>> start[:3].tolist(), end[-2:].tolist()
    ([0, 64, 128], [700, 33])
    >>> plan.matches(cupaged.PageTable.from_seq_lens([701, 33], 16))  # next step: reuse it
    True
    >>> plan.chunk_page_ranges(cupaged.PageTable.from_seq_lens([705, 33], 16))  # 45 pages: 12 chunks
    Traceback (most recent call last):
        ...
    cupaged.errors.PlanMismatchError: plan does not match the page table (request 0: chunk count 11 -> 12 (45 pages at pages_per_chunk=4)); build a new plan
    """

    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: np.dtype
    group_size: int
    heads_per_cta: int
    q_groups: int
    pages_per_chunk: int
    target_ctas: int
    num_chunks: int
    chunk_request: np.ndarray = dataclasses.field(repr=False)
    chunk_index: np.ndarray = dataclasses.field(repr=False)
    o_indptr: np.ndarray = dataclasses.field(repr=False)
    request_chunks: np.ndarray = dataclasses.field(repr=False)
    num_ctas: int
    grid: tuple[int, int, int]
    needs_merge: bool
    workspace_bytes: int
    kv_dtype: Any = None
    deterministic: bool = False
    request_chunk_pages: Any = dataclasses.field(default=None, repr=False)
    launch_order: Any = dataclasses.field(default=None, repr=False)
    heads_groups: int = 0
    group_last: Any = dataclasses.field(default=None, repr=False)
    ctas_per_sm: int = 0

    def __post_init__(self) -> None:
        # optional when constructing: a uniform split in chunk order
        if self.request_chunk_pages is None:
            object.__setattr__(self, "request_chunk_pages", np.full(int(self.batch_size), self.pages_per_chunk))
        if self.launch_order is None:
            object.__setattr__(self, "launch_order", np.arange(int(self.num_chunks)))
        if not self.heads_groups:
            object.__setattr__(self, "heads_groups", int(self.num_kv_heads) * int(self.q_groups))
        for name in _ARRAY_FIELDS:
            object.__setattr__(self, name,
                               _readonly_int32(getattr(self, name), name))
        if self.group_last is not None:
            object.__setattr__(self, "group_last", _readonly_int32(self.group_last, "group_last"))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "kv_dtype", self.dtype if self.kv_dtype is None
                           else canonical_kv_dtype(self.kv_dtype))
        object.__setattr__(self, "deterministic", bool(self.deterministic))
        object.__setattr__(self, "grid", tuple(int(v) for v in self.grid))
        held = int(self.ctas_per_sm) if self.ctas_per_sm else ctas_per_sm(
            self.dtype, self.kv_dtype, int(self.head_dim), int(self.heads_per_cta))
        if held < 1:
            raise InvalidArgumentError(f"ctas_per_sm must be >= 1 (0: the kernel's count), got {self.ctas_per_sm}")
        object.__setattr__(self, "ctas_per_sm", held)

    @classmethod
    def _from_plan_decode(cls, fields: dict[str, Any]) -> DecodePlan:
        """The plan of :func:`plan_decode`'s own values (every field, by
        name), which are already what ``__post_init__`` makes of them (fresh
        read-only C-contiguous int32 arrays, canonical dtypes, an int tuple
        grid): its checks, and the frozen ``__init__``'s
        ``object.__setattr__`` per field, would change nothing and cost ~5 µs
        a plan. tests/test_schedule_fast.py compares every field with the
        ordinary constructor's."""
        if fields.keys() != _FIELD_NAMES:
            raise TypeError(f"DecodePlan fields {sorted(_FIELD_NAMES ^ fields.keys())} missing or unknown")
        plan = object.__new__(cls)
        plan.__dict__.update(fields)
        _validate.trust_plan(plan)  # consistent by construction: decode skips its structural check
        return plan

    @property
    def num_units(self) -> int:
        """Work units the kernel runs (``num_ctas // heads_groups``): the
        chunks, or with row groups the chunks of each group's first row."""
        return self.num_ctas // self.heads_groups

    # -- reuse across decode steps -----------------------------------------
    def matches(self, table: Any) -> bool:
        """True when this plan can serve ``table``: same batch size and page
        size, and every request still has ``request_chunks[i]`` chunks of
        ``request_chunk_pages[i]`` pages; with row groups, each group's rows
        are still consecutive tokens of one request (:func:`rows_form_groups`)
        and the counts are its last row's.  Cheap and vectorized (~3 µs at
        batch 128: a range check per request)."""
        if int(table.batch_size) != self.batch_size:
            return False
        if int(table.page_size) != self.page_size:
            return False
        pages = np.asarray(table.request_pages)
        if self.group_last is not None:
            if not rows_form_groups(table, self.group_last):
                return False
            pages = pages[self.group_last]
        # request i keeps its chunk count exactly while its pages stay in
        # [base_i, base_i + width_i): one subtraction and one unsigned compare
        # (~3 µs at batch 128, against ~8 for recounting every request's chunks)
        base, width = self._match_range()
        return bool(((pages - base).view(np.uint64) < width).all())  # (the method: np.all's wrapper costs ~1 µs)

    def _match_range(self) -> tuple[np.ndarray, np.ndarray]:
        """``(base, width)`` int64/uint64 ``[B]`` of :meth:`matches`: the page
        counts that give request ``i`` its ``request_chunks[i]`` chunks of
        ``request_chunk_pages[i]`` pages (``max(1, ceil(p / c))``): ``[0, c]``
        for one chunk, ``[(n - 1) c + 1, n c]`` for n; none for n < 1.
        Computed once per plan (plans are immutable)."""
        cached = self.__dict__.get("_matches_range")
        if cached is None:
            n = self.request_chunks.astype(np.int64)
            c = self.request_chunk_pages.astype(np.int64)
            base = np.where(n == 1, 0, (n - 1) * c + 1)
            width = np.where(n >= 1, n * c - base + 1, 0).astype(np.uint64)
            cached = (base, width)
            self.__dict__["_matches_range"] = cached  # (a race computes the same value twice)
        return cached

    # -- geometry helpers (tests, reference, debugging) ---------------------
    def chunk_page_ranges(self, table: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(start, end)`` int64 ``[num_chunks]``: each chunk's slice of
        ``table.indices`` (absolute CSR positions).  A zero-page request's
        chunk is the empty range ``[indptr[i], indptr[i])``.

        Raises :class:`~cupaged.errors.PlanMismatchError` when
        ``self.matches(table)`` is false."""
        self._check_table(table)
        indptr = np.asarray(table.indptr, dtype=np.int64)
        req = self.chunk_request.astype(np.int64)
        first = indptr[req]
        last = indptr[req + 1]
        c = self.request_chunk_pages.astype(np.int64)[req]
        start = np.minimum(first + self.chunk_index.astype(np.int64) * c, last)
        end = np.minimum(start + c, last)
        return start, end

    def chunk_token_ranges(self, table: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(start, end)`` int64 ``[num_chunks]``: visible-token positions of
        each chunk, measured from the first visible token of its request
        (which sits at entry ``first_page_offset[i]`` of the first page).
        Per request the ranges tile ``[0, seq_len_i)`` in order; a zero-page
        request's chunk is ``[0, 0)``.

        Raises :class:`~cupaged.errors.PlanMismatchError` when
        ``self.matches(table)`` is false."""
        self._check_table(table)
        P = self.page_size
        req = self.chunk_request.astype(np.int64)
        pages = np.asarray(table.request_pages, dtype=np.int64)[req]
        off = np.asarray(table.first_page_offset, dtype=np.int64)[req]
        seq = np.asarray(table.seq_lens, dtype=np.int64)[req]
        c = self.request_chunk_pages.astype(np.int64)[req]
        p0 = np.minimum(self.chunk_index.astype(np.int64) * c, pages)
        p1 = np.minimum(p0 + c, pages)
        start = np.clip(p0 * P - off, 0, seq)
        end = np.clip(p1 * P - off, 0, seq)
        return start, end

    def _check_table(self, table: Any) -> None:
        if not self.matches(table):
            from ._validate import plan_mismatch_reason  # (imports page_table)

            raise PlanMismatchError(f"plan does not match the page table "
                                    f"({plan_mismatch_reason(self, table)}); build a new plan")


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(DecodePlan))


def plan_decode(table: Any, num_qo_heads: int, num_kv_heads: int,
                head_dim: int, dtype: Any, *, kv_dtype: Any = None,
                deterministic: bool = False, pages_per_chunk: int | None = None,
                max_pages_per_chunk: int | None = None, target_ctas: int | None = None,
                num_sms: int | None = None, window_left: Any = None, qo_indptr: Any = None,
                group_tokens: bool | None = None) -> DecodePlan:
    """Plan a split-KV decode of ``table`` on the host (NumPy; no GPU needed).

    One CTA per (chunk, KV head, q-head group); a chunk is at most
    ``pages_per_chunk`` consecutive pages of one request, and every request
    gets at least one chunk.

    Args:
        table: the batch's :class:`~cupaged.PageTable` (``B >= 1``).
        num_qo_heads, num_kv_heads: ``Hq`` and ``Hkv``, positive ints with
            ``Hq`` a multiple of ``Hkv``.
        head_dim: ``D``, a positive multiple of 8. The kernels have
            instances for 64, 96, 128 and 256: another multiple of 8 is
            planned without complaint, but ``decode`` then runs the gather
            path, which ignores the plan (:func:`~cupaged.select_method` says
            so).
        dtype: the q/out dtype, anything ``numpy.dtype`` accepts that is
            float16, float32 or bfloat16 (``"float16"``, ``np.float16``,
            ``ml_dtypes.bfloat16``).
        kv_dtype: keyword-only KV-cache dtype; None (default) = ``dtype``.
            fp8 is spelled ``"float8_e4m3fn"``, ``ml_dtypes.float8_e4m3fn`` or
            ``np.uint8`` (its bits, as a CuPy cache holds them) and becomes
            :data:`FLOAT8_E4M3`; it goes with a float16 or bfloat16 ``dtype``
            only. Any other ``kv_dtype`` must equal ``dtype``
            (:data:`SUPPORTED_DTYPE_PAIRS`).
        deterministic: keyword-only (default False). True makes each
            request's result independent of the rest of the batch (batch
            invariance, bitwise): the chunk size is
            :func:`deterministic_pages_per_chunk` of the page size
            (``DETERMINISTIC_CHUNK_TOKENS`` = 1024 tokens), never derived from
            the batch or the device, so a request's chunk boundaries, chunk
            count and merge order are functions of the request alone (and the
            kernel instance of the shapes and dtypes alone). An explicit
            ``pages_per_chunk`` is used as given (it is batch-invariant too);
            ``target_ctas`` and ``num_sms`` then only fill the plan's
            ``target_ctas`` field, as they do next to an explicit
            ``pages_per_chunk``.
        pages_per_chunk: keyword-only; every request in chunks of this
            many pages (``1 .. 2**31 - 1``, a uniform split). When None: with
            ``max_pages_per_chunk``, that balanced split; with
            ``deterministic``, :func:`deterministic_pages_per_chunk`; else
            with an explicit target (``target_ctas``, else env
            ``CUPAGED_TARGET_CTAS``) the largest uniform chunk giving at least
            that many CTAs (:func:`choose_pages_per_chunk` with
            ``ctas_per_chunk = num_kv_heads * q_groups``); otherwise the
            default: a balanced split whose cap minimizes the predicted
            time of the step
            (:func:`cupaged.schedule.choose_max_pages_per_chunk`, with
            :func:`ctas_per_sm` resident CTAs per SM).
        max_pages_per_chunk: keyword-only; split each request into the
            fewest equal chunks of at most this many pages (``1 .. 2**31 - 1``;
            :func:`cupaged.schedule.split_pages`).
        target_ctas: keyword-only CTA target (default None).
        num_sms: keyword-only SM count for the default (default None: the
            current CUDA device's, else env ``CUPAGED_NUM_SMS``, else 132).
        window_left: keyword-only sliding window (None, an int, or an int
            ``[B]`` array; -1 none): plans ``table.windowed(window_left)``,
            the table ``decode(..., window_left=...)`` runs on (pages before
            the window get no CTA).
        qo_indptr: keyword-only query tokens per request (None: one each;
            as for :func:`cupaged.decode`): plans
            ``table.query_rows(qo_indptr)``, one row per query token (with a
            window, each row's own), the table ``decode(..., qo_indptr=...)``
            runs on. Without a window, a request's consecutive tokens form
            row groups (``group_last``) that read each chunk's K/V once
            (but see ``group_tokens``).
        group_tokens: keyword-only None (default), True or False. True
            forms row groups wherever the kernel can; False plans every
            query row on its own (each reads its K/V), as with a window;
            None forms them unless the step is small: a 16-bit cache whose
            rows read at most :data:`ROW_TABLE_MAX_BYTES` of KV in all
            (then one row per token runs faster). ``deterministic`` plans
            always form them (the choice must not depend on the batch).

    Environment variables are read at call time; an empty value counts as
    unset.

    Returns:
        A :class:`DecodePlan`. Hold it across decode steps while
        ``plan.matches(table)``.

    Raises:
        InvalidArgumentError (a ValueError; ShapeError for heads not divisible, ArgumentTypeError for a table that is not a PageTable) naming the argument: an empty batch (``B == 0``); a size
        (heads, ``head_dim``, ``pages_per_chunk``, ``target_ctas``,
        ``num_sms``) that is not a positive integer; ``pages_per_chunk`` or
        ``max_pages_per_chunk`` above ``2**31 - 1`` (the kernels' ``int``); ``num_qo_heads`` not a
        multiple of ``num_kv_heads``; ``head_dim`` not a multiple of 8; an
        unsupported ``dtype`` or ``(dtype, kv_dtype)`` pair (the message lists
        the supported pairs); a grid beyond CUDA's limits; a malformed (not a
        positive integer) env ``CUPAGED_TARGET_CTAS``, read whenever
        ``target_ctas`` is None (even with ``pages_per_chunk`` given), or
        ``CUPAGED_NUM_SMS``, read only when neither ``num_sms``, a CTA target
        (argument or env) nor a visible CUDA device gives the SM count.

    Example: 44 and 3 pages, 8 KV heads with 4 query heads each (one q-head
    group: 8 CTAs per chunk); a target of 96 CTAs needs 12 chunks, so 4 pages
    per chunk (5 would give 10):

    >>> import numpy as np
    >>> import cupaged
    >>> table = cupaged.PageTable.from_seq_lens([700, 33], page_size=16)
    >>> plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, target_ctas=96)
    >>> plan.pages_per_chunk, plan.num_chunks, plan.num_ctas, plan.request_chunks.tolist()
    (4, 12, 96, [11, 1])
    >>> plan.kv_dtype == np.float16   # default: the cache has q's dtype
    True
    >>> fp8 = cupaged.plan_decode(table, 32, 8, 128, np.float16, kv_dtype=np.uint8)
    >>> fp8.kv_dtype.name
    'float8_e4m3fn'
    >>> det = cupaged.plan_decode(table, 32, 8, 128, np.float16, deterministic=True)
    >>> det.pages_per_chunk, det.request_chunks.tolist()   # 1024 tokens = 64 pages
    (64, [1, 1])
    >>> cupaged.plan_decode(table, 32, 8, 100, np.float16)
    Traceback (most recent call last):
        ...
    cupaged.errors.InvalidArgumentError: head_dim must be a positive multiple of 8, got 100
    """
    return _plan_decode(table, num_qo_heads, num_kv_heads, head_dim, dtype, kv_dtype=kv_dtype,
                        deterministic=deterministic, pages_per_chunk=pages_per_chunk,
                        max_pages_per_chunk=max_pages_per_chunk, target_ctas=target_ctas, num_sms=num_sms,
                        window_left=window_left, qo_indptr=qo_indptr, group_tokens=group_tokens)


def _plan_decode(table: Any, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: Any, *,
                 kv_dtype: Any = None, deterministic: bool = False, pages_per_chunk: int | None = None,
                 max_pages_per_chunk: int | None = None, target_ctas: int | None = None, num_sms: int | None = None,
                 window_left: Any = None, qo_indptr: Any = None, group_tokens: bool | None = None,
                 eight_warps: bool = True) -> DecodePlan:
    """:func:`plan_decode`, for the kernels ``decode`` picks per plan
    (``eight_warps``: row-group plans held to one CTA per SM run on 8-warp
    CTAs, family rows8) or, without, for a fixed 4-warp rows kernel
    (:class:`~cupaged.DecodeRunner`'s captured one): there warp-pair plans
    keep the kernel's CTAs per SM and the pairs' chunk limit, as measured on
    4 warps (docs/architecture.md "Warp pairs on eight warps")."""
    hq = positive_int(num_qo_heads, "num_qo_heads")
    hkv = positive_int(num_kv_heads, "num_kv_heads")
    if hq % hkv:
        raise ShapeError(
            f"num_qo_heads ({hq}) must be divisible by num_kv_heads ({hkv})")
    d = positive_int(head_dim, "head_dim")
    if d % 8:
        raise InvalidArgumentError(
            f"head_dim must be a positive multiple of 8, got {d}")
    dt = _q_dtype(dtype)
    kv_dt = _kv_dtype(kv_dtype, dt)
    pages_per_chunk, max_pages_per_chunk, target_ctas, num_sms = _knobs(
        deterministic, group_tokens, pages_per_chunk, max_pages_per_chunk, target_ctas, num_sms)

    batch, page_size, pages, ptr = _plan_table(table, window_left, qo_indptr)
    from_table = isinstance(table, PageTable)
    group = hq // hkv
    hpc = _heads_per_cta(group)
    q_groups = group // hpc
    grid_y = hkv * q_groups
    group_last, paired = None, False
    if group_tokens is None:
        group_tokens = deterministic or ptr is None or not _rows_read_little(pages, page_size, hkv, d, kv_dt)
    tokens = _group_tokens(dt, kv_dt, d, hpc) if ptr is not None and group_tokens else None
    if tokens is not None:
        q_len = np.diff(ptr)
        single, pair = tokens
        paired = pair > single and int(q_len.max(initial=0)) > single  # some group's CTA on warp pairs
        group_last = _row_groups(ptr, q_len, pair)
    rows = group_last is not None and int(q_len.max(initial=0)) > 1  # some CTA holds several tokens' rows
    target, sms = _target_and_sms(target_ctas, num_sms)  # once: a device query is not free
    knobs = (page_size, grid_y, dt, kv_dt, d, hpc, deterministic, pages_per_chunk, max_pages_per_chunk, target, sms,
             rows)
    row_pages = pages
    if group_last is not None:
        pages = row_pages[group_last]  # a row splits as its group's last row
    # (4-warp pairs weigh only the kernel's CTAs per SM: held to one per SM a small grid of them ran up to 15 %
    # slower, H200 chunk sweeps, docs/architecture.md "One CTA per SM"; 8-warp ones faster)
    wide = eight_warps and _configs.wide_rows(kv_dt.name, d)  # 1 per SM launches rows8
    target, chunk_pages, req_chunks, units, longest_chunk, held = _grouped_chunking(
        pages, group_last, *knobs, wide or not paired)
    if paired and not (wide and _wide_pairs(held, hpc, page_size, longest_chunk, units * grid_y, sms, row_pages, ptr,
                                            hkv, d, kv_dt)) and (
            int(np.maximum.reduce(req_chunks)) > PAIR_MAX_CHUNKS
            or _pairs_underfill(units * grid_y, deterministic, pages_per_chunk, max_pages_per_chunk, sms)):
        # The last CTA of a group merges all its rows' partials: on warp pairs
        # twice the rows, which outlasts the pairs' saving once a group has
        # many chunks (a small step): then groups of one warp's rows. So too
        # when the pairs' default plan leaves SMs idle (the model, pricing that
        # merge, keeps a small step's groups whole; each CTA's tiles then run
        # one after another: 1-4 x 512 q_len 8, 8-32 CTAs, 20 us).
        group_last = _row_groups(ptr, q_len, single)
        pages = row_pages[group_last]
        target, chunk_pages, req_chunks, units, longest_chunk, held = _grouped_chunking(pages, group_last, *knobs)
    # chunks: the units unless row groups share them (an int32 sum comes back as int64: no overflow)
    n = units if group_last is None else int(np.add.reduce(req_chunks))
    if units * grid_y > MAX_GRID_X:
        raise InvalidArgumentError(
            f"{units} chunks x {grid_y} CTAs each exceed the CUDA grid limit {MAX_GRID_X} "
            f"(grid x); raise pages_per_chunk")
    needs_merge = n > batch  # every request has at least one chunk
    return DecodePlan._from_plan_decode({
        "batch_size": batch,
        "num_qo_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": d,
        "page_size": page_size,
        "dtype": dt,
        "group_size": group,
        "heads_per_cta": hpc,
        "q_groups": q_groups,
        "pages_per_chunk": longest_chunk,
        "target_ctas": int(target),
        "num_chunks": n,
        # (a PageTable's pages are >= 0: every launch-order key lies in [-longest_chunk, 0])
        **_chunk_layout(pages, chunk_pages, req_chunks, n, short_keys=longest_chunk < 2**15 and from_table),
        "heads_groups": grid_y,
        "num_ctas": units * grid_y,
        "grid": (units * grid_y, 1, 1),
        "needs_merge": needs_merge,
        "workspace_bytes": (n * hq * d + n * hq) * 4 if needs_merge else 0,
        "kv_dtype": kv_dt,
        "deterministic": bool(deterministic),
        "group_last": group_last,
        "ctas_per_sm": held,
    })


def _rows_read_little(pages: np.ndarray, page_size: int, hkv: int, d: int, kv_dt: np.dtype) -> bool:
    """Whether the query rows of ``pages`` (a rows table's request pages)
    read at most :data:`ROW_TABLE_MAX_BYTES` of a 16-bit cache in all."""
    if kv_dt.itemsize != 2:  # (fp8 not measured; float32 has no row groups)
        return False
    return _kv_bytes(pages, page_size, hkv, d, kv_dt) <= ROW_TABLE_MAX_BYTES


def _kv_bytes(pages: np.ndarray, page_size: int, hkv: int, d: int, kv_dt: np.dtype) -> int:
    """Bytes of K and V that ``pages`` (pages per request or row) hold over
    all ``hkv`` kv heads."""
    return int(np.add.reduce(pages, dtype=np.int64)) * page_size * 2 * d * kv_dt.itemsize * hkv


def _pairs_underfill(ctas: int, deterministic: bool, pages_per_chunk: int | None, max_pages_per_chunk: int | None,
                     sms: int | None) -> bool:
    """Whether a default plan (no chunk knobs, not deterministic: its
    groups must not depend on the batch; ``sms`` None: an explicit CTA
    target) of warp pairs has fewer ``ctas`` than SMs."""
    if deterministic or pages_per_chunk is not None or max_pages_per_chunk is not None:
        return False
    return sms is not None and ctas < sms


def _wide_pairs(held: int, hpc: int, page_size: int, chunk_pages: int, ctas: int, sms: int | None,
                row_pages: np.ndarray, ptr: np.ndarray, hkv: int, d: int, kv_dt: np.dtype) -> bool:
    """Whether a default plan's warp pairs, on 8-warp CTAs (held to one per
    SM: family rows8) at 4 or 8 heads per CTA (``hpc``; the counts timed),
    run in chunks (the longest: ``chunk_pages``) of at least
    :data:`PAIR_WIDE_CHUNK_TOKENS` on at least half the SMs, over
    requests holding at least :data:`PAIR_WIDE_MIN_BYTES` of KV (each
    request's pages, its last query row's, once; all ``hkv`` kv heads):
    there reading each chunk's K/V once for twice the rows outweighs the
    last CTA's merge of twice the rows at any chunk count."""
    if not (held == 1 and hpc in (4, 8) and sms is not None and 2 * ctas >= sms
            and chunk_pages * page_size >= PAIR_WIDE_CHUNK_TOKENS):
        return False
    last = ptr[1:][ptr[1:] > ptr[:-1]] - 1
    return _kv_bytes(row_pages[last], page_size, hkv, d, kv_dt) >= PAIR_WIDE_MIN_BYTES


def _knobs(deterministic: Any, group_tokens: Any, pages_per_chunk: Any, max_pages_per_chunk: Any,
           target_ctas: Any, num_sms: Any) -> tuple:
    """plan_decode's knobs, checked: ``(pages_per_chunk,
    max_pages_per_chunk, target_ctas, num_sms)`` as ints (or None)."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise InvalidArgumentError(f"deterministic must be True or False, got {deterministic!r}")
    if group_tokens is not None and not isinstance(group_tokens, (bool, np.bool_)):
        raise InvalidArgumentError(f"group_tokens must be None, True or False, got {group_tokens!r}")
    return (None if pages_per_chunk is None else _chunk_size(pages_per_chunk, "pages_per_chunk"),
            None if max_pages_per_chunk is None else _chunk_size(max_pages_per_chunk, "max_pages_per_chunk"),
            None if target_ctas is None else positive_int(target_ctas, "target_ctas"),
            None if num_sms is None else positive_int(num_sms, "num_sms"))


def _plan_table(table: Any, window_left: Any,
                qo_indptr: Any) -> tuple[int, int, np.ndarray, np.ndarray | None]:
    """plan_decode's ``(batch, page_size, request pages, ptr)`` of ``table``
    (of ``kernel_table(table, qo_indptr, window_left)`` with either),
    checked: a PageTable or any object with ``batch_size``, ``page_size`` and
    ``request_pages`` (pages int32 as a PageTable's, else int64). ``ptr``
    is the checked int64 ``qo_indptr`` when its rows may form row groups
    (some request has several tokens and there is no window), else None."""
    ptr = None
    if window_left is not None or qo_indptr is not None:
        if not isinstance(table, PageTable):
            raise ArgumentTypeError(f"window_left and qo_indptr need a cupaged.PageTable, got {type(table).__name__}")
        rows = kernel_table(table, qo_indptr, window_left)
        if rows is not table and window_array(window_left, table.batch_size) is None:
            ptr = qo_indptr_array(qo_indptr, table.batch_size, table.seq_lens)
        table = rows
    try:
        batch, page_size, pages = table.batch_size, table.page_size, table.request_pages
    except AttributeError:
        raise ArgumentTypeError(
            f"table must be a cupaged.PageTable (batch_size, page_size, request_pages), "
            f"got {type(table).__name__}") from None
    batch = int(batch)
    if batch < 1:
        raise InvalidArgumentError(
            "table has batch size 0: there is nothing to plan (a plan's grid "
            "must be launchable)")
    pages = np.asarray(pages)
    if pages.dtype != np.int32:  # a PageTable's are int32 (the plan's own dtype); else as int64
        pages = pages.astype(np.int64)
    if pages.shape != (batch,):
        raise InvalidArgumentError(
            f"table.request_pages must have shape ({batch},), got {pages.shape}")
    return batch, int(page_size), pages, ptr


def _group_tokens(dt: np.dtype, kv_dt: np.dtype, d: int, hpc: int) -> tuple[int, int] | None:
    """``(one warp's tokens, a CTA's tokens)`` of the rows kernel that serves
    the plan (:func:`cupaged._configs.tokens_per_warp` and ``tokens_per_cta``:
    twice the first on warp pairs), or None when it serves one token at a
    time (the CUDA-core core; a head_dim without an instance, which runs the
    gather path): then no row groups."""
    variant = _variant_of(dt, kv_dt)
    try:
        core = _configs.choose_core(variant, d, _env.core())
    except ValueError:
        return None
    tokens = _configs.tokens_per_cta(variant, d, hpc, core)
    return None if tokens == 1 else (_configs.tokens_per_warp(variant, d, hpc, core), tokens)


def _row_groups(ptr: np.ndarray, q_len: np.ndarray, tokens: int) -> np.ndarray:
    """``group_last`` of a plan of ``qo_indptr`` rows (int64 ``ptr``, each
    request's ``q_len``): each request's tokens in groups of ``tokens``."""
    start = np.repeat(ptr[:-1], q_len)
    j = np.arange(int(ptr[-1])) - start
    last = start + np.minimum((j // tokens + 1) * tokens, np.repeat(q_len, q_len)) - 1
    last = last.astype(np.int32)
    last.setflags(write=False)
    return last


def group_leaders(group_last: np.ndarray) -> np.ndarray:
    """Whether each row starts its row group (bool ``[B]``)."""
    lead = np.ones(group_last.shape[0], dtype=bool)
    np.not_equal(group_last[1:], group_last[:-1], out=lead[1:])
    return lead


def rows_form_groups(table: Any, group_last: np.ndarray) -> bool:
    """Whether ``table``'s rows can be ``group_last``'s row groups: each row
    after a group's first is the next token of the row before (one more
    visible slot, the same first page offset, and that row's last page at
    the same place in its own list), as :meth:`PageTable.query_rows` makes
    them. (O(B): the kernel reads a group's pages from its last row.)"""
    if not isinstance(table, PageTable) or group_last.shape[0] != table.batch_size:
        return False
    follow = np.flatnonzero(~group_leaders(group_last))
    if follow.size == 0:
        return True
    seq, off, pages = table.seq_lens, table.first_page_offset, table.request_pages
    prev = follow - 1
    if not (np.array_equal(seq[follow], seq[prev] + 1) and np.array_equal(off[follow], off[prev])):
        return False
    at = pages[prev].astype(np.int64) - 1  # the previous row's last page is this row's page there
    return bool(np.array_equal(table.indices[table.indptr[prev] + at], table.indices[table.indptr[follow] + at]))


def _grouped_chunking(pages: np.ndarray, group_last: np.ndarray | None,
                      *args) -> tuple[int, np.ndarray, np.ndarray, int, int, int]:
    """:func:`_chunking` (``args`` after ``pages``); with row groups
    (``pages`` already each row's group's) each group is planned once, as
    one request, and its rows take its split (the units stay the groups')."""
    if group_last is None:
        return _chunking(pages, *args)
    lead = group_leaders(group_last)
    target, chunk_pages, req_chunks, units, longest, held = _chunking(pages[lead], *args)
    of_group = np.cumsum(lead) - 1
    return target, chunk_pages[of_group], req_chunks[of_group], units, longest, held


def _chunking(pages: np.ndarray, page_size: int, grid_y: int, dt: np.dtype, kv_dt: np.dtype, d: int, hpc: int,
              deterministic: bool, pages_per_chunk: int | None, max_pages_per_chunk: int | None,
              target: int, sms: int | None, rows: bool = False,
              fewer: bool = True) -> tuple[int, np.ndarray, np.ndarray, int, int, int]:
    """``(target_ctas, chunk_pages, chunks, units, longest, ctas_per_sm)`` of
    :func:`plan_decode` (its arguments already checked): the CTA target,
    each request's chunk size and count (in the dtype of ``pages``), the
    chunk count in all, the largest chunk size and the CTAs per SM the
    launches hold to. ``rows``: some CTA holds several query tokens' rows
    (the step model's multi-token constants); ``fewer``: the default plan
    may weigh fewer CTAs per SM than the kernel's count. ``(target, sms)``
    is :func:`_target_and_sms`'s, resolved once by the caller."""
    held = ctas_per_sm(dt, kv_dt, d, hpc)
    longest_request = None
    if pages_per_chunk is not None:
        c = pages_per_chunk
    elif max_pages_per_chunk is not None:
        c = None
    elif deterministic:
        c = deterministic_pages_per_chunk(page_size)  # the batch and the device play no part
    elif sms is None:  # an explicit target (argument or env): the plain search
        c = choose_pages_per_chunk(pages, grid_y, target)
    else:
        page_bytes = page_size * 2 * d * kv_dt.itemsize
        resident = held
        held, max_pages_per_chunk, longest_request = schedule.choose_cap_and_residency(
            pages, grid_y, sms, held, page_bytes, -(-MIN_CHUNK_TOKENS // page_size), kv_dt.itemsize, rows, fewer, d)
        split = _split(pages, max_pages_per_chunk, True, longest_request)
        if not rows and kv_dt.itemsize == 2 and d == 128 and held == resident:  # (where it was measured)
            n = schedule.fill_waves(pages, split[2], split[0], min(split[3], longest_request), grid_y, held * sms,
                                    page_bytes)
            if n is not None:
                split = _split_into(pages, n, max_pages_per_chunk)
        return (target, *split, held)
    if c is None:
        return (target, *_split(pages, max_pages_per_chunk, True, longest_request), held)
    return (target, *_split(pages, c, False, longest_request), held)


def _split(pages: np.ndarray, cap: int, balanced: bool,
           longest_request: int | None = None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(chunk_pages, chunks, units, longest)`` of :func:`_chunking`: each
    request's chunk size and count (in the dtype of ``pages``), the chunk
    count in all and the largest chunk size, of a ``balanced`` split (each
    request in the fewest equal chunks of at most ``cap`` pages) or a
    uniform one (chunks of ``cap`` pages). ``longest_request``: the most
    pages of a request, where the caller knows it."""
    if longest_request is None:
        longest_request = int(np.maximum.reduce(pages))
    batch = pages.shape[0]
    if longest_request <= cap:  # no request splits (often so in ragged batches): one chunk each, of the cap
        return _filled(batch, cap, pages.dtype), _filled(batch, 1, pages.dtype), batch, cap
    # max(1, ceil(p / c)) == below // c + 1: for p >= 1 (p - 1) // c + 1 is
    # ceil(p / c), and an empty request has below = 0 (one chunk). Two passes
    # each, in the table's int32 (c <= 2**31 - 1 and p < 2**31 cannot overflow),
    # with 0-d operands of that dtype (a Python int costs ~0.3 µs more a pass).
    one, cap_0d = _ONE[pages.dtype], np.array(cap, dtype=pages.dtype)
    below = np.maximum(pages, one)
    below -= one
    chunks = below // cap_0d
    chunks += one
    if balanced:
        chunk_pages = below // chunks  # schedule.split_pages, in place
        chunk_pages += one
        # An unsplit request's chunk is the cap itself, not its pages (the
        # kernel clips a chunk to its request): the plan then matches the
        # table until the request outgrows the cap, so a server holds it
        # across decode steps instead of re-planning at every page boundary.
        np.copyto(chunk_pages, cap_0d, where=chunks == one)
    else:
        chunk_pages = _filled(batch, cap, pages.dtype)
    units = int(np.add.reduce(chunks))  # (an int32 sum comes back as int64: no overflow)
    # with fewer than 2 chunks a request, some request is unsplit: its chunk, the cap, is the largest
    longest = cap if units < 2 * batch else int(np.maximum.reduce(chunk_pages))
    return chunk_pages, chunks, units, longest


def _split_into(pages: np.ndarray, chunks: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """:func:`_split`'s result for ``chunks`` chunks per request (>= 1 each),
    made equal (``ceil(p / n)`` pages, then the count that size gives); an
    unsplit request's chunk is ``cap``, as in :func:`_split`."""
    p = pages.astype(np.int64)
    size = np.maximum(-(-p // chunks), 1)
    n = np.maximum(-(-p // size), 1)
    size = np.where(n == 1, np.maximum(p, cap), size)
    chunk_pages, n = size.astype(pages.dtype), n.astype(pages.dtype)
    return chunk_pages, n, int(n.sum()), int(chunk_pages.max())


def _readonly_one(dtype: type) -> np.ndarray:
    one = np.array(1, dtype=dtype)
    one.flags.writeable = False
    return one


#: 1 as a 0-d array of each dtype a plan's page counts may have (int32 from a PageTable, else int64).
_ONE = {np.dtype(t): _readonly_one(t) for t in (np.int32, np.int64)}


def _filled(size: int, value: int, dtype: np.dtype) -> np.ndarray:
    """``np.full(size, value, dtype)`` in ~0.3 µs less (np.full's Python wrapper)."""
    a = np.empty(size, dtype=dtype)
    a.fill(value)
    return a


@functools.lru_cache(maxsize=64)
def _heads_per_cta(group: int) -> int:
    """:func:`heads_per_cta` of a group size already checked, cached."""
    return heads_per_cta(group)


def _target_and_sms(target_ctas: int | None, num_sms: int | None) -> tuple[int, int | None]:
    """``(resolve_target_ctas(target_ctas, num_sms), SM count)``, the SM count
    None when the target is explicit (the argument, else env
    ``CUPAGED_TARGET_CTAS``): then no SM count is looked up. Each source is
    read once (the default plan needs both, and a device query is not free)."""
    target = target_ctas if target_ctas is not None else _env.target_ctas()
    if target is not None:
        return target, None
    sms = resolve_num_sms(num_sms)
    return default_target_ctas(sms), sms


def _chunk_layout(pages: np.ndarray, chunk_pages: np.ndarray, req_chunks: np.ndarray,
                  n: int, short_keys: bool = False) -> dict[str, np.ndarray]:
    """The plan's arrays (fields of :class:`DecodePlan`) of ``n`` chunks,
    request ``i`` in ``req_chunks[i]`` chunks of ``chunk_pages[i]`` pages:
    fresh, read-only int32 arrays. ``short_keys`` promises that every
    chunk's launch-order key (minus its pages) fits in int16.

    The inputs are int32 from a PageTable (int64 from another table): a
    chunk's first page ``chunk_index * chunk_size`` is below its request's
    pages, so no value here passes them, and every index stays below ``n``,
    which the grid limit keeps under 2**31."""
    batch = pages.shape[0]
    if n == batch:  # no request is split: chunk i is all of request i
        chunk_request = np.arange(batch, dtype=np.int32)
        o_indptr = np.arange(batch + 1, dtype=np.int32)
        chunk_index = np.zeros(batch, dtype=np.int32)
        key = -pages
    else:
        o_indptr, chunk_request, chunk_index, key = _split_chunks(pages, chunk_pages, req_chunks, n)
    if req_chunks.dtype != np.int32:  # (from a table whose request_pages are not int32)
        req_chunks, chunk_pages = req_chunks.astype(np.int32), chunk_pages.astype(np.int32)
    if short_keys:  # NumPy sorts 16-bit keys stably by radix, in O(n) (wider ones by timsort)
        key = key.astype(np.int16)
    arrays = dict(o_indptr=o_indptr, chunk_request=chunk_request, chunk_index=chunk_index,
                  request_chunks=req_chunks, request_chunk_pages=chunk_pages,
                  launch_order=key.argsort(kind="stable").astype(np.int32))  # longest first, ties in chunk order
    for a in arrays.values():
        a.setflags(write=False)
    return arrays


def _split_chunks(pages: np.ndarray, chunk_pages: np.ndarray, req_chunks: np.ndarray,
                  n: int) -> tuple[np.ndarray, ...]:
    """``(o_indptr, chunk_request, chunk_index, key)`` of :func:`_chunk_layout`
    where some request has several chunks; ``key`` is minus each chunk's
    length (its pages, the last one's rest)."""
    o_indptr = np.zeros(pages.shape[0] + 1, dtype=np.int32)
    np.add.accumulate(req_chunks, out=o_indptr[1:])  # (np.cumsum's wrapper costs ~1 µs)
    # each chunk's request as intp: NumPy indexes with it ~4x faster than with int32
    request = _arange(pages.shape[0]).repeat(req_chunks)
    chunk_index = np.arange(n, dtype=np.int32)
    chunk_index -= o_indptr[request]
    chunk_size = chunk_pages[request]
    key = chunk_index * chunk_size
    key -= pages[request]
    np.maximum(key, -chunk_size, out=key)
    return o_indptr, request.astype(np.int32), chunk_index, key


@functools.lru_cache(maxsize=16)
def _arange(n: int) -> np.ndarray:
    """``np.arange(n)`` (intp), read-only: an operand only, never a plan's
    own array; cached per batch size (it repeats from one decode step to
    the next)."""
    a = np.arange(n)
    a.setflags(write=False)
    return a
