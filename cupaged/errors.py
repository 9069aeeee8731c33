"""Exceptions raised by cupaged.

Every error a caller can cause derives from :class:`CupagedError`, and each
also derives from the builtin a generic handler would expect (``ValueError``
for a bad value, ``TypeError`` for an argument of the wrong kind,
``KeyError`` for an unknown sequence id, ``MemoryError`` for an exhausted
pool), so existing ``except`` clauses keep working. Messages name the
argument (and the request, for page tables) and the rule that was broken.

The hierarchy::

    CupagedError
    ├── ArgumentTypeError (TypeError)      an argument of the wrong kind
    ├── InvalidArgumentError (ValueError)  a bad argument value; also the base of
    │   ├── ShapeError                     a rank or shape wrong or inconsistent
    │   ├── DTypeError                     a dtype wrong, mixed or unsupported
    │   ├── LayoutError                    a memory layout the kernels cannot use
    │   ├── DeviceMismatchError            arrays on different GPUs
    │   └── UnsupportedConfigError         well formed, but not implemented
    ├── PageTableError (ValueError)        a page table breaks a CSR rule
    ├── PlanMismatchError (ValueError)     a plan that does not fit (stale)
    ├── UnknownSequenceError (KeyError)    a block-pool sequence id that is not live
    ├── OutOfPagesError (MemoryError)      the block pool has too few free pages
    └── NoGPUError (RuntimeError)          no CUDA device

``DTypeError`` is a ``ValueError`` (not a ``TypeError``): a wrong dtype is a
wrong *value* of an array attribute, and cupaged raised ``ValueError`` for it
before these classes existed.
"""


class CupagedError(Exception):
    """Base class of every cupaged exception."""


class ArgumentTypeError(CupagedError, TypeError):
    """An argument of the wrong kind: a NumPy array where a CuPy (CUDA) array
    is needed, a ``table`` that is not a :class:`~cupaged.PageTable`, a
    ``plan`` that is not a :class:`~cupaged.DecodePlan`."""


class InvalidArgumentError(CupagedError, ValueError):
    """An argument's value breaks a rule (a negative count, a non-finite
    ``sm_scale``, a malformed ``o_indptr``, ...). Base class of the specific
    array errors below, so ``except InvalidArgumentError`` catches them all."""


class ShapeError(InvalidArgumentError):
    """An array of the wrong rank or shape, or shapes that disagree with each
    other or with the page table (batch, page size, heads not divisible)."""


class DTypeError(InvalidArgumentError):
    """A dtype that is wrong, differs from another argument's, or has no
    kernel; the message lists the supported ones."""


class LayoutError(InvalidArgumentError):
    """A memory layout a kernel cannot use where no fallback exists (an
    ``out`` whose head_dim is not contiguous, a non-C-contiguous array the
    merge kernel reads as one, overlapping output elements)."""


class DeviceMismatchError(InvalidArgumentError):
    """Arrays of one call on different GPUs, or not on the current device."""


class UnsupportedConfigError(InvalidArgumentError):
    """A well-formed choice cupaged does not implement: an unknown ``method``
    or env ``CUPAGED_DECODE``/``CUPAGED_CORE`` value, a head_dim without a
    merge kernel."""


class CapacityError(InvalidArgumentError):
    """A table or plan larger than a :class:`~cupaged.DecodeRunner`'s fixed
    capacities (``max_batch``, ``max_pages``, ``max_units``)."""


class PageTableError(CupagedError, ValueError):
    """A page table breaks a rule of the CSR view; the message names the
    request (when one is at fault) and the rule."""


class PlanMismatchError(CupagedError, ValueError):
    """A :class:`~cupaged.DecodePlan` does not fit the page table or the
    tensors it is run with (a stale plan)."""


class UnknownSequenceError(CupagedError, KeyError):
    """A :class:`~cupaged.BlockPool` sequence id that is not live (never
    added, or already freed); the pool is left unchanged."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class OutOfPagesError(CupagedError, MemoryError):
    """The block pool has too few free pages; the pool is left unchanged."""


class NoGPUError(CupagedError, RuntimeError):
    """A GPU path was asked for on a machine where CUDA has no device."""
