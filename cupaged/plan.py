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
import numbers
from typing import Any

import ml_dtypes  # noqa: F401  (registers "bfloat16" with np.dtype)
import numpy as np

from . import _env
from .errors import ArgumentTypeError, InvalidArgumentError, PlanMismatchError, ShapeError

__all__ = [
    "MAX_HEADS_PER_CTA",
    "CTAS_PER_SM",
    "LONG_CHUNK_TOKENS",
    "SPLIT_LIMIT",
    "DEFAULT_NUM_SMS",
    "MAX_GRID_X",
    "MAX_GRID_YZ",
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
    "default_pages_per_chunk",
    "device_num_sms",
    "resolve_num_sms",
    "resolve_target_ctas",
    "DecodePlan",
    "plan_decode",
]

#: Most query heads one CTA serves (its q-head group).
MAX_HEADS_PER_CTA = 8
#: CTAs one SM holds at once (the tensor-core kernel: 128 threads and 72 KB of
#: shared memory each, 2 per SM), so ``CTAS_PER_SM * num_sms`` CTAs are one
#: wave: the default chunk size (``default_pages_per_chunk``) fills at most
#: one wave, as evenly as the chunk count allows.
CTAS_PER_SM = 2
#: ... unless that split needs more than SPLIT_LIMIT chunks for a request and
#: its chunks are shorter than LONG_CHUNK_TOKENS: then the merge tail and the
#: per-CTA fixed costs outweigh the second CTA per SM, and the default takes
#: at most one CTA per SM instead. Chunks never drop below MIN_CHUNK_TOKENS.
#: Fitted to a sweep of chunk sizes on the H200 (2026-11-29; fp16, 32q/8kv
#: D128, 64q/8kv, 32q/32kv and D64; scripts/chunk_sweep.py; docs/architecture.md
#: "Chunk size: one wave"): e.g. batch 1 ctx 131072: 264 CTAs 141 us vs 200
#: CTAs 146; batch 4 ctx 32768: 256 CTAs 139.5 vs 224 143.4; batch 1 ctx 4096:
#: 128 CTAs 10.3 vs 256 CTAs 11.2.
SPLIT_LIMIT = 16
LONG_CHUNK_TOKENS = 1024
MIN_CHUNK_TOKENS = 128
#: SM count used when neither the argument, a device nor the env var gives one
#: (an NVIDIA H200 has 132 SMs).
DEFAULT_NUM_SMS = 132
#: CUDA grid limits.
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535

ENV_NUM_SMS = "CUPAGED_NUM_SMS"
ENV_TARGET_CTAS = "CUPAGED_TARGET_CTAS"

