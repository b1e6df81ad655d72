"""Helpers shared by the benchmarks: markdown tables (the product's, re-exported), summary
statistics, a seeded synthetic workload, peak-RSS reading and the machine description printed
above every table."""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import resource
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# The tables `llmserve estimate` prints too; every benchmark imports them from here.
from services.common.tables import format_cell as format_cell
from services.common.tables import format_table as format_table

# Token ids drawn for synthetic prompts: above the special and byte tokens at the bottom of
# the vocabulary, below the size of any model we serve (SmolLM2 has 49152).
SAFE_TOKEN_RANGE = (100, 40_000)

MiB = 1 << 20
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


# ---- statistics ------------------------------------------------------------------------


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; NaN for no values (printed as '-' rather than failing a whole table)."""
    return sum(values) / len(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


class Timer:
    """`with Timer() as t: ...` then t.elapsed_s (time.perf_counter, monotonic, high resolution)."""

    def __init__(self) -> None:
        self.start = 0.0
        self.elapsed_s = 0.0

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.elapsed_s = time.perf_counter() - self.start


# ---- workload --------------------------------------------------------------------------


def uniform_int(rng: random.Random, low: int, high: int) -> int:
    """An integer uniform in [low, high], both included, from Random.random() (see below)."""
    return low + int(rng.random() * (high - low + 1))


def random_prompts(
    num_prompts: int,
    prompt_len: int,
    seed: int = 0,
    token_range: tuple[int, int] = SAFE_TOKEN_RANGE,
) -> list[list[int]]:
    """Prompts of random token ids, the same for the same seed everywhere: built on
    Random.random(), the one method whose sequence Python promises to keep across versions."""
    rng = random.Random(seed)
    low, high = token_range
    return [
        [uniform_int(rng, low, high - 1) for _ in range(prompt_len)] for _ in range(num_prompts)
    ]


def parse_int_list(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; every value must be a positive integer."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expected comma-separated positive integers, got {text!r}")
    return values


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'128x128,1024x128' -> [(128, 128), (1024, 128)] as (input_len, output_len)."""
    shapes = []
    for part in text.split(","):
        input_len, sep, output_len = part.strip().lower().partition("x")
        if not sep:
            raise ValueError(f"a shape is INPUTxOUTPUT, got {part!r}")
        shape = (int(input_len), int(output_len))
        if min(shape) <= 0:
            raise ValueError(f"shape lengths must be positive, got {part!r}")
        shapes.append(shape)
    return shapes


# ---- the process and the machine ---------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so the next reading covers only what follows.
    Returns False where that is not possible (not Linux, or an old kernel)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    """Peak resident set size of this process: VmHWM (resettable) or ru_maxrss (lifetime)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MiB
    except OSError:
        pass
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return max_rss / MiB if sys.platform == "darwin" else max_rss * 1024 / MiB


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_bf16_flags() -> list[str]:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return [flag for flag in BF16_CPU_FLAGS if flag in flags]


SIMD_FLAG_PREFIXES = ("sse4", "avx", "fma", "f16c", "amx")


def cpu_simd_flags() -> list[str]:
    """The CPU's vector instruction-set flags (what decides which kernel variant runs)."""
    try:
        line = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return []
    return [flag for flag in line.split(":", 1)[1].split() if flag.startswith(SIMD_FLAG_PREFIXES)]


def load_average() -> str:
    """Other processes' load at start: numbers taken on a busy machine are not comparable."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average at start: {one:.2f} (1 min), {five:.2f} (5 min)"


SECRET_FLAGS = ("--api-key",)
"""Flags whose value never appears in a report: the command line is echoed above tables and
kept in JSON files that get shared."""
MASK = "***"


def _is_secret_flag(flag: str) -> bool:
    # argparse also takes an unambiguous prefix (--api for --api-key); masking the value of
    # some other flag's prefix only hides a harmless value.
    return len(flag) > 2 and flag.startswith("--") and any(s.startswith(flag) for s in SECRET_FLAGS)


def masked_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with the value of every secret flag (`--api-key KEY`, `--api-key=KEY`) masked."""
    masked: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            masked.append(MASK)
            hide_next = False
            continue
        flag, equals, _ = arg.partition("=")
        if _is_secret_flag(flag):
            masked.append(f"{flag}={MASK}" if equals else arg)
            hide_next = not equals
            continue
        masked.append(arg)
    return masked


def command_line() -> str:
    """This process's command line, as a shell would read it, secret values masked."""
    return shlex.join(masked_argv([Path(sys.argv[0]).name, *sys.argv[1:]]))


def machine_header(torch_threads: int) -> str:
    """The lines above a result table: how it was produced and on what."""
    bf16 = ", ".join(cpu_bf16_flags()) or "none"
    return "\n".join(
        [
            f"command: `{command_line()}`",
            f"cpu: {cpu_model_name()} ({os.cpu_count()} logical cores; native bf16 flags: {bf16})",
            f"cpu flags: {' '.join(cpu_simd_flags()) or 'unknown'}",
            f"torch threads: {torch_threads}; {load_average()}",
        ]
    )


def time_ms(fn: Callable[[], object], budget_s: float) -> float:
    """The fastest of the calls made in `budget_s` (at least 3, after one warm-up), in ms:
    on a shared machine the minimum is the figure other processes disturb least."""
    fn()
    best, count, start = float("inf"), 0, time.perf_counter()
    while count < 3 or time.perf_counter() - start < budget_s:
        begin = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - begin)
        count += 1
    return best * 1e3


def positive_float(text: str) -> float:
    """An argparse type: a float > 0."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an int > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value
