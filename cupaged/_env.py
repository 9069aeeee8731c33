"""Every environment variable cupaged reads, read and validated here.

One function per variable (as vLLM's ``envs.py``). Each returns the parsed
value, or the default when the variable is unset or empty, and raises
:class:`~cupaged.errors.InvalidArgumentError` (a ``ValueError``; for an
unknown method or core its subclass
:class:`~cupaged.errors.UnsupportedConfigError`) whose message names the
variable, its value and what it accepts. When each is read:

=========================  ==========================================  =============
variable                   read by                                     when
=========================  ==========================================  =============
``CUPAGED_DECODE``         :func:`cupaged.decode` (``method="auto"``)  every call
``CUPAGED_CORE``           the v2 launch state of a plan               first launch
``CUPAGED_WAIT_MERGE``     the v2 launch state of a plan               first launch
``CUPAGED_TARGET_CTAS``    :func:`cupaged.plan_decode`                 every call
``CUPAGED_NUM_SMS``        :func:`cupaged.plan_decode` (no GPU)        every call
``CUPAGED_CACHE_DIR``      :mod:`cupaged.autotune`                     every call
``CUPAGED_CUDA_SRC``       ``cupaged._loader``                         import
``CUPAGED_MMA_SMEM_KB``    ``cupaged._configs``                        import
``CUPAGED_MMA_WARPS``      ``cupaged._configs``                        import
``CUPAGED_MMA_MIN_BLOCKS`` ``cupaged._configs``                        import
``CUPAGED_PDL``            ``cupaged._configs``                        import
=========================  ==========================================  =============

The variables read at import configure the compiled kernels (the same value
goes into the NVRTC options and the launch), so a bad value makes ``import
cupaged`` fail with the message. :data:`VARIABLES` lists them all (the
README's table is checked against it).

``CUPAGED_DECODE`` is read on the decode hot path: :func:`decode_method_raw`
is one dict lookup (see its docstring); :func:`decode_method` validates.

This module imports nothing else of cupaged but its errors, so that
``_configs`` can read its variables at import.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InvalidArgumentError, UnsupportedConfigError

DECODE = "CUPAGED_DECODE"
CORE = "CUPAGED_CORE"
WAIT_MERGE = "CUPAGED_WAIT_MERGE"
PDL = "CUPAGED_PDL"
TARGET_CTAS = "CUPAGED_TARGET_CTAS"
NUM_SMS = "CUPAGED_NUM_SMS"
CACHE_DIR = "CUPAGED_CACHE_DIR"
CUDA_SRC = "CUPAGED_CUDA_SRC"
MMA_SMEM_KB = "CUPAGED_MMA_SMEM_KB"
MMA_WARPS = "CUPAGED_MMA_WARPS"
MMA_MIN_BLOCKS = "CUPAGED_MMA_MIN_BLOCKS"

#: Every variable cupaged reads, in the order of the README's table.
VARIABLES: tuple[str, ...] = (DECODE, CORE, WAIT_MERGE, TARGET_CTAS, NUM_SMS, CACHE_DIR, CUDA_SRC,
                              MMA_SMEM_KB, MMA_WARPS, MMA_MIN_BLOCKS, PDL)

#: Values of CUPAGED_DECODE (the ``method`` of :func:`cupaged.decode`).
METHODS: tuple[str, ...] = ("auto", "v2", "v1", "gather")
#: Values of CUPAGED_CORE (the cores of ``cupaged._configs.CORES``).
CORES: tuple[str, ...] = ("mma", "simt")


# os.environ.get costs ~0.7 us when the variable is unset (a KeyError raised
# and caught inside os.environ), and every default plan reads two variables.
# The mapping behind os.environ, which every os.environ assignment and
# deletion updates (CPython), answers in one dict lookup; elsewhere, the
# public call.
try:
    _ENV_DATA = os.environ._data  # type: ignore[attr-defined]
    _ENCODE_KEY, _DECODE_VALUE = os.environ.encodekey, os.environ.decodevalue  # type: ignore[attr-defined]
    _KEYS: dict = {}

    def _get(name: str) -> str | None:
        key = _KEYS.get(name)
        if key is None:
            key = _KEYS[name] = _ENCODE_KEY(name)
        value = _ENV_DATA.get(key)
        return None if value is None else _DECODE_VALUE(value)
except AttributeError:  # pragma: no cover (not CPython)
    _get = os.environ.get


def _raw(name: str) -> str | None:
    """The variable's value stripped of blanks; None when unset or empty."""
    value = _get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _int(name: str, default: int | None, low: int = 1, high: int | None = None) -> int | None:
    raw = _raw(name)
    if raw is None:
        return default
    bounds = (("a positive integer" if low == 1 else f"an integer >= {low}") if high is None
              else f"an integer in [{low}, {high}]")
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name} must be {bounds}, got {raw!r}") from None
    if value < low or (high is not None and value > high):
        raise InvalidArgumentError(f"environment variable {name} must be {bounds}, got {raw!r}")
    return value