#: q/out dtypes the kernels are instantiated for (and KV dtypes, alone).
SUPPORTED_DTYPES = (
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(ml_dtypes.bfloat16),
)
#: The fp8 KV dtype (``ml_dtypes.float8_e4m3fn``: bias 7, max 448, no inf).
#: CuPy has no float8 dtype: on the GPU such a cache is a uint8 array of its
#: bit patterns, which is why ``plan_decode`` also accepts ``np.uint8`` for it.
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
#: ``(dtype, kv_dtype)`` pairs (q/out dtype, KV-cache dtype) a plan may have:
#: one shared dtype, or an fp8 cache read by a float16/bfloat16 query.
SUPPORTED_DTYPE_PAIRS = (
    (np.dtype(np.float16), np.dtype(np.float16)),
    (np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.bfloat16)),
    (np.dtype(np.float32), np.dtype(np.float32)),
    (np.dtype(np.float16), FLOAT8_E4M3),
    (np.dtype(ml_dtypes.bfloat16), FLOAT8_E4M3),
)
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
def _positive_int(value: Any, name: str) -> int:
    """``value`` as a Python int >= 1, else ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    value = int(value)
    if value < 1:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value}")
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
        raise InvalidArgumentError(
            f"dtype must be float16, float32 or bfloat16, got {dtype!r}") from exc
    if dt not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"dtype must be float16, float32 or bfloat16, got {dt}")
    return dt


def _pairs_text() -> str:
    return ", ".join(f"({q}, {kv})" for q, kv in SUPPORTED_DTYPE_PAIRS)


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
            f"kv_dtype must be a dtype; supported (dtype, kv_dtype) pairs: "
            f"{_pairs_text()}, got {kv_dtype!r}") from exc
    return FLOAT8_E4M3 if dt == np.uint8 else dt


def _kv_dtype(kv_dtype: Any, dtype: np.dtype) -> np.dtype:
    """The plan's KV dtype: ``dtype`` when None, else the canonical
    ``kv_dtype``, which must form a supported pair with ``dtype``."""
    if kv_dtype is None:
        return dtype
    kv = canonical_kv_dtype(kv_dtype)
    if (dtype, kv) not in SUPPORTED_DTYPE_PAIRS:
        raise InvalidArgumentError(
            f"unsupported (dtype, kv_dtype) = ({dtype}, {kv}); supported pairs: "
            f"{_pairs_text()} (an fp8 cache may be given as np.uint8 bits)")
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
    g = _positive_int(group_size, "group_size")
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
    return max(1, int(CTAS_PER_SM * _positive_int(num_sms, "num_sms")))


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
    c = _positive_int(pages_per_chunk, "pages_per_chunk")
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
    cpc = _positive_int(ctas_per_chunk, "ctas_per_chunk")
    target = _positive_int(target_ctas, "target_ctas")
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


def _smallest_c_within(pages: np.ndarray, cpc: int, limit: int) -> int:
    """Smallest ``c`` in ``[1, max(1, max pages)]`` with
    ``num_chunks(pages, c) * cpc <= limit``; the largest ``c`` (one chunk
    per request) when no ``c`` fits. Feasible ``c`` form a suffix
    (``num_chunks`` is non-increasing), so a binary search finds it."""
    lo, hi = 1, max(1, int(pages.max()) if pages.size else 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(_chunks_per_request(pages, mid).sum()) * cpc <= limit:
            hi = mid
        else:
            lo = mid + 1
    return lo


# --------------------------------------------------------------------------
# device / environment
# --------------------------------------------------------------------------
_SM_CACHE: dict[int, int] = {}


def default_pages_per_chunk(request_pages: Any, ctas_per_chunk: int, num_sms: int,
                            page_size: int) -> int:
    """The default chunk size, calibrated on the H200.

    1. One wave: the smallest ``c`` with at most ``default_target_ctas(num_sms)``
       (2 per SM) CTAs. Every CTA of a split has the same work, so the
       kernel ends with its busiest SM: a grid between one and two CTAs per
       SM leaves some SMs doubled and the rest half idle, and a grid past one
       wave adds a partial second wave. A batch that needs more than one wave
       unsplit is not split.
    2. Fewer, longer chunks for a short request: when that split gives some
       request more than ``SPLIT_LIMIT`` chunks of under
       ``LONG_CHUNK_TOKENS`` tokens, the smallest ``c`` with at most one CTA
       per SM instead (each CTA has a fixed cost -- query, page ids,
       pipeline fill, partial write -- and the last one merges every chunk).
    3. Never below ``MIN_CHUNK_TOKENS`` tokens per chunk (capped at the
       longest request).
    4. Even out the longest request's chunks at the same chunk count (a
       search can return 255 of 256 pages, leaving a 1-page straggler), when
       that adds no chunk to another request.

    Worked examples (132 SMs, page 16, 8 kv heads x 1 q group = 8 CTAs/chunk):

    >>> default_pages_per_chunk([8192], 8, 132, 16)         # batch 1, ctx 131072: 33 chunks, 264 CTAs
    249
    >>> default_pages_per_chunk([2048] * 4, 8, 132, 16)     # batch 4, ctx 32768: 8 chunks each, 256 CTAs
    256
    >>> default_pages_per_chunk([256], 8, 132, 16)          # batch 1, ctx 4096: 16 chunks, 128 CTAs
    16
    >>> default_pages_per_chunk([64], 8, 132, 16)           # batch 1, ctx 1024: 128 tokens a chunk
    8
    >>> default_pages_per_chunk([256] * 128, 8, 132, 16)    # batch 128, ctx 4096: no split
    256

    Measured (fp16, 32q/8kv, D 128, page 16; µs under graph replay, H200,
    2026-11-29, docs/architecture.md "Chunk size: one wave"): batch 1 ctx
    131072: c=249 141.2 (c=328, the previous 1.5-per-SM default, 145.6);
    batch 4 ctx 32768: c=256 139.5 (c=293: 143.4); batch 1 ctx 4096: c=16
    10.3 (c=8, 256 CTAs: 11.2).
    """
    pages = _request_pages(request_pages)
    per_chunk = _positive_int(ctas_per_chunk, "ctas_per_chunk")
    sms = _positive_int(num_sms, "num_sms")
    p = _positive_int(page_size, "page_size")
    longest = max(1, int(pages.max(initial=1)))
    c = _smallest_c_within(pages, per_chunk, default_target_ctas(sms))
    if -(-longest // c) > SPLIT_LIMIT and c * p < LONG_CHUNK_TOKENS:
        c = _smallest_c_within(pages, per_chunk, sms)
    c = min(max(c, -(-MIN_CHUNK_TOKENS // p)), longest)
    even = -(-longest // -(-longest // c))
    # (evening out must not give a shorter request one more chunk: the grid
    # would outgrow the wave it was sized for)
    return even if num_chunks(pages, even) == num_chunks(pages, c) else c


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
    return max(1, DETERMINISTIC_CHUNK_TOKENS // _positive_int(page_size, "page_size"))


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
        return _positive_int(num_sms, "num_sms")
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
        return _positive_int(target_ctas, "target_ctas")
    env = _env_positive_int(ENV_TARGET_CTAS)
    if env is not None:
        return env
    return default_target_ctas(resolve_num_sms(num_sms))


# --------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------
def _readonly_int32(arr: Any, name: str) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {a.shape}")
    a = np.array(a, dtype=np.int32, copy=True, order="C")
    a.flags.writeable = False
    return a


_ARRAY_FIELDS = ("chunk_request", "chunk_index", "o_indptr", "request_chunks")


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
    * ``pages_per_chunk`` (``c``), ``target_ctas``, ``num_chunks``.
    * ``chunk_request [num_chunks]``: request of each chunk (non-decreasing).
    * ``chunk_index [num_chunks]``: index ``j`` of the chunk within its
      request; its pages are ``[j*c, min((j+1)*c, pages_i))`` relative to the
      request's first page.
    * ``o_indptr [B+1]``: chunks of request ``i`` are
      ``o_indptr[i]:o_indptr[i+1]`` (the merge kernel's CSR).
    * ``request_chunks [B]``: ``max(1, ceil(pages_i / c))``.
    * ``num_ctas = num_chunks * num_kv_heads * q_groups``.
    * ``grid = (num_chunks, num_kv_heads * q_groups, 1)``.
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
    (12, (12, 8, 1), True, [0, 11, 12])
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

    def __post_init__(self) -> None:
        for name in _ARRAY_FIELDS:
            object.__setattr__(self, name,
                               _readonly_int32(getattr(self, name), name))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "kv_dtype", self.dtype if self.kv_dtype is None
                           else canonical_kv_dtype(self.kv_dtype))
        object.__setattr__(self, "deterministic", bool(self.deterministic))
        object.__setattr__(self, "grid", tuple(int(v) for v in self.grid))

    # -- reuse across decode steps -----------------------------------------
    def matches(self, table: Any) -> bool:
        """True when this plan can serve ``table``: same batch size and page
        size, and every request still has ``request_chunks[i]`` chunks at this
        ``pages_per_chunk``.  Cheap and vectorized (one pass over ``B``)."""
        if int(table.batch_size) != self.batch_size:
            return False
        if int(table.page_size) != self.page_size:
            return False
        pages = np.asarray(table.request_pages, dtype=np.int64)
        counts = _chunks_per_request(pages, self.pages_per_chunk)
        return bool(np.array_equal(counts, self.request_chunks))

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
        start = np.minimum(first + self.chunk_index.astype(np.int64)
                           * self.pages_per_chunk, last)
        end = np.minimum(start + self.pages_per_chunk, last)
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
        p0 = np.minimum(self.chunk_index.astype(np.int64) * self.pages_per_chunk,
                        pages)
        p1 = np.minimum(p0 + self.pages_per_chunk, pages)
        start = np.clip(p0 * P - off, 0, seq)
        end = np.clip(p1 * P - off, 0, seq)
        return start, end

    def _check_table(self, table: Any) -> None:
        if not self.matches(table):
            from ._validate import plan_mismatch_reason  # (imports page_table)

            raise PlanMismatchError(f"plan does not match the page table "
                                    f"({plan_mismatch_reason(self, table)}); build a new plan")


def plan_decode(table: Any, num_qo_heads: int, num_kv_heads: int,
                head_dim: int, dtype: Any, *, kv_dtype: Any = None,
                deterministic: bool = False, pages_per_chunk: int | None = None,
                target_ctas: int | None = None,
                num_sms: int | None = None) -> DecodePlan:
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
        pages_per_chunk: keyword-only; used as given (``>= 1``). When None:
            with ``deterministic``, :func:`deterministic_pages_per_chunk`;
            else with an explicit target (``target_ctas``, else env
            ``CUPAGED_TARGET_CTAS``) the largest chunk giving at least that
            many CTAs (:func:`choose_pages_per_chunk` with ``ctas_per_chunk =
            num_kv_heads * q_groups``); otherwise the calibrated default
            :func:`default_pages_per_chunk`.
        target_ctas: keyword-only CTA target (default None).
        num_sms: keyword-only SM count for the default (default None: the
            current CUDA device's, else env ``CUPAGED_NUM_SMS``, else 132).

    Environment variables are read at call time; an empty value counts as
    unset.

    Returns:
        A :class:`DecodePlan`. Hold it across decode steps while
        ``plan.matches(table)``.

    Raises:
        InvalidArgumentError (a ValueError; ShapeError for heads not divisible, ArgumentTypeError for a table that is not a PageTable) naming the argument: an empty batch (``B == 0``); a size
        (heads, ``head_dim``, ``pages_per_chunk``, ``target_ctas``,
        ``num_sms``) that is not a positive integer; ``num_qo_heads`` not a
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
    hq = _positive_int(num_qo_heads, "num_qo_heads")
    hkv = _positive_int(num_kv_heads, "num_kv_heads")
    if hq % hkv:
        raise ShapeError(
            f"num_qo_heads ({hq}) must be divisible by num_kv_heads ({hkv})")
    d = _positive_int(head_dim, "head_dim")
    if d % 8:
        raise InvalidArgumentError(
            f"head_dim must be a positive multiple of 8, got {d}")
    dt = _q_dtype(dtype)
    kv_dt = _kv_dtype(kv_dtype, dt)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise InvalidArgumentError(
            f"deterministic must be True or False, got {deterministic!r}")
    if pages_per_chunk is not None:
        pages_per_chunk = _positive_int(pages_per_chunk, "pages_per_chunk")
    if target_ctas is not None:
        target_ctas = _positive_int(target_ctas, "target_ctas")
    if num_sms is not None:
        num_sms = _positive_int(num_sms, "num_sms")

    if not all(hasattr(table, a) for a in ("batch_size", "page_size", "request_pages")):
        raise ArgumentTypeError(
            f"table must be a cupaged.PageTable (batch_size, page_size, request_pages), "
            f"got {type(table).__name__}")
    batch = int(table.batch_size)
    if batch < 1:
        raise InvalidArgumentError(
            "table has batch size 0: there is nothing to plan (a plan's grid "
            "must be launchable)")
    page_size = int(table.page_size)
    pages = np.asarray(table.request_pages, dtype=np.int64)
    if pages.shape != (batch,):
        raise InvalidArgumentError(
            f"table.request_pages must have shape ({batch},), got {pages.shape}")

    group = hq // hkv
    hpc = heads_per_cta(group)
    q_groups = group // hpc
    grid_y = hkv * q_groups
    if grid_y > MAX_GRID_YZ:
        raise InvalidArgumentError(
            f"num_kv_heads * q_groups = {hkv} * {q_groups} = {grid_y} exceeds "
            f"the CUDA grid limit {MAX_GRID_YZ} (grid y); too many heads")

    target = resolve_target_ctas(target_ctas, num_sms)
    if pages_per_chunk is not None:
        c = pages_per_chunk
    elif deterministic:
        c = deterministic_pages_per_chunk(page_size)  # the batch and the device play no part
    elif target_ctas is not None or _env_positive_int(ENV_TARGET_CTAS) is not None:
        c = choose_pages_per_chunk(pages, grid_y, target)  # an explicit target: the plain search
    else:
        c = default_pages_per_chunk(pages, grid_y, resolve_num_sms(num_sms), page_size)

    req_chunks = _chunks_per_request(pages, c)
    n = int(req_chunks.sum())
    if n > MAX_GRID_X:
        raise InvalidArgumentError(
            f"{n} chunks exceed the CUDA grid limit {MAX_GRID_X} (grid x); "
            f"raise pages_per_chunk")
    o_indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(req_chunks, out=o_indptr[1:])
    chunk_request = np.repeat(np.arange(batch, dtype=np.int64), req_chunks)
    chunk_index = np.arange(n, dtype=np.int64) - o_indptr[chunk_request]
    needs_merge = bool(int(req_chunks.max()) > 1)
    workspace = (n * hq * d + n * hq) * 4 if needs_merge else 0

    return DecodePlan(
        batch_size=batch,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        dtype=dt,
        group_size=group,
        heads_per_cta=hpc,
        q_groups=q_groups,
        pages_per_chunk=int(c),
        target_ctas=int(target),
        num_chunks=n,
        chunk_request=chunk_request,
        chunk_index=chunk_index,
        o_indptr=o_indptr,
        request_chunks=req_chunks,
        num_ctas=n * grid_y,
        grid=(n, grid_y, 1),
        needs_merge=needs_merge,
        workspace_bytes=workspace,
        kv_dtype=kv_dt,
        deterministic=bool(deterministic),
    )
