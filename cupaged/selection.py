"""Which path a decode call takes (v2, v1 or gather) and why: the method
argument and env ``CUPAGED_DECODE``, then what the kernels decline (a
head_dim without an instance, a strided or misaligned array, per-head scales
or sinks on v1), which falls back to the gather path with the reason."""

from __future__ import annotations

from dataclasses import dataclass

from . import _env
from ._arrays import as_cupy
from ._checks import check_inputs, kernel_decline_reason, nhd_views
from ._log import log_fallback
from .errors import UnsupportedConfigError
from .page_table import PageTable, kernel_table
from .plan import DecodePlan

METHODS = ("auto", "v2", "v1", "gather")


@dataclass(frozen=True)
class Selection:
    """The path a decode call takes and why; :func:`select_method` returns it.

    A frozen dataclass (compares by value, hashable).

    Fields:
        method: ``"v2"``, ``"v1"`` or ``"gather"`` (``"auto"`` is resolved,
            never returned).
        reason: a human-readable string: ``"requested"`` (that method was
            asked for, by argument or env ``CUPAGED_DECODE``), ``"auto: ..."``
            (what ``method="auto"`` picked), or ``"fallback from <method>:
            <why>"`` when the kernels decline the tensors and the gather path
            runs instead.

    Example:

    >>> import cupaged
    >>> sel = cupaged.Selection("gather", "requested")
    >>> sel.method, sel.reason
    ('gather', 'requested')
    """

    method: str  # "v2", "v1" or "gather"
    reason: str


def default_method() -> str:
    return _env.decode_method()  # CUPAGED_DECODE, validated


def auto_method() -> Selection:
    """What ``method="auto"`` picks for a call the kernels can serve (any
    batch: the choice does not depend on it).

    v2 everywhere: the H200 microbenchmark (docs/benchmarks/) shows no cell
    where v1 or gather is faster.
    """
    return Selection("v2", "auto: split-KV v2 (fastest in every measured cell)")


def select_method(q, k_cache, v_cache, table: PageTable, plan: DecodePlan | None = None, method: str = "auto", *,
                  kv_layout: str = "NHD", per_head_scales: bool = False, sinks: bool = False, window_left=None,
                  qo_indptr=None) -> Selection:
    """The path :func:`decode` takes for these arguments, and why.

    Launches nothing. Runs ``decode``'s input checks, but not its GPU check,
    its ``out`` check or its plan checks.

    Args:
        q, k_cache, v_cache, table: as for :func:`decode`: ``q [B, Hq, D]``,
            caches ``[num_pages, page_size, Hkv, D]`` (NHD) CuPy (or CUDA)
            arrays of one dtype, and the batch's :class:`PageTable`.
        plan: accepted so a ``decode`` call can be mirrored verbatim; unused
            and unchecked (the choice does not depend on it).
        method: ``"auto"`` (default; env ``CUPAGED_DECODE`` overrides it),
            ``"v2"``, ``"v1"`` or ``"gather"``, as for ``decode``.
        kv_layout: ``"NHD"`` or ``"HND"``, as for ``decode``.
        per_head_scales: True when the call passes per-head (array)
            ``k_scale``/``v_scale`` (v1 takes per-tensor scales only).
        sinks: True when the call passes ``sinks`` (v1 takes none).
        window_left, qo_indptr: as for ``decode`` (the checks then see its
            table: ``q`` has a row per query token).

    Returns:
        A :class:`Selection`. The kernels decline a head_dim other than 64,
        80, 96, 128, 192 or 256, a non-contiguous head_dim, and a base pointer or
        stride that is not a multiple of 16 bytes; fp8 KV runs on v2 at
        head_dim 64, 96, 128 and 192 only; v1 takes no fp8, no per-head
        scales and no sinks. For those the result is ``"gather"`` with the reason, e.g.
        ``"fallback from v2: head_dim 40 has no kernel instance (supported:
        (64, 80, 96, 128, 192, 256))"``.

    Raises:
        ArgumentTypeError [TypeError] (an input that is not a CuPy/CUDA
        array, NumPy arrays included; ``table`` not a PageTable), ShapeError,
        DTypeError, DeviceMismatchError, UnsupportedConfigError (an unknown
        ``method`` or ``CUPAGED_DECODE``), all ValueErrors, as for
        :func:`decode`; PageTableError (a page id ``>= num_pages``). It
        raises no NoGPUError of its own, but CuPy arrays need a GPU.

    Example (needs a GPU)::

        table = cupaged.PageTable.from_seq_lens([100], page_size=16)
        k = cupy.zeros((7, 16, 2, 40), dtype=cupy.float16)  # head_dim 40: no kernel
        q = cupy.zeros((1, 8, 40), dtype=cupy.float16)
        sel = cupaged.select_method(q, k, k, table, method="v2")
        sel.method   # "gather"
        sel.reason   # "fallback from v2: head_dim 40 has no kernel instance (supported: (64, 80, 96, 128, 192, 256))"
    """
    q, k_cache, v_cache = as_cupy(q, "q"), as_cupy(k_cache, "k_cache"), as_cupy(v_cache, "v_cache")
    k_cache, v_cache = nhd_views(k_cache, v_cache, kv_layout)
    table = kernel_table(table, qo_indptr, window_left)
    variant = check_inputs(q, k_cache, v_cache, table)
    return select(q, k_cache, v_cache, table, method, variant, per_head_scales, sinks)


def check_method(method: str) -> str:
    """``method`` checked, with ``"auto"`` replaced by env CUPAGED_DECODE's value."""
    if method not in METHODS:
        raise UnsupportedConfigError(f"method must be one of {METHODS}, got {method!r}")
    return default_method() if method == "auto" else method


def select(q, k_cache, v_cache, table: PageTable, method: str, variant: str = "",
            per_head_scales: bool = False, sinks: bool = False) -> Selection:
    method = check_method(method)
    if method == "gather":
        return Selection("gather", "requested")
    decline = kernel_decline_reason(q, k_cache, v_cache, method, variant)
    if decline is None and method == "v1" and per_head_scales:
        decline = "v1 takes per-tensor k_scale/v_scale only"
    if decline is None and method == "v1" and sinks:
        decline = "v1 takes no sinks"
    if decline is not None:
        log_fallback(method, decline)  # a WARNING, once per (method, reason)
        return Selection("gather", f"fallback from {method}: {decline}")
    if method == "auto":
        return auto_method()
    return Selection(method, "requested")
