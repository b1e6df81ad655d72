"""The machine's roofs a measured speed is held against: the memory read bandwidth (measured:
a sum over a buffer far larger than the last-level cache) and the CPU's int8 multiply-add peak
(measured: every thread runs independent chains of each int8 dot-product instruction the
kernels' build has, kernels/csrc/int8_peak.cpp; the best form counts). `llmserve bench peers
--shapes` prints both beside each table.

    python -m benchmarks.machine_peaks --threads 2          # the two lines the tables show
    python -m benchmarks.machine_peaks --threads 2 --json   # what `bench peers` reads

Where the C++ extension cannot load, the peak falls back to a formula (the widest instruction
x how many issue per cycle x the clock x the threads), printed with the number. The formula
cannot know how many ports a core has for 512-bit dot products (one on Zen 4, two on Zen 5 and
Intel's server cores) nor a VM's real clock: on the 2-core Zen 5 machine it said 1329 GOPS
where the chains measure 2201 (zmm) and 1099 (ymm).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_simd_flags, time_ms

MiB = 1 << 20
BUFFER_MIB = 512
"""16 x the 32 MiB L3 of the machines we measure on: the sum streams from memory."""
BUDGET_S = 0.5
CLOCK_SAMPLE_S = 0.02
CPU_MHZ = re.compile(r"^cpu MHz\s*:\s*([\d.]+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Int8Path:
    """One way a CPU core multiplies u8 x s8 and accumulates in int32."""

    flag: str
    """The /proc/cpuinfo flag that says the core has it."""
    instructions: str
    macs_per_instruction: int
    instructions_per_cycle: float
    """Per core, the best issue rate of the cores that have it: a peak is an upper bound, so a
    core with fewer ports (one 512-bit unit: Ice Lake client, Zen 4's zmm) reaches half."""

    @property
    def ops_per_cycle(self) -> float:
        """A multiply-add counts as two ops, as in every published TOPS figure."""
        return 2 * self.macs_per_instruction * self.instructions_per_cycle


INT8_PATHS = (
    # One 16x16 int32 tile of a 16x64 by 64x16 product, one every 16 cycles: 1024 MACs/cycle.
    Int8Path("amx_int8", "AMX tdpbusd", 16 * 16 * 64, 1 / 16),
    # vpdpbusd: 4 u8 x s8 products summed into each int32 lane; two vector ports issue it.
    Int8Path("avx512_vnni", "AVX-512 VNNI vpdpbusd zmm", 64, 2),
    Int8Path("avx_vnni", "AVX-VNNI vpdpbusd ymm", 32, 2),
    # Without VNNI a dot product is two multiply instructions (vpmaddubsw to int16 pairs, then
    # vpmaddwd by ones to int32) on the same two ports: one pair per cycle.
    Int8Path("avx512bw", "AVX-512BW vpmaddubsw + vpmaddwd zmm", 64, 1),
    Int8Path("avx2", "AVX2 vpmaddubsw + vpmaddwd ymm", 32, 1),
)
"""Fastest first: a CPU's peak is that of the first path its flags have."""


def int8_path(flags: Iterable[str]) -> Int8Path | None:
    have = set(flags)
    return next((path for path in INT8_PATHS if path.flag in have), None)


def int8_peak_ops_per_s(path: Int8Path | None, clock_mhz: float, cores: int) -> float:
    """ops/cycle/core x clock x cores; NaN when the CPU has no int8 path or the clock is
    unknown."""
    if path is None or not math.isfinite(clock_mhz) or clock_mhz <= 0 or cores < 1:
        return math.nan
    return path.ops_per_cycle * clock_mhz * 1e6 * cores


def parse_cpu_mhz(cpuinfo: str) -> list[float]:
    """Every core's 'cpu MHz' line of /proc/cpuinfo."""
    return [float(value) for value in CPU_MHZ.findall(cpuinfo)]


def read_cpu_mhz() -> list[float]:
    try:
        return parse_cpu_mhz(Path("/proc/cpuinfo").read_text())
    except OSError:
        return []


@dataclass(frozen=True, slots=True)
class MachinePeaks:
    """What was measured, and the roofs derived from it."""

    read_bytes_per_s: float
    """The fastest full read of the buffer seen."""
    buffer_bytes: int
    budget_s: float
    """Seconds of repeats the fastest read was taken from."""
    threads: int
    cores: int
    """Cores the peak counts: the threads, at most the logical cores (one thread per core)."""
    clock_mhz: float
    """The highest 'cpu MHz' read while the sum loop kept the cores busy (NaN: none)."""
    flags: tuple[str, ...]
    measured_int8: tuple[float, ...] = ()
    """ops/s of each of MEASURED_FORMS on `threads` threads (NaN: not in the build); empty
    when the extension could not load."""

    @property
    def measured_int8_best(self) -> tuple[str, float] | None:
        """The fastest measured form and its ops/s."""
        found = [
            (form, value)
            for form, value in zip(MEASURED_FORMS, self.measured_int8, strict=False)
            if math.isfinite(value) and value > 0
        ]
        return max(found, key=lambda item: item[1]) if found else None

    @property
    def int8_path(self) -> Int8Path | None:
        return int8_path(self.flags)

    @property
    def int8_ops_per_s(self) -> float:
        """The measured peak, else the formula's."""
        best = self.measured_int8_best
        if best is not None:
            return best[1]
        return int8_peak_ops_per_s(self.int8_path, self.clock_mhz, self.cores)

    def bandwidth_line(self) -> str:
        return (
            f"memory bandwidth: {self.read_bytes_per_s / 1e9:.1f} GB/s read (the fastest torch"
            f" sum of a {self.buffer_bytes // MiB} MiB float32 buffer on huge pages, as the"
            f" weights are, on {self.threads} threads, in {self.budget_s:g} s of repeats)"
        )

    def int8_line(self) -> str:
        best = self.measured_int8_best
        if best is not None:
            others = "; ".join(
                f"{form} {value / 1e9:.0f}"
                for form, value in zip(MEASURED_FORMS, self.measured_int8, strict=False)
                if math.isfinite(value) and form != best[0]
            )
            return (
                f"int8 peak: {best[1] / 1e9:.0f} GOPS measured ({best[0]}: independent chains"
                f" of it alone on {self.threads} threads"
                + (f"; other forms, GOPS: {others}" if others else "")
                + ")"
            )
        path = self.int8_path
        if path is None:
            return "int8 peak: unknown (no int8 dot-product instruction among the cpu flags)"
        rate = path.instructions_per_cycle
        per_cycle = f"1/{round(1 / rate)}" if rate < 1 else f"{rate:g}"
        return (
            f"int8 peak: {self.int8_ops_per_s / 1e9:.0f} GOPS = 2 ops x"
            f" {path.macs_per_instruction} MACs ({path.instructions}) x {per_cycle} per cycle x"
            f" {self.clock_mhz:.0f} MHz x {self.cores} cores (the clock: the highest 'cpu MHz'"
            " of /proc/cpuinfo while the bandwidth loop ran; a VM may show its host's nominal"
            " clock)"
        )

    def to_json(self) -> dict[str, Any]:
        """The fields and the int8 peak, NaN (unknown) as null."""
        document = {**asdict(self), "int8_ops_per_s": self.int8_ops_per_s}
        document["measured_int8"] = [None if math.isnan(v) else v for v in self.measured_int8]
        return {
            k: None if isinstance(v, float) and math.isnan(v) else v for k, v in document.items()
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> MachinePeaks:
        values = {f.name: document[f.name] for f in fields(cls) if f.name in document}
        values["flags"] = tuple(values["flags"])
        values["measured_int8"] = tuple(
            math.nan if v is None else v for v in values.get("measured_int8", ())
        )
        values = {k: math.nan if v is None else v for k, v in values.items()}
        return cls(**values)


MEASURED_FORMS = ("vpdpbusd ymm", "vpdpbusd zmm", "vpmaddubsw + vpmaddwd ymm")
"""The figures of torch.ops.llmserve.int8_dot_peak, in its order."""
PEAK_ITERATIONS = 2_000_000
PEAK_ROUNDS = 5


def measure_int8_peak(threads: int) -> tuple[float, ...]:
    """Each form's best ops/s of PEAK_ROUNDS runs; () where the C++ extension cannot load."""
    import torch

    from kernels import cpu_extension

    if not cpu_extension.load():
        return ()
    torch.set_num_threads(threads)
    best = [math.nan] * len(MEASURED_FORMS)
    for _ in range(PEAK_ROUNDS):
        for index, value in enumerate(torch.ops.llmserve.int8_dot_peak(PEAK_ITERATIONS)):
            if math.isfinite(value) and not value <= best[index]:
                best[index] = value
    return tuple(best)


def measure(
    threads: int,
    buffer_mib: int = BUFFER_MIB,
    budget_s: float = BUDGET_S,
    with_int8_peak: bool = True,
) -> MachinePeaks:
    """Sum one buffer on `threads` threads, fastest of the repeats in `budget_s`, and read the
    clock from another thread meanwhile (torch releases the GIL while it sums)."""
    import torch

    from services.worker.huge_pages import huge_page_buffer

    if threads < 1 or buffer_mib < 1:
        raise ValueError("threads and buffer_mib must be >= 1")
    torch.set_num_threads(threads)
    # On huge pages, as the weights and the KV cache are (services/worker/huge_pages.py): on
    # 4 KiB pages the same sum reads 20-25 % slower, a roof below what the machine gives.
    # Written once: every page is mapped before the timed reads.
    data = huge_page_buffer(buffer_mib * MiB).view(torch.float32).fill_(1.0)
    readings: list[float] = []
    stop = threading.Event()

    def sample_clock() -> None:
        while not stop.is_set():
            readings.extend(read_cpu_mhz())
            stop.wait(CLOCK_SAMPLE_S)

    sampler = threading.Thread(target=sample_clock, daemon=True)
    sampler.start()
    try:
        best_ms = time_ms(data.sum, budget_s)
    finally:
        stop.set()
        sampler.join()
    return MachinePeaks(
        read_bytes_per_s=data.numel() * 4 / (best_ms / 1e3),
        buffer_bytes=data.numel() * 4,
        budget_s=budget_s,
        threads=threads,
        cores=min(threads, os.cpu_count() or threads),
        clock_mhz=max(readings, default=math.nan),
        flags=tuple(cpu_simd_flags()),
        measured_int8=measure_int8_peak(threads) if with_int8_peak else (),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--buffer-mib", type=int, default=BUFFER_MIB)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    try:
        peaks = measure(args.threads, args.buffer_mib)
    except ValueError as exc:
        print(f"machine_peaks: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(peaks.to_json()))
    else:
        print(f"{peaks.bandwidth_line()}\n{peaks.int8_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
