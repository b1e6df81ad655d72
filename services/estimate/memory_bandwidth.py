"""Measure this machine's memory bandwidth with a torch tensor copy, the number that bounds
batch-1 decode on a CPU (every weight is read once per token).

A copy of N bytes reads N and writes N; the figure reported counts both (STREAM's "copy"
convention). Buffers far larger than the last-level cache keep the caches out of it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from tqdm import tqdm  # type: ignore[import-untyped]

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class BandwidthResult:
    bytes_per_s: float
    """Best copy rate seen (read + write bytes per second)."""
    buffer_bytes: int
    num_copies: int
    num_threads: int


def measure_copy_bandwidth(
    buffer_mib: int = 256, duration_s: float = 2.0, show_progress: bool = True
) -> BandwidthResult:
    """Copy one `buffer_mib` buffer into another for about `duration_s` seconds; the fastest
    copy wins, since on a shared machine the slow ones measure the neighbours."""
    import torch

    if buffer_mib < 1 or duration_s <= 0:
        raise ValueError("buffer_mib must be >= 1 and duration_s > 0")
    num_bytes = buffer_mib * MiB
    source = torch.ones(num_bytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # touch every page first: the first copy would time page faults
    best = float("inf")
    copies = 0
    progress = tqdm(
        total=round(duration_s, 1),
        desc="memory bandwidth",
        unit="s",
        file=sys.stderr,
        disable=not show_progress,
        bar_format="{desc}: {bar} {n:.1f}/{total:.1f} s",
    )
    start = time.perf_counter()
    try:
        while True:
            begin = time.perf_counter()
            target.copy_(source)
            end = time.perf_counter()
            best = min(best, end - begin)
            copies += 1
            progress.n = min(end - start, duration_s)
            progress.refresh()
            if end - start >= duration_s:
                break
    finally:
        progress.close()
    return BandwidthResult(2 * num_bytes / best, num_bytes, copies, torch.get_num_threads())