# ---------------------------------------------------------------- call time
def decode_method() -> str:
    """``CUPAGED_DECODE``: the method ``method="auto"`` stands for; default
    ``"auto"`` (v2 where the kernels serve the call).

    >>> decode_method() in METHODS
    True
    """
    raw = _raw(DECODE)
    if raw is None:
        return "auto"
    if raw not in METHODS:
        raise UnsupportedConfigError(f"environment variable {DECODE}={raw!r} must be one of {METHODS}")
    return raw


# decode's hot path only asks whether the raw value changed since its last
# full call: the encoded value, without decoding it (see _get).
try:
    _DECODE_KEY = os.environ.encodekey(DECODE)  # type: ignore[attr-defined]

    def decode_method_raw():
        """``CUPAGED_DECODE``'s raw value (None when unset), unvalidated:
        one dict lookup, for decode's hot path, which compares it with the
        value of its last checked call."""
        return _ENV_DATA.get(_DECODE_KEY)
except AttributeError:  # pragma: no cover (not CPython)
    def decode_method_raw():
        """``CUPAGED_DECODE``'s raw value (None when unset), unvalidated."""
        return os.environ.get(DECODE)


def core() -> str | None:
    """``CUPAGED_CORE``: ``"mma"`` or ``"simt"`` pins the v2 partial kernel's
    core (benchmarks); None (unset) lets dispatch choose. Whether the core
    serves the dtype and head_dim is checked where a plan's launch is built."""
    raw = _raw(CORE)
    if raw is not None and raw not in CORES:
        raise UnsupportedConfigError(f"environment variable {CORE}={raw!r} must be one of {CORES} (or unset)")
    return raw


def wait_merge() -> bool:
    """``CUPAGED_WAIT_MERGE``: 1 lets a plan whose CTAs fit the GPU at once
    merge at each request's first chunk, waiting on the partials' values
    (cupaged/_launch.py ``plan_waits``); 0 or unset (the default): every
    split request merges through the ticket. Opt-in until the ragged and
    uniform sweeps have timed it beside FlashInfer (only the small cells
    were, in a probe: 0.38-0.66 us less); keep it 0 where a client sees
    fewer SMs than the device reports (MPS with an active-thread limit: a
    waiting chunk must find a slot free)."""
    return bool(_int(WAIT_MERGE, 0, 0, 1))


def pdl() -> bool:
    """``CUPAGED_PDL``: 1 or unset (the default) compiles the partial kernel's
    modules that have tensor-core instances with programmatic dependent
    launch and, on sm_90 and newer, launches those instances so (their CTAs
    may start during the previous kernel's tail and wait in
    ``griddepcontrol.wait`` before touching memory that kernel may write);
    0: the ordinary kernel and launch everywhere."""
    return bool(_int(PDL, 1, 0, 1))


def target_ctas() -> int | None:
    """``CUPAGED_TARGET_CTAS``: a positive CTA target for the plain chunk-size
    search instead of the calibrated default; None when unset."""
    return _int(TARGET_CTAS, None)


def num_sms() -> int | None:
    """``CUPAGED_NUM_SMS``: the SM count to plan for when no CUDA device is
    visible (planning on a CPU); None when unset."""
    return _int(NUM_SMS, None)


def cache_dir() -> Path:
    """``CUPAGED_CACHE_DIR``: where :mod:`cupaged.autotune` keeps its winners;
    default ``~/.cache/cupaged``. ``~`` is expanded."""
    raw = _raw(CACHE_DIR)
    return Path(raw).expanduser() if raw is not None else Path.home() / ".cache" / "cupaged"


# --------------------------------------------------------------- import time
def cupy_cache_dir() -> Path:
    """``CUPY_CACHE_DIR`` (CuPy's own variable, read for ``python -m cupaged
    info``): where CuPy keeps compiled kernels, default ``~/.cupy/kernel_cache``."""
    raw = _raw("CUPY_CACHE_DIR")
    return Path(raw).expanduser() if raw is not None else Path.home() / ".cupy" / "kernel_cache"


def cuda_src(default: Path) -> Path:
    """``CUPAGED_CUDA_SRC``: compile the kernels from this folder instead of
    ``default`` (A/B experiments); it must be a directory."""
    raw = _raw(CUDA_SRC)
    if raw is None:
        return default
    path = Path(raw).expanduser()
    if not path.is_dir():
        raise InvalidArgumentError(
            f"environment variable {CUDA_SRC}={raw!r} must be a directory holding the cuda_src/ files")
    return path


def mma_smem_kb() -> int:
    """``CUPAGED_MMA_SMEM_KB``: dynamic shared memory of a tensor-core CTA in
    KB, 1..227 (the most a CTA of sm_90 may take); default 72."""
    return _int(MMA_SMEM_KB, 72, 1, 227)


def mma_warps() -> int:
    """``CUPAGED_MMA_WARPS``: warps per tensor-core CTA, 1..32; default 4."""
    return _int(MMA_WARPS, 4, 1, 32)


def mma_min_blocks() -> int:
    """``CUPAGED_MMA_MIN_BLOCKS``: CTAs per SM the tensor-core kernel's
    register budget allows (``__launch_bounds__``), 1..32; default 2."""
    return _int(MMA_MIN_BLOCKS, 2, 1, 32)
