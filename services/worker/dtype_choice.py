"""`--dtype auto` for a dense model on a CPU: float32 or bf16, whichever multiplies faster here.

Why measured: a decode step of a dense model is its matrix products (the fused C++ step runs
everything else in float32 whatever the dtype), and which dtype streams them faster depends on
the CPU: native bf16 (AVX-512 BF16, AMX) halves the bytes read and computes fast; without it
oneDNN converts bf16 on the fly, which wins where a product is bound by memory and loses where
it computes (measured on an AVX2-only EPYC, 2 threads, 2048 -> 5632: bf16 1.4 vs 2.5 ms at 1
row, 17 vs 9 ms at 16 rows, 141 vs 29 ms at 128 rows). So the engine times the product at a
decode row count, a batched-decode one and a prefill one in both dtypes, once per machine,
takes the dtype with the least total, and keeps the timings in a small cache file (keyed by
the CPU's flags, torch's version and the thread count), so later starts pay nothing. Workers
starting together measure one at a time (under the file's lock), not against each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu_extension import cpu_flags_line
from services.common import cache_files

log = logging.getLogger(__name__)

CACHE_ENV_VAR = "LLMSERVE_DTYPE_CACHE"
"""Path of the cache file; default cpu-dtype.json in llmserve's cache (LLMSERVE_CACHE_DIR)."""

# A 1B-class model's MLP product (weights 46-92 MB, read from memory as a step reads them)
# at one decoding sequence, a batch of 16, and a 128-token prefill chunk.
ROW_COUNTS = (1, 16, 128)
IN_FEATURES, OUT_FEATURES = 2048, 5632
CANDIDATES = (torch.float32, torch.bfloat16)


def cache_path() -> Path:
    explicit = os.environ.get(CACHE_ENV_VAR)
    return Path(explicit) if explicit else cache_files.cache_root() / "cpu-dtype.json"


def machine_key() -> str:
    text = f"{cpu_flags_line()}|torch {torch.__version__}|threads {torch.get_num_threads()}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def time_product(dtype: torch.dtype, rows: int, repeats: int = 3) -> float:
    """Seconds per [rows, IN] @ [OUT, IN]^T in `dtype`, the weight cycling through enough
    copies that it comes from memory; the fastest of `repeats` rounds."""
    copies = 4
    generator = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator).to(dtype) for _ in range(copies)
    ]
    x = torch.randn(rows, IN_FEATURES, generator=generator).to(dtype)
    for weight in weights:  # warm-up: oneDNN picks and caches its kernels
        F.linear(x, weight)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for weight in weights:
            F.linear(x, weight)
        best = min(best, (time.perf_counter() - start) / copies)
    return best


Timings = dict[str, dict[str, float]]
"""dtype name -> row count (as text) -> seconds per product."""


def measure() -> Timings:
    return {
        str(dtype).removeprefix("torch."): {
            str(rows): time_product(dtype, rows) for rows in ROW_COUNTS
        }
        for dtype in CANDIDATES
    }


def faster_of(timings: Timings) -> torch.dtype:
    """The candidate with the least total time; float32 on a tie (exact, no conversion)."""
    name = min(timings, key=lambda key: (sum(timings[key].values()), key != "float32"))
    return getattr(torch, name)  # type: ignore[no-any-return]


def _valid(timings: object) -> bool:
    names = {str(dtype).removeprefix("torch.") for dtype in CANDIDATES}
    counts = {str(rows) for rows in ROW_COUNTS}
    return (
        isinstance(timings, dict)
        and set(timings) == names
        and all(isinstance(t, dict) and set(t) == counts for t in timings.values())
    )


def _read_cache(path: Path) -> dict[str, object]:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def measured_cpu_dtype() -> torch.dtype:
    """This machine's faster dtype for dense products, from the cache or measured now."""
    path, key = cache_path(), machine_key()
    timings = _read_cache(path).get(key)
    if not _valid(timings):
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(cache_files.locked(path))
                writable = True
            except OSError as error:  # a read-only home still serves; it measures each time
                log.warning("dtype measurement not cached", extra={"error": str(error)})
                writable = False
            cached = _read_cache(path)  # another worker may have measured while we waited
            timings = cached.get(key)
            if not _valid(timings):
                log.info("measuring float32 and bf16 products for --dtype auto (once per machine)")
                timings = cached[key] = measure()
                try:
                    if writable:
                        cache_files.write_text(path, json.dumps(cached, indent=1))
                except OSError as error:
                    log.warning("dtype measurement not cached", extra={"error": str(error)})
    assert isinstance(timings, dict)
    chosen = faster_of(timings)
    log.info(
        "dtype auto",
        extra={"chosen": str(chosen), "ms_by_rows": json.dumps(timings)},
    )
    return chosen
