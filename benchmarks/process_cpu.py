"""Where a load's CPU time goes, process by process: the stack's children (from their pids in
`llmserve up`'s ready file) and the benchmark client itself, read from /proc before and after
a load point. Divided by the tokens streamed, it is the cost of one output token in each
process; divided by the wall time, the share of a core each one kept busy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from benchmarks.common import format_table

CLIENT = "client (this process)"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process and all its threads (None: gone, or no
    /proc on this system)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            # The command name (field 2) may hold spaces: fields count from its closing paren.
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime


@dataclass(frozen=True, slots=True)
class CpuSnapshot:
    wall_s: float
    cpu_s: dict[str, float]


class ProcessCpu:
    """Snapshots of CPU time by process name; `pids` names the processes to follow."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)

    def snapshot(self) -> CpuSnapshot:
        cpu = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        times = os.times()
        cpu[CLIENT] = times.user + times.system
        return CpuSnapshot(time.perf_counter(), {k: v for k, v in cpu.items() if v is not None})


@dataclass(frozen=True, slots=True)
class CpuRow:
    process: str
    cpu_s: float
    ms_per_token: float
    core_share: float
    """CPU seconds over wall seconds: 1.0 = one core busy the whole time."""


def cpu_rows(before: CpuSnapshot, after: CpuSnapshot, output_tokens: int) -> list[CpuRow]:
    """Per process (both snapshots saw it), busiest first, then the total."""
    wall = max(after.wall_s - before.wall_s, 1e-9)
    tokens = max(output_tokens, 1)
    rows = [
        CpuRow(name, spent, spent * 1000 / tokens, spent / wall)
        for name in after.cpu_s
        if name in before.cpu_s
        for spent in [max(0.0, after.cpu_s[name] - before.cpu_s[name])]
    ]
    rows.sort(key=lambda row: -row.cpu_s)
    total = sum(row.cpu_s for row in rows)
    rows.append(CpuRow("total", total, total * 1000 / tokens, total / wall))
    return rows


def cpu_table(rows: list[CpuRow]) -> str:
    return format_table(
        ["process", "CPU s", "CPU ms per output token", "cores busy"],
        [[row.process, row.cpu_s, row.ms_per_token, row.core_share] for row in rows],
    )
