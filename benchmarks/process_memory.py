"""Resident memory of a process and its children, read from /proc/PID/status: the current
resident set (VmRSS, split into anonymous and file-backed pages) and its high-water mark
(VmHWM, the kernel's peak of VmRSS over the process's life).

A tree's peak is the sum of each member's VmHWM, sampled while the tree runs so a child that
has exited still counts: exact for a single process, an upper bound when children peak at
different moments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class MemoryStatus:
    """The memory lines of /proc/PID/status, in KiB."""

    rss_kib: int
    hwm_kib: int
    rss_anon_kib: int = 0
    rss_file_kib: int = 0
    rss_shmem_kib: int = 0


STATUS_FIELDS = {
    "VmRSS": "rss_kib",
    "VmHWM": "hwm_kib",
    "RssAnon": "rss_anon_kib",
    "RssFile": "rss_file_kib",
    "RssShmem": "rss_shmem_kib",
}


def parse_status(text: str) -> MemoryStatus | None:
    """The memory lines of a status file ('VmRSS:   123456 kB'); None for a process without
    an address space (a zombie, a kernel thread: no VmRSS line)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in STATUS_FIELDS:
            number, _, unit = rest.strip().partition(" ")
            if unit.strip() != "kB":
                raise ValueError(f"unexpected unit in {line!r}")
            values[STATUS_FIELDS[key]] = int(number)
    if "rss_kib" not in values or "hwm_kib" not in values:
        return None
    return MemoryStatus(**values)


def parse_parent_pid(stat_text: str) -> int:
    """The parent pid from /proc/PID/stat (field 4; the command name, field 2, is in
    parentheses and may hold spaces or parentheses itself)."""
    return int(stat_text.rsplit(")", 1)[1].split()[1])


def descendants(parents: Mapping[int, int], root: int) -> list[int]:
    """`root` and every process below it, parents before children, from a pid -> parent map."""
    children: dict[int, list[int]] = {}
    for pid, parent in sorted(parents.items()):
        children.setdefault(parent, []).append(pid)
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop(0)
        tree.append(pid)
        frontier.extend(children.get(pid, []))
    return tree


def read_status(pid: int) -> MemoryStatus | None:
    try:
        return parse_status((PROC / str(pid) / "status").read_text())
    except (OSError, ValueError):
        return None  # gone meanwhile


def parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process this user can see."""
    parents = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = parse_parent_pid(Path(entry.path, "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return parents


class TreeMemory:
    """The memory of a process tree, sampled: `sample()` while it runs, then the properties."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, MemoryStatus] = {}
        """The last status read of every process ever seen in the tree (the exited too)."""
        self.live: list[int] = []

    def sample(self) -> None:
        self.live = []
        for pid in descendants(parent_pids(), self.root):
            status = read_status(pid)
            if status is not None:
                self.seen[pid] = status
                self.live.append(pid)

    @property
    def num_processes(self) -> int:
        return len(self.seen)

    @property
    def peak_kib(self) -> int:
        return sum(status.hwm_kib for status in self.seen.values())

    def current(self) -> MemoryStatus:
        """The live members' sum (as of the last sample)."""
        statuses = [self.seen[pid] for pid in self.live]
        return MemoryStatus(
            rss_kib=sum(s.rss_kib for s in statuses),
            hwm_kib=sum(s.hwm_kib for s in statuses),
            rss_anon_kib=sum(s.rss_anon_kib for s in statuses),
            rss_file_kib=sum(s.rss_file_kib for s in statuses),
            rss_shmem_kib=sum(s.rss_shmem_kib for s in statuses),
        )
