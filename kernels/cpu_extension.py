"""CPU kernels in C++ (kernels/csrc/*.cpp), built into one library of torch ops under the
`llmserve` namespace (`torch.ops.llmserve.<op>`), so that they also sit inside compiled step
graphs. Every source file declares its ops with TORCH_LIBRARY_FRAGMENT(llmserve, m), its CPU
implementation with TORCH_LIBRARY_IMPL(llmserve, CPU, m) and its shape function with
TORCH_LIBRARY_IMPL(llmserve, Meta, m) (what torch.compile traces with).

The library is built with the machine's compiler the first time a process asks for it (the
worker does so at start-up, before it reports SERVING; `llmserve build-kernels` does it ahead
of time) and cached per CPU and source hash. When the build is impossible (no compiler, no
headers) the torch reference takes over, with one log line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DISABLE_ENV_VAR = "LLMSERVE_CPU_EXTENSION"  # "0" turns the C++ kernels off
SOURCE_DIR = Path(__file__).parent / "csrc"
_lock = threading.Lock()
_loaded = False
_failed = False


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


def cpu_flags_line() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (the processor name elsewhere)."""
    try:
        return next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return platform.processor()


def _cpu_fingerprint() -> str:
    """Built with -march=native: a cached build must never run on another CPU."""
    return hashlib.sha1(cpu_flags_line().encode()).hexdigest()[:10]


def library_name() -> str:
    files = sources()
    digest = hashlib.sha1()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for header in sorted(SOURCE_DIR.glob("*.h")):
        digest.update(header.read_bytes())
    return f"llmserve_cpu_{_cpu_fingerprint()}_{digest.hexdigest()[:10]}"


def load() -> bool:
    """Build (first time only) and load the kernels; False when disabled or unbuildable."""
    global _loaded, _failed
    if _loaded or _failed:
        return _loaded
    if os.environ.get(DISABLE_ENV_VAR, "1") == "0":
        _failed = True
        return False
    with _lock:
        if _loaded or _failed:
            return _loaded
        try:
            from torch.utils.cpp_extension import _get_build_directory
            from torch.utils.cpp_extension import load as load_extension

            name = library_name()
            built = (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
            if not built:
                log.info("building the C++ CPU kernels (once per machine)", extra={"library": name})
            start = time.perf_counter()
            load_extension(
                name=name,
                sources=[str(p) for p in sources()],
                extra_include_paths=[str(SOURCE_DIR)],
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-fopenmp",
                    "-fno-strict-aliasing",
                ],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            if not built:
                log.info(
                    "C++ CPU kernels built",
                    extra={"seconds": round(time.perf_counter() - start, 1)},
                )
            _loaded = True
        except Exception as exc:  # no compiler, no headers, no ninja: fall back, loudly once
            log.warning(
                "CPU C++ kernels unavailable; using the torch path", extra={"error": str(exc)}
            )
            _failed = True
    return _loaded


def ops() -> torch._ops._OpNamespace:
    """`torch.ops.llmserve`; call `load()` first."""
    return torch.ops.llmserve
