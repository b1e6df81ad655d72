"""Where the stack's processes run on a small machine: the worker's threads get the cores.

A decode step is a few milliseconds of OpenMP work split across every core; when the scheduler,
a tokenizer replica or Redis takes a core in the middle of it, the worker's whole thread team
waits at the next barrier for the thread that lost its core. The policies:

    none   every process as the OS places it (the comparison baseline)
    nice   the worker as is; every other process at a lower priority (niceness +10), so it runs
           when a core is free (between steps, while the worker waits on the network) and is
           preempted at once when the worker wants the core back
    split  the worker pinned to all cores but the last, with one thread fewer; everything
           else pinned to the last core: no sharing at all, one core less for the forward

docs/deployment.md (CPU placement) has the measurements and why `auto` is `none`: on 2 cores
neither niceness nor pinning made the stack faster than leaving placement to the kernel, and
split cost half the throughput. Pure planning here (placement_for); apply() places a process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

PlacementPolicy = Literal["auto", "none", "nice", "split"]
POLICIES: tuple[PlacementPolicy, ...] = ("auto", "none", "nice", "split")
AUTO_POLICY: PlacementPolicy = "none"
"""What `auto` means (measured: docs/deployment.md, CPU placement)."""
BACKGROUND_NICENESS = 10
"""Niceness of the processes that are not the worker. At +10 a busy worker's thread gets
about 90% of a contended core (the kernel weighs niceness 0 against 10 about 10 to 1)."""


@dataclass(frozen=True, slots=True)
class Placement:
    niceness: int = 0
    """Added to the process's niceness (only ever raised: lowering needs privileges)."""
    cpus: tuple[int, ...] | None = None
    """CPUs the process may run on; None = any."""
    threads: int | None = None
    """torch threads of a worker placed by this policy; None = the launcher's own choice."""


def placement_for(
    policy: PlacementPolicy,
    kind: str,
    *,
    cpus: tuple[int, ...],
    worker_index: int = 0,
    num_workers: int = 1,
) -> Placement:
    """Where one child of `kind` (worker, scheduler, tokenizer or redis) runs under `policy`,
    given the CPUs this stack may use."""
    policy = AUTO_POLICY if policy == "auto" else policy
    if policy == "none":
        return Placement()
    if policy == "nice":
        return Placement() if kind == "worker" else Placement(niceness=BACKGROUND_NICENESS)
    if policy == "split":
        if len(cpus) < 2:
            return Placement()  # nothing to split: one core is shared whatever we do
        forward, background = cpus[:-1], cpus[-1:]
        if kind != "worker":
            return Placement(cpus=background)
        share = _share(forward, worker_index, num_workers)
        return Placement(cpus=share, threads=len(share))
    raise ValueError(f"unknown CPU placement policy {policy!r}; one of {', '.join(POLICIES)}")


def _share(cpus: tuple[int, ...], index: int, count: int) -> tuple[int, ...]:
    """Worker `index`'s slice of `cpus` (at least one CPU each, shared when too few)."""
    if count <= len(cpus):
        size = len(cpus) // count
        return cpus[index * size : (index + 1) * size]
    return (cpus[index % len(cpus)],)


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (a container's cpuset, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def apply(pid: int, placement: Placement) -> None:
    """Place a just-started process (its threads, created later, inherit both settings)."""
    try:
        if placement.niceness:
            current = os.getpriority(os.PRIO_PROCESS, pid)
            os.setpriority(os.PRIO_PROCESS, pid, current + placement.niceness)
        if placement.cpus is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(pid, placement.cpus)
    except OSError as exc:  # the process already exited, or a restricted container
        log.warning("CPU placement not applied", extra={"pid": pid, "error": str(exc)})
