"""Exceptions raised by cupaged.

Every error a caller can cause derives from :class:`CupagedError`, and each
also derives from the builtin a generic handler would expect (``ValueError``
for bad input, ``MemoryError`` for an exhausted pool), so existing ``except``
clauses keep working.
"""


class CupagedError(Exception):
    """Base class of every cupaged exception."""


class PageTableError(CupagedError, ValueError):
    """A page table breaks a rule of the CSR view; the message names the
    request (when one is at fault) and the rule."""


class OutOfPagesError(CupagedError, MemoryError):
    """The block pool has too few free pages; the pool is left unchanged."""


class PlanMismatchError(CupagedError, ValueError):
    """A :class:`~cupaged.DecodePlan` does not fit the page table or the
    tensors it is run with (a stale plan)."""


class NoGPUError(CupagedError, RuntimeError):
    """A GPU path was asked for on a machine where CUDA has no device."""
