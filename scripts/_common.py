"""Shared helpers of the evidence scripts (correctness.py, microbench.py) and
the pytest-benchmark suite (tests/bench).

What lives here:

* the **adversarial batch layout** (NumPy only, testable without a GPU):
  ragged visible lengths just below ``ctx``, ``ceil(B/2)`` requests starting
  mid-page, physical pages taken in *reverse* order (or a random scatter) out
  of a pool with 2x slack, so a kernel that ignored ``indices`` reads the
  wrong pages and fails;
* the device side (cupy, imported lazily): caches and queries filled with
  random normal values generated in float32 on the GPU and cast to the
  storage dtype;
* the no-GPU check: ``require_gpu()`` prints :data:`NO_GPU_MESSAGE` to stderr
  and exits with status :data:`EXIT_NO_GPU` (3);
* CSV and markdown writers that take the column list as a tuple (each script
  keeps its own module-level tuple; columns are appended, never reordered);
* byte counting for the memory-bound roofline.

Nothing here touches cupy or the GPU at import time.
"""

from __future__ import annotations

import csv
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:  # the shared batch, timing and byte helpers (no GPU at import)
    from cupaged import testing as _testing
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cupaged import testing as _testing

#: Exit status of a script started on a machine without a CUDA GPU.
EXIT_NO_GPU = 3
NO_GPU_MESSAGE = (
    "no CUDA GPU available (cupaged.has_gpu() is False): this script needs an NVIDIA GPU; exiting with status 3"
)
#: Text for an argparse epilog (both scripts document their exit codes).
EXIT_CODES_EPILOG = (
    "exit status: 0 = everything passed/ran, 1 = a check failed, 2 = bad arguments, 3 = no CUDA GPU on this machine"
)

#: H200 read roofline (bytes/s) used for every "% of roofline" column (cupaged.testing's).
ROOFLINE_BPS = _testing.ROOFLINE_BPS

DTYPE_NAMES = ("float16", "bfloat16", "float32")
PAGE_ORDERS = ("reverse", "random")


# ---------------------------------------------------------------- dtypes, args


def resolve_dtype(name: str) -> np.dtype:
    """``"float16" | "bfloat16" | "float32"`` -> NumPy dtype (bfloat16 from
    ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name in ("float16", "float32"):
        return np.dtype(name)
    raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPE_NAMES)}")


def parse_list(values: Iterable[str] | None, cast=str) -> tuple | None:
    """Flatten argparse ``nargs='+'`` values that may also be comma lists:
    ``["512,4096", "16384"]`` -> ``(512, 4096, 16384)``. ``None`` stays
    ``None`` (axis not overridden)."""
    if values is None:
        return None
    out = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if part:
                out.append(cast(part))
    if not out:
        raise ValueError("empty list")
    return tuple(out)


# ------------------------------------------------------------------ GPU check


def has_gpu() -> bool:
    """``cupaged.has_gpu()``; when the package does not provide it (yet), the
    same test done here: cupy imports and reports at least one device."""
    try:
        import cupaged

        fn = cupaged.has_gpu
    except (ImportError, AttributeError):
        fn = None
    if fn is not None:
        return bool(fn())
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def require_gpu() -> None:
    """Exit with :data:`EXIT_NO_GPU` and a clear message when there is no GPU."""
    if not has_gpu():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        sys.exit(EXIT_NO_GPU)


#: Device memory the driver takes back keeps the HBM busy for a while after
#: ``free_all_blocks`` returns: on the H200 a decode timed right after 34 GB
#: were freed ran 13 % slower for ~80 ms (8 GB: ~20 ms), FlashInfer's the same
#: way, ~0.4 TB/s of work nobody asked for (2026-12-04, docs/architecture.md
#: "Benchmarks wait out freed memory"). A server, its KV cache allocated once,
#: never sees it; a benchmark cell after a larger one did (the issue-5 suite's
#: 1 x 131072 after 128 x 32768: 145 us instead of 128). So the next cell waits
#: this rate's time per freed byte, about twice what the slowdown lasted.
FREED_BYTES_PER_S = 200e9


def free_gpu_memory(torch: Any = None) -> None:
    """Return every cached block of cupy's pools (and of ``torch``'s caching
    allocator, the FlashInfer peer's, when given) to the driver (call after
    dropping the references of one configuration), then wait out what the
    driver does with them (:data:`FREED_BYTES_PER_S`; 34 GB: 0.17 s)."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    pool = cupy.get_default_memory_pool()
    held = pool.total_bytes()
    pool.free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    freed = held - pool.total_bytes()
    if torch is not None:
        reserved = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        freed += reserved - torch.cuda.memory_reserved()
    if freed > 0:
        time.sleep(freed / FREED_BYTES_PER_S)


