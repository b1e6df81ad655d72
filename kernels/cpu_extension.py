"""CPU kernels in C++ (kernels/csrc/*.cpp), built into one library of torch ops under the
`llmserve` namespace (`torch.ops.llmserve.<op>`), so that they also sit inside compiled step
graphs. Every source file declares its ops with TORCH_LIBRARY_FRAGMENT(llmserve, m), its CPU
implementation with TORCH_LIBRARY_IMPL(llmserve, CPU, m) and its shape function with
TORCH_LIBRARY_IMPL(llmserve, Meta, m) (what torch.compile traces with).

One library per instruction-set variant (VARIANTS: AVX-512 with VNNI and BF16, AVX2 + FMA with
AVX-VNNI, AVX2 + FMA, and a baseline x86-64-v2 build whose kernels are the scalar ones), each
the same sources compiled with that variant's flags. A process loads the best variant its CPU
runs, read from /proc/cpuinfo, so a build made on one machine (an image, a cache shared by CI
runners) is correct and fast on any x86 CPU; LLMSERVE_CPU_VARIANT names one instead (tests,
diagnosis).

A variant is built with the machine's compiler the first time a process asks for it (the worker
does so at start-up, before it reports SERVING; `llmserve build-kernels` does it ahead of time,
`--all` for every variant) and cached per variant and source hash, in TORCH_EXTENSIONS_DIR
when set (the image's), else in llmserve's cache (services/common/cache_files.py). When the
build is impossible (no compiler, no headers) the torch reference takes over, with one warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.cache_files import cache_root, locked

log = logging.getLogger(__name__)

DISABLE_ENV_VAR = "LLMSERVE_CPU_EXTENSION"  # "0" turns the C++ kernels off
VARIANT_ENV_VAR = "LLMSERVE_CPU_VARIANT"  # a VARIANTS name instead of the CPU's best
EXTENSIONS_DIR_ENV_VAR = "TORCH_EXTENSIONS_DIR"  # torch's; where the image keeps its builds
SOURCE_DIR = Path(__file__).parent / "csrc"
_lock = threading.Lock()
_loaded = False
_failed = False
_loaded_variant: str | None = None


@dataclass(frozen=True, slots=True)
class Variant:
    """One build of the kernels: its compiler flags and the CPU flags it needs."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]
    """/proc/cpuinfo flags the CPU must list to run this build."""


VARIANTS = (
    Variant(
        "avx512",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=generic"),
        (
            "avx2",
            "fma",
            "f16c",
            "bmi2",
            "avx512f",
            "avx512bw",
            "avx512dq",
            "avx512vl",
            "avx512_vnni",
            "avx512_bf16",
        ),
    ),
    # AVX2 CPUs with the VEX form of VNNI (Alder Lake and later, Sierra Forest): the GGUF
    # integer dot products take vpdpbusd where the plain AVX2 build needs two instructions.
    Variant(
        "avx2-vnni",
        ("-march=x86-64-v3", "-mavxvnni", "-mtune=generic"),
        ("avx2", "fma", "f16c", "bmi2", "avx_vnni"),
    ),
    Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), ("avx2", "fma", "f16c", "bmi2")),
    Variant("baseline", ("-march=x86-64-v2", "-mtune=generic"), ()),
)
"""Best first. x86-64-v3 is AVX2, FMA, F16C and BMI; v4 adds AVX-512 F/BW/DQ/VL."""


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


def cpu_flags() -> set[str]:
    line = cpu_flags_line()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def best_variant(flags: set[str]) -> Variant:
    """The first variant whose needs the CPU flags cover (the baseline needs none)."""
    return next(variant for variant in VARIANTS if set(variant.needs) <= flags)


def chosen_variant() -> Variant:
    """LLMSERVE_CPU_VARIANT's variant, else the best this CPU runs."""
    name = os.environ.get(VARIANT_ENV_VAR)
    if not name:
        return best_variant(cpu_flags())
    by_name = {variant.name: variant for variant in VARIANTS}
    if name not in by_name:
        raise ValueError(f"{VARIANT_ENV_VAR} must be one of {', '.join(by_name)}; got {name!r}")
    return by_name[name]


def library_name(variant: Variant | None = None) -> str:
    """The variant's library: named by its instruction set, the sources' hash and where they
    are. Torch rebuilds a library whose include paths changed, so two checkouts on one machine
    (worktrees, a copy in a container build) sharing a name would rebuild each other's in turn;
    with the path in the name each builds its own once."""
    variant = variant or chosen_variant()
    digest = hashlib.sha1(" ".join(variant.flags).encode())
    digest.update(str(SOURCE_DIR.resolve()).encode())
    for path in sources():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for header in sorted(SOURCE_DIR.glob("*.h")):
        digest.update(header.read_bytes())
    return f"llmserve_cpu_{variant.name.replace('-', '_')}_{digest.hexdigest()[:10]}"


