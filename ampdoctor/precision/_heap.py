"""Handing the C heap's free pages back to the OS between the phases of a diagnosis run (glibc only).

torch's CPU tensors come from ``malloc``; glibc serves every allocation below its mmap threshold -- which rises to
the size of the largest block freed, up to 32 MiB -- from its heap, and keeps freed memory there: a traced step's
activations freed during the backward leave holes among the long-lived tensors allocated in between (gradients,
the statistics), and those holes stay resident. Measured on bench/scale.py's 60M config, bf16-amp: at the start of
the optimizer step ~1.5 parameter-sizes of RSS that no tensor holds; ``malloc_trim(0)`` there returns them
(0.07-0.14 s) and the target run's peak RSS drops 2.32 -> 1.85 GiB (bench/results/scale.md has the 750M figures).

:func:`release_free_heap` is that call: pages are given back, nothing allocated moves, no value changes; a later
allocation faults fresh pages in. A no-op where glibc's ``malloc_trim`` is not there (macOS, musl, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

_TRIM: list[Any] = []  # [the C function or None], looked up once


def _malloc_trim() -> Any:
    if not _TRIM:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                fn = None
        _TRIM.append(fn)
    return _TRIM[0]


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS (``malloc_trim(0)``); True if glibc did it. Never raises."""
    fn = _malloc_trim()
    if fn is None:
        return False
    try:
        return bool(fn(0))
    except Exception:  # noqa: BLE001 - memory housekeeping must never break a run
        log.debug("malloc_trim failed", exc_info=True)
        return False