def sweep_axes(base: Mapping[str, tuple], args: Any, axes: Sequence[str]) -> dict:
    """The sweep table ``base`` with every axis flag given on the command line
    (``args.<axis>`` not None) replacing its axis."""
    out = dict(base)
    for axis in axes:
        if getattr(args, axis) is not None:
            out[axis] = tuple(getattr(args, axis))
    return out


# --------------------------------------------------------- batch layout (NumPy)


@dataclass(frozen=True)
class BatchLayout:
    """Host description of one adversarial batch (no cupaged, no cupy).

    ``page_ids[indptr[i]:indptr[i+1]]`` (indptr = cumsum of
    ``request_pages``) are request ``i``'s physical pages in logical order,
    all ``< num_pages``.
    """

    page_size: int
    seq_lens: np.ndarray  # int64 [B] visible tokens
    first_page_offset: np.ndarray  # int64 [B] 0 or in [1, page_size)
    request_pages: np.ndarray  # int64 [B] ceil((off + len) / P)
    page_ids: np.ndarray  # int32 [total_pages]
    num_pages: int  # size of the pool the ids come from

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def total_pages(self) -> int:
        return int(self.page_ids.shape[0])

    @property
    def total_tokens(self) -> int:
        return int(self.seq_lens.sum())


def plan_layout(
    batch: int,
    ctx: int,
    page_size: int,
    *,
    seed: int,
    mid_page: bool = True,
    slack: int = 2,
    page_order: str = "reverse",
    min_num_pages: int = 0,
) -> BatchLayout:
    """Adversarial batch layout, NumPy only.

    * request ``i`` sees ``ctx - r_i`` tokens, ``r_i`` uniform in
      ``[0, min(page_size, ctx))``: the last pages are ragged (``r_i = 0`` with
      offset 0 gives an exactly full last page);
    * with ``mid_page``, ``ceil(batch/2)`` requests chosen at random start at
      ``first_page_offset`` uniform in ``[1, page_size)``; the visible length
      stays as chosen (the request just spans one more page when needed);
    * the pool has ``num_pages = max(slack * total_pages, min_num_pages)``
      pages; ``page_order="reverse"`` hands out ids descending from the top
      of the pool with stride ``num_pages // total_pages`` (>= 2 with the
      default slack: request 0's first page is ``num_pages - 1``);
      ``"random"`` takes a random sample of distinct ids in random order.

    Example: ``plan_layout(2, 40, 16, seed=0)`` -> two requests of 25..40
    tokens, one starting mid-page, ~6 pages out of a 12-page pool, ids
    ``11, 9, 7, ...``.
    """
    if batch < 1 or ctx < 1:
        raise ValueError(f"batch and ctx must be >= 1, got {batch}, {ctx}")
    if page_size < 2 and mid_page:
        raise ValueError("mid-page starts need page_size >= 2")
    if slack < 1:
        raise ValueError(f"slack must be >= 1, got {slack}")
    if page_order not in PAGE_ORDERS:
        raise ValueError(f"page_order must be one of {PAGE_ORDERS}, got {page_order!r}")
    rng = np.random.default_rng(seed)
    trim = rng.integers(0, min(page_size, ctx), size=batch)
    seq_lens = (ctx - trim).astype(np.int64)
    offsets = np.zeros(batch, dtype=np.int64)
    if mid_page:
        chosen = rng.choice(batch, size=(batch + 1) // 2, replace=False)
        offsets[chosen] = rng.integers(1, page_size, size=chosen.shape[0])
    request_pages = -(-(offsets + seq_lens) // page_size)
    total = int(request_pages.sum())
    num_pages = max(slack * total, int(min_num_pages))
    if num_pages > np.iinfo(np.int32).max:
        raise ValueError(f"pool of {num_pages} pages does not fit int32 page ids")
    if page_order == "reverse":
        stride = num_pages // total
        page_ids = (num_pages - 1) - stride * np.arange(total, dtype=np.int64)
    else:
        page_ids = rng.choice(num_pages, size=total, replace=False)
    return BatchLayout(
        page_size=int(page_size),
        seq_lens=seq_lens,
        first_page_offset=offsets,
        request_pages=request_pages.astype(np.int64),
        page_ids=page_ids.astype(np.int32),
        num_pages=int(num_pages),
    )


# ------------------------------------------------------ ragged length family
#: Distributions of ``--lengths`` (``NAME:ARG:ARG...``; tokens per request):
#: ``lognormal:MEDIAN:SIGMA``, ``uniform:LO:HI`` (HI exclusive),
#: ``bimodal:SHORT:LONG`` (half of each, the long ones first),
#: ``onelong:LONG:SHORT`` (one request of LONG, the rest SHORT) and
#: ``zipf:A:UNIT:MAX`` (UNIT * Zipf(A), capped at MAX).
LENGTH_DISTRIBUTIONS = ("lognormal", "uniform", "bimodal", "onelong", "zipf")
#: The ragged family of the benchmarks: (batch, spec, seed). Seeds fixed so
#: the batches are the same in every run; extend the family as users'
#: batches grow.
RAGGED_FAMILY = (
    (64, "onelong:131072:512", 0),
    (8, "onelong:32768:1024", 0),
    (128, "lognormal:1024:1.2", 1),
    (32, "lognormal:2048:1.0", 2),
    (256, "lognormal:512:1.0", 3),
    (16, "uniform:1:16384", 4),
    (64, "uniform:1:4096", 5),
    (8, "uniform:1:32768", 6),
    (64, "bimodal:256:16384", 7),
    (256, "zipf:1.5:256:32768", 8),
)


def parse_lengths(spec: str) -> tuple[str, tuple[float, ...]]:
    """``"lognormal:1024:1.2"`` -> ``("lognormal", (1024.0, 1.2))``; ValueError
    naming the expected arguments when malformed.

    >>> parse_lengths("uniform:1:4096")
    ('uniform', (1.0, 4096.0))
    """
    name, *args = spec.split(":")
    arity = {"lognormal": 2, "uniform": 2, "bimodal": 2, "onelong": 2, "zipf": 3}
    if name not in arity:
        raise ValueError(f"--lengths {spec!r}: distribution must be one of {', '.join(LENGTH_DISTRIBUTIONS)}")
    try:
        values = tuple(float(a) for a in args)
    except ValueError:
        values = ()
    if len(values) != arity[name] or min(values) <= 0:
        raise ValueError(f"--lengths {spec!r}: {name} takes {arity[name]} positive numbers "
                         f"(see LENGTH_DISTRIBUTIONS in scripts/_common.py)")
    return name, values


def ragged_lengths(spec: str, batch: int, seed: int) -> np.ndarray:
    """``batch`` sequence lengths (int64, >= 1) drawn from ``spec`` with ``seed``.

    >>> ragged_lengths("onelong:1000:10", 3, 0).tolist()
    [1000, 10, 10]
    >>> ragged_lengths("bimodal:5:50", 4, 0).tolist()
    [50, 50, 5, 5]
    """
    name, a = parse_lengths(spec)
    rng = np.random.default_rng(seed)
    if name == "lognormal":
        lens = np.round(a[0] * np.exp(a[1] * rng.standard_normal(batch)))
    elif name == "uniform":
        lens = rng.integers(int(a[0]), int(a[1]), size=batch)
    elif name == "bimodal":
        lens = np.where(np.arange(batch) < (batch + 1) // 2, a[1], a[0])
    elif name == "onelong":
        lens = np.where(np.arange(batch) == 0, a[0], a[1])
    else:
        lens = np.minimum(a[1] * rng.zipf(a[0], size=batch), a[2])
    return np.maximum(1, lens).astype(np.int64)


def lengths_layout(seq_lens, page_size: int, *, seed: int, slack: int = 2) -> BatchLayout:
    """A layout of the given visible lengths: no mid-page starts, distinct
    physical pages in random order out of a pool ``slack`` times the need."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    request_pages = -(-seq_lens // page_size)
    total = int(request_pages.sum())
    num_pages = slack * total
    rng = np.random.default_rng(seed)
    return BatchLayout(page_size=int(page_size), seq_lens=seq_lens,
                       first_page_offset=np.zeros_like(seq_lens), request_pages=request_pages,
                       page_ids=rng.choice(num_pages, size=total, replace=False).astype(np.int32),
                       num_pages=int(num_pages))


def layout_table(layout: BatchLayout):
    """The layout as a :class:`cupaged.PageTable` (built with
    ``PageTable.from_seq_lens``; validated against the pool size)."""
    from cupaged.page_table import PageTable

    table = PageTable.from_seq_lens(
        layout.seq_lens,
        layout.page_size,
        layout.first_page_offset,
        page_ids=layout.page_ids,
    )
    table.check_page_ids(layout.num_pages)
    return table


# ------------------------------------------------------------ device batch


@dataclass
class DeviceBatch:
    """Device tensors of one batch. ``caches`` holds ``replicas`` independent
    ``(k_cache, v_cache)`` pairs that share the page table (rotating between
    them keeps small cells out of L2)."""

    layout: BatchLayout
    table: Any  # cupaged.PageTable
    q: Any  # cupy [B, Hq, D]
    caches: list  # [(k_cache, v_cache)] cupy [num_pages, P, Hkv, D]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype

    @property
    def k_cache(self):
        return self.caches[0][0]

    @property
    def v_cache(self):
        return self.caches[0][1]


# standard normal values drawn in float32 on the GPU, chunked (cupaged.testing)
fill_random = _testing.fill_random
FILL_CHUNK = _testing.FILL_CHUNK


def make_device_batch(
    layout: BatchLayout,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: np.dtype,
    *,
    seed: int,
    replicas: int = 1,
) -> DeviceBatch:
    """Random q and ``replicas`` random cache pairs for ``layout``."""
    import cupy

    table = layout_table(layout)
    rs = cupy.random.RandomState(seed)
    shape = (layout.num_pages, layout.page_size, num_kv_heads, head_dim)
    caches = [(fill_random(shape, dtype, rs), fill_random(shape, dtype, rs)) for _ in range(replicas)]
    q = fill_random((layout.batch_size, num_qo_heads, head_dim), dtype, rs)
    cupy.cuda.Device().synchronize()
    return DeviceBatch(layout, table, q, caches, num_qo_heads, num_kv_heads, head_dim, np.dtype(dtype))


def nan_like(q) -> Any:
    """A fresh array of ``q``'s shape and dtype full of NaN (poisoned out)."""
    import cupy

    return cupy.full(q.shape, np.nan, dtype=cupy.float32).astype(q.dtype)


# ------------------------------------------------------- cold-L2 rotation
ROTATE_BYTES = 256 << 20  # visible K/V a timed graph cycles through before it reads a copy again
MAX_COPY_BYTES = 24 << 30  # the pools of all copies of one cell together, at most


def cache_copies(kv_bytes: int, pool_bytes: int, max_copies: int) -> int:
    """Copies of a cell's K/V pools its timed graphs rotate over, so no call
    reads a copy the L2 still holds (the H200's is 50 MB; a server's next
    layer reads another cache): enough that the calls cycle
    :data:`ROTATE_BYTES` when each reads ``kv_bytes``, at most
    ``max_copies``, and at most :data:`MAX_COPY_BYTES` of pools
    (``pool_bytes``: one copy's K and V pools).

    >>> cache_copies(33554432, 2 * 67108864, 64)   # 32 MiB a call: 8 copies
    8
    >>> cache_copies(4194304, 2 * 8388608, 16)     # 4 MiB a call: the cap
    16
    >>> cache_copies(34 << 20, 2 * (2 << 30), 16)  # 8 wanted, 24 GiB holds 6 pools
    6
    >>> cache_copies(512 << 20, 2 << 30, 16)       # more than ROTATE_BYTES a call: one copy
    1
    """
    want = -(-ROTATE_BYTES // max(kv_bytes, 1))
    fit = MAX_COPY_BYTES // max(pool_bytes, 1)
    return int(max(1, min(want, max_copies, fit)))


def rotating(fns: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """One callable that calls ``fns`` in turn (a graph of n captured calls
    holds n consecutive copies).

    >>> seen = []; call = rotating([lambda: seen.append(0), lambda: seen.append(1)])
    >>> for _ in range(3): call()
    >>> seen
    [0, 1, 0]
    """
    state = [0]

    def call():
        fns[state[0] % len(fns)]()
        state[0] += 1
    return call


# ------------------------------------------------------------------- bytes


def kv_bytes(layout: BatchLayout, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Every visible K and V element once (:func:`cupaged.testing.kv_bytes`)."""
    return _testing.kv_bytes(layout.total_tokens, num_kv_heads, head_dim, itemsize)


def decode_bytes(layout: BatchLayout, num_qo_heads: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes one decode must move: visible K and V once, q read, out written,
    and the int32 page table (indices, indptr, last_page_len,
    first_page_offset) (:func:`cupaged.testing.decode_bytes`)."""
    return _testing.decode_bytes(layout.total_tokens, layout.total_pages, layout.batch_size, num_qo_heads,
                                 num_kv_heads, head_dim, itemsize)


# ------------------------------------------------------------------ writers


def _check_keys(columns: Sequence[str], row: Mapping[str, Any]) -> None:
    extra = set(row) - set(columns)
    if extra:
        raise KeyError(f"row has keys not in the column list: {sorted(extra)}")


def write_csv(path: str | Path, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> None:
    """CSV with exactly ``columns`` as header, in that order; a missing key is
    an empty cell, an unknown key is an error (add it to the tuple, at the
    end)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in rows:
            _check_keys(columns, row)
            writer.writerow([_csv_value(row.get(c)) for c in columns])


def _csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "1" if value else "0"
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return "" if math.isnan(value) else repr(value)
    return str(value)


def format_value(value: Any) -> str:
    """Short human form: 4 significant digits for floats, yes/no for bools."""
    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if math.isnan(value):
            return ""
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def markdown_table(
    columns: Sequence[str], rows: Iterable[Mapping[str, Any]], headers: Mapping[str, str] | None = None
) -> str:
    """GitHub markdown table of ``rows`` restricted to ``columns`` (in that
    order); ``headers`` optionally renames columns for display."""
    headers = headers or {}
    lines = [
        "| " + " | ".join(headers.get(c, c) for c in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        cells = [format_value(row.get(c)).replace("|", "\\|") for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def text_table(
    columns: Sequence[str], rows: Sequence[Mapping[str, Any]], headers: Mapping[str, str] | None = None
) -> str:
    """Fixed-width plain-text table for terminal summaries."""
    headers = headers or {}
    head = [headers.get(c, c) for c in columns]
    body = [[format_value(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(h)] + [len(line[i]) for line in body]) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*line) for line in body])
