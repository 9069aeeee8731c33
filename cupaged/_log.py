"""What cupaged tells its logger, ``logging.getLogger("cupaged")``.

A call that the CUDA kernels decline runs the gather path (CuPy + cuBLAS),
which is correct but several times slower. :func:`log_fallback` says so at
**WARNING** level, once per (requested method, reason) per process: a
WARNING reaches stderr through Python's last-resort handler even in a
program that configured no logging, and "once" keeps a serving loop that
decodes the same shape every step from repeating it. Silence it with
``logging.getLogger("cupaged").setLevel(logging.ERROR)``; ask
:func:`cupaged.select_method` for the path of one call.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("cupaged")

_logged: set[tuple[str, str]] = set()


def log_fallback(method: str, reason: str) -> None:
    """Log (WARNING) that ``method``'s kernels declined a call for ``reason``
    and the gather path runs instead; once per ``(method, reason)``.
    (:func:`cupaged.decode` and :func:`cupaged.select_method` call it.)
    """
    key = (method, reason)
    if key in _logged:
        return
    _logged.add(key)
    logger.warning("cupaged.decode(method=%r): the CUDA kernels decline this call (%s), so it runs the "
                   "gather path (CuPy + cuBLAS): correct, but slower. Logged once per method and reason.",
                   method, reason)


def reset() -> None:
    """Forget what was logged (tests): the next fallback of each kind logs again."""
    _logged.clear()
