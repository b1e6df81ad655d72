"""CPU kernels in C++ (kernels/csrc), compiled on first use with the machine's compiler and
cached per CPU; when the build is impossible the torch reference takes over, with a log line.

The paged decode attention reads the cache in place: the torch path must first gather every
sequence's blocks into a dense copy, which at batch 32 costs more than the attention itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

DISABLE_ENV_VAR = "LLMSERVE_CPU_EXTENSION"  # "0" turns the C++ kernels off
_SOURCES = [Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"]
_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def _cpu_fingerprint() -> str:
    """Built with -march=native: a cached build must never run on another CPU."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def load() -> ModuleType | None:
    """The compiled module, or None when disabled or when it cannot be built here."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get(DISABLE_ENV_VAR, "1") == "0":
        _failed = True
        return None
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            from torch.utils.cpp_extension import load as load_extension

            source_hash = hashlib.sha1(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()[:10]
            _module = load_extension(
                name=f"llmserve_cpu_{_cpu_fingerprint()}_{source_hash}",
                sources=[str(p) for p in _SOURCES],
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-fopenmp",
                    "-ffast-math",
                    "-fno-strict-aliasing",
                ],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers, no ninja: fall back, loudly once
            log.warning(
                "CPU C++ kernels unavailable; using the torch path", extra={"error": str(exc)}
            )
            _failed = True
    return _module