def extensions_root() -> Path:
    """TORCH_EXTENSIONS_DIR when set, else torch_extensions/ in llmserve's cache, one folder
    per Python and torch build (a library is linked against both)."""
    explicit = os.environ.get(EXTENSIONS_DIR_ENV_VAR)
    if explicit:
        return Path(explicit)
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / "torch_extensions" / f"{python}-torch{torch.__version__}"


def build_directory(name: str) -> Path:
    """The library `name`'s build directory (created): its objects, ninja file, `lock` and
    the .so itself."""
    directory = extensions_root() / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _compile_flags(variant: Variant) -> list[str]:
    return ["-O3", *variant.flags, "-fopenmp", "-fno-strict-aliasing"]


STALE_LOCK_S = 15 * 60.0
"""A build lock older than this belongs to a build that died (a build takes 1-3 minutes)."""


def remove_stale_lock(directory: Path, now: float | None = None) -> bool:
    """torch's build step takes a `lock` file in the build directory and waits, without end,
    while one exists; a build killed midway leaves it behind and every later process would
    hang. Removes a lock older than STALE_LOCK_S (True when it did)."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning(
        "removing a stale C++ kernel build lock", extra={"lock": str(lock), "age_s": round(age)}
    )
    lock.unlink(missing_ok=True)
    return True


def loaded_variant() -> str | None:
    """The variant this process loaded (None: none yet, or the torch path)."""
    return _loaded_variant


def build_only(variant: Variant) -> Path:
    """Compile a variant without loading it (one this CPU may not run: an image's other
    variants); returns the library's path. Uses torch's own ninja build step."""
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library

    name = library_name(variant)
    directory = build_directory(name)
    library = directory / f"{name}.so"
    # Under the lock `load()` builds under: one process builds, the others find it built.
    with locked(library):
        if library.exists():  # its name carries the sources' and flags' hash: current
            return library
        remove_stale_lock(directory)
        _write_ninja_file_and_build_library(
            name,
            [str(p) for p in sources()],
            _compile_flags(variant),
            None,
            None,
            ["-fopenmp"],
            [str(SOURCE_DIR)],
            str(directory),
            False,
            False,
            False,
            is_standalone=False,
        )
    return library


def load() -> bool:
    """Build (first time only) and load the kernels; False when disabled or unbuildable."""
    global _loaded, _failed, _loaded_variant
    if _loaded or _failed:
        return _loaded
    if os.environ.get(DISABLE_ENV_VAR, "1") == "0":
        _failed = True
        return False
    with _lock:
        if _loaded or _failed:
            return _loaded
        try:
            variant = chosen_variant()
            name = library_name(variant)
            directory = build_directory(name)
            library = directory / f"{name}.so"
            if library.exists():
                # Built before (an earlier start, `build-kernels`, an image's build stage):
                # its name carries the sources' and flags' hash, so it is current. Loaded as
                # is: torch's JIT path would want a compiler, ninja and a writable build
                # directory just to find it up to date, which a slim image has not.
                torch.ops.load_library(str(library))
            else:
                # One build per library among processes (test workers, `build_only`'s
                # callers), which torch's own `lock` file does not give with `build_only`.
                with locked(library):
                    if library.exists():  # another process built it meanwhile
                        torch.ops.load_library(str(library))
                    else:
                        _build_and_load(variant, name, directory)
            _loaded = True
            _loaded_variant = variant.name
            if variant.name == "baseline":
                log.warning(
                    "C++ CPU kernels without SIMD (the CPU lacks AVX2/FMA/F16C): slow",
                    extra={"library": name},
                )
        except Exception as exc:  # no compiler, no headers, no ninja: fall back, loudly once
            log.warning(
                "CPU C++ kernels unavailable; using the torch path", extra={"error": str(exc)}
            )
            _failed = True
    return _loaded


def _build_and_load(variant: Variant, name: str, directory: Path) -> None:
    from torch.utils.cpp_extension import load as load_extension

    remove_stale_lock(directory)
    log.info("building the C++ CPU kernels (once per instruction set)", extra={"library": name})
    start = time.perf_counter()
    load_extension(
        name=name,
        sources=[str(p) for p in sources()],
        extra_include_paths=[str(SOURCE_DIR)],
        extra_cflags=_compile_flags(variant),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    log.info("C++ CPU kernels built", extra={"seconds": round(time.perf_counter() - start, 1)})


def ops() -> torch._ops._OpNamespace:
    """`torch.ops.llmserve`; call `load()` first."""
    return torch.ops.llmserve
