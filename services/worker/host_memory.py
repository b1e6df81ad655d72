"""Keep freed host memory inside the process instead of returning it to the OS.

glibc hands every allocation above its mmap threshold (128 KiB to 32 MiB, adaptive) straight
to the kernel, so each large activation of a CPU forward is a fresh mmap whose pages fault in
one by one. Measured on 2 cores, 4096-token prefill activations: RMSNorm 13.5 -> 1.8 ms,
SiLU-and-mul 15.8 -> 4.9 ms (bf16). Raising the thresholds makes the heap reuse those pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied = False


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 31) -> bool:
    """Tune glibc's malloc once per process; returns False where it does not apply."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
    ok = bool(mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, (1 << 31) - 1))) and ok
    _applied = ok
    log.debug("malloc thresholds raised", extra={"ok": ok})
    return ok
